"""A logits processor the e2e server may import by qualified name
(``--logits-processor-pattern '^tests\\.e2e\\.'``): it bans the token ids it is built with."""

from __future__ import annotations

from tokenloom.plugin_api import LogitsProcessor


class BanTokens(LogitsProcessor):
    def __init__(self, *token_ids: int):
        self.token_ids = [int(token_id) for token_id in token_ids]

    def __call__(self, prompt_token_ids, output_token_ids, logits):
        logits[self.token_ids] = float("-inf")
        return logits
