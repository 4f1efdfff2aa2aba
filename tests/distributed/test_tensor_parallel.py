"""Tensor parallelism end to end inside the model: ``tp`` worker processes (spawned, gloo),
each a ``Worker(spec, parallel=init_parallel_state(...))``, replay the SchedulerOutputs of a
one-worker engine run, and must sample the same greedy tokens with the same logits.

One spawn per world size for the whole module (the cases of that size replayed one after
another in the same processes); each case checks the per-rank KV cache shape, that every rank
samples the same tokens (they append them to their own request state), and rank 0's tokens and
logits against the one-worker run. Tiny random models in float32 cover the layouts (KV heads split,
replicated, biases, a padded vocabulary shard, Gemma 3's single KV head); the real SmolLM2 GGUF
covers sharded 4-bit loading, dequantized to float32 and kept packed for the int4 kernel.
"""

from __future__ import annotations

import pickle
import socket

import pytest
import torch
import torch.multiprocessing as mp
from helpers.model_parity import perturb_parameters
from helpers.rank_processes import run_ranks
from helpers.tiny_llama import tiny_llama_config

from tokenloom import LLM, SamplingParams
from tokenloom.core.distributed import ParallelRank, init_parallel_state

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
]
MAX_TOKENS = 8
ENGINE_ARGS = dict(block_size=4, max_model_len=128, kv_cache_memory_bytes=8 << 20, max_num_seqs=4)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tokenizer_of(gguf_path: str):
    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat

    return GGUFLoadFormat().load_tokenizer(gguf_path, None)


def save_tiny_model(directory, tokenizer, hf_class, config, seed: int) -> str:
    """A random model scaled up (std 0.3 noise on every parameter) so greedy choices are
    decisive rather than near-ties a different summation order could flip."""
    torch.manual_seed(seed)
    model = perturb_parameters(hf_class(config).eval(), seed=seed, scale=0.3)
    tokenizer.save_pretrained(directory)
    model.save_pretrained(directory, safe_serialization=True)
    return str(directory)


class Reference:
    """A one-worker engine run: the pickled SchedulerOutputs it executed, the tokens each
    step sampled, and the logits of every row it sampled from."""

    def __init__(self, model: str, sampling_params, **engine_args):
        llm = LLM(model=model, **{**ENGINE_ARGS, **engine_args})
        executor = llm.engine.executor
        self.spec, self.num_blocks = executor.spec, llm.engine.num_blocks
        self.steps: list[bytes] = []
        self.sampled: list[dict[str, list[int]]] = []
        self.logits: list[torch.Tensor] = []
        execute, model_module = executor.execute, executor.worker.runner.model
        compute_logits = model_module.compute_logits

        def recording_execute(scheduler_output):
            self.steps.append(pickle.dumps(scheduler_output))
            output = execute(scheduler_output)
            self.sampled.append({req: list(ids) for req, ids in output.sampled_token_ids.items()})
            return output

        def recording_logits(hidden_states):
            logits = compute_logits(hidden_states)
            self.logits.append(logits.detach().float().clone())
            return logits

        executor.execute = recording_execute
        model_module.compute_logits = recording_logits
        self.outputs = llm.generate(PROMPTS, sampling_params)


