"""Speculative decoding: the :class:`~tokenloom.core.spec_decode.proposer.Proposer` interface
that proposer plugins implement, and the rejection sampler that verifies their drafts in one
target step without changing the target's distribution."""
