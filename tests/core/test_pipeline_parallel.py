"""Pipeline parallelism in real worker processes over gloo: each process builds
``Worker(spec, parallel=init_parallel_state(...))`` for its place in the ``pp x tp`` grid, a
small driver on rank 0 (a real Scheduler) feeds every worker the same SchedulerOutputs, and
the last stage's output comes back to it, as an executor does. Float32 greedy token ids must
equal one worker's for tiny random Llamas (2 and 3 stages, uneven layers, tied and untied
heads), a tiny Gemma 3, a 2 x 2 grid, and the real SmolLM2 GGUF. The driver's small token
budget and block pool make prompts prefill in chunks and requests get preempted, so stages
that never sample must follow the scheduler's tokens exactly."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.rank_processes import run_ranks

from tokenloom.core.config import EngineArgs
from tokenloom.core.distributed import ParallelRank, init_parallel_state
from tokenloom.core.executor import WorkerSpec
from tokenloom.core.model_loader import resolve_model
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.scheduler import Scheduler
from tokenloom.core.sequence import EngineSequence
from tokenloom.core.worker import Worker
from tokenloom.plugins.manager import load_plugins

VOCAB_SIZE = 160
PROMPTS = [
    [1, 17, 99, 3, 42, 7, 8, 140, 66, 12, 5],
    [1, 120, 4],
    [1, 33, 61, 5, 90, 11, 150, 23, 8, 77, 5, 64, 31, 9, 9, 2, 18],
    [1, 70, 71, 72],
]
MAX_TOKENS = 10


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_spec(model_dir: str, num_blocks: int = 14, **engine_args) -> WorkerSpec:
    # 14 blocks of 4 tokens cannot hold the four sequences at once: some are preempted
    engine_args = (
        dict(
            model=model_dir,
            dtype="float32",
            skip_tokenizer_init=True,
            device="cpu",
            block_size=4,
            num_gpu_blocks_override=num_blocks,
            max_num_batched_tokens=8,
            max_model_len=64,
            enable_prefix_caching=False,
        )
        | engine_args
    )
    config = EngineArgs(**engine_args).create_engine_config()
    plugins = load_plugins()
    info, _ = resolve_model(config, plugins)
    return WorkerSpec(config=config, model_info=info, platform="cpu", plugin_tables=plugins.to_plain())


def drive(spec: WorkerSpec, execute) -> dict:
    """Run the prompts to completion through a real scheduler; ``execute`` runs one step."""
    config = spec.config
    scheduler = Scheduler(
        config.scheduler,
        config.cache,
        config.cache.num_gpu_blocks_override,
        spec.model_info.max_model_len,
        send_token_ids=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [
        EngineSequence(seq_id=f"r{i}", prompt_token_ids=list(prompt), sampling_params=params, eos_token_ids={2})
        for i, prompt in enumerate(PROMPTS)
    ]
    for request in requests:
        scheduler.add_sequence(request)
    num_steps = 0
    while scheduler.has_unfinished_sequences():
        scheduler_output = scheduler.schedule()
        scheduler.update_from_output(scheduler_output, execute(scheduler_output))
        num_steps += 1
    return {
        "tokens": {request.seq_id: list(request.output_token_ids) for request in requests},
        "num_preemptions": scheduler.num_preemptions,
        "num_steps": num_steps,
    }


def _run_worker(rank: int, tp_size: int, pp_size: int, init_method: str, specs: list[WorkerSpec], results) -> None:
    """Every spec in turn at this rank's place in the grid, in one process group."""
    place = ParallelRank.of(rank, tp_size, pp_size)
    parallel = init_parallel_state(place, init_method, "gloo")
    torch.set_num_threads(1)  # the same arithmetic in every run, however many processes share the cores
    for index, spec in enumerate(specs):
        _run_spec(index, place, parallel, spec, results)
    if place.world_size > 1:
        dist.destroy_process_group()


