"""Each step's physical floor: the least time the machine needs for the bytes and flops a step must do.

A dispatched step program (the engine's ragged step: prompt chunks, decode rows, or both) is
some token rows, some KV read per row and some KV written. It must at
least read the weights once (only the experts a token is routed to, only the embedding rows it
looks up), read the KV cache its queries attend (each row's context before the step, capped at a
sliding window), write the new tokens' KV, and do 2 flops per weight element per token plus
attention's 4·H·D per (query, key) pair. `step_cost` counts that; `floor_seconds` divides it by
the machine's peaks (`MachinePeaks`): ``max(bytes / bandwidth, flops / peak)``. The floor is a
lower bound, never a flattering one: it counts no padding and no re-read, and the peaks are the
best the machine has shown by any method we know (`measure_peaks`), not one pessimistic probe.

Peaks: on CPU measured once per machine and cached on disk (`machine_peaks`); on accelerators
given in `jaxinfer.config.EngineConfig` (``peak_bandwidth_gbps``, ``peak_tflops``), else unknown
and no floor is reported. `StepClock` times each dispatched program on the device without making
the host wait: a watcher thread blocks on each output in dispatch order, so a program's time is
its output's ready time minus the later of its dispatch and the previous program's ready time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.env import cache_root, cpu_flags
from jaxinfer.ops.quant import is_quantized

CACHE_FORMAT = 1
BUFFER_BYTES = 256 << 20  # the bandwidth probes' buffer: far larger than any last-level cache here


# ---------------------------------------------------------------------------
# the machine's peaks


@dataclass(frozen=True)
class MachinePeaks:
    """Read bandwidth (GB/s, 1e9 bytes) and float32 flops (GFLOP/s) of the machine a step runs on.

    ``method`` / ``flops_method``: where each figure came from (the best probe, or "config");
    ``measurements``: every probe's figure by name (GB/s for reads, GFLOP/s for products).
    0 means unknown: that term of the floor is left out (the floor stays a lower bound)."""

    bandwidth_gbps: float
    flops_gflops: float
    method: str = ""
    flops_method: str = ""
    measurements: dict = field(default_factory=dict, compare=False)
    key: dict = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MachinePeaks":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    def __str__(self) -> str:
        return (f"{self.bandwidth_gbps:.1f} GB/s ({self.method or '-'}), "
                f"{self.flops_gflops:.1f} GFLOP/s ({self.flops_method or '-'})")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_key(native_kernel: Optional[bool] = None) -> dict:
    """What the measured peaks depend on: the CPU model, the cores this process may use, the CPU's
    flags, the JAX version, and whether the native matmul kernel was among the probes."""
    if native_kernel is None:
        native_kernel = _native_matmul_loaded()
    return {"format": CACHE_FORMAT, "cpu": _cpu_model(), "cores": _cores(),
            "flags": hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16],
            "jax": jax.__version__, "native_kernel": bool(native_kernel)}


def _native_matmul_loaded() -> bool:
    from jaxinfer.ops.backend import KernelChoice

    try:
        return KernelChoice.loaded("cpu").cpu_matmul
    except Exception:  # noqa: BLE001 - no kernel is no probe, never a failed start
        return False


def _best(fn: Callable[[], Any], reps: int) -> float:
    """The shortest of ``reps`` timed calls (after one untimed call)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _numpy_read(buf: np.ndarray, threads: int, reps: int) -> float:
    """GB/s of ``threads`` threads each reducing its share of ``buf`` to its maximum (the lightest
    numpy reduction per byte; numpy drops the GIL in the loop)."""
    parts = np.array_split(buf, threads)
    if threads == 1:
        return buf.nbytes / _best(lambda: parts[0].max(), reps) / 1e9

    def run():
        ts = [threading.Thread(target=p.max) for p in parts]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    return buf.nbytes / _best(run, reps) / 1e9


