"""What the offline step benchmarks (decode_breakdown.py, spec_rewrite_steps.py,
spec_verify_rows.py, spec_verify_steps.py) share: hooks on the model runner that count a step's
rows and time its forward and LM head."""

import time


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


def time_forward_and_logits(runner) -> dict[str, float]:
    """Wrap the runner's model so that the returned ``{"forward": s, "logits": s}`` sums the
    seconds spent in its forward and in its LM head (``compute_logits``)."""
    spent = {"forward": 0.0, "logits": 0.0}

    def timed(name, function):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - started

        return wrapper

    runner.model.forward = timed("forward", runner.model.forward)
    runner.model.compute_logits = timed("logits", runner.model.compute_logits)
    return spent