def _run_spec(index: int, place: ParallelRank, parallel, spec: WorkerSpec, results) -> None:
    rank, tp_size, pp_size = place.rank, place.tp_size, place.pp_size
    worker = Worker(spec, parallel=parallel)
    worker.load_model()
    worker.allocate_kv_cache(spec.config.cache.num_gpu_blocks_override)
    model = worker.runner.model
    results[index, f"stage{rank}"] = {
        "num_kv_layers": model.kv_cache_spec.num_layers,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "has_lm_head": hasattr(model.lm_head, "compute_logits"),
    }
    if place.world_size == 1:
        results[index, "run"] = drive(spec, worker.execute)
        return
    last_rank = (pp_size - 1) * tp_size  # the last stage's tp-rank-0 worker returns the output

    def step(scheduler_output):
        box = [scheduler_output]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return None
        box = [worker.execute(box[0])]
        assert place.is_last_stage or box[0] is None, "a stage before the last returned an output"
        dist.broadcast_object_list(box, src=last_rank)
        return box[0]

    if rank == 0:
        results[index, "run"] = drive(spec, step)
        step(None)
    else:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                break
            output = worker.execute(box[0])
            assert place.is_last_stage or output is None, "a stage before the last returned an output"
            dist.broadcast_object_list([output], src=last_rank)


def per_spec(results, num_specs: int) -> list[dict]:
    """``{(spec index, key): value}`` as one ``{key: value}`` per spec."""
    return [{key: value for (index, key), value in results.items() if index == i} for i in range(num_specs)]


def run_grid(specs: list[WorkerSpec], tp_size: int, pp_size: int) -> list[dict]:
    results = mp.Manager().dict()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    run_ranks(_run_worker, (tp_size, pp_size, init_method, specs, results), nprocs=tp_size * pp_size)
    return per_spec(dict(results), len(specs))


def save_tiny_llama(directory, num_layers: int, tie_word_embeddings: bool) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(num_layers)
    LlamaForCausalLM(config).eval().save_pretrained(directory, safe_serialization=True)
    return str(directory)


@pytest.fixture(scope="module")
def tiny_llama_5_layers(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama5"), 5, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_llama_5_layers_untied(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama5u"), 5, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4,
        max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(3)
    directory = tmp_path_factory.mktemp("gemma3")
    Gemma3ForCausalLM(config).eval().save_pretrained(directory, safe_serialization=True)
    return str(directory)


def run_one_worker(spec: WorkerSpec) -> dict:
    """The one-worker run, in this process: a world of one joins no process group, so it needs
    no spawn (each costs a torch import and a Manager process)."""
    threads = torch.get_num_threads()
    results: dict = {}
    try:
        _run_worker(0, 1, 1, "", [spec], results)  # one thread, as every grid's workers
    finally:
        torch.set_num_threads(threads)
    return per_spec(results, 1)[0]


# test -> (the fixture of its model directory, tp size, pp size)
GRID_OF_TEST = {
    "test_llama_two_stages_equal_one_worker": ("tiny_llama_5_layers", 1, 2),
    "test_llama_three_uneven_stages_with_an_untied_head_equal_one_worker": ("tiny_llama_5_layers_untied", 1, 3),
    "test_gemma3_two_stages_equal_one_worker": ("tiny_gemma3", 1, 2),
    "test_two_tensor_ranks_by_two_stages_equal_one_worker": ("tiny_llama_5_layers", 2, 2),
    "test_smollm2_gguf_two_stages_equal_one_worker": ("smollm2_gguf", 1, 2),
}


