"""Which kernels a step uses, decided once: the `KernelChoice`.

Device code does not look at the process (which kernels happen to be loaded, which backend is
the default) while it is traced. The choice is made once, after the native kernels load
(`prepare`), as a frozen, hashable `KernelChoice`; the step programs take it as a static
argument (`jaxinfer.engine.step`), so the same shapes and the same choice always trace the
same program, and the program cache key hashes this one value (`jaxinfer.engine.programs`).
While a step is traced the choice is the one `current` returns (`using` sets it); the
attention (`jaxinfer.ops.attention`) and the products (`jaxinfer.models.decoder.matmul`,
`jaxinfer.ops.cpu_matmul.fits`) read only that.

A choice can be built for a platform other than the host's (`KernelChoice.for_platform`):
lowering a step for ``tpu`` or ``cuda`` on a CPU machine takes that platform's kernels
(`jaxinfer.tools.lowering` does, and checks the programs).

The choice also carries the precision of XLA's float32 products (``matmul_precision``, the engine
config's `EngineConfig.matmul_precision`): like the kernels, it changes the program, so it is part
of the one static value the programs and their cache key take. `precision_scope` applies it to every
product traced inside a step (the attention's einsums included); `jaxinfer.models.decoder.matmul`
also passes it to its own product explicitly.

Batch-invariant mode (``batch_invariant``, the engine config's `EngineConfig.batch_invariant`) is part of
the choice too: on the pure-JAX path it makes products fixed-shape row tiles and row sums fixed trees
(`jaxinfer.ops.invariant`), which are other programs. Device code reads it from the step's choice
(`jaxinfer.ops.invariant.active`), never from the process, so two engines in one process, one invariant
and one not, trace and keep their own programs.

The TPU the programs are for (``tpu_kind``, its device kind, e.g. ``"TPU v6 lite"``) is carried the same
way: the Pallas kernel's block sizes follow the TPU generation, and a choice built on a CPU host for a TPU
names the generation instead of the trace reading the devices.

The platform's dtype for ``dtype="auto"`` (`dtype_choice`) is decided here too: it follows
whether the native CPU matmul kernel can run.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator, Optional

import jax
import jax.numpy as jnp

from jaxinfer.config import MATMUL_PRECISIONS, EngineConfig
from jaxinfer.env import BATCH_INVARIANT, GPU_KERNELS, cpu_flags, is_on, is_set
from jaxinfer.ops import kernels
from jaxinfer.ops.attention_pallas import tpu_kernel_fits
from jaxinfer.ops.attention_pallas_gpu import gpu_kernel_fits

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
SIMD_LEVELS = ("", "avx512", "avx2", "scalar")
SIMD_FEATURES = ("amx", "vnni")  # an AVX-512 build's dot instructions, "+"-joined after the level: "avx512+amx+vnni"


def simd_features(simd: str) -> tuple:
    """The "+feature"s of a `KernelChoice.simd` string ("avx512+amx+vnni" -> ("amx", "vnni"))."""
    return tuple(simd.split("+")[1:])


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The kernels programs traced with this value use. Frozen and hashable: a jit static argument.

    platform:      the platform the programs are for, as lowering names it ("cpu", "cuda", "rocm", "tpu").
    cpu_matmul:    products go to the native CPU kernel (`jaxinfer.ops.cpu_matmul`) where it takes the weight.
    cpu_attention: attention goes to the native CPU paged-attention kernel where it takes the shapes.
    tpu_attention: attention goes to Pallas ``ragged_paged_attention`` where it takes the shapes.
    gpu_attention: attention goes to our Pallas GPU (Triton) ragged paged attention
                   (`jaxinfer.ops.attention_pallas_gpu`) where it takes the shapes; cuda only, chosen there
                   unless ``JAXINFER_GPU_KERNELS=0`` (`for_platform`).
    gpu_interpret: that kernel in Pallas interpret mode: a cuda program that runs on a CPU host (tests, a
                   device check's quick run on CPU); never on a GPU (slow).
    simd:          the SIMD path of the CPU matmul kernel ("avx512", "avx2", "scalar"; "" when unknown or not
                   used) and on AVX-512 its dot instructions ("+amx": bfloat16 weights' products on the AMX
                   tiles, activations rounded to bfloat16; "+vnni": int8 / int4 weights' products by VNNI,
                   activations quantized to int8 per block of 32; `jaxinfer.ops.cpu_matmul`), e.g.
                   "avx512+amx+vnni": a different build, or different products, of the same source, so programs
                   compiled with one are not programs of the other.
    matmul_precision: XLA's float32 products (dot_general, einsums) at the platform's "default" precision
                   (TF32 on NVIDIA GPUs, one bfloat16 pass on TPUs) or at "highest" (full float32). The
                   native CPU kernels compute float32 exactly either way.
    batch_invariant: batch-invariant mode on the pure-JAX path (`jaxinfer.ops.invariant`): products as
                   fixed-shape row tiles, row sums as fixed pairwise trees, so a row's numbers do not depend
                   on the step's other rows. The native CPU kernels are invariant without it.
    tpu_kind:      the device kind of the TPU the programs are for ("TPU v6 lite", "TPU v5p", "TPU7x"; ""
                   when not known): the Pallas kernel's tuned block sizes follow it; without it the kernel
                   takes explicit block sizes. Only on the tpu platform.
    """

    platform: str = "cpu"
    cpu_matmul: bool = False
    cpu_attention: bool = False
    tpu_attention: bool = False
    gpu_attention: bool = False
    gpu_interpret: bool = False
    simd: str = ""
    matmul_precision: str = "default"
    batch_invariant: bool = False
    tpu_kind: str = ""

    def __post_init__(self):
        if self.platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {', '.join(PLATFORMS)}, got {self.platform!r}")
        if (self.cpu_matmul or self.cpu_attention) and self.platform != "cpu":
            raise ValueError(f"the native CPU kernels run on the cpu platform only, not {self.platform!r}")
        if self.tpu_attention and self.platform != "tpu":
            raise ValueError(f"the Pallas TPU attention runs on the tpu platform only, not {self.platform!r}")
        if self.gpu_attention and self.platform != "cuda":
            raise ValueError(f"the Pallas GPU attention runs on the cuda platform only, not {self.platform!r}")
        if self.gpu_interpret and not self.gpu_attention:
            raise ValueError("gpu_interpret is the Pallas GPU attention's interpret mode: it needs gpu_attention")
        level, features = self.simd.split("+")[0], simd_features(self.simd)
        if level not in SIMD_LEVELS or not set(features) <= set(SIMD_FEATURES) or (features and level != "avx512"):
            raise ValueError(f"simd must be one of {', '.join(repr(s) for s in SIMD_LEVELS)}, \"avx512\" with any of "
                             f"{', '.join('+' + f for f in SIMD_FEATURES)} after it, got {self.simd!r}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}, "
                             f"got {self.matmul_precision!r}")
        if not isinstance(self.batch_invariant, bool):
            raise TypeError(f"batch_invariant must be a bool, got {self.batch_invariant!r}")
        if self.tpu_kind and (self.platform != "tpu" or "TPU" not in self.tpu_kind):
            raise ValueError(f"tpu_kind must name a TPU device kind (e.g. 'TPU v6 lite') on the tpu platform, "
                             f"got {self.tpu_kind!r} on {self.platform!r}")

    def with_precision(self, matmul_precision: str) -> "KernelChoice":
        """This choice with XLA's float32 products at ``matmul_precision`` ("default" | "highest")."""
        return self if matmul_precision == self.matmul_precision else dataclasses.replace(
            self, matmul_precision=matmul_precision)

    def with_batch_invariant(self, batch_invariant: Optional[bool]) -> "KernelChoice":
        """This choice in batch-invariant mode or not (`batch_invariant`); None keeps it as it is."""
        if batch_invariant is None or bool(batch_invariant) == self.batch_invariant:
            return self
        return dataclasses.replace(self, batch_invariant=bool(batch_invariant))

    @property
    def lax_precision(self) -> Optional[jax.lax.Precision]:
        """The ``precision`` a product passes to XLA: None (the default, as every product had before the
        field) or ``Precision.HIGHEST``."""
        return jax.lax.Precision.HIGHEST if self.matmul_precision == "highest" else None

    @classmethod
    def for_platform(cls, platform: str, native_cpu_kernels: bool = True, simd: str = "",
                     tpu_kind: str = "", gpu_kernels: Optional[bool] = None) -> "KernelChoice":
        """The kernels of ``platform`` ("cpu", "cuda" or "gpu", "rocm", "tpu"), whatever this host is:
        on cpu the native kernels unless ``native_cpu_kernels`` is False, on tpu the Pallas attention
        (for the TPU ``tpu_kind`` names, e.g. "TPU v6 lite"; "" for the kernel's explicit block sizes),
        on cuda the Pallas GPU attention unless ``gpu_kernels`` is False (None: unless
        ``$JAXINFER_GPU_KERNELS`` is 0, read now), on rocm the pure-JAX path. Nothing is built or loaded: a
        program traced with it calls the CPU kernels by name, so run it where they are loaded (`prepare`)."""
        platform = {"gpu": "cuda"}.get(platform, platform)
        cpu = platform == "cpu" and native_cpu_kernels
        gpu = platform == "cuda" and (is_on(GPU_KERNELS) if gpu_kernels is None else bool(gpu_kernels))
        return cls(platform, cpu_matmul=cpu, cpu_attention=cpu, tpu_attention=platform == "tpu",
                   gpu_attention=gpu, simd=simd if cpu else "", tpu_kind=tpu_kind)

    @classmethod
    def pure_jax(cls, platform: str = "cpu") -> "KernelChoice":
        """No kernel at all: XLA's products and the pure-JAX gather attention (any platform)."""
        return cls({"gpu": "cuda"}.get(platform, platform))

    @classmethod
    def loaded(cls, platform: Optional[str] = None) -> "KernelChoice":
        """The host's choice now: ``platform`` (default: JAX's default backend) and, on cpu, the native
        kernels that are loaded in this process (never builds; `prepare` loads them first); on a TPU host
        its device kind. Batch-invariant mode as ``$JAXINFER_BATCH_INVARIANT`` says now (an engine sets it
        from its config: `prepare`). Read here, when the choice is built, never while a step is traced."""
        platform = platform or host_platform()
        invariant = is_set(BATCH_INVARIANT)
        if platform != "cpu":
            kind = _host_tpu_kind() if platform == "tpu" else ""
            return cls.for_platform(platform, tpu_kind=kind).with_batch_invariant(invariant)
        on = kernels.enabled()
        matmul = on and kernels.ready(kernels.MATMUL)
        return cls("cpu", cpu_matmul=matmul, cpu_attention=on and kernels.ready(kernels.PAGED_ATTENTION),
                   simd=_matmul_isa() if matmul else "", batch_invariant=invariant)

    # -- what it means for a layer's shapes ----------------------------------------------

    def attention_kernel(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                         cache_dtype) -> Optional[str]:
        """The attention kernel for these shapes (one device's heads): "cpu", "tpu", "gpu", or None for the
        pure-JAX gather path."""
        if self.cpu_attention and cpu_attention_fits(num_heads, num_kv_heads, head_dim, cache_dtype):
            return "cpu"
        if self.tpu_attention and tpu_kernel_fits(num_heads, num_kv_heads, head_dim, page_size, cache_dtype):
            return "tpu"
        if self.gpu_attention and gpu_kernel_fits(num_heads, num_kv_heads, head_dim, page_size, cache_dtype):
            return "gpu"
        return None

    def __str__(self) -> str:
        used = [n for n, on in (("cpu matmul", self.cpu_matmul), ("cpu attention", self.cpu_attention),
                                ("tpu attention", self.tpu_attention), ("gpu attention", self.gpu_attention))
                if on]
        simd = f" ({self.simd})" if self.simd else ""
        precision = f", {self.matmul_precision} precision" if self.matmul_precision != "default" else ""
        mode = ", batch-invariant" if self.batch_invariant else ""
        mode += ", interpreted" if self.gpu_interpret else ""
        kind = f" [{self.tpu_kind}]" if self.tpu_kind else ""
        return f"{self.platform}{kind}: {', '.join(used) or 'pure JAX'}{simd}{precision}{mode}"


