"""Batch invariance: a row's numbers never depend on the other rows of the step.

A seeded request must draw the same tokens whatever else is in the batch. Sampling derives
each row's random key from its seed and position; the arithmetic must do its part: every
product, norm, softmax and attention reduction has to compute an output element with one
order of operations, whatever the number of rows in the step, their contents, how a prompt
was chunked, or whether the row is decoded or prefilled.

What breaks it on XLA's CPU backend (measured with jax 0.10, `tests/test_batch_invariance.py`):

- ``dot_general``: its blocking (and so the order of a dot's partial sums) follows the shape;
  a row of a 2-row product differs in bits from the same row alone, in float32 and bfloat16;
- ``reduce`` (``jnp.sum``, ``jnp.mean``, ``jax.nn.softmax``): the row reduction of an ``[M, K]``
  array is vectorised across rows from some M on, which changes each row's order;
- ``lax.rsqrt``: its vector approximation and its scalar tail differ in the last bit, so a
  row's value depends on where it falls against the vector boundaries (``1 / sqrt(x)`` is exact
  in both and does not);

while elementwise ``exp``, ``log``, ``tanh``, ``logistic``, ``max``, ``argmax``, sort and
``cumsum`` are invariant.

The engine's answer has two parts:

- **CPU, native kernels on (the default):** every product goes to `jaxinfer.ops.cpu_matmul`, whose
  kernel computes each output element in one order for any row count (decode and prefill
  alike), attention to `jaxinfer/ops/kernels/paged_attention_cpu.cc` likewise, and every row
  reduction here (`row_sum`, and `softmax`, `log_softmax`, `logsumexp` built on it) goes through
  the same kernel as a product with a row of ones. Invariant in every precision, always.
- **The pure-JAX path** (GPU, TPU, or ``JAXINFER_CPU_KERNELS=0``): XLA chooses the order, so it is
  invariant only in **batch-invariant mode** (`active`: ``JAXINFER_BATCH_INVARIANT=1``,
  ``--batch-invariant``, or ``EngineConfig(batch_invariant=True)``, all of which end up in the
  step's `jaxinfer.ops.backend.KernelChoice`, its ``batch_invariant``), as vLLM's
  ``VLLM_BATCH_INVARIANT`` and SGLang's ``--enable-deterministic-inference`` offer: products run
  as a loop of fixed-shape ``[TILE_ROWS, K] @ W`` tiles (one dot shape whatever the step's rows,
  so XLA picks one algorithm; decode pads its rows to a tile) and row sums as a fixed pairwise
  tree of elementwise adds. It costs speed (each tile reads the weight again) and compile time
  (each tree is a chain of small fusions), which is why it is a mode there.

The mode is static configuration, like the kernels: device code reads it from the kernel choice a
step is traced with (`jaxinfer.ops.backend.current`), never from the process, so two engines in one
process, one invariant and one not, trace different programs (their cache keys hash the choice).
Research code tracing outside a step gets the host's choice, whose mode follows
``$JAXINFER_BATCH_INVARIANT``, or names one: ``backend.using(KernelChoice.loaded().with_batch_invariant(True))``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer import env
from jaxinfer.ops import backend, cpu_matmul

ENV = env.BATCH_INVARIANT
TILE_ROWS = 16  # rows of one product tile in batch-invariant mode (pure-JAX path)


def active() -> bool:
    """Whether what is traced now takes the batch-invariant forms on the pure-JAX path: the kernel
    choice's mode (`jaxinfer.ops.backend.KernelChoice.batch_invariant`; inside a step the step's)."""
    return backend.current().batch_invariant


# ---------------------------------------------------------------------------
# row reductions


def _kernel_sum(x2: jax.Array):
    """``x2 [R, K]`` float32 summed over K by the native matmul kernel (a product with a row of
    ones), or None where the kernel does not take it (or the step's kernel choice has none)."""
    r, k = x2.shape
    ones = jnp.ones((1, k), jnp.float32)
    if r == 0 or k == 0 or not cpu_matmul.fits(r, ones, 1):
        return None
    return cpu_matmul.matmul(x2, ones, 1)[:, 0]


def tree_sum(x: jax.Array) -> jax.Array:
    """The sum over the last axis as a pairwise tree of elementwise adds (an odd width gains a
    zero): one order for every row whatever the array's shape, on any backend."""
    while x.shape[-1] > 1:
        w = x.shape[-1]
        if w % 2:
            x = jnp.concatenate([x, jnp.zeros((*x.shape[:-1], 1), x.dtype)], axis=-1)
            w += 1
        x = x[..., : w // 2] + x[..., w // 2:]
    return x[..., 0]


def row_sum(x: jax.Array, keepdims: bool = False) -> jax.Array:
    """``x [..., K]`` summed over its last axis in float32, each row in an order of its own.

    CPU with the native kernel: the kernel's product with a row of ones. Batch-invariant mode on
    the pure-JAX path: `tree_sum`. Otherwise XLA's reduce (fast; its order follows the shape).
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x = x.astype(jnp.float32)
    rows = 1
    for d in lead:
        rows *= d
    s = _kernel_sum(x.reshape(rows, k)) if k else None
    if s is not None:
        s = s.reshape(lead)
    elif active():
        s = tree_sum(x)
    else:
        s = jnp.sum(x, axis=-1)
    return s[..., None] if keepdims else s


def row_mean(x: jax.Array, keepdims: bool = False) -> jax.Array:
    return row_sum(x, keepdims) / x.shape[-1]


def logsumexp(x: jax.Array, keepdims: bool = False) -> jax.Array:
    """log(sum(exp(x))) over the last axis, shifted by the row's max (exact in any order); rows of
    only -inf give -inf, as `jax.nn.logsumexp` does."""
    m = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    out = jnp.log(row_sum(jnp.exp(x - m), keepdims=True)) + m
    return out if keepdims else out[..., 0]


def log_softmax(x: jax.Array) -> jax.Array:
    """``x - logsumexp(x)`` over the last axis (float32), with the invariant row sum."""
    x = x.astype(jnp.float32)
    m = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    shifted = x - m
    return shifted - jnp.log(row_sum(jnp.exp(shifted), keepdims=True))


def softmax(x: jax.Array) -> jax.Array:
    """``exp(x) / sum(exp(x))`` over the last axis (float32), with the invariant row sum."""
    x = x.astype(jnp.float32)
    m = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(x - m)
    return e / row_sum(e, keepdims=True)


def rsqrt(x: jax.Array) -> jax.Array:
    """``1 / sqrt(x)``: correctly rounded in XLA's vector and scalar code alike (``lax.rsqrt`` is not)."""
    return 1.0 / jnp.sqrt(x)


# ---------------------------------------------------------------------------
# products on the pure-JAX path


def tiled_dot(x2: jax.Array, w: jax.Array, dims) -> jax.Array:
    """``dot_general(x2 [M, K], w, dims)`` (float32 out) as a loop of `TILE_ROWS`-row dots of one
    shape: each row's result is then the same whatever M is and wherever the row sits."""
    m = x2.shape[0]
    tiles = -(-m // TILE_ROWS)
    pad = tiles * TILE_ROWS - m
    if pad:
        x2 = jnp.concatenate([x2, jnp.zeros((pad, x2.shape[1]), x2.dtype)])
    ys = jax.lax.map(lambda t: jax.lax.dot_general(t, w, dims, preferred_element_type=jnp.float32),
                     x2.reshape(tiles, TILE_ROWS, x2.shape[1]))
    return ys.reshape(tiles * TILE_ROWS, -1)[:m]
