"""The bench workloads: random prompts (token ids for the offline benches; text decoded from
token ids, like vLLM's random dataset, for ``bench serve``) and prompts from a local
ShareGPT-format JSON file. Randomness comes from a seeded ``numpy`` generator."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from tokenloom.errors import ConfigError

# vLLM's ShareGPT filter: skip tiny and very long conversations
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
# decode -> re-encode rounds before a random text prompt settles on its length
MAX_LENGTH_ROUNDS = 10


@dataclass
class SampleRequest:
    """One benchmark request: the prompt (text or token ids), its length in tokens, and how
    many tokens to generate."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


def sample_lengths(rng: Any, num_requests: int, length: int, range_ratio: float, minimum: int = 1) -> list[int]:
    """``num_requests`` lengths drawn uniformly from [length*(1-r), length*(1+r)], as vLLM's
    ``--random-range-ratio``; all equal to ``length`` when r is 0."""
    low = max(math.floor(length * (1 - range_ratio)), minimum)
    high = max(math.ceil(length * (1 + range_ratio)), low)
    return [int(value) for value in rng.integers(low, high + 1, size=num_requests)]


def allowed_token_ids(tokenizer: Any, vocab_size: int) -> list[int]:
    """Token ids a random prompt may hold: the vocabulary without the special tokens."""
    special = set(getattr(tokenizer, "all_special_ids", None) or []) if tokenizer is not None else set()
    allowed = [token_id for token_id in range(vocab_size) if token_id not in special]
    if not allowed:
        raise ConfigError("the tokenizer's vocabulary has no ordinary tokens to build random prompts from")
    return allowed


def random_token_requests(
    rng: Any,
    num_requests: int,
    input_len: int,
    output_len: int,
    allowed_ids: list[int],
    *,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
) -> list[SampleRequest]:
    """Prompts of exactly the drawn lengths, as token ids: a shared random prefix, then a run of
    consecutive allowed ids from a random offset (distinct prompts, no accidental prefix hits)."""
    input_lens = sample_lengths(rng, num_requests, input_len, range_ratio, minimum=0 if prefix_len else 1)
    output_lens = sample_lengths(rng, num_requests, output_len, range_ratio)
    offsets = rng.integers(0, len(allowed_ids), size=num_requests)
    prefix = [allowed_ids[int(index)] for index in rng.integers(0, len(allowed_ids), size=prefix_len)]
    requests = []
    for request_index, (length, generate, offset) in enumerate(zip(input_lens, output_lens, offsets)):
        body = [allowed_ids[(int(offset) + request_index + position) % len(allowed_ids)] for position in range(length)]
        requests.append(SampleRequest(prefix + body, prefix_len + length, generate))
    return requests


def random_text_requests(
    rng: Any,
    tokenizer: Any,
    num_requests: int,
    input_len: int,
    output_len: int,
    *,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
) -> list[SampleRequest]:
    """vLLM's random dataset: random token ids decoded to text, re-encoded and trimmed or
    topped up until the text is ``prefix_len + input_len`` tokens long (or close to it: some
    token sequences never survive a decode/encode round trip exactly)."""
    vocab_size = int(getattr(tokenizer, "vocab_size", 0) or len(tokenizer))
    allowed = allowed_token_ids(tokenizer, vocab_size)
    requests = random_token_requests(
        rng, num_requests, input_len, output_len, allowed, range_ratio=range_ratio, prefix_len=prefix_len
    )
    for request in requests:
        if isinstance(request.prompt, list):  # always: random_token_requests gives token ids
            request.prompt, request.prompt_len = decode_to_length(
                rng, tokenizer, request.prompt, request.prompt_len, allowed
            )
    return requests


def decode_to_length(
    rng: Any, tokenizer: Any, token_ids: list[int], target_len: int, allowed_ids: list[int]
) -> tuple[str, int]:
    """Text that encodes to ``target_len`` tokens when possible; returns (text, its length)."""
    text = tokenizer.decode(token_ids)
    encoded = tokenizer.encode(text, add_special_tokens=False)
    for _ in range(MAX_LENGTH_ROUNDS):
        if len(encoded) == target_len:
            break
        if len(encoded) > target_len:
            encoded = encoded[:target_len]
        else:
            extra = rng.integers(0, len(allowed_ids), size=target_len - len(encoded))
            encoded = encoded + [allowed_ids[int(index)] for index in extra]
        text = tokenizer.decode(encoded)
        encoded = tokenizer.encode(text, add_special_tokens=False)
    return text, len(encoded)


def sharegpt_requests(
    rng: Any,
    path: str,
    tokenizer: Any,
    num_requests: int,
    *,
    output_len: int | None = None,
    max_model_len: int | None = None,
) -> list[SampleRequest]:
    """Prompts from a ShareGPT-format JSON file (a list of ``{"conversations": [{"from": "human",
    "value": ...}, {"from": "gpt", "value": ...}, ...]}``): each conversation's first turn is
    the prompt and the second's length the output length (unless ``output_len`` fixes it).
    Conversations are shuffled with ``rng``; too short or too long ones are skipped as vLLM
    does (and those that do not fit ``max_model_len``). Short files are repeated to fill
    ``num_requests``."""
    conversations = _load_sharegpt(path)
    order = rng.permutation(len(conversations))
    requests: list[SampleRequest] = []
    for index in order:
        if len(requests) == num_requests:
            break
        prompt, completion = conversations[int(index)]
        prompt_len = len(tokenizer.encode(prompt))
        completion_len = output_len or len(tokenizer.encode(completion, add_special_tokens=False))
        if prompt_len < SHAREGPT_MIN_LEN or (output_len is None and completion_len < SHAREGPT_MIN_LEN):
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + completion_len > SHAREGPT_MAX_TOTAL_LEN:
            continue
        if max_model_len is not None and prompt_len + completion_len > max_model_len:
            continue
        requests.append(SampleRequest(prompt, prompt_len, completion_len))
    if not requests:
        limit = f", and fits --max-model-len {max_model_len}" if max_model_len is not None else ""
        raise ConfigError(
            f"--dataset-path {path}: no conversation has a prompt and reply of {SHAREGPT_MIN_LEN} to "
            f"{SHAREGPT_MAX_PROMPT_LEN} tokens{limit}",
            param="dataset-path",
        )
    if len(requests) < num_requests:
        print(f"the dataset holds {len(requests)} usable conversations; repeating them to make {num_requests} requests")
        picks = rng.integers(0, len(requests), size=num_requests - len(requests))
        requests += [SampleRequest(**vars(requests[int(pick)])) for pick in picks]
    return requests


def _load_sharegpt(path: str) -> list[tuple[str, str]]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as exc:
        raise ConfigError(f"--dataset-path {path}: {exc.strerror}", param="dataset-path") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"--dataset-path {path}: not valid JSON ({exc.msg} at line {exc.lineno})", param="dataset-path"
        ) from None
    if not isinstance(data, list):
        raise ConfigError(f"--dataset-path {path}: expected a JSON list of ShareGPT entries", param="dataset-path")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if (
            isinstance(first, dict)
            and isinstance(second, dict)
            and isinstance(first.get("value"), str)
            and isinstance(second.get("value"), str)
        ):
            pairs.append((first["value"], second["value"]))
    if not pairs:
        raise ConfigError(
            f'--dataset-path {path}: no entry has a "conversations" list of at least two turns '
            '(ShareGPT format: [{"conversations": [{"from": "human", "value": ...}, '
            '{"from": "gpt", "value": ...}]}])',
            param="dataset-path",
        )
    return pairs