def cpu_attention_fits(num_heads: int, num_kv_heads: int, head_dim: int, cache_dtype) -> bool:
    """The shapes and dtypes the native CPU attention kernel takes."""
    return (head_dim in (16, 32, 64, 128, 256) and num_heads // num_kv_heads <= 64
            and jnp.dtype(cache_dtype) in (jnp.float32, jnp.bfloat16))


def latent_attention_fits(dim: int, value_dim: int, cache_dtype) -> bool:
    """The shapes and dtypes the native CPU latent-attention kernel takes: an entry of ``dim`` values and a
    value of its first ``value_dim``, both multiples of 8 (``value_dim <= dim <= 1024``)."""
    return (dim % 8 == 0 and value_dim % 8 == 0 and 8 <= value_dim <= dim <= 1024
            and jnp.dtype(cache_dtype) in (jnp.float32, jnp.bfloat16))


def engine_preset(platform: Optional[str] = None) -> EngineConfig:
    """The engine preset (configs/*.json) for ``platform``, by default JAX's default backend."""
    return EngineConfig.for_backend(platform or host_platform())


def host_platform() -> str:
    """JAX's default backend as lowering names it ("cpu", "cuda", "rocm", "tpu")."""
    backend = jax.default_backend()
    if backend == "gpu":
        version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
        return "rocm" if "rocm" in version else "cuda"
    return backend


