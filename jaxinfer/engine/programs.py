"""The program table: every XLA program the engine runs, listed in advance and compiled ahead of time.

A program is the ragged step (`jaxinfer.engine.step.ragged_step`: every scheduled token of every
request in one flat list, decode rows and prefill chunks alike) at one padded shape, named by a
`ProgramKey` (requests, tokens, page-table width). Steps are padded only by their token count, to a
token bucket (`ProgramTable.token_buckets`: the batch buckets, then the chunk buckets), and by
their request count, to a request bucket a step of that many tokens can take
(`ProgramTable.request_buckets`). The page table goes at full width: both attention paths stop at
each request's context (the CPU kernel per row; the pure-JAX path skips the blocks past the step's
last position), so pages are no compile key. Sampler settings, logprobs counts, prompt logprobs (a
`lax.cond` on a data flag) and context lengths are data, so the list depends only on the engine
config: `ProgramTable.keys()` is the whole set (25 programs for the ``cpu`` preset), printed by
``jaxinfer programs`` and compiled by `ProgramTable.warmup`.

The runner dispatches every step through this table (`ProgramTable.get`), so
nothing is traced at serving time. Each program is lowered and compiled with
JAX's ahead-of-time API; the compiled executable is also serialized to
``$XDG_CACHE_HOME/jaxinfer/programs/<key>/`` so a later start loads it
without tracing or compiling (about 0.1 s a program instead of 1-3 s). The
cache key covers everything the executables depend on: JAX and jaxlib
versions, the device, the CPU's flags, the model and engine configs (and the
values the trace reads from the model config's derived properties), the
kernel choice (`jaxinfer.ops.backend.KernelChoice`, decided once when the
table is made; it carries the engine config's matmul precision and
batch-invariant mode, so the key hashes the one value the trace reads), the
parameter tree's shapes and dtypes, and the source of jaxinfer's device code
(ops/, its C++ kernels, models/, engine/step.py; not the configs' or this
module's code: editing a default there keeps the cache).
`JAXINFER_COMPILATION_CACHE=0` turns it off. Within one process, tables with the same
fingerprint (another `LLM` of the same model and engine config) share the executables
themselves, so a process never deserializes a program it already holds.
A key reached that is not in the table (only possible with a config the list
does not cover) is compiled on the spot and logged as a warning.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import models, progress
from jaxinfer.config import ModelConfig
from jaxinfer.engine import step
from jaxinfer.env import cpu_flags
from jaxinfer.ops import backend
from jaxinfer.ops.attention import RaggedMetadata
from jaxinfer.engine import buckets
from jaxinfer.engine.buckets import bucket_for, pages_needed
from jaxinfer.engine.compile_cache import cache_root, caching_enabled, jax_cache_active
from jaxinfer.ops.mesh import cache_sharding, replicated
from jaxinfer.engine.sampling import build_metadata

log = logging.getLogger("jaxinfer")

FORMAT = 6  # bump when the serialized program layout changes, or the step's arguments (`_abstract_args`)


@dataclasses.dataclass(frozen=True, order=True)
class ProgramKey:
    kind: str  # "step": the ragged step
    batch: int  # padded requests
    tokens: int  # padded tokens of the step
    pages: int  # page-table width
    logits: int = 0  # logits rows (`jaxinfer.engine.buckets.logits_buckets`); 0: one a request (``batch``)

    def __post_init__(self):
        if not self.logits:
            object.__setattr__(self, "logits", self.batch)

    def __str__(self) -> str:
        verify = f" logits={self.logits}" if self.logits != self.batch else ""
        return f"{self.kind} batch={self.batch} tokens={self.tokens} pages={self.pages}{verify}"

    @property
    def file_name(self) -> str:
        return f"{self.kind}-b{self.batch}-t{self.tokens}-p{self.pages}-l{self.logits}.bin"


def _sds(tree, sharding=None):
    """Shapes, dtypes and shardings of a tree: a device array's own, else ``sharding``."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", sharding)), tree)