def _tp_worker(rank, tp_size, init_method, runs, results):
    from tokenloom.core.worker import Worker

    parallel = init_parallel_state(ParallelRank.of(rank, tp_size, 1), init_method, "gloo")
    out = []
    for spec, num_blocks, steps, without_native_bfloat16 in runs:
        if without_native_bfloat16:  # as the parent ran it (see test_smollm2_gguf_tp3_...)
            from tokenloom.builtin_plugins.platforms.cpu import CpuPlatform

            CpuPlatform.native_bfloat16 = staticmethod(lambda: False)
        worker = Worker(spec, parallel=parallel)
        torch.set_num_threads(1)  # tp processes share the machine's cores
        worker.load_model()
        model = worker.runner.model
        rank_blocks = worker.determine_num_blocks()
        worker.allocate_kv_cache(num_blocks)
        logits_seen = []
        compute_logits = model.compute_logits

        def recording_logits(hidden_states, compute_logits=compute_logits, logits_seen=logits_seen):
            logits = compute_logits(hidden_states)
            logits_seen.append(logits.detach().float().clone())
            return logits

        model.compute_logits = recording_logits
        sampled = []
        for step in steps:
            output = worker.execute(pickle.loads(step))
            sampled.append({req: list(ids) for req, ids in output.sampled_token_ids.items()})
        qkv = model.model.layers[0].self_attn.qkv_proj
        out.append(
            {
                "sampled": sampled,
                "logits": logits_seen if rank == 0 else None,  # the same on every rank after the gather
                "kv_cache_shape": tuple(worker.runner.kv_caches[0].shape),
                "rank_blocks": rank_blocks,
                "heads": (qkv.num_heads, qkv.num_kv_heads),
                "int4_layers": sum(getattr(m, "int4_weight", None) is not None for m in model.modules()),
                # each rank's share of every routed expert's intermediate features (a mixture of experts)
                "expert_intermediate": {
                    m.intermediate_size for m in model.modules() if type(m).__name__ == "FusedExperts"
                },
            }
        )
        del worker, model
    results[rank] = out
    torch.distributed.destroy_process_group()


def run_tensor_parallel(tp_size: int, references: list[Reference], without_native_bfloat16=()) -> list[list[dict]]:
    """Every reference's steps replayed by ``tp_size`` workers: per rank, per reference, what it
    saw. References whose index is in ``without_native_bfloat16`` run on a CPU platform that
    reports no native bfloat16 (as the parent ran them)."""
    results = mp.Manager().dict()
    runs = [(ref.spec, ref.num_blocks, ref.steps, i in without_native_bfloat16) for i, ref in enumerate(references)]
    run_ranks(_tp_worker, (tp_size, f"tcp://127.0.0.1:{free_port()}", runs, results), nprocs=tp_size)
    return [results[rank] for rank in range(tp_size)]


def assert_same_as_one_worker(reference: Reference, per_rank: list[dict], greedy_requests=None, atol=1e-4, tie=None):
    """Every rank samples what rank 0 samples (random rows too); rank 0's greedy tokens and
    logits equal the one-worker run's. With ``tie``: the runs may part at a near-tie (the
    one-worker logits of both choices within ``tie``); steps after it see different tokens and
    are not compared."""
    for rank_result in per_rank[1:]:
        assert rank_result["sampled"] == per_rank[0]["sampled"]
    sampled, logits = per_rank[0]["sampled"], per_rank[0]["logits"]
    assert len(sampled) == len(reference.sampled) and len(logits) == len(reference.logits)
    for step, (expected, got) in enumerate(zip(reference.sampled, sampled)):
        # rows of a step's logits: the requests that sampled, in the order they did
        rows = [req for req, ids in expected.items() if ids]
        keys = rows if greedy_requests is None else [k for k in rows if k in greedy_requests]
        assert logits[step].shape == reference.logits[step].shape  # the padded vocabulary cut after the gather
        # a random request's own logits part after its first draw; the greedy rows must not
        compared = [rows.index(k) for k in keys]
        torch.testing.assert_close(logits[step][compared], reference.logits[step][compared], atol=atol, rtol=1e-4)
        parted = [k for k in keys if got[k] != expected[k]]
        if parted and tie is not None:
            for req in parted:
                row = reference.logits[step][rows.index(req)]
                gap = float(row[expected[req][0]] - row[got[req][0]])
                assert 0 <= gap <= tie, f"step {step}, request {req}: not a near-tie (logit gap {gap})"
            return
        assert {k: got[k] for k in keys} == {k: expected[k] for k in keys}, f"step {step}"


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


# -- tiny random models in float32 ----------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    return tokenizer_of(smollm2_gguf)


# -- the cases: each a world size and its one-worker reference runs ----------------------------