def _host_tpu_kind() -> str:
    """This host's TPU device kind ("TPU v6 lite", ...), "" when its first device is not a TPU."""
    if jax.default_backend() != "tpu":
        return ""
    kind = jax.devices()[0].device_kind
    return kind if "TPU" in kind else ""


def _matmul_isa() -> str:
    lib = kernels.library(kernels.MATMUL)
    return "" if lib is None else kernels.matmul_isa(lib)


# ---------------------------------------------------------------------------
# deciding once, and reading it while tracing


def start_build(platform: Optional[str] = None) -> None:
    """Begin building the native CPU kernels in the background (a model load calls this first, so the
    once-per-machine compile overlaps reading the weights); `prepare` waits for them."""
    if (platform or host_platform()) == "cpu":
        kernels.build_in_background(kernels.PAGED_ATTENTION)
        kernels.build_in_background(kernels.MATMUL)


def prepare(platform: Optional[str] = None, matmul_precision: str = "default",
            batch_invariant: Optional[bool] = None) -> KernelChoice:
    """Load the platform's native kernels (building them once per machine, with a progress line each)
    and decide: the `KernelChoice` the engine's programs are traced with. Call it before tracing, never
    inside a trace. Idempotent; a failed build warns once and its kernel is not chosen. ``matmul_precision``:
    XLA's float32 products (`KernelChoice.matmul_precision`); ``batch_invariant``: batch-invariant mode
    (`KernelChoice.batch_invariant`; None: as ``$JAXINFER_BATCH_INVARIANT`` says)."""
    platform = platform or host_platform()
    if platform == "cpu":
        kernels.prepare(kernels.PAGED_ATTENTION)
        kernels.prepare(kernels.MATMUL)
    return KernelChoice.loaded(platform).with_precision(matmul_precision).with_batch_invariant(batch_invariant)