def return_freed_memory() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``; elsewhere nothing).

    XLA's compiler allocates and frees a lot while it builds programs, and glibc keeps
    what was freed in its arenas: after the cpu preset's warm-up this returns about
    250 MB of resident memory to the system.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class ProgramTable:
    """The compiled step programs of one runner, by `ProgramKey`."""

    def __init__(self, runner, kernels: Optional[backend.KernelChoice] = None):
        self.runner = runner
        self.ecfg = runner.ecfg
        # Which kernels the programs call: ``kernels``, else the runner's decision, else decided once here
        # (`backend.prepare`: loads the host's kernels first), with XLA's float32 products at the engine
        # config's precision (`EngineConfig.matmul_precision`) and in its batch-invariant mode
        # (`EngineConfig.batch_invariant`; None leaves the choice's). A static argument of every program, and
        # part of the cache key: programs of another precision or mode are other programs.
        choice = kernels or getattr(runner, "kernels", None) or backend.prepare()
        self.kernels: backend.KernelChoice = (choice.with_precision(self.ecfg.matmul_precision)
                                              .with_batch_invariant(self.ecfg.batch_invariant))
        self._compiled: dict[ProgramKey, Any] = {}
        self.warmed_up = False
        self.compiled_late: list[ProgramKey] = []  # keys first reached after warm-up
        self.loaded_from_disk = 0
        self._dir: Optional[str] = None
        self._lock = threading.Lock()

    # -- the list --------------------------------------------------------------------

    @functools.cached_property
    def page_buckets(self) -> tuple[int, ...]:
        """The page buckets up to the first that holds a whole context (``max_model_len`` tokens)."""
        e = self.ecfg
        top = bucket_for(pages_needed(self.runner.max_model_len, e.page_size), e.page_buckets, "pages attended")
        return tuple(p for p in e.page_buckets if p <= top)

    def page_width(self, need: int) -> int:
        """The page-table width of every step: the largest page bucket (a ValueError naming it when a
        request needs more pages)."""
        top = self.page_buckets[-1]
        if need > top:
            raise ValueError(f"pages attended {need} exceeds the largest bucket ({top})")
        return top

    def step_key(self, tokens: int, requests: int, pages: int, logits: int = 0) -> ProgramKey:
        """The program of a step of ``tokens`` real tokens from ``requests`` requests, the longest
        needing ``pages`` pages, drawing ``logits`` rows (0: one a request; more: speculative decoding's
        verify segments) (`jaxinfer.engine.buckets`: token, request and logits buckets)."""
        t = bucket_for(tokens, buckets.token_buckets(self.ecfg), "step tokens")
        r = bucket_for(requests, buckets.request_buckets(self.ecfg, t), "step requests")
        rows = bucket_for(max(logits, requests), buckets.logits_buckets(self.ecfg, r, t), "step logits rows")
        return ProgramKey("step", r, t, self.page_width(pages), rows)

    def keys(self) -> list[ProgramKey]:
        """Every program a workload can reach: each token bucket with each request bucket it takes, and
        with speculative decoding each of those with its verify rows too."""
        width = self.page_buckets[-1]
        return [ProgramKey("step", r, t, width, rows) for t in buckets.token_buckets(self.ecfg)
                for r in buckets.request_buckets(self.ecfg, t) for rows in buckets.logits_buckets(self.ecfg, r, t)]

    # -- dispatch --------------------------------------------------------------------

    def get(self, key: ProgramKey):
        """The program for ``key``, compiled (or loaded from the program cache) on first use.

        Without warm-up (``jaxinfer generate``, the library by default) a program is made
        the first time a step needs it, with a progress line; after a complete warm-up a
        new key means the list missed a shape, which is logged as a warning.
        """
        prog = self._compiled.get(key)
        if prog is None:
            if self.warmed_up:
                self.compiled_late.append(key)
                log.warning("compiling %s outside warm-up: it is not in the program list", key)
            with progress.stage(f"compiling {key}") as s:
                before = self.loaded_from_disk
                prog = self._load_or_compile(key)
                if self.loaded_from_disk > before:
                    s.title = f"loading {key}"
        return prog

    def status(self, keys: list) -> list:
        """[(key, "ready" | "cached" | "to compile")] for ``keys``: in memory, on disk, or neither."""
        d = self.cache_dir()
        out = []
        for k in keys:
            if k in self._compiled:
                out.append((k, "ready"))
            elif d is not None and os.path.exists(os.path.join(d, k.file_name)):
                out.append((k, "cached"))
            else:
                out.append((k, "to compile"))
        return out

    def warmup(self, keys: list, complete: bool = True) -> int:
        """Compile (or load from disk) ``keys``; returns how many were compiled or loaded now.

        ``complete``: ``keys`` is the whole list, so any later compile is reported as late.
        """
        todo = [k for k in keys if k not in self._compiled]
        before = self.loaded_from_disk
        if todo:
            # Two workers: one traces and lowers (Python, holding the GIL) while the other
            # compiles (XLA, without it), which is faster than one at a time even on 2 cores.
            workers = max(1, min(2, os.cpu_count() or 1, len(todo)))
            with progress.stage("compiling programs", total=len(todo), unit="program") as s:
                with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxinfer-compile") as pool:
                    for _ in pool.map(self._load_or_compile, todo):
                        s.update()
                s.note(f"{self.loaded_from_disk - before} from the program cache")
            return_freed_memory()  # compiling leaves hundreds of MB free in the C heap
        self.warmed_up = self.warmed_up or complete
        return len(todo)

    @property
    def num_ready(self) -> int:
        return len(self._compiled)

    # -- compiling and caching ---------------------------------------------------------

    def _abstract_args(self, key: ProgramKey):
        r = self.runner
        b, n, p, rows = key.batch, key.tokens, key.pages, key.logits
        rep = replicated(r.mesh)  # host inputs go to every device
        spec = self.ecfg.num_speculative_tokens

        def host(*shape, dtype=jnp.int32):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

        md = _sds(build_metadata([None] * rows, rows, num_slots=self.ecfg.max_num_seqs,
                                 max_logprobs=self.ecfg.max_logprobs, vocab_size=r.model_cfg.vocab_size,
                                 prior_width=spec), rep)
        attn = RaggedMetadata(host(n), host(n), host(b + 1), host(b, p), host(b))
        logits_rows = step.LogitsRows(host(rows), host(rows), host(rows) if spec else None)
        state = (_sds(r.params), _sds(r.kv_cache), _sds(r.sampler_state))
        fn = step.on_mesh(cache_sharding(r.mesh, r.cfg), rep)
        args = (*state, host(n), host(n, dtype=jnp.bool_), attn, logits_rows, host(b, dtype=jnp.bool_), md)
        return fn, args

    def _load_or_compile(self, key: ProgramKey):
        shared_key = (self.fingerprint, key)
        with _SHARED_LOCK:
            prog = _SHARED.get(shared_key)
        if prog is not None:
            with self._lock:
                self._compiled[key] = prog
            return prog
        prog = self._load(key)
        if prog is not None:
            with self._lock:
                self.loaded_from_disk += 1
        else:
            fn, args = self._abstract_args(key)
            with jax.set_mesh(self.runner.mesh):  # attention shard_maps over its "tp" axis
                prog = fn.lower(*args, cfg=self.runner.cfg, kernels=self.kernels).compile()
            if not jax_cache_active():  # see jaxinfer.engine.compile_cache: such a copy would not reload
                self._save(key, prog)
        with self._lock:
            self._compiled[key] = prog
        with _SHARED_LOCK:
            _SHARED.setdefault(shared_key, prog)
        return prog

    def cache_dir(self) -> Optional[str]:
        """This table's directory in the program cache (None when caching is off)."""
        if not caching_enabled():
            return None
        if self._dir is None:
            self._dir = os.path.join(cache_root(), "programs", self.fingerprint)
        return self._dir

    @functools.cached_property
    def fingerprint(self) -> str:
        """What every program of this table depends on, hashed (computed once per table)."""
        import jaxlib

        r = self.runner
        dev = jax.devices()[0]
        h = hashlib.sha256()
        for part in (
            FORMAT, jax.__version__, jaxlib.__version__, dev.platform, dev.device_kind,
            getattr(dev.client, "platform_version", ""), sorted(cpu_flags()) if dev.platform == "cpu" else "",
            repr(r.cfg), traced_config_values(r.cfg), repr(self.ecfg), self.kernels, r.mesh.devices.shape,
            [d.id for d in r.mesh.devices.flat], jax.device_count(), jax.process_count(),
            jax.process_index(),
            [(s.shape, str(s.dtype)) for s in jax.tree.leaves(_sds(r.params))],
            str(jax.tree.structure(r.params)),
        ):
            h.update(repr(part).encode())
            h.update(b"\0")
        h.update(_device_code_digest())
        return h.hexdigest()[:20]

    def _load(self, key: ProgramKey):
        d = self.cache_dir()
        if d is None:
            return None
        path = os.path.join(d, key.file_name)
        if not os.path.exists(path):
            return None
        try:
            from jax.experimental.serialize_executable import deserialize_and_load

            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            # onto the mesh's devices: by default it would load onto every device of the process
            return deserialize_and_load(payload, in_tree, out_tree,
                                        execution_devices=list(self.runner.mesh.devices.flat))
        except Exception as e:  # a stale or damaged entry: compile again and overwrite it
            log.warning("program cache entry %s unusable (%s: %s); compiling it again", path, type(e).__name__, e)
            return None

    def _save(self, key: ProgramKey, prog) -> None:
        d = self.cache_dir()
        if d is None:
            return
        try:
            from jax.experimental.serialize_executable import serialize

            blob = pickle.dumps(serialize(prog))
            os.makedirs(d, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, os.path.join(d, key.file_name))  # atomic: readers see a whole file or none
        except Exception as e:  # caching is an optimisation; a full disk or an odd backend is no failure
            log.info("program %s not cached (%s: %s)", key, type(e).__name__, e)


