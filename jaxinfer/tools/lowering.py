"""Accelerator programs checked without an accelerator: the step lowered for ``cuda`` and ``tpu`` on
a CPU host, and what its StableHLO text must show.

No GPU or TPU has run this engine. What can be checked on a CPU machine is the program we hand
XLA: `lower_step` traces the engine's step (`jaxinfer.engine.step`: ``prefill`` or ``decode``)
with the target platform's kernel choice (`jaxinfer.ops.backend.KernelChoice.for_platform`) and
lowers it for that platform (``jit(...).trace(...).lower(lowering_platforms=...)``, the API
JAX 0.10.2 and 0.11 both have) under an abstract device of that platform (so the Pallas TPU
kernel lowers to Mosaic), with abstract inputs only (`jax.ShapeDtypeStruct`: no weights and no
cache are allocated, whatever their size). The checks below are functions of the lowered
program's text, so they hold any step to the same rules, whoever lowered it:

- `full_cache_ops`: the KV cache is read only through the pages a step attends and written only at
  the new tokens' slots. No op may produce a value the size of a whole cache layer (a convert,
  copy, broadcast, gather, transpose, loop carry or branch result of it) except an in-place update
  of the cache itself (a scatter or dynamic-update-slice at the slots, or a custom call that
  aliases it); `undonated_cache_args` adds that every cache argument is donated.
- `custom_calls`, `has_pallas_ragged_attention`, `has_pallas_gpu_attention`, `cpu_targets`: the TPU
  program calls the Pallas ragged paged attention kernel (a ``tpu_custom_call`` of that kernel name)
  and the cuda program our Pallas GPU kernel (a Triton custom call, ``__gpu$xla.gpu.triton``, named
  `jaxinfer.ops.attention_pallas_gpu.KERNEL_NAME`) where the model's shapes fit them, and no
  accelerator program calls the native CPU kernels.
- `cache_gathers`: where a kernel attends, no gather reads a cache layer (the pure-JAX path's page
  gather, which on GPU is also what makes it batch-dependent); the kernel reads the pages itself.
- `float_weight_copies`: a quantized weight (an int8 or packed-int4 argument) never becomes a float
  tensor as large as the whole weight outside a product; each finding says whether the copy only
  flows into dot_generals (a dequantization XLA may fuse into the product) or not.
- `precision_findings`: every float32 product (dot_general) carries the configured precision
  (``precision = [HIGHEST, HIGHEST]`` for "highest"; DEFAULT or none for "default"). The Pallas
  kernel's own products are inside its Mosaic body, not in this text.

This checks the programs we write; what XLA:GPU or XLA:TPU does to them while optimizing (fusions,
copies it inserts, layouts) waits for a device (``python -m jaxinfer.device_check``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from typing import Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine import step
from jaxinfer.engine.sampling import build_metadata
from jaxinfer.ops import kernels as native_kernels
from jaxinfer.ops import kv_cache
from jaxinfer.ops.attention import AttentionMetadata, RaggedMetadata
from jaxinfer.ops.attention_pallas_gpu import KERNEL_NAME as PALLAS_GPU_KERNEL
from jaxinfer.ops.backend import KernelChoice
from jaxinfer.ops.mesh import DP_AXIS, TP_AXIS
from jaxinfer.ops.sampler import init_sampler_state
from jaxinfer.ops.spec import abstract, model_specs

PLATFORMS = ("cuda", "tpu")
# The device kind an abstract device of each platform reports while lowering: the Pallas TPU kernel
# reads the TPU generation from it (a v5e here; any v4 or later lowers the same kernel).
DEVICE_KINDS = {"cuda": "NVIDIA H100 80GB HBM3", "rocm": "AMD Instinct MI300X", "tpu": "TPU v5 lite"}
PALLAS_RAGGED_KERNEL = "ragged_paged_attention"  # the Mosaic kernel's name starts with it


# ---------------------------------------------------------------------------
# lowering


@contextlib.contextmanager
def abstract_device(platform: str) -> Iterator[None]:
    """Trace and lower under a one-device ("dp", "tp") mesh of an abstract ``platform`` device: what the
    Pallas TPU lowering needs to know which TPU it is for, without one."""
    if platform not in DEVICE_KINDS:
        raise ValueError(f"platform must be one of {', '.join(DEVICE_KINDS)}, got {platform!r}")
    device = jax.sharding.AbstractDevice(device_kind=DEVICE_KINDS[platform], num_cores=1, platform=platform)
    mesh = jax.sharding.AbstractMesh((1, 1), (DP_AXIS, TP_AXIS), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """One step lowered for one platform: its StableHLO ``text`` and what the checks need to read it."""

    platform: str
    kind: str  # "prefill" | "decode"
    kernels: KernelChoice
    text: str
    cache_shape: tuple[int, ...]  # one layer: [num_pages, page_size, 2 * KVH, head_dim]
    attention_kernel: Optional[str]  # what the choice names for these shapes: "tpu", "gpu", "cpu" or None (pure JAX)

    def check(self, matmul_precision: Optional[str] = None) -> dict[str, list]:
        """Every check's findings (empty lists where it holds); `check_program`."""
        return check_program(self.text, self.cache_shape, self.platform,
                             matmul_precision or self.kernels.matmul_precision,
                             expect_pallas=self.attention_kernel in ("tpu", "gpu"))