def llama_padded_vocabulary(directory, tokenizer, smollm2_gguf) -> list[Reference]:
    """4 query / 2 KV heads; one more vocabulary row than the tokenizer's, so the last rank's
    head shard is padded; the second request samples at random."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(tokenizer, vocab_size=len(tokenizer) + 1)
    model = save_tiny_model(directory, tokenizer, LlamaForCausalLM, config, seed=1)
    return [Reference(model, LLAMA_TP2_PARAMS, dtype="float32")]


LLAMA_TP2_PARAMS = [GREEDY, SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS), GREEDY]


def llama_one_kv_head_per_rank(directory, tokenizer, smollm2_gguf) -> list[Reference]:
    """6 query / 3 KV heads over 3 ranks, an untied head."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(
        tokenizer,
        hidden_size=96,
        intermediate_size=192,
        num_attention_heads=6,
        num_key_value_heads=3,
        tie_word_embeddings=False,
    )
    return [Reference(save_tiny_model(directory, tokenizer, LlamaForCausalLM, config, 2), GREEDY, dtype="float32")]


def llama_replicated_kv_heads(directory, tokenizer, smollm2_gguf) -> list[Reference]:
    """8 query / 2 KV heads over 4 ranks: each KV head replicated on two ranks."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(tokenizer, num_attention_heads=8, num_key_value_heads=2)
    return [Reference(save_tiny_model(directory, tokenizer, LlamaForCausalLM, config, 3), GREEDY, dtype="float32")]


def qwen2_with_biases(directory, tokenizer, smollm2_gguf) -> list[Reference]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen2 = Qwen2Config(**tiny_llama_config(tokenizer).to_dict())
    return [Reference(save_tiny_model(directory, tokenizer, Qwen2ForCausalLM, qwen2, 4), GREEDY, dtype="float32")]


def gemma3_with_one_kv_head(directory, tokenizer, smollm2_gguf) -> list[Reference]:
    from helpers.tiny_gemma3 import tiny_gemma3_config
    from transformers import Gemma3ForCausalLM

    gemma3 = tiny_gemma3_config(tokenizer, num_key_value_heads=1, final_logit_softcapping=30.0)
    return [Reference(save_tiny_model(directory, tokenizer, Gemma3ForCausalLM, gemma3, 5), GREEDY, dtype="float32")]


# architecture -> (its transformers config class and model class names, the overrides of the tiny
# Llama config, each expert's intermediate size or 0): one tiny checkpoint each, every -tp 2 split it has (q/k norms per head or over the
# whole projection, sliding windows and soft caps, multipliers, experts with their intermediate
# features halved, a shared expert)
ARCHITECTURES_TP2 = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16), 0),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
        32,
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48),
        32,
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32), 32),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2), 128),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=4,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"],
            pad_token_id=0,
        ),
        0,
    ),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=1.5),
        0,
    ),
}


def architecture_tp2(architecture: str):
    def references(directory, tokenizer, smollm2_gguf) -> list[Reference]:
        import transformers

        config_class, model_class, overrides, _ = ARCHITECTURES_TP2[architecture]
        options = {**tiny_llama_config(tokenizer).to_dict(), **overrides}
        options.pop("model_type", None)
        config = getattr(transformers, config_class)(**options)
        model = save_tiny_model(directory, tokenizer, getattr(transformers, model_class), config, 6)
        return [Reference(model, GREEDY, dtype="float32")]

    return references


def smollm2_float32_and_bfloat16(directory, tokenizer, smollm2_gguf) -> list[Reference]:
    short = SamplingParams(temperature=0.0, max_tokens=5)
    return [Reference(smollm2_gguf, short, dtype="float32"), Reference(smollm2_gguf, short, dtype="bfloat16")]


def gemma3_270m(directory, tokenizer, smollm2_gguf) -> list[Reference]:
    from tokenloom.builtin_plugins.model_sources.pip_packages import PipPackageModelSource

    gemma3 = PipPackageModelSource().resolve("gemma3-270m").path
    return [Reference(gemma3, SamplingParams(temperature=0.0, max_tokens=5), dtype="float32")]


# case -> (world size, its references)
CASES = {
    "llama_padded_vocabulary": (2, llama_padded_vocabulary),
    "llama_one_kv_head_per_rank": (3, llama_one_kv_head_per_rank),
    "llama_replicated_kv_heads": (4, llama_replicated_kv_heads),
    "qwen2_with_biases": (2, qwen2_with_biases),
    "gemma3_with_one_kv_head": (2, gemma3_with_one_kv_head),
    "smollm2_float32_and_bfloat16": (3, smollm2_float32_and_bfloat16),
    "gemma3_270m": (2, gemma3_270m),
    **{architecture: (2, architecture_tp2(architecture)) for architecture in ARCHITECTURES_TP2},
}
# test -> the cases it checks
CASES_OF_TEST = {
    "test_llama_tp2_padded_vocabulary_and_a_random_request": ["llama_padded_vocabulary"],
    "test_llama_tp3_and_tp4_split_and_replicated_kv_heads": ["llama_one_kv_head_per_rank", "llama_replicated_kv_heads"],
    "test_qwen2_with_biases_and_gemma3_with_one_kv_head_tp2": ["qwen2_with_biases", "gemma3_with_one_kv_head"],
    "test_smollm2_gguf_tp3_float32_and_native_int4": ["smollm2_float32_and_bfloat16"],
    "test_gemma3_270m_gguf_tp2_replicates_its_kv_head": ["gemma3_270m"],
    "test_every_architecture_tp2_samples_as_one_worker": list(ARCHITECTURES_TP2),
}


@pytest.fixture(scope="module")
def replayed(request, tmp_path_factory, tokenizer, smollm2_gguf):
    """``replayed(case)``: [(a reference of the case, what each rank saw replaying it)]. The
    first case of a world size asked for replays every case of that size among this module's
    collected tests, in one spawn of that many processes (a spawn costs each process a torch
    import and a gloo set-up): 9 processes for the module instead of 16, each spawn still in
    the test that first needs it."""
    collected = [
        case
        for item in request.session.items
        if item.module is request.module
        for case in CASES_OF_TEST[item.originalname]
    ]
    replays: dict[str, list[tuple[Reference, list[dict]]]] = {}

    def replay(case: str) -> list[tuple[Reference, list[dict]]]:
        if case not in replays:
            tp_size = CASES[case][0]
            of_this_size = [other for other in dict.fromkeys([case, *collected]) if CASES[other][0] == tp_size]
            flat = [
                (other, reference)
                for other in of_this_size
                for reference in CASES[other][1](tmp_path_factory.mktemp(other), tokenizer, smollm2_gguf)
            ]
            per_rank = run_tensor_parallel(tp_size, [reference for _, reference in flat])
            for index, (other, reference) in enumerate(flat):
                replays.setdefault(other, []).append((reference, [rank[index] for rank in per_rank]))
        return replays[case]

    return replay


def test_llama_tp2_padded_vocabulary_and_a_random_request(replayed):
    """4 query / 2 KV heads over 2 ranks; one more vocabulary row than the tokenizer's, so the
    last rank's head shard is padded; an unseeded random request samples the same on both ranks."""
    ((reference, per_rank),) = replayed("llama_padded_vocabulary")
    greedy = {output.request_id for output, p in zip(reference.outputs, LLAMA_TP2_PARAMS) if p.temperature == 0}
    assert all(r["heads"] == (2, 1) and r["kv_cache_shape"][3] == 1 for r in per_rank)
    assert all(r["rank_blocks"] >= reference.num_blocks for r in per_rank)  # half the heads: twice the blocks
    assert_same_as_one_worker(reference, per_rank, greedy_requests=greedy)


