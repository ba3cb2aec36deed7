"""The continuous-batching scheduler (in the spirit of vLLM's v1 scheduler).

Each step hands a token budget (``max_num_batched_tokens``) first to the
running requests — one decode token each (with speculative decoding, its input
token and its drafts, `Request.drafts`: all of them or, where they do not fit,
none this step), or the next chunk of a prompt still being prefilled — and then to waiting requests, which join at once with a
prefill chunk (after reusing whatever prefix the cache holds). Pages are
allocated on demand as requests grow; when none are left, the newest running
request is preempted (its pages freed, its tokens recomputed later — with the
prefix cache most of them come back free).

A request is plain counters (`Request.num_computed`, `num_sampled`), so
whole prefill, chunked prefill, prefix hits, recompute and decode are one
arithmetic. The scheduler only decides; the engine dispatches and reads.

Several choices of one prompt (a group, `Engine.submit_group`) are prefilled
once: a waiting member forks from a running one that has computed the prompt's
full pages, taking references on them (no copy, no recompute, with or without
the prefix cache), and computes only the rest of the prompt; until one has, it
waits at the head of the queue. A request that uses penalties neither forks
nor takes prefix-cache hits: its token history (`jaxinfer.ops.sampler.SamplerState`)
is recorded from the tokens it feeds, so it must feed its whole prompt.

A request that asks for prompt logprobs (`SamplingParams.prompt_logprobs`) neither
forks nor takes prefix-cache hits either (as in vLLM): every prompt position's
logits come from its own prefill. A chunk scores each of its tokens but the last
from the position before it, so each of such a request's chunks after the first
starts one token early (`overlap`): it recomputes the previous chunk's last
position, whose distribution scores this chunk's first token. The page that
position lies in is named for the prefix cache only after it is rewritten.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Optional, Union

from jaxinfer.engine.buckets import pages_needed, token_budget
from jaxinfer.config import EngineConfig
from jaxinfer.engine.page_allocator import PageAllocator
from jaxinfer.engine.prefix_cache import extend_hashes
from jaxinfer.engine.request import Request


_WAIT = "wait"  # a group member that will fork once a running member has computed the prompt's pages


def overlap(r: Request) -> int:
    """1 when `r`'s next prefill chunk starts a token before ``num_computed``: it asked for prompt
    logprobs and its next token is a prompt token after the first, which is scored from the
    previous position's distribution (recomputed in that chunk); else 0."""
    return int(r.params.wants_prompt_logprobs and 0 < r.num_computed < r.prompt_len)


@dataclass
class PrefillChunk:
    """Prefill `length` tokens of `request` starting at position `start` (the runner pads and runs it)."""

    request: Request
    start: int
    length: int


