"""The weights table's views agree: for every family, the parameter specs, the Hugging Face tensors,
the GGUF names, the tensor-parallel relayouts and the quantization rules derived from
`jaxinfer.models.weights_table` describe the same leaves, each once."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.loading import gguf_models as G
from jaxinfer.models import config_from_hf, get_family
from jaxinfer.models import weights_table as T
from jaxinfer.ops import mesh, quant
from jaxinfer.ops.mesh import TPLayout
from jaxinfer.ops.spec import check_tree, is_spec

FAMILY_DIR = Path(__file__).parent / "fixtures" / "families"
FAMILIES = sorted(p.name for p in FAMILY_DIR.iterdir() if (p / "config.json").is_file())
# the llama.cpp architecture that stores each family (Mixtral and Mistral are llama.cpp's llama)
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "qwen3_moe": "qwen3moe", "gemma3": "gemma3", "gemma3_text": "gemma3", "deepseek_v2": "deepseek2",
             "deepseek_v3": "deepseek2"}


def config(family: str):
    return config_from_hf(json.loads((FAMILY_DIR / family / "config.json").read_text()), family)


def leaf_sources(cfg) -> dict[str, list[str]]:
    """{leaf path: the canonical HF tensors the table says it is made of}."""
    out = {}
    block = {id(d): name for name, table in (("attention", T.ATTENTION), ("attention", T.LATENT_ATTENTION),
                                             ("norms", T.NORMS), ("mlp", T.DENSE_MLP), ("mlp", T.MOE)) for d in table}
    for d in T.model_descs(cfg):
        out[f".{d.name}"] = d.hf_names("")
    for li in range(cfg.num_layers):
        for d in T.layer_descs(cfg, li):
            experts = range(cfg.num_experts) if d.kind == "experts" else [None]
            out[f".layers[{li}].{block[id(d)]}.{d.name}"] = [
                n for e in experts for n in d.hf_names(f"model.layers.{li}.", e)]
    return out


def test_the_tree_types_have_a_field_per_table_weight_and_no_weight_is_named_like_a_quantized_field():
    for cls, table in ((T.Attention, T.ATTENTION), (T.LatentAttention, T.LATENT_ATTENTION), (T.Norms, T.NORMS),
                       (T.DenseMLP, T.DENSE_MLP), (T.RoutedMLP, T.MOE)):
        assert [f.name for f in dataclasses.fields(cls)] == list(dict.fromkeys(d.name for d in table))
    assert {f.name for f in dataclasses.fields(T.Params)} - {"layers"} == {d.name for d in T.MODEL}
    # `jaxinfer.ops.mesh` tells a quantized weight's fields from weights by these names
    assert not {d.name for d in T.ALL} & {f.name for f in dataclasses.fields(quant.QuantizedWeight)}


@pytest.fixture(scope="module", params=FAMILIES)
def cfg(request):
    return config(request.param)


def test_every_spec_leaf_has_its_own_hf_sources(cfg):
    specs = T.param_specs(cfg)
    leaves = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]}
    sources = leaf_sources(cfg)
    assert set(sources) == leaves
    hf = T.hf_tensor_shapes(cfg)
    owners = Counter(n for names in sources.values() for n in names)
    assert set(owners) == set(hf) and max(owners.values()) == 1  # each HF tensor belongs to one leaf


def test_hf_tensors_convert_to_the_specs_shapes(cfg):
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in T.hf_tensor_shapes(cfg).items()}
    params = T.params_from_hf(tensors, cfg)
    check_tree(T.param_specs(cfg), params)
    # a fused leaf is its sources side by side: q | k | v columns, gate | up
    attention = params.layers[0].attention
    if cfg.latent:  # the latent's up-projection head by head: [heads, nope key rows | value rows, latent]
        kv_b = tensors["model.layers.0.self_attn.kv_b_proj.weight"]
        rows = cfg.qk_nope_head_dim + cfg.head_dim
        np.testing.assert_array_equal(attention.wkv_b[1], kv_b[rows : 2 * rows])
        return
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(attention.wqkv[:, : q.shape[0]], q.T)


def test_every_hf_tensor_has_one_gguf_name_that_maps_back(cfg):
    arch = G.ARCHITECTURES[GGUF_ARCH[cfg.architecture]]
    names = arch.names
    hf = T.hf_tensor_shapes(cfg)
    found = Counter()
    for gname, g in names.items():
        if g.layer:
            for li in range(cfg.num_layers):
                for suffix in ("weight", "bias"):
                    for n in G.canonical_names(arch, f"blk.{li}.{gname}.{suffix}", cfg.num_experts) or []:
                        if n in hf:
                            found[n] += 1
        else:
            found.update(n for n in G.canonical_names(arch, gname, cfg.num_experts) or [] if n in hf)
    assert set(found) == set(hf), sorted(set(hf) - set(found))[:5]
    assert max(found.values()) == 1


def test_relayouts_name_existing_leaves_with_maps_of_their_laid_out_size(cfg):
    by_name = {(d.name, len(d.shape(cfg))) for d in T.ALL}
    for shards in (2, 3):
        lay = TPLayout.of(cfg, shards)
        maps = mesh.family_relayouts(cfg, lay)
        assert set(maps) <= by_name
        big = T.param_specs(lay.config(cfg))
        for path, s in jax.tree_util.tree_flatten_with_path(big, is_leaf=is_spec)[0]:
            m = maps.get((mesh.leaf_name(path), len(s.shape)))
            if m is not None:
                axis, idx = m
                assert len(idx) == s.shape[axis], (path, axis)


@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_quantization_roles_are_the_quantized_leaves(cfg, scheme):
    import dataclasses

    float_specs = T.param_specs(cfg)
    q_specs = T.param_specs(dataclasses.replace(cfg, quant=scheme))
    flat_f = jax.tree_util.tree_flatten_with_path(float_specs, is_leaf=is_spec)[0]
    flat_q = jax.tree.leaves(q_specs, is_leaf=lambda x: is_spec(x) or quant.is_quantized(x))
    layers, head = quant.Scheme.pair(scheme)
    for (path, f), q in zip(flat_f, flat_q, strict=True):
        k = f.shape[1] if f.quant == "embed" else f.shape[0]
        fits = (head if f.quant in ("embed", "head") else layers).fits(k)
        assert quant.is_quantized(q) == (bool(f.quant) and fits), jax.tree_util.keystr(path)
    assert set(T.head_tensors()) == set(quant.HEAD_TENSORS)


def test_a_quantized_conversion_and_quantize_params_agree():
    import dataclasses

    cfg = config("qwen3_moe")
    rng = np.random.default_rng(1)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in T.hf_tensor_shapes(cfg).items()}
    qcfg, qp = quant.quantize_params(T.params_from_hf(tensors, cfg), cfg, "int8")
    conv = T.params_from_hf(tensors, dataclasses.replace(cfg, quant=qcfg.quant))
    a, b = jax.tree.leaves(qp), jax.tree.leaves(conv)
    assert jax.tree.structure(qp) == jax.tree.structure(conv)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_registry_gives_ops_the_families_specs(cfg):
    from jaxinfer.ops.spec import family_descs, model_specs

    assert family_descs(cfg.architecture) == T.ALL
    got = jax.tree.map(lambda s: (s.shape, s.axes), model_specs(cfg, jnp.float32), is_leaf=is_spec)
    want = jax.tree.map(lambda s: (s.shape, s.axes), get_family(cfg.architecture).param_specs(cfg), is_leaf=is_spec)
    assert got == want