def test_llama_tp3_and_tp4_split_and_replicated_kv_heads(replayed):
    """tp=3 with 6 query / 3 KV heads (one KV head per rank, untied head); tp=4 with 8 query /
    2 KV heads (each KV head replicated on two ranks) -- one spawn of 4 processes would not
    serve both, so each size gets its own."""
    ((ref3, per_rank3),) = replayed("llama_one_kv_head_per_rank")
    assert len(per_rank3) == 3 and all(r["heads"] == (2, 1) for r in per_rank3)
    assert_same_as_one_worker(ref3, per_rank3)

    ((ref4, per_rank4),) = replayed("llama_replicated_kv_heads")
    assert len(per_rank4) == 4 and all(r["heads"] == (2, 1) and r["kv_cache_shape"][3] == 1 for r in per_rank4)
    assert_same_as_one_worker(ref4, per_rank4)


def test_qwen2_with_biases_and_gemma3_with_one_kv_head_tp2(replayed):
    """Qwen2's q/k/v biases split with their heads; Gemma 3's single KV head replicated on both
    ranks, with its q/k norms, sliding window, soft caps and scaled embeddings."""
    ((qwen2_ref, qwen2_ranks),) = replayed("qwen2_with_biases")
    ((gemma3_ref, gemma3_ranks),) = replayed("gemma3_with_one_kv_head")
    assert all(r["heads"] == (2, 1) for r in qwen2_ranks)
    assert all(r["heads"] == (2, 1) and r["kv_cache_shape"][3] == 1 for r in gemma3_ranks)
    assert_same_as_one_worker(qwen2_ref, qwen2_ranks)
    assert_same_as_one_worker(gemma3_ref, gemma3_ranks)