def step_inputs(cfg: ModelConfig, ecfg: EngineConfig, kind: str, batch: int, tokens: int, pages: int) -> tuple:
    """The abstract arguments of step ``kind`` (`jaxinfer.engine.step`): parameters in the engine's dtype
    (quantized by ``cfg.quant``), the KV cache, the sampler state, and a batch of ``batch`` rows of
    ``tokens`` tokens attending ``pages`` pages. Shapes and dtypes only; nothing is allocated."""
    sds = jax.ShapeDtypeStruct
    i32 = jnp.int32
    params = abstract(model_specs(cfg, jnp.dtype(ecfg.dtype)))
    cache = abstract(kv_cache.cache_specs(cfg, ecfg))
    state = jax.eval_shape(lambda: init_sampler_state(ecfg.max_num_seqs, cfg.vocab_size))
    md = jax.tree.map(lambda x: sds(np.shape(x), x.dtype),
                      build_metadata([None] * batch, batch, num_slots=ecfg.max_num_seqs,
                                     max_logprobs=ecfg.max_logprobs, vocab_size=cfg.vocab_size))
    if kind == "step":  # the engine's ragged step: ``batch`` requests, ``tokens`` tokens in all
        meta = RaggedMetadata(sds((tokens,), i32), sds((tokens,), i32), sds((batch + 1,), i32),
                              sds((batch, pages), i32), sds((batch,), i32))
        rows = step.LogitsRows(sds((batch,), i32), sds((batch,), i32))
        return (params, cache, state, sds((tokens,), i32), sds((tokens,), jnp.bool_), meta, rows,
                sds((batch,), jnp.bool_), md)
    t = tokens if kind == "prefill" else 1
    attn = AttentionMetadata(sds((batch, t), i32), sds((batch, t), i32), sds((batch, pages), i32), sds((batch,), i32))
    if kind == "prefill":
        return params, cache, state, sds((batch, t), i32), attn, sds((batch,), i32), md
    if kind == "decode":
        return params, cache, state, sds((batch,), i32), sds((batch,), jnp.bool_), attn, md
    raise ValueError(f"kind must be step, prefill or decode, got {kind!r}")


