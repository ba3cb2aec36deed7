"""Speculative decoding on the host: who proposes drafts, how many, and what was accepted.

Each engine step, before the scheduler runs, every running request that decodes next gets its drafts
(`Request.drafts`, at most ``num_speculative_tokens``): its verify segment — the input token and the
drafts — goes into the one ragged step (`jaxinfer.engine.runner.ModelRunner.step_inputs`), which draws a
token after each of them and accepts on device (`jaxinfer.ops.sampler.Drafts`: greedy rows while the
draft is the argmax, sampled rows by the rejection rule). The engine reads the step back before the
next one (a proposer needs the tokens just accepted: the engine's ``spec_syncs``), and
`Speculator.verified` records what each request accepted.

Proposers (`Proposer`: ``propose(tokens, k) -> drafts``, the request's prompt and output so far):

- `NgramProposer` (``method: "ngram"``, prompt lookup): the request's last n tokens, n from
  ``prompt_lookup_max`` down to ``prompt_lookup_min``, matched against everything before them in its
  prompt and output (numpy, all start positions at once); the k tokens after the latest match are
  the drafts.
- A proposer that reads the target's hidden states (EAGLE-3, MTP heads) fits the same seam: it needs
  the step to return the hidden states of each request's accepted tokens (one more `SamplerOutput`
  field, gathered at `LogitsRows.index`) and its own small head run in the step after; its drafts go
  into `Request.drafts` as any other's. None is built: no such weights exist offline to test against.

How many (`Speculator.budget_for`). A verify row draws what plain decoding would draw at its position
(`jaxinfer.ops.sampler`) and accepts the draft when it drew it, so a request's tokens — greedy or seeded —
are the same however many drafts it verified, or none: the rule below changes speed, never output, and
may look at the batch. Per request, from its own history:

- slow start: k starts at ``K_START`` (1) and doubles after each verify that accepted every draft, up
  to ``num_speculative_tokens``; after one that accepted a < k drafts, the next k is a + 1 (what was
  accepted, and one more). A request earns long drafts by having short ones accepted, so requests
  whose drafts fail rarely verify more than a token or two (at a high batch that keeps a step of
  many such requests within its token bucket);
- after ``MISS_LIMIT`` verifies in a row that accepted nothing, or ``NOMATCH_LIMIT`` steps in a row
  where the proposer found nothing (cheaper: no verify work, only the sync below), the request stops
  proposing for ``pause`` of its own output tokens (``PAUSE_START``, doubling up to ``PAUSE_MAX`` each
  time it happens again) and starts again from ``K_START``; any accepted draft resets the pause. A
  paused request decodes as without speculation, and the engine does not wait for its tokens before
  the next step (`Speculator.wants_tokens`): low-acceptance text (open-ended chat) keeps most of the
  plain engine's overlap of host and device.
- never more than ``max_tokens`` allows (the segment's last row draws one more token) or than a
  step's token budget shared by ``max_num_seqs`` requests allows (`max_drafts`).

Per step, from the batch (`Speculator.speculates`): when more requests decode than
``disable_by_batch_size`` (vLLM's field; by default the batch from which a decode step is compute-bound
on this machine, `jaxinfer.engine.roofline.compute_bound_batch`), no request proposes: every further
token of such a step costs compute, so drafts would slow it, and the engine keeps plain decoding's
overlap (no sync). A request's own history is left as it was for the next step that speculates.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Protocol

import numpy as np

from jaxinfer.config import EngineConfig, SpeculativeConfig
from jaxinfer.engine.distributed import to_host
from jaxinfer.engine.request import TokenRef
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.scheduler import PrefillChunk
from jaxinfer.engine.structured import draft_prefix
from jaxinfer.loading import model_cache
from jaxinfer.loading.weights import resolve_model
from jaxinfer.ops.mesh import mesh_placement
from jaxinfer.sampling_params import SamplingParams

MISS_LIMIT = 3  # verifies in a row that accepted nothing before a request pauses speculating
NOMATCH_LIMIT = 5  # steps in a row without a proposal before it pauses
K_START = 1  # drafts of a request's first verify, and of its first after a pause (slow start)
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

    def may_propose(self, known: np.ndarray) -> bool:
        """Whether ``known`` followed by any one token can have a proposal: its last ``n_min`` - 1 tokens
        occur earlier (a match of n >= n_min tokens ending at the next token holds them at its end). False
        lets the engine skip reading the step in flight that draws that token."""
        n = self.n_min - 1
        size = known.shape[0]
        if n == 0:
            return size > 0
        if size <= n:
            return False
        windows = np.lib.stride_tricks.sliding_window_view(known[:-1], n)
        return bool((windows == known[size - n:]).all(axis=1).any())


def decodes_next(r) -> bool:
    """``r``'s next step is a decode row: its prompt is in, and it has tokens left to draw."""
    return not r.finished and r.prefill_done and not r.done_sampling