_DIGEST: Optional[bytes] = None

# Executables this process holds, by (table fingerprint, key): a second table of the same model
# and engine config takes them from here instead of deserializing its copy from the disk cache.
_SHARED: dict = {}
_SHARED_LOCK = threading.Lock()


def traced_config_values(cfg: ModelConfig) -> tuple:
    """What the trace reads from the model config's derived properties (`ModelConfig.attn_scale`,
    ``layer_window``, ...), as values: the key holds them as data, so config.py's code (a formula or a
    default there) need not be hashed with the device sources."""
    layers = range(cfg.num_layers)
    return (cfg.q_size, cfg.kv_size, cfg.attn_scale, cfg.kv_window, tuple(cfg.layer_window(li) for li in layers),
            tuple(cfg.is_moe_layer(li) for li in layers))


def _device_code_digest() -> bytes:
    """A hash of the source the programs are built from: any change invalidates cached programs.

    Only device code: ops/ (with its C++ kernels), models/ and engine/step.py. Host modules (the
    configs, this table, the runner) reach the key as data instead (`ProgramTable.fingerprint`)."""
    global _DIGEST
    if _DIGEST is None:
        _DIGEST = source_digest(device_sources())
    return _DIGEST


def device_sources() -> list[tuple[str, str]]:
    """(name, path) of each file whose code ends up in a step program, in a fixed order."""
    import jaxinfer

    root = os.path.dirname(os.path.abspath(jaxinfer.__file__))
    out = [("jaxinfer/engine/step.py", os.path.join(root, "engine", "step.py"))]
    for name, top in (("jaxinfer/ops", os.path.join(root, "ops")),
                      ("jaxinfer/models", os.path.dirname(os.path.abspath(models.__file__)))):
        for d, subdirs, files in sorted(os.walk(top)):
            subdirs[:] = sorted(n for n in subdirs if n != "__pycache__")
            rel = os.path.relpath(d, top)
            out += [(os.path.normpath(os.path.join(name, rel, f)), os.path.join(d, f))
                    for f in sorted(files) if f.endswith((".py", ".cc"))]
    return out


def source_digest(files: list[tuple[str, str]]) -> bytes:
    """The files' names and contents, hashed."""
    h = hashlib.sha256()
    for name, path in files:
        with open(path, "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.digest()