def measure_peaks(buffer_bytes: int = BUFFER_BYTES, reps: int = 5, native_kernel: Optional[bool] = None
                  ) -> MachinePeaks:
    """Measure this host's read bandwidth and float32 flops, each the best of several probes.

    Reads (a buffer of ``buffer_bytes``, the best of ``reps`` passes each): numpy reductions over 1, 2,
    4, … threads up to the cores this process may use; numpy's BLAS matrix-vector product (its own
    threads) over the buffer as a matrix; XLA's jitted sum; and, when the native CPU matmul
    kernel is loaded (``native_kernel`` None: whether it is), its one-row product over the buffer as a
    float32 ``[K, N]`` weight (the read rate of a batch-1 decode). Flops: XLA's jitted float32
    product of two square matrices, and the native kernel's over many rows. The maximum of each is
    the peak: a pessimistic probe would put the floor above what a real step reaches."""
    if native_kernel is None:
        native_kernel = _native_matmul_loaded()
    reads: dict = {}
    n = max(buffer_bytes // 4, 1 << 16)
    buf = np.ones(n, np.float32)
    threads = sorted({min(1 << i, _cores()) for i in range(8)} | {_cores()})
    for t in threads:
        reads[f"numpy max, {t} thread{'s' * (t > 1)}"] = _numpy_read(buf, t, reps)
    mat = buf[: (n // 4096) * 4096].reshape(-1, 4096)
    vec = np.ones(4096, np.float32)
    reads["numpy BLAS gemv"] = mat.nbytes / _best(lambda: mat @ vec, reps) / 1e9
    mat = None  # free it (not del: the timed lambda names it)
    dev = jnp.asarray(buf)
    del buf
    xsum = jax.jit(jnp.sum)
    reads["xla jitted sum"] = dev.nbytes / _best(lambda: xsum(dev).block_until_ready(), reps) / 1e9
    flops: dict = {}
    m = 1024
    a = jnp.ones((m, m), jnp.float32)
    mm = jax.jit(lambda x, y: jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST))
    flops["xla jitted matmul 1024^3"] = 2 * m ** 3 / _best(lambda: mm(a, a).block_until_ready(), reps) / 1e9
    if native_kernel:
        from jaxinfer.ops import cpu_matmul

        k = 4096
        w = dev[: (dev.size // k) * k].reshape(k, -1)
        x1 = jnp.ones((1, k), jnp.float32)
        one = jax.jit(lambda x, w: cpu_matmul.matmul(x, w))
        reads["native matmul, one row"] = w.nbytes / _best(lambda: one(x1, w).block_until_ready(), reps) / 1e9
        wk = jnp.ones((1024, 4096), jnp.float32)
        xk = jnp.ones((256, 1024), jnp.float32)
        flops["native matmul 256x1024x4096"] = (
            2 * 256 * 1024 * 4096 / _best(lambda: one(xk, wk).block_until_ready(), reps) / 1e9)
    dev = None  # free it (not del: the timed lambda names it)
    bw_method = max(reads, key=reads.get)
    fl_method = max(flops, key=flops.get)
    return MachinePeaks(reads[bw_method], flops[fl_method], bw_method, fl_method,
                        {**{k: round(v, 3) for k, v in reads.items()}, **{k: round(v, 3) for k, v in flops.items()}},
                        machine_key(native_kernel))


def cache_path(key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(cache_root(), "roofline", f"peaks-{digest}.json")


def cached_peaks(measure: Callable[[], MachinePeaks] = measure_peaks, key: Optional[dict] = None,
                 load: Optional[Callable[[], float]] = None) -> MachinePeaks:
    """This machine's peaks from the disk cache (``$XDG_CACHE_HOME/jaxinfer/roofline``, one file per
    `machine_key`), measured by ``measure`` and stored on the first call for a key. Peaks measured
    while the host was busy (``load()``, default the 1-minute load average, above `LOADED` per core)
    are measured again at a later call that finds the host at most half as busy, keeping each
    probe's best."""
    key = machine_key() if key is None else key
    _load = load or _loadavg
    path = cache_path(key)
    old = None
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        if d.get("key") == key and d.get("bandwidth_gbps", 0) > 0:
            old = MachinePeaks.from_dict(d)
            busy = d.get("load", 0.0)
            # probes that ran on a busy host read low: measure again once it is quieter, keep the best
            if busy <= LOADED * _cores() or _load() >= busy / 2:
                return old
    except (OSError, ValueError, TypeError):
        pass
    load = _load()
    peaks = dataclasses.replace(measure(), key=key)
    if old is not None:
        peaks = _best_of(old, peaks)
    store_peaks(peaks, load=min(load, _load()))
    return peaks


LOADED = 0.5  # a load average above this many runnable tasks per core: the probes ran on a busy host


def _loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def _best_of(a: MachinePeaks, b: MachinePeaks) -> MachinePeaks:
    """Each probe's best of two measurements, and the peaks they give."""
    m = dict(a.measurements)
    for k, v in b.measurements.items():
        m[k] = max(v, m.get(k, 0.0))
    bw = max((a.bandwidth_gbps, a.method), (b.bandwidth_gbps, b.method))
    fl = max((a.flops_gflops, a.flops_method), (b.flops_gflops, b.flops_method))
    return MachinePeaks(bw[0], fl[0], bw[1], fl[1], m, b.key)


def store_peaks(peaks: MachinePeaks, load: Optional[float] = None) -> None:
    """Write ``peaks`` as the cached ones of its `machine_key` (a read-only cache: nothing), with the
    host's load average while they were measured (None: keep the stored one)."""
    path = cache_path(peaks.key)
    d = peaks.to_dict()
    if load is None:
        try:
            with open(path, encoding="utf-8") as f:
                load = json.load(f).get("load", 0.0)
        except (OSError, ValueError):
            load = 0.0
    d["load"] = round(load, 2)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(d, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def machine_peaks(engine_cfg: EngineConfig, platform_name: Optional[str] = None) -> Optional[MachinePeaks]:
    """The peaks the floor divides by: ``engine_cfg``'s ``peak_bandwidth_gbps`` / ``peak_tflops``
    where set (per device, times ``tensor_parallel_size``); on CPU the measured ones for the rest;
    elsewhere None when neither is set (no floor is reported)."""
    platform_name = platform_name or jax.default_backend()
    bw, tf = engine_cfg.peak_bandwidth_gbps, engine_cfg.peak_tflops
    if platform_name == "cpu" and not (bw and tf):
        measured = cached_peaks()
        return MachinePeaks(bw or measured.bandwidth_gbps, tf * 1e3 if tf else measured.flops_gflops,
                            "config" if bw else measured.method, "config" if tf else measured.flops_method,
                            measured.measurements, {} if (bw or tf) else measured.key)
    if not (bw or tf):
        return None
    chips = 1 if platform_name == "cpu" else engine_cfg.tensor_parallel_size
    return MachinePeaks(bw * chips, tf * 1e3 * chips, "config" if bw else "", "config" if tf else "")


# ---------------------------------------------------------------------------
# what a step must do


@dataclass(frozen=True)
class StepCost:
    """The bytes a step must move and the flops it must do (`step_cost`)."""

    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    flops: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes


def floor_seconds(cost: StepCost, peaks: MachinePeaks) -> float:
    """``max(bytes / bandwidth, flops / peak flops)``; an unknown (0) peak leaves its term out."""
    t_bytes = cost.bytes / (peaks.bandwidth_gbps * 1e9) if peaks.bandwidth_gbps > 0 else 0.0
    t_flops = cost.flops / (peaks.flops_gflops * 1e9) if peaks.flops_gflops > 0 else 0.0
    return max(t_bytes, t_flops)


def compute_bound_batch(cost: "CostModel", peaks: MachinePeaks, most: int = 1024) -> Optional[int]:
    """The fewest decode rows (one token each, no context) whose step's flops take at least as long as
    its bytes at the machine's peaks: from there on each more token costs compute, where below it the
    step's time is the weights' read. None where a peak is unknown (or past ``most`` rows)."""
    if peaks.bandwidth_gbps <= 0 or peaks.flops_gflops <= 0:
        return None

    def compute_bound(rows: int) -> bool:
        c = cost.step([1] * rows, [0] * rows)
        return c.flops / peaks.flops_gflops >= c.bytes / peaks.bandwidth_gbps

    if not compute_bound(most):
        return None
    lo, hi = 1, most  # the least bound batch lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if compute_bound(mid) else (mid + 1, hi)
    return lo


def _leaf_bytes(x: Any) -> int:
    if is_quantized(x):
        return int(x.nbytes)
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def _leaf_elements(x: Any) -> int:
    return int(np.prod(x.shape))  # a QuantizedWeight's shape is its logical [K, N]


class CostModel:
    """A model's per-step costs with its constants counted once (the engine calls `step` every step).

    ``params``: the weights as held (float or quantized leaves: the bytes a step really reads).
    ``cache_dtype``: the KV cache's dtype. The embedding table counts only the rows a step looks
    up, unless it is also the LM head (tied), read whole when any row needs logits; an untied LM
    head is read whole when any row needs logits; a mixture of experts reads, and multiplies by,
    ``num_experts_per_tok`` of its ``num_experts`` per MoE layer (the fewest a step can touch)."""

    def __init__(self, model_cfg: ModelConfig, params: Any, cache_dtype: Any):
        cfg = self.cfg = model_cfg
        flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantized)[0]
        self.dense_bytes = self.dense_elems = 0
        self.expert_bytes = self.expert_elems = 0
        self.embed_bytes = self.head_bytes = 0
        for path, x in flat:
            name = str(getattr(path[-1], "key", getattr(path[-1], "name", path[-1])))
            if len(path) == 1 and name == "embed":
                self.embed_bytes = _leaf_bytes(x)
            elif len(path) == 1 and name == "lm_head":
                self.head_bytes = _leaf_bytes(x)
            elif cfg.num_experts and not is_quantized(x) and np.ndim(x) == 3 and x.shape[0] == cfg.num_experts:
                self.expert_bytes += _leaf_bytes(x)
                self.expert_elems += _leaf_elements(x)
            else:
                self.dense_bytes += _leaf_bytes(x)
                self.dense_elems += _leaf_elements(x)
        self.expert_share = cfg.num_experts_per_tok / cfg.num_experts if cfg.num_experts else 0.0
        self.kv_token_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * np.dtype(cache_dtype).itemsize  # one layer
        windows = [cfg.layer_window(li) for li in range(cfg.num_layers)]
        self.full_layers = sum(1 for w in windows if not w)
        self.windowed = [w for w in windows if w]
        self.head_elems = cfg.vocab_size * cfg.hidden_size

    def step(self, rows: Sequence[int], kv_read_tokens: Sequence[int], logits_rows: Optional[int] = None
             ) -> StepCost:
        """The cost of a step whose request i computes ``rows[i]`` new tokens after
        ``kv_read_tokens[i]`` tokens already in the cache; ``logits_rows``: how many positions
        need logits (default one per request)."""
        cfg = self.cfg
        tokens = int(sum(rows))
        logits = len(rows) if logits_rows is None else int(logits_rows)
        weights = self.dense_bytes + int(self.expert_bytes * self.expert_share)
        row_bytes = self.embed_bytes // max(cfg.vocab_size, 1)
        if self.head_bytes:  # untied: the looked-up rows, and the head when logits are drawn
            weights += row_bytes * min(tokens, cfg.vocab_size) + (self.head_bytes if logits else 0)
        else:
            weights += self.embed_bytes if logits else row_bytes * min(tokens, cfg.vocab_size)
        kv_read = pairs = 0
        for n, s in zip(rows, kv_read_tokens):
            kv_read += self.full_layers * s + sum(min(s, w - 1) for w in self.windowed)
            pairs += self.full_layers * (n * s + n * (n + 1) // 2)
            for w in self.windowed:  # query at position p attends min(p + 1, w) keys
                m = min(max(w - s, 0), n)
                pairs += m * s + m * (m + 1) // 2 + (n - m) * w
        flops = (2 * tokens * (self.dense_elems + int(self.expert_elems * self.expert_share))
                 + 2 * logits * self.head_elems + 4 * cfg.num_heads * cfg.head_dim * pairs)
        return StepCost(weights, kv_read * self.kv_token_bytes, tokens * cfg.num_layers * self.kv_token_bytes,
                        flops)


def step_cost(model_cfg: ModelConfig, params: Any, cache_dtype: Any, rows: Sequence[int],
              kv_read_tokens: Sequence[int], logits_rows: Optional[int] = None) -> StepCost:
    """One step's cost (`CostModel.step`): request i computes ``rows[i]`` tokens after
    ``kv_read_tokens[i]`` cached ones; ``params`` as held (their real bytes, quantized or not)."""
    return CostModel(model_cfg, params, cache_dtype).step(rows, kv_read_tokens, logits_rows)


# ---------------------------------------------------------------------------
# timing each dispatched program


@dataclass
class StepTiming:
    """One dispatched program, measured: its kind, token rows, cost, floor and device time."""

    kind: str  # "prefill" | "decode" | "mixed": the step's rows all prompt chunks, all decode rows, or both
    tokens: int
    cost: StepCost
    floor_s: float
    dispatched: float  # perf_counter just before the program was called
    requests: list  # the requests with a row in it
    measured_s: Optional[float] = None  # None: its output never became ready (a failed step)
    upper_s: Optional[float] = None  # ready minus dispatch: never less than its device time (it may have queued)

    @property
    def fraction(self) -> Optional[float]:
        """floor / measured: 1 is the machine's limit, 0.25 means four times slower than it."""
        if not self.measured_s:
            return None
        return self.floor_s / self.measured_s


class StepClock:
    """Times dispatched programs without blocking the host: a watcher thread waits on each
    program's output in dispatch order and stamps when it is ready. A program runs once its inputs
    are (the previous program's donated cache), so its device time is its ready time minus the
    later of its dispatch and the previous program's ready time. The thread starts with the first
    program and lives until `close` (the engine's shutdown), like the engine's own thread."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._done: list = []  # timed, not yet collected
        self._submitted = 0
        self._timed = 0
        self._last_ready = 0.0
        self._thread: Optional[threading.Thread] = None

    def submit(self, timing: StepTiming, output: Any) -> int:
        """Watch ``output`` (an array the program produces); returns the program's sequence number."""
        with self._cv:
            self._submitted += 1
            seq = self._submitted
            self._q.put((seq, timing, output))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._watch, name="jaxinfer-step-clock", daemon=True)
                self._thread.start()
        return seq

    def close(self, timeout: float = 5.0) -> None:
        """Stop the watcher once it has timed what was submitted (a later `submit` starts it again)."""
        with self._cv:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._q.put(None)
            thread.join(timeout)

    def _watch(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            seq, timing, output = item
            try:
                jax.block_until_ready(output)
                ready = time.perf_counter()
                timing.measured_s = ready - max(timing.dispatched, self._last_ready)
                timing.upper_s = ready - timing.dispatched
                self._last_ready = ready
            except Exception:  # noqa: BLE001 - a failed step is reported by the engine, not here
                timing.measured_s = None
            with self._cv:
                self._done.append(timing)
                self._timed = seq
                self._cv.notify_all()

    def collect(self, upto: int = 0, timeout: float = 5.0) -> list:
        """The programs timed since the last call, in order; first waits (at most ``timeout``
        seconds) until program ``upto`` is timed — its output is ready, so that is at once."""
        with self._cv:
            if upto:
                self._cv.wait_for(lambda: self._timed >= upto, timeout)
            out, self._done = self._done, []
        return out

    @property
    def timed(self) -> int:
        """The sequence number of the last program timed."""
        return self._timed


class EngineRoofline:
    """The engine's side: the cost of each program it dispatches, its floor, and its measured time.

    `step` takes what the scheduler handed the runner (decode rows, prompt chunks) right after
    the dispatch and before the requests' counters move; `settle` (the engine thread, when it reads
    a step's output) hands every program timed so far to ``sink`` in dispatch order."""

    def __init__(self, cost: CostModel, peaks: MachinePeaks, sink: Callable[[StepTiming], None]):
        self.cost = cost
        self.peaks = peaks
        self.sink = sink
        self.clock = StepClock()
        self._seq: dict = {}  # id(output array) -> its program's sequence number

    @classmethod
    def for_runner(cls, runner: Any, sink: Callable[[StepTiming], None]) -> Optional["EngineRoofline"]:
        """None where the peaks are unknown (an accelerator whose config gives none)."""
        peaks = machine_peaks(runner.ecfg)
        if peaks is None:
            return None
        return cls(CostModel(runner.model_cfg, runner.params, runner.ecfg.cache_dtype), peaks, sink)

    def _timed(self, t: StepTiming) -> None:
        """A program timed. One that seems to beat its floor is first taken at its upper bound (ready
        minus dispatch: a watcher that woke late for the program before can shorten the other
        estimate). If even that beats the floor, the probes under-measured the machine (a busy host
        when they ran): the peak that bound the floor rises to what the step showed, so every floor
        from then on is a lower bound again, and this step's fraction is 1."""
        if t.measured_s and t.measured_s < t.floor_s:
            t.measured_s = t.upper_s
        if t.measured_s and t.measured_s < t.floor_s:
            p = self.peaks
            if p.bandwidth_gbps > 0 and t.cost.bytes / (p.bandwidth_gbps * 1e9) >= t.floor_s:
                self.peaks = dataclasses.replace(p, bandwidth_gbps=t.cost.bytes / t.measured_s / 1e9,
                                                 method=f"a {t.kind} step")
            else:
                self.peaks = dataclasses.replace(p, flops_gflops=t.cost.flops / t.measured_s / 1e9,
                                                 flops_method=f"a {t.kind} step")
            t.floor_s = min(floor_seconds(t.cost, self.peaks), t.measured_s)
            if self.peaks.key:  # measured ones: the next start begins from the raised peak
                store_peaks(self.peaks)
        self.sink(t)

    def program(self, kind: str, rows: list, context: list, logits: int, requests: list, output: Any,
                dispatched: float) -> None:
        """Any dispatched step program (a ragged step's mix too): request i computes ``rows[i]`` tokens
        after ``context[i]`` cached ones, ``logits`` positions need logits; ``output``: an array the
        program returns (watched until ready); ``dispatched``: perf_counter just before the call."""
        cost = self.cost.step(rows, context, logits)
        timing = StepTiming(kind, int(sum(rows)), cost, floor_seconds(cost, self.peaks), dispatched, requests)
        self._seq[id(output)] = self.clock.submit(timing, output)

    def step(self, decodes: Sequence[Any], chunks: Sequence[Any], output: Any, dispatched: float) -> None:
        """A ragged step: ``decodes`` (one token each after ``num_computed``, and their drafts) then ``chunks``
        (`jaxinfer.engine.scheduler.PrefillChunk`: ``length`` tokens after ``start``); logits at each
        decode row, where a chunk ends its prompt, or at every chunk position for prompt logprobs.
        Its kind: "decode", "prefill" or "mixed"."""
        segments = [1 + len(r.drafts) for r in decodes]  # a decode's input and its drafts (speculation)
        logits = sum(segments)
        for c in chunks:
            r = c.request
            if r.prompt_logprobs is not None:
                logits += c.length
            elif c.start + c.length >= r.prefill_target:
                logits += 1
        kind = "mixed" if decodes and chunks else "decode" if decodes else "prefill"
        self.program(kind, segments + [c.length for c in chunks],
                     [r.num_computed for r in decodes] + [c.start for c in chunks], logits,
                     list(decodes) + [c.request for c in chunks], output, dispatched)

    def settle(self, output: Any = None) -> None:
        """Hand the programs timed so far to the sink; with ``output``, first wait until its program
        (whose result the caller has just read) is timed."""
        upto = self._seq.pop(id(output), 0) if output is not None else 0
        timed = self.clock.collect(upto)
        if timed:  # forget the programs timed (a prefill whose output nobody reads among them)
            last = self.clock.timed
            self._seq = {k: v for k, v in self._seq.items() if v > last}
        for t in timed:
            self._timed(t)
