"""The native CPU matmul kernel (`jaxinfer.ops.cpu_matmul`) against XLA's path, on SmolLM2-135M's shapes.

Prints:

* the CPU's SIMD flags, the kernel's SIMD path, and the memory bandwidth over 512 MiB: a
  jitted float32 sum and a jitted matrix-vector product (bytes read; the floor below uses
  the better of the two, as `benchmarks.core` does), a numpy copy (bytes read + written);
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
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.ops import cpu_matmul
from jaxinfer.tools.harness import machine_line
from jaxinfer.ops.quant import QuantizedWeight
from jaxinfer.stats import median

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
    """(median, best) seconds per call over ``repeats`` rounds of ``calls`` calls."""
    fn()
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t) / calls)
    return median(out), min(out)


def bandwidth(mbytes: int = 512, repeats: int = 7) -> dict:
    n = mbytes * 2**20 // 4
    x = jnp.ones((n,), jnp.float32) * 0.5
    total = jax.jit(jnp.sum)
    t_sum = timed(lambda: total(x).block_until_ready(), repeats)[0]
    cols = 4096
    mat, vec = x.reshape(n // cols, cols), jnp.ones((cols,), jnp.float32)
    mv = jax.jit(lambda a, b: a @ b)
    t_mv = timed(lambda: mv(mat, vec).block_until_ready(), repeats)[0]
    src = np.ones((n,), np.float32)
    dst = np.empty_like(src)
    t_cp = timed(lambda: np.copyto(dst, src), repeats)[0]
    return {"jax_sum": n * 4 / t_sum / 1e9, "jax_matvec": n * 4 / t_mv / 1e9, "numpy_copy": 2 * n * 4 / t_cp / 1e9}


def product(path: str, w_contract: int = 0):
    if path == "kernel":
        return lambda x, w: cpu_matmul.matmul(x, w, w_contract)
    return lambda x, w: xla_product(x, w, w_contract)


def single_products(rng, bw: float, repeats: int) -> None:
    print("\nM = 1, one product per jitted call (hot caches for small weights; dispatch included).")
    print("floor: the bandwidth floor's share of the time (1.0 = at the floor), median round / best round")
    print(f"{'weight':<22} {'kind':<5} {'MB':>7} {'floor us':>9} | {'kernel us':>9} {'GB/s':>6} {'floor':>11} | "
          f"{'XLA us':>9} {'GB/s':>6} {'floor':>11} | {'speed-up':>8}")
    cases = [(name, k, n, 0) for name, (k, n) in SHAPES.items()] + [("lm_head", HIDDEN, VOCAB, 0)]
    for kind in KINDS:
        extra = {"f32": [("lm_head (tied, [V, H])", HIDDEN, VOCAB, 1)],
                 "bf16": [("lm_head (tied, [V, H])", HIDDEN, VOCAB, 1)],
                 "int8": [("lm_head [V, H] axis 1", HIDDEN, VOCAB, 1)]}.get(kind, [])
        for name, k, n, wc in cases + extra:
            w = make_weight(rng, kind, k, n, transposed=wc == 1)
            x = jnp.asarray(rng.standard_normal((1, k), np.float32))
            b = nbytes(w)
            floor = b / bw / 1e9
            calls = max(1, min(200, int(2e-3 / max(floor, 1e-6))))
            res = {}
            for path in ("kernel", "xla"):
                f = jax.jit(product(path, wc))
                res[path] = timed(lambda: f(x, w).block_until_ready(), repeats, calls)
            (kt, kb), (xt, xb) = res["kernel"], res["xla"]
            print(f"{name:<22} {kind:<5} {b / 1e6:7.2f} {floor * 1e6:9.1f} | {kt * 1e6:9.1f} {b / kt / 1e9:6.1f} "
                  f"{floor / kt:5.2f}/{floor / kb:5.2f} | {xt * 1e6:9.1f} {b / xt / 1e9:6.1f} "
                  f"{floor / xt:5.2f}/{floor / xb:5.2f} | {xt / kt:7.2f}x")


def head_layouts(rng, bw: float, repeats: int, rows: list, cache_mb: int = 300) -> None:
    print(f"\nThe int8 LM head [{HIDDEN}, {VOCAB}], per-column scales, cold: each round calls every one of "
          f"enough distinct copies to pass {cache_mb} MB")
    print("us per product: median / best round; floor: the floor's share of the median / best round")
    print(f"{'M':>3} {'MB':>6} {'floor us':>9} | {'[H, V] kernel':>17} {'floor':>11} | {'[V, H] kernel':>17} "
          f"{'floor':>11} | {'[V, H] XLA':>17} {'floor':>11} | {'[V,H] vs [H,V]':>14} {'vs XLA':>7}")
    kn0 = make_weight(rng, "int8", HIDDEN, VOCAB)
    nk0 = make_weight(rng, "int8", HIDDEN, VOCAB, transposed=True)
    copies = max(2, -(-cache_mb * 2**20 // nbytes(nk0)))
    # copies: the same values in distinct buffers (what is timed is the read, not the values)
    kn = [kn0] + [jax.tree.map(lambda a: a + 0 if a.dtype == jnp.int8 else a * 1, kn0) for _ in range(copies - 1)]
    nk = [nk0] + [jax.tree.map(lambda a: a + 0 if a.dtype == jnp.int8 else a * 1, nk0) for _ in range(copies - 1)]
    b = nbytes(nk0)
    floor = b / bw / 1e9
    # XLA's time is its dequantized float32 copy (4x the bytes, written then read), cold or not:
    # two copies, one round (its rounds take many times the kernel's)
    paths = {"kn": (jax.jit(product("kernel", 0)), kn), "nk": (jax.jit(product("kernel", 1)), nk),
             "xla": (jax.jit(product("xla", 1)), nk[:2])}
    for m in rows:
        x = jnp.asarray(rng.standard_normal((m, HIDDEN), np.float32))

        def round_of(f, ws):
            return lambda: [f(x, w).block_until_ready() for w in ws]

        res = {}
        for name, (f, ws) in paths.items():  # seconds per product
            med, best = timed(round_of(f, ws), repeats if name != "xla" else 1)
            res[name] = (med / len(ws), best / len(ws))
        cols = " | ".join(f"{res[p][0] * 1e6:8.1f}/{res[p][1] * 1e6:8.1f} "
                          f"{floor / res[p][0]:5.2f}/{floor / res[p][1]:5.2f}" for p in paths)
        print(f"{m:3d} {b / 1e6:6.1f} {floor * 1e6:9.1f} | {cols} | {res['kn'][0] / res['nk'][0]:13.2f}x "
              f"{res['xla'][0] / res['nk'][0]:6.2f}x")


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


def chained(rng, bw: float, repeats: int, rows: list, kinds=KINDS) -> None:
    print(f"\nThe whole model chained in one jitted call: {LAYERS} layers x 4 products + the LM head, "
          "distinct weights (cold caches)")
    print("ms: median / best round; floor: the floor's share of the median / best round")
    print(f"{'kind':<5} {'M':>3} {'MB':>7} {'floor ms':>9} | {'kernel ms':>15} {'floor':>11} | {'XLA ms':>15} "
          f"{'floor':>11} | {'speed-up':>8} | {'GFLOP/s kernel':>14} {'XLA':>6}")
    for kind in kinds:
        layers, lm_head, hc = model_weights(rng, kind)
        b = sum(nbytes(w) for lw in layers for w in lw.values()) + nbytes(lm_head)
        flops_per_row = 2 * (sum(k * n for k, n in SHAPES.values()) * LAYERS + HIDDEN * VOCAB)
        floor = b / bw / 1e9
        steps = {path: model_step(path, hc) for path in ("kernel", "xla")}
        for m in rows:
            h = jnp.asarray(rng.standard_normal((m, HIDDEN), np.float32))
            # prefill's rows: fewer rounds (a round is ~m times a decode step's work)
            reps = repeats if m <= 64 else max(3, repeats // 2)
            res = {p: timed(lambda: f(h, layers, lm_head).block_until_ready(), reps)
                   for p, f in steps.items()}
            (kt, kb), (xt, xb) = res["kernel"], res["xla"]
            print(f"{kind:<5} {m:3d} {b / 1e6:7.1f} {floor * 1e3:9.2f} | {kt * 1e3:7.2f}/{kb * 1e3:7.2f} "
                  f"{floor / kt:5.2f}/{floor / kb:5.2f} | {xt * 1e3:7.2f}/{xb * 1e3:7.2f} "
                  f"{floor / xt:5.2f}/{floor / xb:5.2f} | "
                  f"{xt / kt:7.2f}x | {m * flops_per_row / kt / 1e9:14.1f} {m * flops_per_row / xt / 1e9:6.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="*", default=None, help="row counts for the chained sweep")
    ap.add_argument("--quick", action="store_true", help="3 repeats; rows 1 4 16 64 128")
    ap.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS, help="weight forms for the chained sweep")
    ap.add_argument("--no-single", action="store_true", help="skip the one-product table")
    ap.add_argument("--no-chained", action="store_true", help="skip the whole-model table")
    ap.add_argument("--head-rows", type=int, nargs="*", default=None,
                    help="row counts for the cold LM head table (the flag alone: skip it)")
    a = ap.parse_args()
    repeats = 3 if a.quick else a.repeats
    rows = a.rows or ([1, 4, 16, 64, 128] if a.quick else [1, 2, 4, 8, 16, 32, 48, 64, 128, 256])
    if not cpu_matmul.prepare():
        raise SystemExit("the native matmul kernel is unavailable (JAXINFER_CPU_KERNELS=0, or no compiler)")
    print(machine_line())
    print(f"kernel SIMD path: {cpu_matmul.isa()}; XLA threads: the intra-op pool "
          f"({os.cpu_count()} cores)")
    bws = bandwidth(repeats=max(3, repeats))
    bw = max(bws["jax_sum"], bws["jax_matvec"])
    print(f"memory bandwidth (512 MiB): jitted sum {bws['jax_sum']:.1f} GB/s, jitted matvec {bws['jax_matvec']:.1f} "
          f"GB/s (read); numpy copy {bws['numpy_copy']:.1f} GB/s (read + write). Floor below: bytes / {bw:.1f} GB/s")
    rng = np.random.default_rng(0)
    if not a.no_single:
        single_products(rng, bw, repeats)
    head_rows = [1, 16] if a.quick else [1, 2, 4, 8, 16, 32, 48]
    if a.head_rows is None or a.head_rows:
        head_layouts(rng, bw, repeats, a.head_rows or head_rows)
    if not a.no_chained:
        chained(rng, bw, repeats, rows, a.kinds)


if __name__ == "__main__":
    main()
