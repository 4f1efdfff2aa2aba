"""``ScriptedForCausalLM``: a parameter-light model that answers each prompt with a scripted
token sequence, chosen by a marker (``[[scenario:NAME]]``) in the prompt.

It keeps no state between steps: its one-layer KV cache (one head of size 1) is its memory
of every sequence's token ids (K holds ``id // 256``, V ``id % 256``, exact in any float
dtype), written at ``slot_mapping`` and read back through ``block_tables``, so prefix
caching, chunked prefill and preemption work as for a real model. Hidden states carry the
next token the same way; ``compute_logits`` turns them into logits that pick it. A prompt
with no marker, or a script at its end, gets EOS.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from tokenloom.plugin_api import KVCacheSpec, ModelLoadError

ID_BASE = 256  # token ids are stored as two floats below this, exact in bf16 and fp16
SCENARIO_FILE = "scenarios.json"


def last_occurrence(history: list[int], needle: list[int], end: int) -> int:
    """Start of the last occurrence of ``needle`` in ``history[:end]``, or -1."""
    for start in range(end - len(needle), -1, -1):
        if history[start : start + len(needle)] == needle:
            return start
    return -1


class Script:
    """The scenarios of a model directory: marker token ids -> response token ids."""

    def __init__(self, table: dict, eos_token_id: int):
        self.response_start = list(table["response_start_ids"])
        self.scenarios = [(list(s["marker_ids"]), list(s["response_ids"])) for s in table["scenarios"].values()]
        self.eos_token_id = eos_token_id

    def next_token(self, history: list[int]) -> int:
        start = last_occurrence(history, self.response_start, len(history))
        if start < 0:
            return self.eos_token_id
        start += len(self.response_start)
        chosen, chosen_at = None, -1
        for marker, response in self.scenarios:
            found = last_occurrence(history, marker, start)
            if found > chosen_at or (found == chosen_at >= 0 and len(marker) > len(chosen[0])):
                chosen, chosen_at = (marker, response), found
        if chosen is None:
            return self.eos_token_id
        response = chosen[1]
        # the tokens generated so far are the longest scripted prefix that ends the history
        # (the template may have put more tokens, e.g. an empty think block, after `start`)
        for generated in range(min(len(response), len(history) - start), -1, -1):
            if generated == 0 or history[len(history) - generated :] == response[:generated]:
                return response[generated] if generated < len(response) else self.eos_token_id
        return self.eos_token_id


class ScriptedForCausalLM(nn.Module):
    def __init__(self, ctx):
        super().__init__()
        config = ctx.hf_config
        self.vocab_size = int(config.vocab_size)
        directory = getattr(config, "_name_or_path", None) or getattr(ctx.model_config, "model", "")
        path = os.path.join(directory, SCENARIO_FILE)
        if not os.path.isfile(path):
            raise ModelLoadError(f"the scripted model needs {SCENARIO_FILE} next to its config.json (looked in {path})")
        with open(path, encoding="utf-8") as scenario_file:
            self.script = Script(json.load(scenario_file), int(config.eos_token_id))
        # how far below the scripted token every other logit is; a real weight, so the model
        # loads through the load format's weight path like any other
        self.logit_margin = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.kv_cache_spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_size=1, sliding_windows=[None])

    def load_weights(self, weights) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if name != "logit_margin":
                raise ModelLoadError(f"the scripted model has no weight {name!r}")
            self.logit_margin.copy_(tensor.to(self.logit_margin.dtype))
            loaded.add(name)
        return loaded

    def forward(self, input_ids, positions, attn_metadata):
        keys, values = (cache.view(-1) for cache in attn_metadata.kv_caches[0])
        keys[attn_metadata.slot_mapping] = (input_ids // ID_BASE).to(keys.dtype)
        values[attn_metadata.slot_mapping] = (input_ids % ID_BASE).to(values.dtype)
        next_ids = torch.full((input_ids.shape[0],), self.script.eos_token_id, dtype=torch.long)
        block_size = attn_metadata.block_size
        query_ends = attn_metadata.query_start_loc.tolist()[1:]
        for row, (seq_len, query_end) in enumerate(zip(attn_metadata.seq_lens_cpu, query_ends)):
            token_positions = torch.arange(seq_len, device=input_ids.device)
            slots = (
                attn_metadata.block_tables[row, token_positions // block_size] * block_size
                + token_positions % block_size
            )
            history = (keys[slots].long() * ID_BASE + values[slots].long()).tolist()
            next_ids[query_end - 1] = self.script.next_token(history)
        return torch.stack([next_ids // ID_BASE, next_ids % ID_BASE], dim=1).to(self.logit_margin.dtype)

    def compute_logits(self, hidden_states):
        next_ids = hidden_states[:, 0].round().long() * ID_BASE + hidden_states[:, 1].round().long()
        logits = torch.full(
            (hidden_states.shape[0], self.vocab_size),
            -float(self.logit_margin),
            dtype=torch.float32,
            device=hidden_states.device,
        )
        logits[torch.arange(hidden_states.shape[0]), next_ids] = 0.0
        return logits