def lower_step(cfg: ModelConfig, ecfg: EngineConfig, platform: str, kind: str = "step", *, batch: int = 2,
               tokens: int = 16, pages: int = 4, kernels: Optional[KernelChoice] = None,
               debug_info: bool = False) -> StepProgram:
    """The engine's step ``kind`` lowered for ``platform`` ("cuda", "tpu"; "rocm" and "cpu" too) on this
    host, with that platform's kernels (``kernels``, default `KernelChoice.for_platform`) at the engine
    config's matmul precision. ``debug_info``: the text carries each op's source location."""
    ecfg = ecfg.resolved(auto_dtype="bfloat16")  # "auto" on an accelerator is bfloat16 (`backend.dtype_choice`)
    choice = (kernels or KernelChoice.for_platform(platform)).with_precision(ecfg.matmul_precision)
    if choice.platform != platform:
        raise ValueError(f"the kernel choice is for {choice.platform}, not {platform}")
    fn = {"step": step.ragged_step, "prefill": step.prefill, "decode": step.decode_step}[kind]
    args = step_inputs(cfg, ecfg, kind, batch, tokens, pages)
    with abstract_device(platform) if platform in DEVICE_KINDS else contextlib.nullcontext():
        lowered = fn.trace(*args, cfg=cfg, kernels=choice).lower(lowering_platforms=(platform,))
    layer = kv_cache.cache_specs(cfg, ecfg)[0]
    return StepProgram(platform, kind, choice, lowered.as_text(debug_info=debug_info), tuple(layer.shape),
                       choice.attention_kernel(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, ecfg.page_size,
                                           ecfg.cache_dtype))


def check_program(text: str, cache_shape: Sequence[int], platform: str, matmul_precision: str,
                  expect_pallas: bool = False) -> dict[str, list]:
    """Every check on one lowered step: {check name: findings}; a property holds where its list is empty.
    ``expect_pallas``: the platform's Pallas attention must be called (tpu: the ragged kernel; cuda: ours)
    and no gather may read a cache layer."""
    out = {
        "full_cache_ops": full_cache_ops(text, cache_shape),
        "undonated_cache": undonated_cache_args(text, cache_shape),
        "float_weight_copies": float_weight_copies(text),
        "precision": precision_findings(text, matmul_precision),
        "cpu_targets": cpu_targets(text) if platform != "cpu" else [],
    }
    out["pallas"] = []
    if expect_pallas and platform == "cuda" and not has_pallas_gpu_attention(text):
        out["pallas"] = [f"no Triton custom call of the Pallas GPU attention kernel ({PALLAS_GPU_KERNEL})"]
    elif expect_pallas and platform != "cuda" and not has_pallas_ragged_attention(text):
        out["pallas"] = ["no tpu_custom_call of the Pallas ragged paged attention kernel"]
    out["cache_gathers"] = cache_gathers(text, cache_shape) if expect_pallas else []
    return out


# ---------------------------------------------------------------------------
# reading StableHLO text


