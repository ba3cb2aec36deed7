"""The tensor-parallel layout (`jaxinfer.ops.mesh.TPLayout`) on one device.

The layout says which original head (or a zero pad) each laid-out head slot holds, and
how the fused projections' columns are reordered shard-major. Its properties are checked
for many (query heads, KV heads, shards) combinations, and a tree re-laid out by it with
numpy is run as the bigger model it describes (`TPLayout.config`): on one device, with
no mesh, it computes the original model's logits. The multi-device runs are in
tests/multidevice.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxinfer
from conftest import TINY, TINY_ENGINE
from jaxinfer.ops import kv_cache, mesh
from jaxinfer.ops.attention import AttentionMetadata, prepare_cpu_kernel
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.ops.mesh import TPLayout
from jaxinfer.models import get_family
from jaxinfer.ops.spec import is_spec


def model(heads: int, kv_heads: int, head_dim: int = 4, intermediate: int = 10, **kw) -> ModelConfig:
    fields = dict(vocab_size=32, hidden_size=16, intermediate_size=intermediate, num_layers=1, num_heads=heads,
                  num_kv_heads=kv_heads, head_dim=head_dim, name=f"h{heads}kv{kv_heads}")
    fields.update(kw)
    return ModelConfig(**fields)


# (query heads, KV heads): MHA, GQA of several group sizes, MQA, odd and prime counts
HEADS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (6, 2), (6, 3), (8, 2), (8, 4), (9, 3), (12, 4),
         (15, 5), (16, 8), (32, 8), (7, 7), (14, 7), (10, 5), (24, 6)]
SHARDS = [1, 2, 3, 4, 5, 6, 8]
COMBOS = list(itertools.product(HEADS, SHARDS))


def check_layout(heads: int, kv_heads: int, shards: int) -> None:
    """Every property a layout must have, for one combination."""
    cfg = model(heads, kv_heads)
    group = heads // kv_heads
    lay = TPLayout.of(cfg, shards)
    q, kv = np.array(lay.q_slots), np.array(lay.kv_slots)
    where = f"{heads} heads / {kv_heads} KV heads over {shards} shards: q {lay.q_slots}, kv {lay.kv_slots}"

    assert lay.shards == shards
    # every query head exactly once, every KV head at least once; the rest are pads (-1)
    assert sorted(q[q >= 0].tolist()) == list(range(heads)), where
    assert set(kv[kv >= 0].tolist()) == set(range(kv_heads)), where
    assert set(q[q < 0].tolist()) <= {-1} and set(kv[kv < 0].tolist()) <= {-1}, where
    # equal counts per shard, and a whole number of query slots per KV slot
    assert len(q) % shards == 0 and len(kv) % shards == 0, where
    assert len(q) % len(kv) == 0, where
    # a shard's KV heads are distinct (a shard never holds one head twice)
    per_kv = len(kv) // shards
    for s in range(shards):
        mine = kv[s * per_kv : (s + 1) * per_kv]
        assert len(set(mine[mine >= 0].tolist())) == (mine >= 0).sum(), where
    # the attention reads KV slot i // new_group for query slot i: it holds that query's KV head
    new_group = len(q) // len(kv)
    for i, head in enumerate(q):
        if head >= 0:
            assert kv[i // new_group] == head // group, (i, where)
    # padding only where needed: no more KV slots than the shards force
    assert len(kv) == -(-kv_heads // shards) * shards, where
    # the intermediate size is padded to a multiple of the shards, by less than one shard
    assert lay.intermediate_size % shards == 0 and 0 <= lay.intermediate_size - cfg.intermediate_size < shards

    laid = lay.config(cfg)
    if shards == 1:
        assert laid is cfg and lay.identity and lay.q_slots == tuple(range(heads))
        assert lay.kv_slots == tuple(range(kv_heads))
    else:
        assert (laid.num_heads, laid.num_kv_heads, laid.tp_shards) == (len(q), len(kv), shards)
        assert laid.intermediate_size == lay.intermediate_size
        assert dataclasses.replace(laid, num_heads=heads, num_kv_heads=kv_heads, tp_shards=1,
                                   intermediate_size=cfg.intermediate_size) == cfg
    check_index_maps(cfg, lay)


def check_index_maps(cfg: ModelConfig, lay: TPLayout) -> None:
    """The index maps are the original indices reordered, with -1 pads; each laid-out unit (head
    slot, intermediate unit) reads the same original unit in every projection that touches it."""
    d, h, kvh, s = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, lay.shards
    nq, nkv = len(lay.q_slots) // s, len(lay.kv_slots) // s

    def head(x: int, base: int) -> list:
        return [-1] * d if x < 0 else list(base + x * d + np.arange(d))

    cols = lay.qkv_columns(cfg)
    assert len(cols) == (len(lay.q_slots) + 2 * len(lay.kv_slots)) * d
    # each original column is there: q columns exactly once, K and V ones once per replica of their head
    real = cols[cols >= 0]
    assert set(real.tolist()) == set(range((h + 2 * kvh) * d))
    q_cols = real[real < h * d]
    assert sorted(q_cols.tolist()) == list(range(h * d))
    # shard-major blocks, each [its q heads | its k heads | its v heads], as split_qkv reads them
    block = (nq + 2 * nkv) * d
    for sh in range(s):
        b = cols[sh * block : (sh + 1) * block].tolist()
        qs, kvs = lay.q_slots[sh * nq : (sh + 1) * nq], lay.kv_slots[sh * nkv : (sh + 1) * nkv]
        want = sum((head(x, 0) for x in qs), []) + sum((head(x, h * d) for x in kvs), [])
        want += sum((head(x, (h + kvh) * d) for x in kvs), [])
        assert b == want, sh

    # wo reads the same heads as the q columns, slot by slot
    rows = lay.wo_rows(cfg)
    assert rows.tolist() == sum((head(x, 0) for x in lay.q_slots), [])
    assert sorted(rows[rows >= 0].tolist()) == list(range(h * d))

    for size in {cfg.intermediate_size, 1, s, 2 * s + 1, 37}:
        gu, down = lay.gate_up_columns(size), lay.down_rows(size)
        padded = -(-size // s) * s
        assert len(gu) == 2 * padded and len(down) == padded
        assert sorted(gu[gu >= 0].tolist()) == list(range(2 * size))
        assert sorted(down[down >= 0].tolist()) == list(range(size))
        # shard blocks [gate | up]: unit k of shard sh reads gate g, up size + g and down row g
        per = padded // s
        blocks = gu.reshape(s, 2, per)
        gate, up = blocks[:, 0].reshape(-1), blocks[:, 1].reshape(-1)
        assert np.array_equal(gate, down)
        assert np.array_equal(up, np.where(gate >= 0, gate + size, -1))
        assert (gate < size).all()


@pytest.mark.parametrize("heads,kv_heads,shards", [(h, k, s) for (h, k), s in COMBOS])
def test_layout_properties(heads, kv_heads, shards):
    check_layout(heads, kv_heads, shards)


@settings(max_examples=200, deadline=None)
@given(kv_heads=st.integers(1, 16), group=st.integers(1, 8), shards=st.integers(1, 16))
def test_layout_properties_for_any_head_counts(kv_heads, group, shards):
    check_layout(kv_heads * group, kv_heads, shards)


def test_layout_examples_follow_the_documented_rules():
    """Three worked examples: padding, replication (vLLM's rule) and the plain split."""
    # 6 heads / 3 KV heads over 2 shards: KV heads padded to 4, two per shard
    lay = TPLayout.of(model(6, 3), 2)
    assert lay.kv_slots == (0, 1, 2, -1)
    assert lay.q_slots == (0, 1, 2, 3, 4, 5, -1, -1)
    # 4 heads / 1 KV head over 4 shards: the KV head on every shard, one query head each
    lay = TPLayout.of(model(4, 1), 4)
    assert lay.kv_slots == (0, 0, 0, 0) and lay.q_slots == (0, 1, 2, 3)
    # 8 heads / 4 KV heads over 4 shards: a plain split, nothing padded
    lay = TPLayout.of(model(8, 4), 4)
    assert lay.kv_slots == (0, 1, 2, 3) and lay.q_slots == tuple(range(8))
    assert np.array_equal(lay.wo_rows(model(8, 4)), np.arange(8 * 4))


def test_a_layout_that_changes_nothing_needs_no_relayout():
    cfg = model(8, 4, intermediate=12)
    assert mesh.family_relayouts(cfg, TPLayout.of(cfg, 1)) == {}
    # at 4 shards only the fused projections (and the Q/K/V biases, for a model that has them) are
    # reordered: wo's and w_down's rows stay in place
    assert set(mesh.family_relayouts(cfg, TPLayout.of(cfg, 4))) == {("wqkv", 2), ("w_gate_up", 2)}
    biased = dataclasses.replace(cfg, attention_bias=True)
    assert set(mesh.family_relayouts(biased, TPLayout.of(biased, 4))) == {("wqkv", 2), ("bqkv", 1), ("w_gate_up", 2)}


# ---------------------------------------------------------------------------
# a re-laid-out tree computes the same function (one device, no mesh)


def random_params(cfg: ModelConfig, seed: int) -> dict:
    """Every leaf random (biases and norms too, so padding and reordering of each is seen)."""
    rng = np.random.default_rng(seed)
    specs = get_family(cfg.architecture).param_specs(cfg, jnp.float32)

    def leaf(spec):
        x = rng.standard_normal(spec.shape).astype(np.float32)
        return 1.0 + 0.1 * x if spec.init in ("ones", "zeros") and len(spec.shape) == 1 else 0.3 * x

    return jax.tree.map(leaf, specs, is_leaf=is_spec)


def relayout_with_numpy(params: dict, cfg: ModelConfig, lay: TPLayout) -> dict:
    """The layout applied on the host: take each re-laid-out leaf's index map, zeros at -1."""
    maps = mesh.family_relayouts(cfg, lay)

    def apply(path, x):
        m = maps.get((mesh.leaf_name(path), x.ndim))
        if m is None:
            return x
        axis, idx = m
        taken = np.take(x, np.maximum(idx, 0), axis=axis)
        keep = np.expand_dims(idx >= 0, [a for a in range(x.ndim) if a != axis])
        return np.where(keep, taken, np.zeros((), x.dtype))

    return jax.tree_util.tree_map_with_path(apply, params)


PAGE = 4


def forward_logits(cfg: ModelConfig, params: dict, tokens: list, chunk: int) -> np.ndarray:
    """Logits at every position, `chunk` tokens at a time through a paged cache (scattered pages)."""
    prepare_cpu_kernel()  # the attention the engine runs on this machine (or pure JAX, with it off)
    fam = get_family(cfg.architecture)
    n = len(tokens)
    total = -(-n // chunk) * chunk
    pages = -(-total // PAGE)
    eng = EngineConfig(page_size=PAGE, num_pages=pages + 2, dtype="float32")
    cache = kv_cache.init_cache(cfg, eng)
    table = np.arange(pages + 1, 1, -1, dtype=np.int32)[None]
    ids = np.zeros(total, np.int32)
    ids[:n] = tokens
    positions = np.where(np.arange(total) < n, np.arange(total), -1).astype(np.int32)
    step = jax.jit(lambda p, t, c, a: (lambda h, c: (fam.logits(p, cfg, h), c))(*fam.forward(p, cfg, t, c, a)))
    out = []
    for start in range(0, total, chunk):
        pos = positions[start : start + chunk][None]
        slots = np.where(pos >= 0, kv_cache.slots_for(table, np.maximum(pos, 0), PAGE), 0).astype(np.int32)
        attn = AttentionMetadata(pos, slots, table, np.array([min(n, start + chunk)], np.int32))
        lg, cache = step(params, jnp.asarray(ids[start : start + chunk][None]), cache, attn)
        out.append(np.asarray(lg[0]))
    return np.concatenate(out)[:n]


# each case pads or replicates something: KV heads, query heads, the intermediate size, experts'
RELAYOUT_CASES = {
    "6h3kv-2shards-kv-padded": (model(6, 3, head_dim=16, intermediate=50, vocab_size=50, num_layers=2), 2),
    "6h3kv-4shards-kv-replicated": (model(6, 3, head_dim=16, intermediate=50, vocab_size=50, num_layers=2), 4),
    "4h1kv-3shards-mqa": (model(4, 1, head_dim=16, intermediate=50, vocab_size=50, num_layers=2), 3),
    "8h4kv-4shards-split": (model(8, 4, head_dim=16, intermediate=48, vocab_size=50, num_layers=2), 4),
    "qwen3moe-bias-qknorm-5shards": (
        model(4, 2, head_dim=16, intermediate=24, vocab_size=50, num_layers=2, architecture="qwen3_moe",
              attention_bias=True, qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=10,
              dense_layers=(1,), tie_word_embeddings=True),
        5,
    ),
}


@pytest.mark.parametrize("case", list(RELAYOUT_CASES))
def test_relaid_out_tree_computes_the_same_logits_on_one_device(case):
    cfg, shards = RELAYOUT_CASES[case]
    lay = TPLayout.of(cfg, shards)
    params = random_params(cfg, seed=shards)
    laid = relayout_with_numpy(params, cfg, lay)
    big = lay.config(cfg)
    assert big != cfg and big.tp_shards == shards
    # the re-laid-out tree has exactly the laid-out config's shapes
    want_shapes = jax.tree.map(lambda s: s.shape, get_family(cfg.architecture).param_specs(big, jnp.float32),
                               is_leaf=is_spec)
    assert jax.tree.map(np.shape, laid) == want_shapes
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 19).tolist()
    want = forward_logits(cfg, params, tokens, chunk=8)
    got = forward_logits(big, laid, tokens, chunk=8)
    assert np.abs(want).max() > 1.0  # logits that say something
    err = np.abs(got - want).max()
    assert err < 1e-5, f"{case}: max |logit difference| {err:.2e}"


def test_a_layout_read_the_plain_way_is_a_different_function():
    """The laid-out config's shard-major split matters: the laid-out tree read with tp_shards = 1
    (plain [q | k | v] columns) computes something else, so the test above can fail."""
    cfg, shards = RELAYOUT_CASES["8h4kv-4shards-split"]
    lay = TPLayout.of(cfg, shards)
    params = random_params(cfg, seed=1)
    laid = relayout_with_numpy(params, cfg, lay)
    tokens = list(range(1, 12))
    want = forward_logits(cfg, params, tokens, chunk=8)
    plain = dataclasses.replace(lay.config(cfg), tp_shards=1)
    assert np.abs(forward_logits(plain, laid, tokens, chunk=8) - want).max() > 1e-2


# ---------------------------------------------------------------------------
# the mesh


def test_make_mesh_names_the_sizes_and_the_cpu_flag_when_devices_are_short():
    n = jax.device_count()
    with pytest.raises(ValueError) as e:
        mesh.make_mesh(EngineConfig(tensor_parallel_size=n + 1))
    msg = str(e.value)
    assert f"tensor_parallel_size {n + 1} needs {n + 1} devices; this process sees {n}" in msg
    if jax.devices()[0].platform == "cpu":
        assert "XLA_FLAGS=--xla_force_host_platform_device_count=N" in msg
    # the library refuses it the same way, before anything is placed or compiled
    with pytest.raises(ValueError, match=f"tensor_parallel_size {n + 1} needs {n + 1} devices"):
        jaxinfer.LLM.from_params(TINY, {}, engine_config=TINY_ENGINE.replace(tensor_parallel_size=n + 1))


def test_tensor_parallel_size_below_one_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1, got 0"):
        EngineConfig(tensor_parallel_size=0)


def test_one_device_mesh_replicates_everything_and_places_the_plain_tree():
    m = mesh.make_mesh(EngineConfig())
    assert dict(m.shape) == {"dp": 1, "tp": 1} and mesh.tp_size() == 1
    cfg = model(6, 3, head_dim=16, intermediate=50, vocab_size=50)
    params = random_params(cfg, seed=0)
    placed = mesh.place_params(params, cfg, TPLayout.of(cfg, 1), m)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(placed)):
        assert isinstance(b, jax.Array) and np.array_equal(a, np.asarray(b))
    (dev, total), = mesh.per_device_bytes(placed).items()
    assert total == sum(x.nbytes for x in jax.tree.leaves(params))
    with jax.set_mesh(m):
        assert mesh.tp_size() == 1
