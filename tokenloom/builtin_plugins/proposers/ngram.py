"""N-gram prompt lookup: drafts by finding the sequence's latest n-gram earlier in its own
prompt and output, and proposing the tokens that followed it there. No model, no memory; it
pays off where the output repeats the input (code edits, RAG answers, summaries)."""

from __future__ import annotations

import numpy as np

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
        # where each n-gram match ends: one scan for the last token (the matches of n = 1, each
        # followed by at least one token), then every longer suffix keeps the matches of the
        # shorter one whose token before agrees; matches_by_n[n - 1] holds n's, ascending
        ends = np.flatnonzero(tokens[: num_tokens - 1] == tokens[-1])
        matches_by_n = [ends]
        for n in range(2, min(self.max_n, num_tokens - 1) + 1):
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[num_tokens - n]]
            if not ends.size:
                break
            matches_by_n.append(ends)
        for n in range(len(matches_by_n), self.min_n - 1, -1):
            matches = matches_by_n[n - 1] - (n - 1)  # where the matches start
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