_CURRENT: contextvars.ContextVar = contextvars.ContextVar("jaxinfer_kernel_choice", default=None)


@contextlib.contextmanager
def using(choice: KernelChoice) -> Iterator[KernelChoice]:
    """Trace with ``choice``: what `current` returns inside (the steps wrap their body in it)."""
    if not isinstance(choice, KernelChoice):
        raise TypeError(f"kernels must be a KernelChoice, got {type(choice).__name__}")
    token = _CURRENT.set(choice)
    try:
        yield choice
    finally:
        _CURRENT.reset(token)


def current() -> KernelChoice:
    """The choice device code follows: inside a step, the step's static one (`using`); elsewhere (research
    code tracing a model's forward itself) the host's choice at that moment (`KernelChoice.loaded`)."""
    choice = _CURRENT.get()
    return choice if choice is not None else KernelChoice.loaded()


def precision_scope(choice: KernelChoice):
    """A context in which every product traced without its own ``precision`` (the attention's einsums, the
    experts', the batch-invariant tiles) takes ``choice.matmul_precision``; for "default" nothing at all, so
    those programs are exactly what they were before the field."""
    if choice.matmul_precision == "default":
        return contextlib.nullcontext()
    return jax.default_matmul_precision(choice.matmul_precision)


# ---------------------------------------------------------------------------
# the weights' dtype for dtype="auto"