@dataclass
class SchedulerOutput:
    prefill: list = field(default_factory=list)  # [PrefillChunk]
    decode: list = field(default_factory=list)  # [Request]
    preempted: list = field(default_factory=list)  # [Request]

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(
        self,
        ecfg: EngineConfig,
        allocator: PageAllocator,
        *,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        kv_window: int = 0,
    ):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
        self.ecfg = ecfg
        self.allocator = allocator
        self.page_size = ecfg.page_size
        # the step's tokens (decode rows and prefill chunks together), at most the largest token bucket
        self.budget = token_budget(dataclasses.replace(ecfg, max_num_batched_tokens=max_num_batched_tokens))
        self.max_chunk = min(ecfg.chunk_buckets[-1], self.budget)  # one request's tokens in a step
        self.policy = policy
        # > 0: every layer attends at most this many positions back, so pages behind it are given back
        self.kv_window = kv_window
        self.waiting: list = []  # heap of (priority, arrival order, request)
        self.running: list = []  # admission order: newest last
        self.free_slots = list(range(ecfg.max_num_seqs - 1, -1, -1))
        self._order = itertools.count()
        self.num_preemptions = 0
        self.num_forks = 0  # group members admitted on another member's prompt pages
        # requests holding a slot and pages while their prompt's KV arrives from a prefill engine
        # (`jaxinfer.engine.kv_transfer.KVReceiver`): they join `running` as decode rows (`adopt`)
        self.reserved: set = set()

    # -- queue -------------------------------------------------------------------

    def add(self, r: Request) -> None:
        r.arrival_order = next(self._order)
        self._push(r)

    def _push(self, r: Request) -> None:
        prio = r.priority if self.policy == "priority" else 0
        heapq.heappush(self.waiting, (prio, r.arrival_order, r))

    @property
    def num_waiting(self) -> int:
        return sum(1 for _, _, r in self.waiting if not r.finished)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running) or any(not r.finished for _, _, r in self.waiting)

    def finish(self, r: Request) -> None:
        """Release a finished or aborted request's pages and slot (it leaves the batch now)."""
        if r in self.running:
            self.running.remove(r)
        self._free(r)

    def can_adopt(self) -> bool:
        """A slot is free for a request whose KV comes from elsewhere (`reserve`)."""
        return len(self.running) + len(self.reserved) < self.ecfg.max_num_seqs and bool(self.free_slots)

    def reserve(self, r: Request) -> None:
        """Give `r` (its pages already allocated) a slot while its KV arrives; `adopt` or `finish` ends it."""
        r.slot = self.free_slots.pop()
        r.prefill_target = r.prompt_len
        self.reserved.add(r)

    def adopt(self, r: Request) -> None:
        """`r`'s prompt KV is in its pages (``num_computed`` == its prompt): it runs as a decode row."""
        self.reserved.discard(r)
        r.arrival_order = next(self._order)
        r.num_registered_pages = 0
        self.running.append(r)
        self.register_full_pages(r)

    def _free(self, r: Request) -> None:
        self.reserved.discard(r)
        if r.pages:
            self.allocator.release(p for p in reversed(r.pages) if p)  # 0: released behind the window
            r.pages = []
            r.num_released_pages = 0
        if r.slot is not None:
            self.free_slots.append(r.slot)
            r.slot = None

    def _preempt(self, r: Request) -> None:
        self.running.remove(r)
        self._free(r)
        r.num_computed = 0
        r.last_token = None
        r.drafts = []
        r.num_preemptions += 1
        self.num_preemptions += 1
        self._push(r)

    # -- pages ---------------------------------------------------------------------

    def _grow(self, r: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Give `r` pages for `num_tokens` tokens, preempting newer requests if needed.

        Returns False if `r` itself had to be preempted.
        """
        need = pages_needed(num_tokens, self.page_size) - len(r.pages)
        while need > self.allocator.num_free:
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is r:
                return False
        if need > 0:
            r.pages.extend(self.allocator.allocate(need))
        return True

    def _release_behind_window(self, r: Request) -> None:
        """Give back the pages of `r` wholly behind every layer's window (`kv_window`).

        The next step's first query is at ``r.num_computed`` and later ones are further on, so
        no step still to be scheduled reads a key before ``num_computed - kv_window + 1``.
        (A step already dispatched may, but it runs first on the device, before any step that
        could write to a page given back now.) The entries become 0, the dummy page: the CPU
        kernel starts each row at its window and the pure-JAX path masks what it gathers there.
        """
        first_key = r.num_computed - overlap(r) - self.kv_window + 1
        upto = min(max(0, first_key) // self.page_size, len(r.pages))
        if upto <= r.num_released_pages:
            return
        if r.group is not None and any(o.slot is None and not o.finished for o in r.group):
            # a member still to fork needs the pages inside the window of the prompt's shared pages
            ps = self.page_size
            upto = min(upto, max(0, (r.prompt_len - 1) // ps * ps - self.kv_window + 1) // ps)
            if upto <= r.num_released_pages:
                return
        behind = r.pages[r.num_released_pages : upto]
        self.allocator.release(reversed(behind))
        r.pages[r.num_released_pages : upto] = [0] * len(behind)
        r.num_released_pages = upto

    def register_full_pages(self, r: Request) -> None:
        """Name the pages whose tokens are all known and written, for later prefix hits."""
        if not self.allocator.enable_prefix_cache or not r.pages:
            return
        upto = min(r.num_known_tokens, r.num_computed - overlap(r)) // self.page_size
        if upto <= r.num_registered_pages:
            return
        extend_hashes(r.page_hashes, r.known_token_ids(), self.page_size)
        for i in range(r.num_registered_pages, min(upto, len(r.pages), len(r.page_hashes))):
            if r.pages[i]:  # a page given back behind the window before it was named stays unnamed
                self.allocator.register(r.pages[i], r.page_hashes[i])
        r.num_registered_pages = upto

    # -- one step --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.budget
        for r in list(self.running):
            if r not in self.running or r.finished:
                continue
            if self.kv_window:
                self._release_behind_window(r)
            if r.prefill_done:
                if r.done_sampling:
                    continue  # its last token is still in flight
                need = 1 + len(r.drafts)  # the input token and its drafts (speculative decoding)
                if budget < need or not self._grow(r, r.num_computed + need, out):
                    continue
                out.decode.append(r)
                budget -= need
            else:
                back = overlap(r)
                n = min(r.prefill_target - r.num_computed, budget - back, self.max_chunk - back)
                if n <= 0 or not self._grow(r, r.num_computed + n, out):
                    continue
                out.prefill.append(PrefillChunk(r, r.num_computed - back, n + back))
                budget -= n + back
        if out.preempted:
            return out  # no admissions in a step that had to preempt
        while self.waiting and budget > 0 and len(self.running) + len(self.reserved) < self.ecfg.max_num_seqs:
            _, _, r = self.waiting[0]
            if r.finished:
                heapq.heappop(self.waiting)
                continue
            chunk = self._admit(r, budget, out.prefill)
            if chunk is None:
                break
            heapq.heappop(self.waiting)
            out.prefill.append(chunk)
            budget -= chunk.length
        return out

    def _fork_point(self, r: Request) -> Union[None, str, tuple]:
        """Where a group member can start from a running member's KV pages.

        ``(behind, pages)``: the prompt's full pages (all but at least its last token) held by
        a running member that has computed them (``behind`` leading pages wholly outside a
        sliding window, not needed); `_WAIT` while a running member is still computing them;
        None when no member can give them (the request is admitted as any other).
        """
        ps = self.page_size
        k = min(r.prompt_len // ps, (r.num_known_tokens - 1) // ps)  # pages of prompt tokens only
        if k == 0 or r.params.uses_penalties or r.params.wants_prompt_logprobs:
            return None
        behind = max(0, k * ps - self.kv_window + 1) // ps if self.kv_window else 0
        wait = False
        for other in r.group:
            if other is r or other.finished or other.slot is None:  # not running
                continue
            if other.num_computed < k * ps:
                wait = True
                continue
            pages = other.pages[behind:k]
            if len(pages) == k - behind and all(pages):  # none given back behind its own window
                return behind, pages
        return _WAIT if wait else None

    def _admit(self, r: Request, budget: int, prefill: list) -> Optional[PrefillChunk]:
        ps = self.page_size
        tokens = r.known_token_ids()
        hit: list = []
        behind = 0  # cached pages wholly behind the window of the first query: not needed (0 in r.pages)
        fork = self._fork_point(r) if r.group is not None else None
        if fork is _WAIT:
            return None
        if fork is not None:
            behind, hit = fork
        elif self.allocator.enable_prefix_cache and not (r.params.uses_penalties or r.params.wants_prompt_logprobs):
            extend_hashes(r.page_hashes, tokens, ps)
            hashes = r.page_hashes[: (len(tokens) - 1) // ps]  # keep >= 1 token to run
            if self.kv_window:
                behind, hit = self.allocator.lookup_window(hashes, self.kv_window, ps)
            else:
                hit = self.allocator.lookup(hashes)
        cached = (behind + len(hit)) * ps
        n = min(len(tokens) - cached, budget, self.max_chunk)
        if n <= 0:
            return None
        new_pages = pages_needed(cached + n, ps) - behind - len(hit)
        reclaimed = sum(1 for p in hit if self.allocator.refcount[p] == 0)
        if new_pages > self.allocator.num_free - reclaimed:
            return None
        self.allocator.share(hit)
        if fork is not None:
            self.num_forks += 1
        r.pages = [0] * behind + hit + self.allocator.allocate(new_pages)
        r.num_released_pages = behind
        r.num_registered_pages = behind + len(hit)
        r.num_computed = cached
        r.prefill_target = len(tokens)
        if r.num_preemptions == 0:
            r.metrics.cached_tokens = cached
        r.slot = self.free_slots.pop()
        self.running.append(r)
        return PrefillChunk(r, cached, n)