@pytest.mark.parametrize("architecture", list(ARCHITECTURES_TP2))
def test_every_architecture_tp2_samples_as_one_worker(replayed, architecture):
    """Each built-in architecture without a -tp test of its own, replayed by two ranks in the
    spawn the other two-rank cases use: 4 query / 2 KV heads (one per rank); a mixture of
    experts holds half of every expert's intermediate features on each rank, as vLLM splits them."""
    ((reference, per_rank),) = replayed(architecture)
    assert all(r["heads"] == (2, 1) for r in per_rank)
    expert_size = ARCHITECTURES_TP2[architecture][3]
    assert all(r["expert_intermediate"] == ({expert_size // 2} if expert_size else set()) for r in per_rank)
    assert_same_as_one_worker(reference, per_rank)


# -- the real SmolLM2 GGUF (9 query / 3 KV heads, 4-bit) --------------------------------------


def test_smollm2_gguf_tp3_float32_and_native_int4(replayed):
    """Each rank cuts its slice of every 4-bit tensor in packed form (rows for q/k/v and
    gate/up, whole 32-value blocks of columns for o_proj and down_proj).

    - ``--dtype float32``: dequantized at load; greedy ids equal, logits close.
    - bfloat16 (this CPU's ``--dtype auto``): every projection stays int4 blocks for tokenloom's
      kernel, which quantizes each row's activations to 8 bits per 32-value group: a 1-ulp
      difference in summation order can move one activation's code, so the runs may part at a
      near-tie in a generation; until then ids equal and logits close at bfloat16's precision
      after 30 layers: each rank's partial sums are rounded to bfloat16 before they are added,
      which moved single logits by up to 0.65-0.88 on the avx512 level and 1.06 on the avx2 one
      (a mis-sharded weight or KV head moves logits by far more than that).
    """
    (float32, float32_ranks), (bfloat16, bfloat16_ranks) = replayed("smollm2_float32_and_bfloat16")
    assert len(float32_ranks) == 3
    assert all(r["heads"] == (3, 1) and r["kv_cache_shape"][3] == 1 for r in float32_ranks + bfloat16_ranks)
    assert all(r["int4_layers"] == 0 for r in float32_ranks)
    assert all(r["int4_layers"] == 30 * 4 for r in bfloat16_ranks)  # every projection of every layer stays 4-bit
    assert_same_as_one_worker(float32, float32_ranks, atol=1e-3)
    assert_same_as_one_worker(bfloat16, bfloat16_ranks, atol=1.5, tie=1.5)


# -- the real Gemma 3 270M GGUF (4 query heads / 1 KV head: replicated) -------------------------


@pytest.mark.slow
def test_gemma3_270m_gguf_tp2_replicates_its_kv_head(replayed):
    """Gemma 3 270M's one KV head is replicated on both ranks, each with two of the four query
    heads; its K-quant tensors are cut in whole 256-value blocks (o_proj: 1024 -> 512 columns,
    down_proj: 2048 -> 1024). Float32, dequantized at load: greedy ids equal, logits close."""
    ((reference, per_rank),) = replayed("gemma3_270m")
    assert all(r["heads"] == (2, 1) and r["kv_cache_shape"][3] == 1 for r in per_rank)
    assert_same_as_one_worker(reference, per_rank, atol=1e-3)
