"""How many tokens to draft for a request next step: the length that maximises the tokens a
step is expected to emit per unit of step time, from the request's own acceptance so far.

The cost model: a step that verifies ``j`` drafts computes ``j + 1`` rows and costs
``1 + c * j`` decode steps (``c``: one more row relative to a one-row step, the platform's
:meth:`~tokenloom.core.platform.Platform.verify_row_cost` or ``verify_row_cost`` in
``--speculative-config``). If each draft is accepted with probability ``p`` (given the ones
before it were), the step emits ``1 + p + p^2 + ... + p^j`` tokens on average. The draft length
is the ``j`` in ``1..k`` with the best ratio of the two (the shortest on a tie), never 0: a
request whose drafts stopped paying still drafts one, which keeps its estimate moving.

``p`` is estimated per request from each verify's accepted count, Beta-style with forgetting:
a verify of ``n`` drafts of which ``a`` were accepted adds ``a`` successes and (when ``a < n``)
one failure, after the counts so far are multiplied by :data:`DECAY`, and the counts are scaled down to at
most :data:`MAX_TRIALS` trials; the estimate starts at :data:`PRIOR_PROBABILITY` with the weight
of :data:`PRIOR_TRIALS` trials. Counting successes
over successes plus failures is the maximum-likelihood estimate of a geometric run that a short
draft cuts off, so drafting fewer tokens does not bias it.
"""

from __future__ import annotations

from dataclasses import dataclass

# the estimate before a request has verified anything: even odds, worth two drafts' evidence
PRIOR_PROBABILITY = 0.5
PRIOR_TRIALS = 2.0
# each verify multiplies the evidence so far by this: about the last five verifies count, so a
# request whose text turns from copying to writing (or back) changes length within a few steps
DECAY = 0.8
# a verify that accepts all k drafts adds k trials but a rejecting one only one: without a cap a
# long copied run would take as many rejecting verifies to unlearn as it had drafts (k=8 after
# six fully accepted verifies: still 5 drafts after six rejecting ones; with the cap, 2)
MAX_TRIALS = 8.0


@dataclass
class AcceptanceEstimate:
    """One request's (decayed) draft acceptance counts."""

    accepted: float = PRIOR_PROBABILITY * PRIOR_TRIALS
    """Drafts accepted (decayed), the prior's share included."""
    trials: float = PRIOR_TRIALS
    """Drafts accepted plus verifies that rejected one (decayed), the prior's share included."""

    @property
    def probability(self) -> float:
        """The estimated chance that a draft is accepted, given the drafts before it were."""
        return self.accepted / self.trials

    def observe(self, num_verified: int, num_accepted: int) -> None:
        """A verify of ``num_verified`` drafts accepted the first ``num_accepted`` of them."""
        if num_verified <= 0:
            return  # nothing was drafted: no evidence
        self.accepted = self.accepted * DECAY + num_accepted
        self.trials = self.trials * DECAY + num_accepted + (1 if num_accepted < num_verified else 0)
        if self.trials > MAX_TRIALS:
            self.accepted *= MAX_TRIALS / self.trials
            self.trials = MAX_TRIALS


def expected_tokens_per_cost(probability: float, num_drafts: int, verify_row_cost: float) -> float:
    """Tokens a step verifying ``num_drafts`` drafts emits on average, per decode step of time."""
    expected_tokens = sum(probability**position for position in range(num_drafts + 1))
    return expected_tokens / (1.0 + verify_row_cost * num_drafts)


def best_draft_length(probability: float, max_draft_tokens: int, verify_row_cost: float) -> int:
    """The draft length in ``1..max_draft_tokens`` with the most tokens per unit of step time
    (the shortest of equals)."""
    best_length, best_rate = 1, expected_tokens_per_cost(probability, 1, verify_row_cost)
    for length in range(2, max_draft_tokens + 1):
        rate = expected_tokens_per_cost(probability, length, verify_row_cost)
        if rate > best_rate * (1 + 1e-9):
            best_length, best_rate = length, rate
    return best_length


@dataclass(frozen=True)
class DraftLengthPolicy:
    """The per-request draft length: ``num_speculative_tokens`` always when not adaptive, else
    :func:`best_draft_length` of the request's estimate, at most ``num_speculative_tokens``."""

    num_speculative_tokens: int
    adaptive: bool
    verify_row_cost: float

    def next_length(self, estimate: AcceptanceEstimate) -> int:
        if not self.adaptive:
            return self.num_speculative_tokens
        return best_draft_length(estimate.probability, self.num_speculative_tokens, self.verify_row_cost)
