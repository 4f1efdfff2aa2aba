"""What the scheduler refuses at admission: a request that could never run (its id taken, an
empty prompt, a prompt past the model's context or bigger than the whole KV cache), refused
with an error saying what to change before anything is queued."""

from __future__ import annotations

from collections.abc import Container

from tokenloom.core.block_manager import BlockManager
from tokenloom.core.sequence import EngineSequence
from tokenloom.errors import ContextLengthError, InvalidRequestError


def check_admissible(
    seq: EngineSequence, seq_ids_in_use: Container[str], max_model_len: int, block_manager: BlockManager
) -> None:
    """Raise when ``seq`` can never be queued: its id is taken, or it can never fit."""
    seq_id = seq.seq_id
    if seq_id in seq_ids_in_use:
        raise InvalidRequestError(
            f"request id {seq_id!r} is already in use; give each request a unique id", param="request_id"
        )
    num_prompt_tokens = seq.num_prompt_tokens
    if num_prompt_tokens == 0:
        raise InvalidRequestError("the prompt is empty: it must hold at least one token", param="prompt")
    # a pooling prompt may fill the context: no output token follows it
    num_output_slots = 0 if seq.pooling_params is not None else 1
    if num_prompt_tokens + num_output_slots > max_model_len:
        raise ContextLengthError(
            f"the prompt has {num_prompt_tokens} tokens, but the model's maximum context length is "
            f"{max_model_len} tokens (prompt plus at least one output token); shorten the prompt "
            f"to at most {max_model_len - 1} tokens",
            param="prompt",
        )
    block_size = block_manager.block_size
    num_blocks_needed = block_manager.num_blocks_needed(num_prompt_tokens + 1)
    if num_blocks_needed > block_manager.num_blocks:
        raise InvalidRequestError(
            f"the prompt has {num_prompt_tokens} tokens and needs {num_blocks_needed} KV-cache blocks of "
            f"{block_size} tokens, but the cache has only {block_manager.num_blocks} blocks; shorten "
            "the prompt or give the KV cache more memory (--gpu-memory-utilization, "
            "--kv-cache-memory-bytes, --num-gpu-blocks-override)",
            param="prompt",
        )
