"""What the offline speculative-decoding benchmarks (spec_rewrite_steps.py, spec_verify_rows.py,
spec_verify_steps.py) share: the number of rows each step of the model runner computes."""


def record_step_rows(runner) -> list[int]:
    """Wrap ``runner.execute`` so that every step appends its number of scheduled rows (a decode
    step 1 per request, a verifying step k + 1) to the returned list."""
    rows_seen: list[int] = []
    execute = runner.execute

    def counting_execute(scheduler_output):
        rows_seen.append(sum(scheduler_output.num_scheduled_tokens.values()))
        return execute(scheduler_output)

    runner.execute = counting_execute
    return rows_seen
