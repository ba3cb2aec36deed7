"""The native CPU matmul kernel (`jaxinfer.ops.cpu_matmul`) against XLA's path, on SmolLM2-135M's shapes.

Prints:

* the CPU's SIMD flags, the kernel's SIMD path, and the machine's read bandwidth and flops as the
  engine's roofline measures them (`jaxinfer.tools.harness.peaks`: the best of several read
  methods and thread counts); the floor below is weight bytes / that bandwidth;
* M = 1, one product at a time (one jitted call each, so a call's dispatch is
  in both columns; small weights stay in cache between calls): time, GB/s of weight bytes,
  and the fraction of the bandwidth floor (weight bytes / bandwidth) reached;
* the int8 LM head, cold (a round over distinct copies larger than the last-level cache),
  per M: the [H, V] layout (`QuantizedWeight` as the layers store it: each row of a column
  band 48 KB from the next) against the transposed [V, H] one (``axis`` 1, GGUF's row
  blocks: each band one contiguous run), both by the kernel, and XLA on the [V, H] one;
* the whole model chained in one jitted call (30 layers of wqkv, wo, w_gate_up, w_down,
  then the LM head, each a distinct weight, so the weights stream from memory as in a
  decode step): time per step and fraction of the floor, per M from decode's 1 row to
  prefill's 64-256, for every weight form (float32, bfloat16, int8, int4), the kernel
  against XLA's path.

Times are medians of ``--repeats`` rounds, with the best round next to them: on a shared
host the median carries other processes' load (the load average is printed), the best
round is the figure the hardware gives.

XLA's path is what `jaxinfer.models.decoder.matmul` does without the kernel: a quantized
weight is ``w.dequantize()`` then ``lax.dot_general`` in float32; a bfloat16 weight's dot
takes x rounded to bfloat16 (one row padded to two, as the decoder does); float32 is the
plain dot. The kernel keeps x in float32 for every form. Weights are random (quantized
leaves are random integers and scales: the kernel's speed does not depend on the values).

    python -m benchmarks.matmul_kernel                  # everything (a few minutes)
    python -m benchmarks.matmul_kernel --quick          # fewer repeats, fewer row counts
    python -m benchmarks.matmul_kernel --no-single --head-rows --rows 1 128   # the chained model only
    python -m benchmarks.matmul_kernel --quick --json matmul.json                # every figure as JSON too
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.ops import cpu_matmul
from jaxinfer.ops.quant import QuantizedWeight
from jaxinfer.stats import median
from jaxinfer.tools.harness import Bench, heading, parser, peaks, peaks_line, run, settle, table, timings

HIDDEN, INTER, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30
SHAPES = {  # name: (K, N)
    "wqkv": (HIDDEN, QKV),
    "wo": (HIDDEN, HIDDEN),
    "w_gate_up": (HIDDEN, 2 * INTER),
    "w_down": (INTER, HIDDEN),
}
KINDS = ("int8", "int4", "f32", "bf16")  # int8: per output channel; int4: groups of 32 with an offset


def axis1_weight(q, scale, group):
    """An int8 weight stored [N, K] with groups along K (QuantizedWeight.axis 1, the quantized LM head's layout)."""
    return QuantizedWeight(q, scale, None, 8, group, axis=1)


def make_weight(rng, kind: str, k: int, n: int, transposed: bool = False):
    if kind == "int8" and transposed:  # [N, K], one scale per row (the axis-1 layout)
        q = rng.integers(-127, 128, (n, k), dtype=np.int8)
        scale = (rng.random((n, 1)) * 0.02 / np.sqrt(k)).astype(np.float16)
        return axis1_weight(jnp.asarray(q), jnp.asarray(scale), k)
    if kind in ("f32", "bf16"):
        w = (rng.standard_normal((n, k) if transposed else (k, n), np.float32) / np.sqrt(k)).astype(np.float32)
        return jnp.asarray(w, jnp.float32 if kind == "f32" else jnp.bfloat16)
    if kind == "int8":
        q = rng.integers(-127, 128, (k, n), dtype=np.int8)
        scale = (rng.random((1, n)) * 0.02 / np.sqrt(k)).astype(np.float16)
        return QuantizedWeight(jnp.asarray(q), jnp.asarray(scale), None, 8, k)
    q = rng.integers(0, 256, (k // 2, n), dtype=np.uint8)
    scale = (rng.random((k // 32, n)) * 0.01 + 0.001).astype(np.float16)
    offset = (-7.5 * scale.astype(np.float32)).astype(np.float16)
    return QuantizedWeight(jnp.asarray(q), jnp.asarray(scale), jnp.asarray(offset), 4, 32)


def nbytes(w) -> int:
    if isinstance(w, QuantizedWeight):
        return w.nbytes
    return int(np.prod(w.shape)) * jnp.dtype(w.dtype).itemsize


def xla_product(x, w, w_contract: int = 0):
    """`jaxinfer.models.decoder.matmul` without the kernel (XLA's path on CPU)."""
    if isinstance(w, QuantizedWeight):
        return cpu_matmul.xla_matmul(x, w, w_contract)
    x2 = x.astype(w.dtype)
    pad = x2.shape[0] == 1 and w.dtype != jnp.float32
    if pad:
        x2 = jnp.concatenate([x2, jnp.zeros_like(x2)])
    y = jax.lax.dot_general(x2, w, (((1,), (w_contract,)), ((), ())), preferred_element_type=jnp.float32)
    return y[:1] if pad else y


def timed(fn, repeats: int, calls: int = 1) -> tuple[float, float]:
    """(median, best) seconds per call over ``repeats`` rounds of ``calls`` calls, after two untimed calls."""
    ts = timings(fn, repeats, warmup=2, calls=calls)
    return median(ts), min(ts)


def product(path: str, w_contract: int = 0):
    if path == "kernel":
        return lambda x, w: cpu_matmul.matmul(x, w, w_contract)
    return lambda x, w: xla_product(x, w, w_contract)


def single_products(rng, bw: float, repeats: int) -> list:
    """M = 1, one product per jitted call: each weight in each form, the kernel and XLA; a row each."""
    cases = [(name, k, n, 0) for name, (k, n) in SHAPES.items()] + [("lm_head", HIDDEN, VOCAB, 0)]
    out = []
    for kind in KINDS:
        extra = {"f32": [("lm_head (tied, [V, H])", HIDDEN, VOCAB, 1)],
                 "bf16": [("lm_head (tied, [V, H])", HIDDEN, VOCAB, 1)],
                 "int8": [("lm_head [V, H] axis 1", HIDDEN, VOCAB, 1)]}.get(kind, [])
        for name, k, n, wc in cases + extra:
            w = make_weight(rng, kind, k, n, transposed=wc == 1)
            x = jnp.asarray(rng.standard_normal((1, k), np.float32))
            b = nbytes(w)
            calls = max(1, min(200, int(2e-3 / max(b / bw / 1e9, 1e-6))))
            row = {"weight": name, "kind": kind, "bytes": b}
            for path in ("kernel", "xla"):
                f = jax.jit(product(path, wc))
                row[f"{path}_s"], row[f"{path}_best_s"] = timed(lambda: f(x, w).block_until_ready(), repeats, calls)
            out.append(row)
    return out


def head_layouts(rng, bw: float, repeats: int, rows: list, cache_mb: int = 300) -> dict:
    """The int8 LM head cold, per M: [H, V] and [V, H] by the kernel, [V, H] by XLA (seconds per product)."""
    kn0 = make_weight(rng, "int8", HIDDEN, VOCAB)
    nk0 = make_weight(rng, "int8", HIDDEN, VOCAB, transposed=True)
    copies = max(2, -(-cache_mb * 2**20 // nbytes(nk0)))
    # copies: the same values in distinct buffers (what is timed is the read, not the values)
    kn = [kn0] + [jax.tree.map(lambda a: a + 0 if a.dtype == jnp.int8 else a * 1, kn0) for _ in range(copies - 1)]
    nk = [nk0] + [jax.tree.map(lambda a: a + 0 if a.dtype == jnp.int8 else a * 1, nk0) for _ in range(copies - 1)]
    # XLA's time is its dequantized float32 copy (4x the bytes, written then read), cold or not:
    # two copies, one round (its rounds take many times the kernel's)
    paths = {"kn": (jax.jit(product("kernel", 0)), kn), "nk": (jax.jit(product("kernel", 1)), nk),
             "xla": (jax.jit(product("xla", 1)), nk[:2])}
    res = {"bytes": nbytes(nk0), "cache_mb": cache_mb, "rows": []}
    for m in rows:
        x = jnp.asarray(rng.standard_normal((m, HIDDEN), np.float32))
        row = {"m": m}
        for name, (f, ws) in paths.items():  # seconds per product
            med, best = timed(lambda: [f(x, w).block_until_ready() for w in ws], repeats if name != "xla" else 1)
            row[name] = [med / len(ws), best / len(ws)]
        res["rows"].append(row)
    return res


def model_weights(rng, kind: str) -> tuple[list, object, int]:
    """30 layers' weights and the LM head (f32, bf16: the tied head [V, H]), and w_contract of the head."""
    layers = [{name: make_weight(rng, kind, k, n) for name, (k, n) in SHAPES.items()} for _ in range(LAYERS)]
    if kind in ("f32", "bf16"):
        return layers, make_weight(rng, kind, HIDDEN, VOCAB, transposed=True), 1
    return layers, make_weight(rng, kind, HIDDEN, VOCAB), 0


def model_step(path: str, head_contract: int):
    mm = product(path)
    head = product(path, head_contract)

    def step(h, layers, lm_head):
        for lw in layers:
            a = mm(h, lw["wqkv"])
            h = h + 0.1 * mm(a[:, :HIDDEN], lw["wo"])
            g = mm(h, lw["w_gate_up"])
            h = h + 0.1 * mm(jax.nn.silu(g[:, :INTER]) * g[:, INTER:], lw["w_down"])
        return head(h, lm_head)

    return jax.jit(step)


def chained(rng, repeats: int, rows: list, kinds=KINDS) -> list:
    """The whole model in one jitted call, per weight form and row count: the kernel and XLA; a row each."""
    flops_per_row = 2 * (sum(k * n for k, n in SHAPES.values()) * LAYERS + HIDDEN * VOCAB)
    out = []
    for kind in kinds:
        layers, lm_head, hc = model_weights(rng, kind)
        b = sum(nbytes(w) for lw in layers for w in lw.values()) + nbytes(lm_head)
        steps = {path: model_step(path, hc) for path in ("kernel", "xla")}
        for m in rows:
            h = jnp.asarray(rng.standard_normal((m, HIDDEN), np.float32))
            # prefill's rows: fewer rounds (a round is ~m times a decode step's work)
            reps = repeats if m <= 64 else max(3, repeats // 2)
            row = {"kind": kind, "m": m, "bytes": b, "flops": m * flops_per_row}
            for p, f in steps.items():
                row[f"{p}_s"], row[f"{p}_best_s"] = timed(lambda: f(h, layers, lm_head).block_until_ready(), reps)
            out.append(row)
    return out


def measure(b: Bench) -> None:
    a, res = b.args, b.figures
    if not cpu_matmul.prepare():
        raise SystemExit("the native matmul kernel is unavailable (JAXINFER_CPU_KERNELS=0, or no compiler)")
    res.update(kernel_isa=cpu_matmul.isa(), repeats=a.repeats, bandwidth=peaks())  # after the kernel loads
    bw = res["bandwidth_gbs"] = res["bandwidth"]["bandwidth_gbs"]
    rng = np.random.default_rng(0)
    if not a.no_single:
        b.log("one product at a time")
        res["single"] = single_products(rng, bw, a.repeats)
    if a.head_rows is None or a.head_rows:
        b.log("the int8 LM head, cold")
        res["head"] = head_layouts(rng, bw, a.repeats, a.head_rows or ([1, 16] if a.quick else [1, 2, 4, 8, 16, 32, 48]))
    if not a.no_chained:
        b.log("the whole model chained")
        res["chained"] = chained(rng, a.repeats, a.rows, a.kinds)


def _pair(med: float, best: float, floor: float, unit: float, spec: str) -> list:
    """median / best time in `unit`, and the floor's share of each."""
    return [f"{med * unit:{spec}}/{best * unit:{spec}}", f"{floor / med:.2f}/{floor / best:.2f}"]


def report(res: dict) -> str:
    bw = res["bandwidth_gbs"]
    L = heading("the native CPU matmul kernel against XLA's path, on SmolLM2-135M's shapes", res["system"]) + [
        f"kernel SIMD path: {res['kernel_isa']}; XLA threads: the intra-op pool ({res['system']['cpus']} cores)",
        f"{peaks_line(res['bandwidth'])}. Floor below: bytes / {bw:.1f} GB/s"]
    if "single" in res:
        rows = []
        for r in res["single"]:
            b, fl = r["bytes"], r["bytes"] / bw / 1e9
            rows.append([r["weight"], r["kind"], f"{b / 1e6:.2f}", f"{fl * 1e6:.1f}",
                         f"{r['kernel_s'] * 1e6:.1f}", f"{b / r['kernel_s'] / 1e9:.1f}",
                         f"{fl / r['kernel_s']:.2f}/{fl / r['kernel_best_s']:.2f}",
                         f"{r['xla_s'] * 1e6:.1f}", f"{b / r['xla_s'] / 1e9:.1f}",
                         f"{fl / r['xla_s']:.2f}/{fl / r['xla_best_s']:.2f}", f"{r['xla_s'] / r['kernel_s']:.2f}x"])
        L += ["", "M = 1, one product per jitted call (hot caches for small weights; dispatch included).",
              "floor: the bandwidth floor's share of the time (1.0 = at the floor), median round / best round",
              table(["weight", "kind", "MB", "floor us", "kernel us", "GB/s", "floor", "XLA us", "GB/s", "floor",
                     "speed-up"], rows, left=(0, 1))]
    if "head" in res:
        h = res["head"]
        fl = h["bytes"] / bw / 1e9
        rows = [[r["m"], f"{h['bytes'] / 1e6:.1f}", f"{fl * 1e6:.1f}",
                 *(c for p in ("kn", "nk", "xla") for c in _pair(*r[p], fl, 1e6, ".1f")),
                 f"{r['kn'][0] / r['nk'][0]:.2f}x", f"{r['xla'][0] / r['nk'][0]:.2f}x"] for r in h["rows"]]
        L += ["", f"The int8 LM head [{HIDDEN}, {VOCAB}], per-column scales, cold: each round calls every one of "
              f"enough distinct copies to pass {h['cache_mb']} MB",
              "us per product: median / best round; floor: the floor's share of the median / best round",
              table(["M", "MB", "floor us", "[H, V] kernel", "floor", "[V, H] kernel", "floor", "[V, H] XLA", "floor",
                     "[V,H] vs [H,V]", "vs XLA"], rows, left=())]
    if "chained" in res:
        rows = []
        for r in res["chained"]:
            fl = r["bytes"] / bw / 1e9
            rows.append([r["kind"], r["m"], f"{r['bytes'] / 1e6:.1f}", f"{fl * 1e3:.2f}",
                         *_pair(r["kernel_s"], r["kernel_best_s"], fl, 1e3, ".2f"),
                         *_pair(r["xla_s"], r["xla_best_s"], fl, 1e3, ".2f"), f"{r['xla_s'] / r['kernel_s']:.2f}x",
                         f"{r['flops'] / r['kernel_s'] / 1e9:.1f}", f"{r['flops'] / r['xla_s'] / 1e9:.1f}"])
        L += ["", f"The whole model chained in one jitted call: {LAYERS} layers x 4 products + the LM head, "
              "distinct weights (cold caches)",
              "ms: median / best round; floor: the floor's share of the median / best round",
              table(["kind", "M", "MB", "floor ms", "kernel ms", "floor", "XLA ms", "floor", "speed-up",
                     "GFLOP/s kernel", "XLA"], rows)]
    return "\n".join(L)


def main(argv=None) -> int:
    p = parser("python -m benchmarks.matmul_kernel", __doc__, model=None, quick="3 repeats; rows 1 4 16 64 128")
    p.add_argument("--repeats", type=int, default=None, help="rounds per figure (default 7, --quick 3)")
    p.add_argument("--rows", type=int, nargs="*", default=None, help="row counts for the chained sweep")
    p.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS, help="weight forms for the chained sweep")
    p.add_argument("--no-single", action="store_true", help="skip the one-product table")
    p.add_argument("--no-chained", action="store_true", help="skip the whole-model table")
    p.add_argument("--head-rows", type=int, nargs="*", default=None,
                   help="row counts for the cold LM head table (the flag alone: skip it)")
    a = p.parse_args(argv)
    a.rows = a.rows or None
    return run(measure, report, settle(p, a, quick={"repeats": (7, 3), "rows": (
        [1, 2, 4, 8, 16, 32, 48, 64, 128, 256], [1, 4, 16, 64, 128])}, at_least={"repeats": 1}))


if __name__ == "__main__":
    sys.exit(main())