@pytest.fixture(scope="module")
def grid_runs(request):
    """``grid_runs(model_dir, tp_size, pp_size)``: what that grid's ranks returned. The first
    model of a grid shape asked for runs every model of that shape among this module's collected
    tests, in one spawn (one process per rank, a torch import and a gloo set-up each): the three
    two-stage runs take two processes, not six; each spawn still in the test that first needs it."""
    grids = list(
        dict.fromkeys(
            GRID_OF_TEST[item.originalname] for item in request.session.items if item.module is request.module
        )
    )
    model_dirs = {fixture: request.getfixturevalue(fixture) for fixture, _, _ in grids}
    shapes = {(model_dirs[fixture], tp_size, pp_size) for fixture, tp_size, pp_size in grids}
    runs: dict[tuple[str, int, int], dict] = {}

    def run(model_dir: str, tp_size: int, pp_size: int) -> dict:
        if (model_dir, tp_size, pp_size) not in runs:
            shape = (tp_size, pp_size)
            same_shape = [model_dir] + [d for d, *other in sorted(shapes) if tuple(other) == shape and d != model_dir]
            results = run_grid([make_spec(d) for d in same_shape], tp_size, pp_size)
            for d, result in zip(same_shape, results, strict=True):
                runs[(d, tp_size, pp_size)] = result
        return runs[(model_dir, tp_size, pp_size)]

    return run


# model directory -> the one-worker run (worth doing once)
_REFERENCE_RUNS: dict[str, dict] = {}


def assert_same_greedy_ids(grid_runs, model_dir: str, tp_size: int, pp_size: int) -> dict:
    if model_dir not in _REFERENCE_RUNS:
        _REFERENCE_RUNS[model_dir] = run_one_worker(make_spec(model_dir))
    reference = _REFERENCE_RUNS[model_dir]
    split = grid_runs(model_dir, tp_size, pp_size)
    assert reference["run"]["num_preemptions"] > 0  # the driver's cache is small on purpose
    assert split["run"]["tokens"] == reference["run"]["tokens"]
    assert all(len(tokens) == MAX_TOKENS for tokens in split["run"]["tokens"].values())
    return split | {"reference": reference}


def test_llama_two_stages_equal_one_worker(grid_runs, tiny_llama_5_layers):
    results = assert_same_greedy_ids(grid_runs, tiny_llama_5_layers, tp_size=1, pp_size=2)
    stages = [results["stage0"], results["stage1"]]
    assert [stage["num_kv_layers"] for stage in stages] == [3, 2]
    assert [stage["has_lm_head"] for stage in stages] == [False, True]
    whole = results["reference"]["stage0"]["num_parameters"]
    # each stage holds its layers; the tied embedding sits on both ends
    assert max(stage["num_parameters"] for stage in stages) < whole
    embedding = VOCAB_SIZE * 64
    assert sum(stage["num_parameters"] for stage in stages) == whole + embedding


def test_llama_three_uneven_stages_with_an_untied_head_equal_one_worker(grid_runs, tiny_llama_5_layers_untied):
    results = assert_same_greedy_ids(grid_runs, tiny_llama_5_layers_untied, tp_size=1, pp_size=3)
    assert [results[f"stage{r}"]["num_kv_layers"] for r in range(3)] == [2, 2, 1]
    whole = results["reference"]["stage0"]["num_parameters"]
    assert sum(results[f"stage{r}"]["num_parameters"] for r in range(3)) == whole  # nothing held twice


def test_gemma3_two_stages_equal_one_worker(grid_runs, tiny_gemma3):
    results = assert_same_greedy_ids(grid_runs, tiny_gemma3, tp_size=1, pp_size=2)
    assert [results[f"stage{r}"]["num_kv_layers"] for r in range(2)] == [2, 2]


def test_two_tensor_ranks_by_two_stages_equal_one_worker(grid_runs, tiny_llama_5_layers):
    results = assert_same_greedy_ids(grid_runs, tiny_llama_5_layers, tp_size=2, pp_size=2)
    assert [results[f"stage{r}"]["num_kv_layers"] for r in range(4)] == [3, 3, 2, 2]


@pytest.mark.slow
def test_smollm2_gguf_two_stages_equal_one_worker(grid_runs, smollm2_gguf):
    results = assert_same_greedy_ids(grid_runs, smollm2_gguf, tp_size=1, pp_size=2)
    assert [results[f"stage{r}"]["num_kv_layers"] for r in range(2)] == [15, 15]
