"""The engine: one host thread owns all state and drives the device.

The outside world talks to it through a thread-safe inbox (`submit`, `abort`)
and per-request output streams (`RequestStream`: a blocking iterator and an
async iterator). Each engine step:

1. takes new requests and aborts from the inbox;
2. asks the scheduler for this step's prefill chunks and decode rows;
3. dispatches them to the device (asynchronously; decode inputs may still be
   device arrays from the previous step);
4. only then reads back the *previous* step's tokens, detokenizes, checks stops
   and streams them — so the device never waits on the host, and a request
   that stopped costs at most one extra token.

Several choices of one prompt (`SamplingParams.n`) arrive together through
`Engine.submit_group`: the prompt is computed once and the other choices fork
from it, sharing its KV pages (`jaxinfer.engine.scheduler`).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import weakref
import queue
import threading
import time
from collections import deque
from typing import Optional

import jax

from jaxinfer.engine.buckets import pages_needed
from jaxinfer.engine.engine_stats import EngineStats
from jaxinfer.engine.kv_transfer import make_side
from jaxinfer.engine.distributed import to_host
from jaxinfer.outputs import Logprob, StreamDelta
from jaxinfer.engine.page_allocator import PageAllocator
from jaxinfer.engine.request import Request, TokenRef
from jaxinfer.engine.roofline import EngineRoofline, compute_bound_batch
from jaxinfer.engine.runner import ModelRunner, read_output
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.speculative import speculator_for

log = logging.getLogger("jaxinfer")

_END = object()


class RequestStream:
    """The output side of one request: iterate (sync or async) over its `StreamDelta`s."""

    def __init__(self, request_id: str, engine: "Engine"):
        self.request_id = request_id
        self._engine = engine
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._aq: Optional[asyncio.Queue] = None
        self._aloop: Optional[asyncio.AbstractEventLoop] = None
        self._abort_sent = False
        self.output = None  # the final RequestOutput once finished

    def _put(self, item) -> None:
        with self._lock:
            if self._aq is None:
                self._q.put(item)
                return
            try:
                self._aloop.call_soon_threadsafe(self._aq.put_nowait, item)
                return
            except RuntimeError:  # the consumer's event loop is closed: nobody will read this
                self._aq = None
        if item is not _END:
            self.abort()

    def __iter__(self):
        try:
            while True:
                item = self._q.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        except GeneratorExit:
            self.abort()
            raise

    def result(self):
        """Block until the request finishes; return its RequestOutput."""
        for _ in self:
            pass
        return self.output

    async def _aiter(self):
        with self._lock:
            self._aloop = asyncio.get_running_loop()
            self._aq = asyncio.Queue()
            while True:  # move anything that arrived before we attached
                try:
                    self._aq.put_nowait(self._q.get_nowait())
                except queue.Empty:
                    break
        try:
            while True:
                item = await self._aq.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        except (GeneratorExit, asyncio.CancelledError):
            self.abort()
            raise

    def __aiter__(self):
        return self._aiter()

    def abort(self) -> None:
        """Abort the request unless it has finished; only the first call acts, and the id is free at once.

        The abort names this stream, so it can never reach a later request given the same id.
        """
        with self._lock:
            if self.output is not None or self._abort_sent:
                return
            self._abort_sent = True
        self._engine._inbox.put(("abort", self.request_id, self))  # queued before the id is free again
        self._engine._release_id(self)
        self._engine._wake.set()


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_num_batched_tokens: Optional[int] = None,
        enable_prefix_caching: bool = True,
        policy: str = "fcfs",
        log_stats_interval: Optional[float] = None,
        autostart: bool = True,
        kv_transfer_config=None,
    ):
        self.runner = runner
        self.autostart = autostart  # False: the caller drives `step()` itself (tests, benchmarks)
        self.ecfg = runner.ecfg
        self.allocator = PageAllocator(self.ecfg.num_pages, enable_prefix_cache=enable_prefix_caching)
        budget = max_num_batched_tokens or self.ecfg.max_num_batched_tokens
        self.scheduler = Scheduler(self.ecfg, self.allocator, max_num_batched_tokens=budget, policy=policy,
                                   kv_window=runner.cfg.kv_window)
        self.stats = EngineStats(self)
        # each step program's physical floor and measured time; None where the peaks are unknown
        self.roofline = EngineRoofline.for_runner(runner, self.stats.on_step_timed)
        # speculative decoding (`jaxinfer.engine.speculative`): None unless the engine config asks for it
        bound = None  # the decode batch from which a step is compute-bound here: speculation's default limit
        if self.ecfg.speculative_config is not None and self.roofline is not None:
            bound = compute_bound_batch(self.roofline.cost, self.roofline.peaks, most=self.ecfg.max_num_seqs)
        self.speculator = speculator_for(self.ecfg, self.scheduler.budget, runner.max_model_len, runner, bound)
        self.log_stats_interval = log_stats_interval
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict = {}
        self._requests: dict = {}
        self._live: dict = {}  # request id -> its RequestStream, from submit until finished or aborted
        self._pending: deque = deque()  # (rows [(request, row)], step output) not yet read
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self._lock = threading.Lock()
        # prefill/decode disaggregation (`jaxinfer.engine.kv_transfer`): the role's side, or None
        self.kv = make_side(self, kv_transfer_config)

    # -- outside world (any thread) ------------------------------------------------

    def submit(self, request: Request) -> RequestStream:
        """Queue a request; raises ValueError when its id belongs to a request that has not finished.

        An aborted request's id is free again as soon as `RequestStream.abort` returns: the
        inbox is ordered, so the engine drops the old request before it adds the new one.
        """
        return self.submit_group([request])[0]

    def submit_group(self, requests) -> list:
        """Queue several choices of one prompt (`jaxinfer.LLM.make_requests`); one stream each, in order.

        Every request must have the same prompt token ids. The first is prefilled as usual;
        the others wait until a running member of the group has computed the prompt's full
        pages, then fork from it: they take references on those KV pages (no copy, no
        recompute) and compute only the rest of the prompt (at least its last token, so each
        draws its own first token with its own seed). Each is otherwise a request of its own:
        aborting one aborts only it; one that finds no running member to fork from (the
        others finished, were aborted or preempted) prefills the prompt itself. A request
        that uses penalties never forks (its token history must be recorded from position 0).
        """
        reqs = list(requests)
        if not reqs:
            raise ValueError("submit_group needs at least one request.")
        limit = self.runner.max_model_len
        for r in reqs:
            if r.prompt_ids != reqs[0].prompt_ids:
                raise ValueError(
                    f"the requests of a group must have the same prompt: {r.request_id!r} differs from "
                    f"{reqs[0].request_id!r}."
                )
            if len(r.prompt_ids) + r.max_tokens > limit:  # a Request built by hand, not by the processor
                raise ValueError(
                    f"request {r.request_id!r} needs {len(r.prompt_ids) + r.max_tokens} tokens "
                    f"({len(r.prompt_ids)} prompt + {r.max_tokens} max_tokens), more than max_model_len "
                    f"({limit})."
                )
        ids = [r.request_id for r in reqs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"the requests of a group need distinct request ids, got {ids}.")
        streams = [RequestStream(r.request_id, self) for r in reqs]
        with self._lock:
            for rid in ids:
                if rid in self._live:
                    raise ValueError(f"request_id {rid!r} is already in use by a running request.")
            for rid, stream in zip(ids, streams):
                self._live[rid] = stream
        if len(reqs) > 1:
            for i, r in enumerate(reqs):
                r.group = reqs
        self._inbox.put(("add", reqs, streams))
        if self.autostart:
            self._ensure_running()
        self._wake.set()
        return streams

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))
        self._wake.set()

    def call_soon(self, fn) -> None:
        """Run ``fn()`` on the engine thread at its next iteration (the KV transfer's workers report so)."""
        self._inbox.put(("call", fn, None))
        self._wake.set()

    def _release_id(self, stream: RequestStream) -> None:
        with self._lock:
            if self._live.get(stream.request_id) is stream:
                del self._live[stream.request_id]

    def _ensure_running(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop = False
                self._thread = threading.Thread(target=self._loop, name="jaxinfer-engine", daemon=True)
                self._thread.start()
                # stop the loop before the interpreter tears JAX down under a running step
                ref = weakref.ref(self)
                atexit.register(lambda: ref() is not None and ref().shutdown(timeout=5.0))

    def is_idle(self) -> bool:
        return self._inbox.empty() and not self.scheduler.has_work() and not self._pending and not self._streams

    def wait_idle(self, timeout: float = 30.0) -> bool:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.is_idle():
                return True
            self._wake.set()
            time.sleep(0.005)
        return self.is_idle()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.roofline is not None:
            self.roofline.clock.close(timeout)
        if self.kv is not None:
            self.kv.close()

    # -- the engine thread -----------------------------------------------------------

    def _loop(self) -> None:
        last_log = time.perf_counter()
        while not self._stop:
            idle = not self.scheduler.has_work() and not self._pending
            if idle and self._inbox.empty():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
            try:
                self.step()
            except Exception as e:  # a bug in a step must not hang every caller
                log.exception("engine step failed")
                self._fail_all(e)
            if self.log_stats_interval and time.perf_counter() - last_log >= self.log_stats_interval:
                last_log = time.perf_counter()
                if self.scheduler.has_work() or self.stats.recent_tokens():
                    log.info(self.stats.line() + (self.kv.stats_suffix() if self.kv is not None else ""))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, a, b = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":  # a: requests (a group's or one), b: their streams
                for r, stream in zip(a, b):
                    self._requests[r.request_id] = r
                    self._streams[r.request_id] = stream
                    if self.kv is None or not self.kv.on_add(r):  # True: its KV comes from a prefill engine
                        self.scheduler.add(r)
            elif kind == "call":  # a: a function for the engine thread
                a()
            elif kind == "abort":  # b: the stream that asked, or None to abort whatever holds the id
                r = self._requests.get(a)
                if b is not None and self._streams.get(a) is not b:
                    continue
                if r is not None and not r.finished:
                    r.abort("abort")
                    self._finish(r, "")

    def step(self) -> None:
        """One engine iteration (public so tests and benchmarks can drive it synchronously)."""
        t_step = time.perf_counter()
        wait_before = self.stats.wait_s
        self._drain_inbox()
        if self.kv is not None:
            self.kv.tick()
        spec = self.speculator
        if self._pending and any(r.constraint is not None for r in self.scheduler.running):
            # a constrained row's next mask needs the token it drew last: read every step in flight
            # first (one batched dispatch cannot wait for some rows only), and finish what ended
            self.stats.grammar_syncs += 1
            self._read_pending()
        elif self._pending and spec is not None and spec.must_read(self.scheduler.running):
            # drafts follow the tokens just accepted
            t0 = time.perf_counter()
            self.stats.spec_syncs += 1
            self._read_pending()
            spec.stats.sync_s += time.perf_counter() - t0
        if spec is not None:
            spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if spec is not None:
            spec.fill(sched.decode)  # a draft model proposes once its segments have their pages
        now = time.perf_counter()
        n_before = len(self._pending)
        if not sched.empty:  # one ragged step: the decode rows (each with its drafts), then the prefill chunks
            out = self.runner.step(sched.decode, sched.prefill)
            if self.roofline is not None:
                self.roofline.step(sched.decode, sched.prefill, out.tokens, self.runner.dispatched_at)
            rows, scored = [], []
            row = 0  # the step's logits rows: each decode's verify segment, then one a chunk
            for r in sched.decode:
                r.num_computed += 1
                r.num_sampled += 1
                r.last_token = TokenRef(out.tokens, row)
                r.metrics.decode_steps += 1
                rows.append((r, row, 1 + len(r.drafts)))
                row += 1 + len(r.drafts)
            at = sum(1 + len(r.drafts) for r in sched.decode)  # the first chunk's first token in the flat list
            for c in sched.prefill:
                r = c.request
                if r.metrics.scheduled_time is None:
                    r.metrics.scheduled_time = now
                r.metrics.prefill_chunks.append(now)
                new = c.start + c.length - r.num_computed  # a chunk may start a token back (prompt logprobs)
                r.num_computed += new
                self.stats.prompt_tokens += new
                if r.prompt_logprobs is not None and c.start + 1 < r.prompt_len:
                    scored.append((r, at, c.start, c.length))
                if r.prefill_done:
                    r.num_sampled += 1
                    r.last_token = TokenRef(out.tokens, row)
                    rows.append((r, row, 1))
                self.scheduler.register_full_pages(r)
                at += c.length
                row += 1
            if rows or scored:
                self._pending.append((rows, out, scored))
        self.stats.steps += 1
        # read everything but what this step dispatched: the device stays busy meanwhile
        keep = len(self._pending) - n_before
        while len(self._pending) > keep:
            self._read(*self._pending.popleft())
        if not sched.empty:
            total = time.perf_counter() - t_step
            self.stats.busy_s += total
            self.stats.host_s += total - (self.stats.wait_s - wait_before)

    def _read_pending(self) -> None:
        while self._pending:
            self._read(*self._pending.popleft())

    def _read(self, rows: list, out, scored=()) -> None:
        """Bring one step's results home: prompt logprobs of the chunks in ``scored`` first (the
        request may finish on the token below), then the tokens drawn for ``rows`` [(request, first
        logits row, rows)]: one token a row, or a verify segment's accepted drafts and the token after."""
        t0 = time.perf_counter()
        if scored:
            read_prompt_logprobs(out, scored)
        if not rows:
            self.stats.wait_s += time.perf_counter() - t0
            return
        results = read_output(out, rows)
        now = time.perf_counter()
        self.stats.wait_s += now - t0
        if self.roofline is not None:  # the steps timed so far, onto their requests before any finishes
            self.roofline.settle(out.tokens)
        for (r, _, n), drawn in zip(rows, results):
            if r.finished:
                continue  # drawn in the step after it stopped, or aborted meanwhile
            if n > 1:  # a verify segment: the accepted drafts' KV is in the cache too
                accepted = len(drawn) - 1
                r.num_computed += accepted
                r.num_sampled += accepted
                self.speculator.verified(r, n - 1, accepted)
            if isinstance(r.last_token, TokenRef) and r.last_token.array is out.tokens:
                r.last_token = drawn[-1][0]
            m = r.metrics
            if m.first_token_time is None:
                m.first_token_time = m.prefill_done_time = now
            text, toks, lps = "", [], []
            for tok, lp in drawn:
                m.token_times.append(now)
                text += r.add_token(tok, lp)
                toks.append(tok)
                if lp is not None:
                    lps.append(lp)
                self.stats.generation_tokens += 1
                if r.finished:
                    break  # a stop inside an accepted run: the rest is dropped
            m.output_tokens = len(r.output_ids)
            self.scheduler.register_full_pages(r)
            stream = self._streams.get(r.request_id)
            delta = StreamDelta(r.request_id, text, toks, lps if r.params.logprobs is not None else None,
                                r.finish_reason)
            if r.prompt_logprobs is not None and len(r.output_ids) == len(toks):
                delta.prompt_logprobs = list(r.prompt_logprobs)
            if r.finished:
                self._finish(r, text, delta)
            elif stream is not None:
                stream._put(delta)

    def _finish(self, r: Request, text: str, delta: Optional[StreamDelta] = None) -> None:
        """A request leaves the batch: free its pages now, close its stream."""
        if self.kv is not None:
            self.kv.on_finish(r)  # a prefill engine holds the pages of a prompt to send
        self.scheduler.finish(r)
        r.metrics.finished_time = time.perf_counter()
        output = r.to_output()
        stream = self._streams.pop(r.request_id, None)
        self._requests.pop(r.request_id, None)
        self.stats.finished[r.finish_reason] = self.stats.finished.get(r.finish_reason, 0) + 1
        self.stats.on_finished(r)
        if stream is not None:
            if delta is None:
                delta = StreamDelta(r.request_id, text, [], None, r.finish_reason)
            delta.output = output
            with stream._lock:
                stream.output = output
            self._release_id(stream)  # after the output is set: an abort from now on does nothing
            stream._put(delta)
            stream._put(_END)

    def adopt_first_token(self, r: Request, token: int, logprob: Optional[Logprob]) -> None:
        """A request whose prompt KV came from a prefill engine, now a decode row: its first token (drawn
        there) is recorded and streamed as if this engine had drawn it."""
        now = time.perf_counter()
        m = r.metrics
        m.first_token_time = m.prefill_done_time = now
        m.token_times.append(now)
        text = r.add_token(token, logprob)
        self.stats.generation_tokens += 1
        m.output_tokens = len(r.output_ids)
        self.scheduler.register_full_pages(r)
        lps = [logprob] if logprob is not None else []
        delta = StreamDelta(r.request_id, text, [token], lps if r.params.logprobs is not None else None,
                            r.finish_reason)
        if r.finished:
            self._finish(r, text, delta)
        else:
            stream = self._streams.get(r.request_id)
            if stream is not None:
                stream._put(delta)

    def _fail_all(self, err: Exception) -> None:
        for rid, r in list(self._requests.items()):
            r.abort("error")
            stream = self._streams.pop(rid, None)
            if self.kv is not None:
                self.kv.on_finish(r)
            self.scheduler.finish(r)
            if stream is not None:
                self._release_id(stream)
                stream.output = r.to_output()
                stream._put(RuntimeError(f"engine step failed: {err}"))
        self._requests.clear()
        self._pending.clear()

    # -- warm-up -----------------------------------------------------------------------

    def program_keys(self) -> list:
        """Every step program the engine can run (`jaxinfer.engine.programs.ProgramKey`), in one list."""
        return self.runner.programs.keys()

    def request_program_keys(self, prompt_len: int, max_tokens: int, prompt_logprobs: bool = False) -> list:
        """The programs one request run alone needs: its prefill chunks and its decode steps.

        ``prompt_logprobs``: the request asks for them, so its chunks after the first start a
        token back (`jaxinfer.engine.scheduler.overlap`)."""
        e, table = self.ecfg, self.runner.programs
        keys = set()
        start = 0
        while start < prompt_len:
            back = int(prompt_logprobs and start > 0)
            n = min(prompt_len - start, self.scheduler.budget - back, self.scheduler.max_chunk - back)
            keys.add(table.step_key(n + back, 1, pages_needed(start + n, e.page_size)))
            start += n
        for context in range(prompt_len + 1, prompt_len + max(max_tokens, 1)):
            keys.add(table.step_key(1, 1, pages_needed(context, e.page_size)))
        return sorted(keys)

    def warmup(self) -> int:
        """Compile (or load from the program cache) every program up front; returns how many now.

        After it, serving compiles nothing: any mix of sampling settings, logprobs, prompt
        lengths and batch sizes runs one of these programs.
        """
        n = self.runner.warmup(self.program_keys())
        n += self.kv.warmup() if self.kv is not None else 0  # the KV transfer's gather or scatter programs
        return n + (self.speculator.warmup() if self.speculator is not None else 0)

    @property
    def backend(self) -> str:
        return jax.default_backend()


def read_prompt_logprobs(out, scored) -> None:
    """Fill ``Request.prompt_logprobs`` from a prefill step's output (`jaxinfer.engine.step.prompt_logprobs`).

    ``scored``: [(request, the chunk's first token in the step, chunk start, chunk length)]. Chunk
    index j scores the token at position start + j + 1; positions past the prompt (a recompute after
    preemption) are not prompt tokens and are left out, and one already filled is filled again with
    the same value.
    """
    lp, ids, top = to_host(out.prompt_logprob), to_host(out.prompt_top_ids), to_host(out.prompt_top_logprobs)
    rank = to_host(out.prompt_rank)
    for r, i, start, length in scored:
        if r.finished:
            continue
        k = r.params.prompt_logprobs
        prompt = r.prompt_ids
        for j in range(min(length - 1, r.prompt_len - 1 - start)):
            p = start + j + 1
            alts = {int(t): float(v) for t, v in zip(ids[i + j, :k], top[i + j, :k])}
            r.prompt_logprobs[p] = Logprob(prompt[p], float(lp[i + j]), alts, int(rank[i + j]))