@dataclasses.dataclass
class SpecState:
    """One request's speculation history (`Speculator.budget_for`)."""

    k: int  # drafts to propose next
    misses: int = 0  # verifies in a row that accepted nothing
    nomatch: int = 0  # steps in a row without a proposal
    pause: int = 0  # length of the next pause, in output tokens
    resume_at: int = 0  # output count from which the request proposes again
    draft_done: int = 0  # method "draft_model": positions whose keys and values are in the draft's cache
    preemptions: int = 0  # the request's preemptions when draft_done was last valid (its pages are new since)


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
        self.unspeculated_steps = 0  # steps in which too many requests decoded to speculate (`disable_by_batch_size`)

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
            "unspeculated_steps": self.unspeculated_steps,
        }


class Speculator:
    """The engine's speculative decoding on the host (the module's docstring)."""

    def __init__(self, config: SpeculativeConfig, ecfg: EngineConfig, budget: int, max_model_len: int,
                 runner=None, compute_bound: Optional[int] = None):
        self.config = config
        # more requests decoding than this: the step does not speculate (None: no limit)
        self.batch_limit = config.disable_by_batch_size if config.disable_by_batch_size is not None else compute_bound
        self.k = max_drafts(ecfg, budget)
        if not self.k:
            raise ValueError(
                f"speculative decoding needs room in a step for a draft per running request: the step's token "
                f"budget ({budget} tokens) over max_num_seqs ({ecfg.max_num_seqs}) leaves none; give a budget of "
                f"at least {2 * ecfg.max_num_seqs} tokens (max_num_batched_tokens and a token bucket that large) "
                f"or fewer max_num_seqs.")
        self.max_model_len = max_model_len
        self.proposer: Proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        # method "draft_model": the draft runs after the scheduler has given each segment its pages
        self.draft: Optional[DraftModel] = DraftModel(config, runner, budget) if config.method == "draft_model" else None
        self.stats = SpecStats(config.num_speculative_tokens)

    def budget_for(self, r) -> int:
        """How many drafts ``r`` proposes now (the module's rule), within its max_tokens and context."""
        st = r.spec
        if st is None:
            st = r.spec = SpecState(k=min(K_START, self.k))
        if r.num_sampled < st.resume_at:
            return 0
        room = min(r.max_tokens - r.num_sampled, self.max_model_len - r.num_computed) - 1
        return max(0, min(st.k, room))

    def wants_tokens(self, r) -> bool:
        """``r`` decodes next and would propose: the engine reads the step in flight before this one, so
        the proposer sees its last tokens. (A paused request runs without that sync.)"""
        return decodes_next(r) and self.budget_for(r) > 0

    def speculates(self, running) -> bool:
        """Whether this step's decode rows may carry drafts: no more of ``running`` decode next than
        `batch_limit` (the module's docstring)."""
        if self.batch_limit is None:
            return True
        return sum(1 for r in running if decodes_next(r)) <= self.batch_limit

    def must_read(self, running) -> bool:
        """The engine reads the steps in flight before scheduling when one of ``running`` has a verify
        segment among them (its counters wait for what was accepted), or when this step speculates and
        one `wants_tokens`."""
        if any(r.drafts for r in running):
            return True
        return self.speculates(running) and any(self.wants_tokens(r) and self._may_propose(r) for r in running)

    def _may_propose(self, r) -> bool:
        """Whether ``r`` can have drafts once its token in flight is read (prompt lookup: `NgramProposer.may_propose`
        on the tokens before it; other proposers: always)."""
        check = getattr(self.proposer, "may_propose", None)
        if self.draft is not None or check is None or isinstance(r.last_token, int):
            return True
        return check(np.asarray(r.known_token_ids(), np.int64))

    def propose(self, running) -> None:
        """Set `Request.drafts` of every running request whose next step decodes (others: none). A request
        whose last token is still on device (paused, so the engine did not wait for it) proposes nothing;
        in a step that does not speculate, none does."""
        t0 = time.perf_counter()
        on = self.speculates(running)
        if not on:
            self.stats.unspeculated_steps += 1
        for r in running:
            r.drafts = []
            if not on or not self.wants_tokens(r):
                continue
            if not isinstance(r.last_token, int):  # not read: no proposal could follow it (`_may_propose`)
                self._no_match(r)
                continue
            if self.draft is not None:  # room for k drafts; `fill` runs the draft model once pages are given
                r.drafts = [PLACEHOLDER] * self.budget_for(r)
                continue
            r.drafts = self.proposer.propose(np.asarray(r.known_token_ids(), np.int64), self.budget_for(r))
            if r.constraint is not None:  # structured output: only the drafts its grammar allows
                r.drafts = draft_prefix(r.constraint, r.drafts)
            if not r.drafts:
                self._no_match(r)
        self.stats.propose_s += time.perf_counter() - t0

    def fill(self, decodes) -> None:
        """The draft model's proposals for the scheduled ``decodes`` that hold room for drafts (their
        pages already cover the segment); a no-op for prompt lookup."""
        if self.draft is None:
            return
        t0 = time.perf_counter()
        todo = [r for r in decodes if r.drafts]
        if todo:
            for r, drafts in zip(todo, self.draft.propose(todo)):
                r.drafts = draft_prefix(r.constraint, drafts) if r.constraint is not None else drafts
        self.stats.propose_s += time.perf_counter() - t0

    def warmup(self) -> int:
        """Compile the draft model's programs (none for prompt lookup)."""
        return self.draft.runner.warmup(self.draft.runner.programs.keys()) if self.draft is not None else 0

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
        st.draft_done = min(st.draft_done, r.num_computed)  # the draft's KV of rejected drafts is stale
        st.nomatch = 0
        if accepted < drafted:
            st.k = min(self.k, accepted + 1)
        elif drafted >= st.k:  # a full segment, all accepted (fewer proposed: k stays)
            st.k = min(self.k, 2 * st.k)
        if accepted:
            st.misses, st.pause = 0, 0
        else:
            st.misses += 1
            if st.misses >= MISS_LIMIT:
                self._pause(r)

    def _no_match(self, r) -> None:
        """A step of ``r`` whose proposer found nothing: after `NOMATCH_LIMIT` in a row, a pause."""
        st = r.spec
        st.nomatch += 1
        if st.nomatch >= NOMATCH_LIMIT:
            self._pause(r)

    def _pause(self, r) -> None:
        """``r`` stops proposing for its next `pause` tokens (doubling each time, up to `PAUSE_MAX`), then
        starts again from `K_START` drafts."""
        st = r.spec
        st.pause = min(PAUSE_MAX, st.pause * 2) if st.pause else PAUSE_START
        st.resume_at = r.num_sampled + st.pause
        st.misses = st.nomatch = 0
        st.k = min(K_START, self.k)