def dtype_choice(backend: Optional[str] = None) -> tuple[str, str]:
    """What "auto" means here, and why: (dtype, reason).

    GPUs and TPUs: bfloat16, which they multiply natively. CPUs: decided after the native kernels load
    (`prepare`: from the install-time build, or built now), by the matmul kernel that actually runs
    (`jaxinfer.ops.cpu_matmul`): bfloat16 where it has a SIMD path (it reads each bfloat16 weight once, so
    a decode step moves half of float32's bytes, and the products stay batch-invariant; on AMX the
    products run on the tiles, activations rounded to bfloat16). Without it (kernels off, a build that
    failed, no SIMD path), bfloat16 would go to XLA's own product, which is fast only with bfloat16 dot
    instructions and not batch-invariant: float32 then.
    """
    backend = backend or host_platform()
    if backend != "cpu":
        return "bfloat16", f"{backend} multiplies bfloat16 natively"
    if not kernels.enabled():
        return "float32", ("native CPU kernels are off (JAXINFER_CPU_KERNELS=0), and XLA's bfloat16 product "
                           "is not batch-invariant")
    prepare(backend)
    isa = _matmul_isa()
    if not isa:
        return "float32", ("the native CPU matmul kernel could not be loaded (see the warning above), and XLA's "
                           "bfloat16 product is not batch-invariant")
    if isa == "scalar":
        return "float32", ("the native CPU kernel has no SIMD path here (AVX2 or AVX-512), and XLA's bfloat16 "
                           "product is not batch-invariant")
    if "amx" in simd_features(isa):
        return "bfloat16", ("the native CPU kernel multiplies bfloat16 weights on the AMX tiles (activations "
                            "rounded to bfloat16, float32 sums)")
    return "bfloat16", (f"the native CPU kernel ({isa_name(isa)}) reads bfloat16 weights (half of float32's "
                        f"bytes) against float32 activations")


_ISA_NAMES = {"avx512": "AVX-512", "avx2": "AVX2", "scalar": "no SIMD", "amx": "AMX", "vnni": "VNNI"}


def isa_name(simd: str) -> str:
    """A `KernelChoice.simd` string as the load line says it: "avx512+amx+vnni" -> "AVX-512 + AMX + VNNI"."""
    return " + ".join(_ISA_NAMES.get(part, part) for part in simd.split("+"))


def kernels_note(backend: Optional[str] = None) -> str:
    """What runs a CPU program's products and attention (the load line): the native kernels that loaded,
    with the matmul kernel's SIMD path, or XLA's own ops; "" on other platforms."""
    if (backend or host_platform()) != "cpu":
        return ""
    if not kernels.enabled():
        return "CPU kernels off (JAXINFER_CPU_KERNELS=0): XLA's own products and attention"
    isa = _matmul_isa()
    matmul = f"matmul native ({isa_name(isa)})" if isa else "matmul XLA (native kernel unavailable)"
    attention = ("attention native" if kernels.ready(kernels.PAGED_ATTENTION)
                 else "attention pure-JAX (native kernel unavailable)")
    return f"CPU kernels: {matmul}, {attention}"


def resolve_dtype(dtype: str, backend: Optional[str] = None) -> str:
    """The weights' dtype for "auto" (`dtype_choice`); any other value is returned as given."""
    return dtype if dtype != "auto" else dtype_choice(backend)[0]


def resolve_engine_config(engine: EngineConfig, backend: Optional[str] = None) -> EngineConfig:
    """``engine`` with dtype "auto" replaced by this platform's choice (`dtype_choice`) and batch_invariant
    None by ``$JAXINFER_BATCH_INVARIANT`` (`EngineConfig.resolved`)."""
    if engine.dtype == "auto":
        return engine.resolved(auto_dtype=resolve_dtype("auto", backend))
    return engine.resolved()
