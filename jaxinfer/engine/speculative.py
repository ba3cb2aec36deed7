"""Speculative decoding on the host: who proposes drafts, how many, and what was accepted.

Each engine step, before the scheduler runs, every running request that decodes next gets its drafts
(`Request.drafts`, at most ``num_speculative_tokens``): its verify segment — the input token and the
drafts — goes into the one ragged step (`jaxinfer.engine.runner.ModelRunner.step_inputs`), which draws a
token after each of them and accepts on device (`jaxinfer.ops.sampler.Drafts`: greedy rows while the
draft is the argmax, sampled rows by the rejection rule). The engine reads the step back before the
next one (a proposer needs the tokens just accepted: the engine's ``spec_syncs``), and
`Speculator.verified` records what each request accepted.

Proposers (`Proposer`: ``propose(request, k) -> drafts``):

- `NgramProposer` (``method: "ngram"``, prompt lookup): the request's last n tokens, n from
  ``prompt_lookup_max`` down to ``prompt_lookup_min``, matched against everything before them in its
  prompt and output (numpy, all start positions at once); the k tokens after the latest match are
  the drafts.
- A proposer that reads the target's hidden states (EAGLE-3, MTP heads) fits the same seam: it needs
  the step to return the hidden states of each request's accepted tokens (one more `SamplerOutput`
  field, gathered at `LogitsRows.index`) and its own small head run in the step after; its drafts go
  into `Request.drafts` as any other's. None is built: no such weights exist offline to test against.

How many (`Speculator.budget_for`), from the request's own history only — never the batch, the load or
preemption, so a seeded request draws the same tokens whatever runs beside it:

- start at k = ``num_speculative_tokens``; after a verify that accepted every draft, k stays at the
  most; after one that accepted a < k, the next k is a + 1 (what was accepted, and one more);
- after ``MISS_LIMIT`` steps in a row without an accepted draft (the proposer found nothing, or every
  draft was rejected), the request stops proposing for ``pause`` of its own output tokens
  (``PAUSE_START``, doubling up to ``PAUSE_MAX`` each time it happens again); any accepted draft
  resets the pause. A paused request decodes as without speculation, and the engine does not wait
  for its tokens before the next step (`Speculator.wants_tokens`): low-acceptance text (open-ended
  chat) keeps most of the plain engine's overlap of host and device.
- never more than ``max_tokens`` allows (the segment's last row draws one more token) or than a
  step's token budget shared by ``max_num_seqs`` requests allows (`max_drafts`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Protocol

import numpy as np

from jaxinfer.config import EngineConfig, SpeculativeConfig
from jaxinfer.engine.structured import draft_prefix

MISS_LIMIT = 3  # steps in a row without an accepted draft before a request pauses speculating
PAUSE_START = 8  # output tokens of the first pause
PAUSE_MAX = 64  # the longest pause


def max_drafts(ecfg: EngineConfig, budget: int) -> int:
    """The most drafts a request proposes: ``num_speculative_tokens``, and no more than lets every one of
    ``max_num_seqs`` running requests verify a full segment within a step's token ``budget`` (so no
    request ever waits for another's drafts: its segment never depends on the batch)."""
    return max(0, min(ecfg.num_speculative_tokens, budget // ecfg.max_num_seqs - 1))


class Proposer(Protocol):
    def propose(self, tokens: np.ndarray, k: int) -> list:
        """Up to ``k`` draft tokens to follow ``tokens`` (the request's prompt and output so far)."""


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n
    tokens (the longest n from ``n_max`` down to ``n_min`` that occurs)."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, tokens: np.ndarray, k: int) -> list:
        size = tokens.shape[0]
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            # windows starting at 0 .. size - n - 1: every earlier occurrence, never the suffix itself
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[size - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest occurrence: what followed it
                return tokens[start:start + k].tolist()
        return []


@dataclasses.dataclass
class SpecState:
    """One request's speculation history (`Speculator.budget_for`)."""

    k: int  # drafts to propose next
    misses: int = 0  # verifies in a row that accepted nothing
    pause: int = 0  # length of the next pause, in output tokens
    resume_at: int = 0  # output count from which the request proposes again


class SpecStats:
    """vLLM's speculative-decoding counters: verify segments with drafts ("drafts"), draft tokens,
    accepted tokens, and accepted tokens per draft position."""

    def __init__(self, k: int):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k
        self.propose_s = 0.0  # host time proposing
        self.sync_s = 0.0  # host time waiting for the previous step before proposing

    def add(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify segment with drafts emits, on average (its accepted drafts and the one drawn)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def snapshot(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "propose_s": self.propose_s,
            "sync_s": self.sync_s,
        }


class Speculator:
    """The engine's speculative decoding on the host (the module's docstring)."""

    def __init__(self, config: SpeculativeConfig, ecfg: EngineConfig, budget: int, max_model_len: int):
        if config.method != "ngram":
            raise ValueError(f"speculative_config method {config.method!r} is not available yet; use 'ngram'.")
        self.config = config
        self.k = max_drafts(ecfg, budget)
        if not self.k:
            raise ValueError(
                f"speculative decoding needs room in a step for a draft per running request: the step's token "
                f"budget ({budget} tokens) over max_num_seqs ({ecfg.max_num_seqs}) leaves none; give a budget of "
                f"at least {2 * ecfg.max_num_seqs} tokens (max_num_batched_tokens and a token bucket that large) "
                f"or fewer max_num_seqs.")
        self.max_model_len = max_model_len
        self.proposer: Proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpecStats(config.num_speculative_tokens)

    def budget_for(self, r) -> int:
        """How many drafts ``r`` proposes now (the module's rule), within its max_tokens and context."""
        st = r.spec
        if st is None:
            st = r.spec = SpecState(k=self.k)
        if r.num_sampled < st.resume_at:
            return 0
        room = min(r.max_tokens - r.num_sampled, self.max_model_len - r.num_computed) - 1
        return max(0, min(st.k, room))

    def wants_tokens(self, r) -> bool:
        """``r`` decodes next and would propose: the engine reads the step in flight before this one, so
        the proposer sees its last tokens. (A paused request runs without that sync.)"""
        return not r.finished and r.prefill_done and not r.done_sampling and self.budget_for(r) > 0

    def must_read(self, r) -> bool:
        """The engine reads the steps in flight before scheduling when ``r`` has a verify segment among
        them (its counters wait for what was accepted) or `wants_tokens`."""
        return bool(r.drafts) or self.wants_tokens(r)

    def propose(self, running) -> None:
        """Set `Request.drafts` of every running request whose next step decodes (others: none). A request
        whose last token is still on device (paused, so the engine did not wait for it) proposes nothing."""
        t0 = time.perf_counter()
        for r in running:
            r.drafts = []
            if not self.wants_tokens(r) or not isinstance(r.last_token, int):
                continue
            r.drafts = self.proposer.propose(np.asarray(r.known_token_ids(), np.int64), self.budget_for(r))
            if r.constraint is not None:  # structured output: only the drafts its grammar allows
                r.drafts = draft_prefix(r.constraint, r.drafts)
            if not r.drafts:
                self._missed(r)
        self.stats.propose_s += time.perf_counter() - t0

    def verified(self, r, drafted: int, accepted: int) -> None:
        """``r``'s segment of ``drafted`` drafts accepted ``accepted`` (its tokens counted in
        ``num_sampled``): the stats, and its next k."""
        if not drafted:
            return
        self.stats.add(drafted, accepted)
        r.metrics.spec_drafts += 1
        r.metrics.spec_draft_tokens += drafted
        r.metrics.spec_accepted_tokens += accepted
        st = r.spec
        st.k = self.k if accepted == drafted else min(self.k, accepted + 1)
        if accepted:
            st.misses, st.pause = 0, 0
        else:
            self._missed(r)

    def _missed(self, r) -> None:
        """A step of ``r`` without an accepted draft (no proposal, or every draft rejected): after
        `MISS_LIMIT` in a row, a pause of its next `pause` tokens."""
        st = r.spec
        st.misses += 1
        if st.misses >= MISS_LIMIT:
            st.pause = min(PAUSE_MAX, st.pause * 2) if st.pause else PAUSE_START
            st.resume_at = r.num_sampled + st.pause
            st.misses = 0


def speculator_for(ecfg: EngineConfig, budget: int, max_model_len: int) -> Optional[Speculator]:
    """The engine's `Speculator`, or None when ``ecfg.speculative_config`` is None."""
    if ecfg.speculative_config is None:
        return None
    return Speculator(ecfg.speculative_config, ecfg, budget, max_model_len)