@dataclasses.dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: str  # MLIR's element type: "f32", "bf16", "i8", "ui8", "i1", ...

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype.startswith(("f", "bf")) or self.dtype.startswith("f8")

    def __str__(self) -> str:
        return f"tensor<{'x'.join(map(str, self.shape))}{'x' if self.shape else ''}{self.dtype}>"


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation of a lowered module, as the checks see it."""

    func: str  # the function it is in
    line: int  # 1-based line of its first line in the text
    name: str  # "stablehlo.convert", "func.call", ...
    results: tuple[str, ...]  # SSA names ("%5", "%7#1")
    operands: tuple[str, ...]  # SSA names it reads (a while's initial values; a call's arguments)
    result_types: tuple[Optional[TensorType], ...]
    operand_types: tuple[Optional[TensorType], ...]  # where the text spells them (``(a, b) -> c``)
    attrs: str  # the op's text without string contents (attributes, callee, precision ...)
    loc: str = ""  # its location alias (``#loc12``) when lowered with debug info
    carried: tuple[str, ...] = ()  # a while's loop-carried names, one per operand
    yields: tuple[str, ...] = ()  # what a while's body returns for them, in order

    def where(self, locs: Optional[dict] = None) -> str:
        place = f"line {self.line} in @{self.func}"
        if self.loc and locs:
            place += f" ({locs.get(self.loc, self.loc)})"
        return place


@dataclasses.dataclass(frozen=True)
class Module:
    ops: tuple[Op, ...]
    args: dict  # function -> [(name, TensorType or None, attribute text)]
    returns: dict  # function -> [SSA names returned]
    locs: dict  # "#locN" -> a readable location


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_TENSOR = re.compile(r"tensor<([^<>]*)>")
_NAME = re.compile(r"%[\w.$\-]+(?:#\d+)?")
_FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([\w.$\-]+)\((.*)$")
_OP = re.compile(r"^\s*(%[\w.$\-]+(?::\d+)?(?:\s*,\s*%[\w.$\-]+(?::\d+)?)*)\s*=\s*(.*)$")
_LOC_REF = re.compile(r"\s*loc\((#loc\d*|unknown)\)\s*$")
_LOC_DEF = re.compile(r'^(#loc\d*) = loc\((.*)\)\s*$')


def _tensor(text: str) -> Optional[TensorType]:
    m = _TENSOR.fullmatch(text.strip())
    if not m:
        return None
    body = m.group(1).split(",")[0].strip()  # drop an encoding (``tensor<4xf32, #enc>``)
    *dims, dtype = body.split("x") if "x" in body else [body]
    try:
        return TensorType(tuple(int(d) for d in dims), dtype)
    except ValueError:  # a dynamic dimension (``?``): not a static tensor
        return None


def _split_top(text: str, sep: str) -> list[str]:
    """``text`` (strings already emptied) split at ``sep`` outside brackets; an arrow is no bracket."""
    out, depth, start, i = [], 0, 0, 0
    while i < len(text):
        if depth == 0 and text.startswith(sep, i):
            out.append(text[start:i])
            start = i = i + len(sep)
            continue
        if text.startswith("->", i):
            i += 2
            continue
        c = text[i]
        if c in "<([{":
            depth += 1
        elif c in ">)]}":
            depth -= 1
        i += 1
    out.append(text[start:])
    return out


def _inside_parens(text: str) -> str:
    """What is inside the parenthesis ``text`` starts in (its first character is past the ``(``)."""
    depth = 0
    for i, c in enumerate(text):
        if text.startswith("->", i) or (i and text.startswith("->", i - 1)):
            continue
        if c in "<([{":
            depth += 1
        elif c in ">)]}":
            if depth == 0:
                return text[:i]
            depth -= 1
    return text


def _types(text: str) -> tuple[Optional[TensorType], ...]:
    text = text.strip()
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    return tuple(_tensor(t) for t in _split_top(text, ",") if t.strip())


def _signature(text: str) -> tuple[tuple, tuple]:
    """(operand types, result types) of an op's text: what follows its last top-level `` : ``."""
    parts = _split_top(text, " : ")
    if len(parts) < 2:
        return (), ()
    sig = parts[-1]
    arrow = _split_top(sig, " -> ")
    if len(arrow) == 2:
        return _types(arrow[0]), _types(arrow[1])
    return (), _types(sig)


def _results(lhs: str) -> tuple[str, ...]:
    out = []
    for part in lhs.split(","):
        name, _, count = part.strip().partition(":")
        out += [f"{name}#{i}" for i in range(int(count))] if count else [name]
    return tuple(out)


def parse(text: str) -> Module:
    """The ops, function arguments and returns of a lowered module's text (StableHLO as JAX prints it)."""
    lines = text.splitlines()
    ops, args, returns, locs = [], {}, {}, {}
    func = ""
    i = 0
    while i < len(lines):
        raw = lines[i]
        m = _LOC_DEF.match(raw)
        if m:
            locs[m.group(1)] = m.group(2)
            i += 1
            continue
        clean = _STRING.sub('""', raw)
        m = _FUNC.match(clean)
        if m:
            func = m.group(1)
            args[func] = []
            for a in _split_top(_inside_parens(m.group(2)), ","):
                nm, _, rest = a.strip().partition(":")
                if nm.startswith("%"):
                    rest = rest.strip()
                    args[func].append((nm.strip(), _tensor(rest.split(" {")[0]), rest))
            i += 1
            continue
        stripped = clean.strip()
        if stripped.startswith(("return ", "func.return ", "stablehlo.return ")) and func:
            if stripped.startswith(("return ", "func.return ")) and _indent(raw) == 4:
                body = _split_top(stripped.split(" ", 1)[1], " : ")[0]
                returns[func] = _NAME.findall(body)
            i += 1
            continue
        m = _OP.match(clean)
        if not m:
            i += 1
            continue
        lhs, rhs = m.group(1), m.group(2)
        generic = rhs.startswith('"')
        name = _STRING.search(raw[raw.index("=") + 1:]).group(0)[1:-1] if generic else rhs.split("(")[0].split()[0]
        loc = ""
        lm = _LOC_REF.search(rhs)
        if lm:
            loc, rhs = lm.group(1), rhs[: lm.start()]
        sig_text = rhs
        start = i
        if rhs.rstrip().endswith("({"):  # a generic op with regions: its types follow the closing "})"
            depth_indent = _indent(raw)
            j = i + 1
            while j < len(lines) and not (_indent(lines[j]) == depth_indent and lines[j].lstrip().startswith("})")):
                j += 1
            closing = _STRING.sub('""', lines[j]) if j < len(lines) else ""
            lm2 = _LOC_REF.search(closing)
            if lm2:
                loc, closing = lm2.group(1), closing[: lm2.start()]
            sig_text = rhs + " " + closing.strip()
        head = _split_top(rhs, " : ")[0] if not generic else rhs.split("({")[0]
        carried: tuple[str, ...] = ()
        yields: tuple[str, ...] = ()
        if name == "stablehlo.while":
            pairs = re.findall(r"(%[\w.$\-]+) = (%[\w.$\-]+(?:#\d+)?)", head)
            carried = tuple(p[0] for p in pairs)
            operands = tuple(p[1] for p in pairs)
            yields = _while_yields(lines, i)
        else:
            operands = tuple(_NAME.findall(head))
        in_types, out_types = _signature(sig_text)
        if name == "stablehlo.while" and not out_types:
            out_types = _types(_split_top(rhs, " : ")[-1])
        ops.append(Op(func, start + 1, name, _results(lhs), operands, out_types, in_types, head, loc, carried,
                      yields))
        i += 1
    return Module(tuple(ops), args, returns, {k: _readable_loc(v, locs) for k, v in locs.items()})


def _while_yields(lines: list[str], i: int) -> tuple[str, ...]:
    """The names a pretty-printed while (its header on line ``i``) returns from its body ("} do {" ... return)."""
    ind = _indent(lines[i])
    j = i + 1
    while j < len(lines) and not (_indent(lines[j]) == ind and lines[j].strip().startswith("} do {")):
        j += 1
    for k in range(j + 1, len(lines)):
        if _indent(lines[k]) <= ind:
            break
        text = lines[k].strip()
        if _indent(lines[k]) == ind + 2 and text.startswith("stablehlo.return"):
            return tuple(_NAME.findall(_split_top(_STRING.sub('""', text), " : ")[0]))
    return ()


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _readable_loc(v: str, locs: dict, depth: int = 0) -> str:
    """A location alias as text: its first quoted name and file:line, following aliases a few levels."""
    names = re.findall(r'"([^"]*)"(?:\(|:(\d+))', v)
    files = re.findall(r'"([^"]+\.py)":(\d+)', v)
    if files:
        f, ln = files[0]
        label = next((n for n, _ in names if not n.endswith(".py")), "")
        return f"{label} at {f.rsplit('/', 1)[-1]}:{ln}".strip()
    refs = re.findall(r"#loc\d*", v)
    if refs and depth < 8:
        return " <- ".join(_readable_loc(locs.get(r, ""), locs, depth + 1) for r in refs[:2] if r in locs)
    return names[0][0] if names else v[:80]


def _module(text_or_module) -> Module:
    return text_or_module if isinstance(text_or_module, Module) else parse(text_or_module)


# ---------------------------------------------------------------------------
# the checks: each returns its findings (readable strings); an empty list means the property holds


def _layer_sized(t: Optional[TensorType], cache_shape: Sequence[int]) -> bool:
    """A value as large as one whole cache layer, shaped as a view of it: as many elements, and leading
    dimensions that multiply to the page count (or the page count times the page size: a flat slot view)."""
    if t is None or t.elements != math.prod(cache_shape) or not t.shape:
        return False
    pages, slots = cache_shape[0], cache_shape[0] * cache_shape[1]
    lead = 1
    for d in t.shape:
        lead *= d
        if lead in (pages, slots):
            return True
        if lead > slots:
            return False
    return False


# in-place updates of the cache: they write the new tokens' slots into the (donated) buffer
IN_PLACE = ("stablehlo.scatter", "stablehlo.dynamic_update_slice")
# ops that hand their operand on as it is (an ordering fence, not a copy)
PASS_THROUGH = ("stablehlo.optimization_barrier",)


def full_cache_ops(text, cache_shape: Sequence[int]) -> list[str]:
    """Ops whose result is a whole cache layer (``cache_shape``: [num_pages, page_size, 2 * KVH, head_dim])
    or a view of its size, other than an in-place update of the cache (a scatter or dynamic-update-slice
    into it, a custom call that aliases it as its output), an optimization barrier (it hands its operand
    on), a loop that only reads it (a while whose body returns that carried value unchanged: a loop
    that updates the cache it carries is a copy per step) and calls (the callee's ops are checked)."""
    mod = _module(text)
    out = []
    for op in mod.ops:
        big = [i for i, t in enumerate(op.result_types) if _layer_sized(t, cache_shape)]
        if not big:
            continue
        if op.name in IN_PLACE or op.name in PASS_THROUGH or op.name in ("func.call", "call"):
            continue
        if op.name == "stablehlo.custom_call" and "output_operand_aliases" in op.attrs:
            continue
        if op.name == "stablehlo.while" and op.yields and all(
                i < len(op.yields) and op.yields[i] == op.carried[i] for i in big):
            continue
        out.append(f"{op.name} -> {op.result_types[big[0]]} at {op.where(mod.locs)}")
    return out


def undonated_cache_args(text, cache_shape: Sequence[int], func: str = "main") -> list[str]:
    """Arguments of the entry function shaped like a cache layer that are not donated (no
    ``tf.aliasing_output`` or ``jax.buffer_donor`` attribute): such a cache is copied every step."""
    mod = _module(text)
    return [f"{name}: {ty} is not donated" for name, ty, attrs in mod.args.get(func, [])
            if ty is not None and tuple(ty.shape) == tuple(cache_shape)
            and "tf.aliasing_output" not in attrs and "jax.buffer_donor" not in attrs]


def custom_calls(text) -> list[tuple[str, str]]:
    """(call target, kernel name or "") of every custom call in the text."""
    out = []
    for line in text.splitlines():
        m = re.search(r"stablehlo\.custom_call @([\w.$\-]+)|call_target_name = \"([^\"]+)\"", line)
        if m:
            k = re.search(r'kernel_name = "([^"]*)"', line)
            out.append((m.group(1) or m.group(2), k.group(1) if k else ""))
    return out


def has_pallas_ragged_attention(text) -> bool:
    """Whether the program calls the Pallas TPU ragged paged attention kernel (a Mosaic ``tpu_custom_call``)."""
    return any(t == "tpu_custom_call" and k.startswith(PALLAS_RAGGED_KERNEL) for t, k in custom_calls(text))


TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call a Pallas Triton kernel lowers to


def has_pallas_gpu_attention(text, name: str = PALLAS_GPU_KERNEL) -> bool:
    """Whether the program calls our Pallas GPU attention kernel: a Triton custom call whose backend config
    names it (``name = "jaxinfer_ragged_paged_attention"``)."""
    return any(f"@{TRITON_CALL}(" in line and f'name = "{name}"' in line for line in text.splitlines())


def cache_gathers(text, cache_shape: Sequence[int]) -> list[str]:
    """Gathers whose operand is a whole cache layer (``cache_shape``): a page gather of the cache, which a
    kernel that reads the pages itself never needs."""
    mod = _module(text)
    return [f"{op.name} of {op.operand_types[0]} at {op.where(mod.locs)}" for op in mod.ops
            if op.name in ("stablehlo.gather", "stablehlo.dynamic_gather") and op.operand_types
            and op.operand_types[0] is not None and tuple(op.operand_types[0].shape) == tuple(cache_shape)]


def cpu_targets(text) -> list[str]:
    """Calls of the native CPU kernels (their FFI targets): never right in a GPU or TPU program."""
    ours = {name for targets in native_kernels.TARGETS.values() for name in targets}
    return [f"custom call {t}" for t, _ in custom_calls(text) if t in ours or t.startswith("jaxinfer_")]


# Ops a weight's values pass through unchanged in meaning (a dequantization's steps, layout changes):
# a value made by one of them from a weight is still that weight.
_WEIGHT_OPS = {
    "stablehlo.convert", "stablehlo.multiply", "stablehlo.add", "stablehlo.subtract", "stablehlo.and",
    "stablehlo.or", "stablehlo.shift_right_logical", "stablehlo.shift_right_arithmetic", "stablehlo.shift_left",
    "stablehlo.reshape", "stablehlo.broadcast_in_dim", "stablehlo.transpose", "stablehlo.concatenate",
    "stablehlo.slice", "stablehlo.select", "stablehlo.bitcast_convert", "stablehlo.copy",
    "stablehlo.optimization_barrier", "stablehlo.negate", "stablehlo.clamp",
}
PRODUCTS = ("stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution")


def quantized_args(text, func: str = "main") -> list[tuple[str, int]]:
    """The entry function's quantized weights: (argument, elements of the float weight it stands for).
    An int8 argument is an int8 weight; a uint8 one packs two int4 values a byte (`jaxinfer.ops.quant`)."""
    mod = _module(text)
    out = []
    for name, ty, _ in mod.args.get(func, []):
        if ty is not None and len(ty.shape) == 2 and ty.dtype in ("i8", "ui8"):
            out.append((name, ty.elements * (2 if ty.dtype == "ui8" else 1)))
    return out


def float_weight_copies(text, weights: Optional[Sequence[tuple[str, int]]] = None,
                        allow_fused: bool = False) -> list[str]:
    """Float tensors as large as a whole quantized weight, made from it before a product.

    ``weights``: (entry argument, float elements), default `quantized_args`. A value derived from a
    weight through `_WEIGHT_OPS` (into calls and loop bodies too) is the weight; a float one with at
    least the weight's elements is a float copy of it. One finding per weight: its first such op, how
    many there are, and whether they all flow only into products (``only into products``: a
    dequantization the compiler may fuse into the dot, if it does; else ``used elsewhere``).
    ``allow_fused``: report only copies used elsewhere (XLA's dot takes float operands, so any product of
    a quantized weight on the pure-JAX path converts it first; only a kernel avoids the copy outright)."""
    mod = _module(text)
    weights = quantized_args(mod) if weights is None else list(weights)
    by_func: dict[str, list[Op]] = {}
    for op in mod.ops:
        by_func.setdefault(op.func, []).append(op)
    users: dict[tuple[str, str], list[Op]] = {}
    for op in mod.ops:
        for v in op.operands:
            users.setdefault((op.func, v), []).append(op)
    out = []
    for arg, elements in weights:
        derived: set[tuple[str, str]] = set()
        _taint(mod, by_func, "main", {arg}, derived, set())
        copies = [op for op in mod.ops if op.name in _WEIGHT_OPS
                  and any((op.func, r) in derived and t is not None and t.is_float and t.elements >= elements
                          for r, t in zip(op.results, op.result_types))]
        if not copies:
            continue
        fused = all(_only_into_products(mod, users, op.func, r, set()) for op in copies for r in op.results)
        if fused and allow_fused:
            continue
        first = copies[0]
        t = next(t for t in first.result_types if t is not None)
        out.append(f"{arg} ({elements} weights) -> {first.name} {t} at {first.where(mod.locs)}"
                   f" and {len(copies) - 1} more; {'only into products' if fused else 'used elsewhere'}")
    return out


def _taint(mod: Module, by_func: dict, func: str, names: set, derived: set, seen: set) -> None:
    """Add to ``derived`` every (function, value) made from ``names`` in ``func`` through `_WEIGHT_OPS`,
    following calls into their callees and loops into their bodies."""
    key = (func, frozenset(names))
    if key in seen:
        return
    seen.add(key)
    live = set(names)
    derived.update((func, n) for n in names)
    changed = True
    while changed:
        changed = False
        for op in by_func.get(func, []):
            hit = [i for i, v in enumerate(op.operands) if v in live]
            if not hit:
                continue
            if op.name == "stablehlo.while":
                new = {op.carried[i] for i in hit} - live
            elif op.name in ("func.call", "call"):
                callee = re.search(r"@([\w.$\-]+)", op.attrs)
                if callee:
                    params = [a[0] for a in mod.args.get(callee.group(1), [])]
                    inner = {params[i] for i in hit if i < len(params)}
                    _taint(mod, by_func, callee.group(1), inner, derived, seen)
                    ret = mod.returns.get(callee.group(1), [])
                    back = {op.results[i] for i, v in enumerate(ret) if (callee.group(1), v) in derived
                            and i < len(op.results)}
                    new = back - live
                else:
                    new = set()
            elif op.name in _WEIGHT_OPS:
                new = set(op.results) - live
            else:
                new = set()
            if new:
                live |= new
                derived.update((func, n) for n in new)
                changed = True


def _only_into_products(mod: Module, users: dict, func: str, value: str, seen: set) -> bool:
    """Whether ``value`` reaches only products: every use a dot_general, or a weight op whose results do."""
    if (func, value) in seen:
        return True
    seen.add((func, value))
    uses = users.get((func, value), [])
    if not uses:
        return False  # returned or unused: not a product's operand
    for op in uses:
        if op.name in PRODUCTS:
            continue
        if op.name in _WEIGHT_OPS and all(_only_into_products(mod, users, func, r, seen) for r in op.results):
            continue
        return False
    return True


def dot_precisions(text) -> list[tuple[Op, tuple[str, ...], tuple[str, ...]]]:
    """Every product in the text: (op, its operands' element types, its precision per operand; () when
    the op names none, which is DEFAULT)."""
    out = []
    for op in _module(text).ops:
        if op.name not in PRODUCTS:
            continue
        m = re.search(r"precision(?:_config)? = \[([^\]]*)\]", op.attrs)
        prec = tuple(re.findall(r"(DEFAULT|HIGHEST|HIGH)", m.group(1))) if m else ()
        out.append((op, tuple(t.dtype if t else "?" for t in op.operand_types), prec))
    return out


def precision_findings(text, matmul_precision: str) -> list[str]:
    """Float32 products that do not carry ``matmul_precision``: "highest" wants ``[HIGHEST, HIGHEST]``;
    "default" wants DEFAULT or nothing (the platform's default)."""
    want = {"highest": "HIGHEST", "default": "DEFAULT"}[matmul_precision]
    mod = _module(text)
    out = []
    for op, dtypes, prec in dot_precisions(mod):
        if not dtypes or any(d != "f32" for d in dtypes):
            continue
        got = prec or ("DEFAULT", "DEFAULT")
        if any(p != want for p in got) or "algorithm" in op.attrs:
            out.append(f"{op.name} ({', '.join(dtypes)}) precision {list(got)} at {op.where(mod.locs)}")
    return out
