"""N-gram prompt lookup: drafts by finding the sequence's latest n-gram earlier in its own
prompt and output, and proposing the tokens that followed it there. No model, no memory; it
pays off where the output repeats the input (code edits, RAG answers, summaries)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tokenloom.plugin_api import Draft, DraftRequest, Proposer, ProposerSpec


class NgramProposer(Proposer):
    """Longest match first: for ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``,
    the last ``n`` tokens are looked up among the earlier ones. Among the occurrences followed
    by a whole draft (all of them when none is), those followed by the most frequent next
    token are kept: a short suffix (one or two tokens) occurs many times, and the continuation
    it had most often is the likeliest one now (on the rewrite workload of issue 23 this
    turns lookups of one token from a loss into a gain). Of those, the most recent wins (it
    is likeliest to continue the way the text goes now), or the earliest when none is
    followed by a whole draft (in a short loop the latest is followed by one token only)."""

    def __init__(self, spec: ProposerSpec):
        super().__init__(spec)
        self.min_n = spec.speculative.prompt_lookup_min
        self.max_n = spec.speculative.prompt_lookup_max

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(self.lookup(request.token_ids, request.max_draft_tokens)) for request in requests]

    def lookup(self, token_ids: list[int], max_tokens: int) -> list[int]:
        num_tokens = len(token_ids)
        if max_tokens <= 0 or num_tokens < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            suffix = tokens[num_tokens - n :]
            # windows that start early enough to be followed by at least one token, and are not
            # the suffix itself
            windows = sliding_window_view(tokens[: num_tokens - 1], n)
            matches = np.flatnonzero((windows == suffix).all(axis=1))
            if matches.size:
                full = matches[matches + n + max_tokens <= num_tokens]
                candidates = full if full.size else matches
                # the majority vote on the next token (tokens tied for the most votes all stay)
                _, inverse, counts = np.unique(tokens[candidates + n], return_inverse=True, return_counts=True)
                votes = counts[inverse.reshape(-1)]
                candidates = candidates[votes == votes.max()]
                # the latest match followed by a full draft; else the earliest (the longest tail)
                start = int(candidates[-1] if full.size else candidates[0]) + n
                return token_ids[start : start + max_tokens]
        return []
