"""The generation loop: runs requests in padded batches and streams their tokens.

Requests are admitted in waves that fit the engine (``max_num_seqs`` slots,
KV pages for prompt + max_tokens). Each request is prefilled in chunks, then
all of the wave decode together, one token per step. The loop keeps the
device busy: step k+1 is dispatched (its input tokens still on device)
before step k's tokens are read back for detokenization and stop checks, so
a request that stops wastes at most one token.

This is the host loop the continuous-batching scheduler replaces; it uses only
`ModelRunner.prefill` / `ModelRunner.decode` and the request counters.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Iterable, Iterator

from jaxinfer.buckets import chunk_plan, pages_needed
from jaxinfer.outputs import StreamDelta
from jaxinfer.page_allocator import PageAllocator
from jaxinfer.request import Request, TokenRef
from jaxinfer.runner import ModelRunner, PrefillChunk, read_output


class Generator:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.ecfg = runner.ecfg
        self.allocator = PageAllocator(self.ecfg.num_pages)
        self._free_slots = list(range(self.ecfg.max_num_seqs))

    def pages_for(self, r: Request) -> int:
        return pages_needed(r.prompt_len + r.max_tokens, self.ecfg.page_size)

    def run(self, requests: Iterable[Request]) -> Iterator[StreamDelta]:
        """Run all `requests` to completion, yielding deltas as tokens are read back."""
        waiting = deque(requests)
        while waiting:
            wave, budget = [], self.allocator.num_free
            while waiting and len(wave) < self.ecfg.max_num_seqs and self.pages_for(waiting[0]) <= budget:
                budget -= self.pages_for(waiting[0])
                wave.append(waiting.popleft())
            if not wave:  # cannot happen for validated requests; fail the head rather than spin
                r = waiting.popleft()
                r.abort("error")
                yield StreamDelta(r.request_id, "", [], None, "error", r.to_output())
                continue
            yield from self._run_wave(wave)

    # -- one wave ----------------------------------------------------------

    def _admit(self, r: Request) -> None:
        r.slot = self._free_slots.pop()
        r.pages = self.allocator.allocate(self.pages_for(r))
        r.metrics.scheduled_time = time.perf_counter()

    def _release(self, r: Request) -> None:
        self.allocator.free(r.pages)
        r.pages = []
        self._free_slots.append(r.slot)
        r.slot = None

    def _run_wave(self, wave: list) -> Iterator[StreamDelta]:
        runner = self.runner
        for r in wave:
            self._admit(r)
        pending: deque = deque()  # (requests, step output) dispatched but not yet read
        try:
            for r in wave:
                start = r.num_computed
                for n in chunk_plan(r.prompt_len - start, self.ecfg.chunk_buckets):
                    t0 = time.perf_counter()
                    out = runner.prefill([PrefillChunk(r, start, n)])
                    r.metrics.prefill_chunks.append(time.perf_counter() - t0)
                    start += n
                r.num_computed = start
                r.num_sampled = 1
                r.last_token = TokenRef(out.tokens, 0)
                pending.append(([r], out))
            while True:
                active = [r for r in wave if not r.done_sampling]
                if active:
                    out = runner.decode(active)
                    for i, r in enumerate(active):
                        r.num_computed += 1
                        r.num_sampled += 1
                        r.last_token = TokenRef(out.tokens, i)
                        r.metrics.decode_steps += 1
                    pending.append((active, out))
                if not pending:
                    break
                # read everything but the step just dispatched, which keeps the device busy
                while len(pending) > (1 if active else 0):
                    yield from self._read(*pending.popleft())
        finally:
            for r in wave:
                if not r.finished:
                    r.abort()
                self._release(r)

    def _read(self, reqs: list, out) -> Iterator[StreamDelta]:
        results = read_output(out, reqs)
        now = time.perf_counter()
        for r, (tok, lp) in zip(reqs, results):
            if r.finished:
                continue  # drawn in the step after it stopped
            if isinstance(r.last_token, TokenRef) and r.last_token.array is out.tokens:
                r.last_token = tok
            m = r.metrics
            if m.first_token_time is None:
                m.first_token_time = m.prefill_done_time = now
            m.token_times.append(now)
            text = r.add_token(tok, lp)
            m.output_tokens = len(r.output_ids)
            final = None
            if r.finished:
                m.finished_time = now
                final = r.to_output()
            yield StreamDelta(r.request_id, text, [tok], [lp] if lp is not None else None, r.finish_reason, final)