PLACEHOLDER = -1  # a draft token not drawn yet (method "draft_model", between `propose` and `fill`)
GREEDY = SamplingParams(temperature=0.0)


class DraftView:
    """A target request as the draft model's runner sees it: the same pages and slot (the draft's KV cache
    has the target's page layout, so the scheduler's pages serve both), its known tokens, greedy."""

    params = GREEDY
    constraint = None
    seed = 0

    def __init__(self, r, start: int):
        self.request_id = r.request_id
        self.pages, self.slot = r.pages, r.slot
        self.tokens = r.known_token_ids()  # through the target's input token at position r.num_computed
        self.prompt_len = self.prefill_target = len(self.tokens)
        self.num_computed = start
        self.drafts: list = []
        self.last_token = None

    def all_token_ids(self, start: int, n: int) -> list:
        return self.tokens[start:start + n]

    def banned_ids(self, ahead: int = 0) -> tuple:
        return ()


class DraftModel:
    """Method "draft_model": a smaller model of the same vocabulary (``config.model``, loaded as the
    engine loads its own, quantized by ``config.quantization``) proposes its argmax, k tokens a request.

    Its KV cache has the target's pages and page size, so a request's pages (given by the scheduler for
    the whole verify segment before the draft runs) hold the draft's keys and values too, and the
    prefix cache and forks share them as they share the target's (the same tokens give the same values).
    Each proposal first catches the draft's cache up to the target's input token (the request's tokens
    from `SpecState.draft_done`: its whole prompt the first time; after a verify, the accepted tokens),
    in chunks within the step budget, drawing the first draft; then k - 1 one-token steps, each fed the
    token drawn before it on device, read back once at the end. A preempted request starts again from 0.
    """

    def __init__(self, config: SpeculativeConfig, target, budget: int):

        if target.cfg.kv_window:
            raise ValueError("speculative_config method 'draft_model' is not supported for a model whose every layer "
                             "slides (pages behind the window are given back): use 'ngram'.")
        if target.plans is not None:
            raise ValueError("speculative_config method 'draft_model' is not supported on several processes.")
        ecfg = target.ecfg.replace(speculative_config=None, quantization=config.quantization)
        loaded = model_cache.load(resolve_model(config.model), ecfg.dtype, placement=mesh_placement(ecfg),
                                  quantization=ecfg.quantization)
        if loaded.config.vocab_size != target.model_cfg.vocab_size:
            raise ValueError(f"the draft model {config.model} has a vocabulary of {loaded.config.vocab_size} tokens, "
                             f"the target {target.model_cfg.vocab_size}: a draft must share the target's tokenizer.")
        self.runner = ModelRunner(loaded.config, ecfg, loaded.take_params())
        self.budget = budget
        self.max_chunk = min(ecfg.chunk_buckets[-1], budget)

    def propose(self, requests) -> list:
        """Each request's drafts (``len(r.drafts)`` of them: the room it was given), greedy."""

        views = []
        for r in requests:
            st = r.spec
            if st.preemptions != r.num_preemptions:
                st.draft_done, st.preemptions = 0, r.num_preemptions
            views.append(DraftView(r, min(st.draft_done, r.num_computed)))
        drawn: list = [[] for _ in views]  # TokenRef of each draft
        # catch up to the input token: chunks within the budget, the last one of each drawing its first draft
        while any(v.num_computed < v.prefill_target for v in views):
            chunks, budget = [], self.budget
            for i, v in enumerate(views):
                n = min(v.prefill_target - v.num_computed, budget, self.max_chunk)
                if n > 0:
                    chunks.append((i, PrefillChunk(v, v.num_computed, n)))
                    budget -= n
            out = self.runner.step([], [c for _, c in chunks])
            for row, (i, c) in enumerate(chunks):
                v = views[i]
                v.num_computed += c.length
                if v.num_computed == v.prefill_target:
                    v.last_token = TokenRef(out.tokens, row)
                    drawn[i].append(v.last_token)
        # then one token a step, each fed the draft drawn before it (still on device)
        for step in range(1, max(len(r.drafts) for r in requests)):
            live = [(i, v) for i, (r, v) in enumerate(zip(requests, views)) if step < len(r.drafts)]
            out = self.runner.step([v for _, v in live], [])
            for row, (i, v) in enumerate(live):
                v.num_computed += 1
                v.last_token = TokenRef(out.tokens, row)
                drawn[i].append(v.last_token)
        host: dict = {}
        proposals = []
        for r, v, refs in zip(requests, views, drawn):
            r.spec.draft_done = v.num_computed
            toks = []
            for ref in refs:
                if id(ref.array) not in host:
                    host[id(ref.array)] = to_host(ref.array)
                toks.append(int(host[id(ref.array)][ref.row]))
            proposals.append(toks)
        return proposals


def speculator_for(ecfg: EngineConfig, budget: int, max_model_len: int, runner=None,
                   compute_bound: Optional[int] = None) -> Optional[Speculator]:
    """The engine's `Speculator`, or None when ``ecfg.speculative_config`` is None; ``runner``: the target's
    (a draft model takes its page layout and mesh); ``compute_bound``: the decode batch from which a step
    is compute-bound here (the default ``disable_by_batch_size``), None if unknown."""
    if ecfg.speculative_config is None:
        return None
    return Speculator(ecfg.speculative_config, ecfg, budget, max_model_len, runner, compute_bound)
