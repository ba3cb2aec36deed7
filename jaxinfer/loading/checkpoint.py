"""The engine's own model format: the parameter pytree saved with orbax, beside config and tokenizer.

A converted model is a directory::

    jaxinfer_model.json      the manifest: format version, ModelConfig, GenerationDefaults,
                             the parameters' dtype and leaf shapes, the tokenizer's facts,
                             and (for a conversion) the source it came from
    params/                  an orbax-checkpoint PyTree checkpoint of the family's tree
                             (`family.param_specs`), uncompressed
    tokenizer.json           (or tokenizer.model for SentencePiece), tokenizer_config.json,
    generation_config.json   a Hugging Face tokenizer directory `Tokenizer.from_dir` reads

`save_model` writes one from research code's own parameters, ``jaxinfer convert``
and the model cache (`jaxinfer.loading.model_cache`) write one from a GGUF file or a
Hugging Face directory, and `load_converted` (what ``LLM(dir)`` uses) restores
it. A directory is written under a temporary name beside its destination and
renamed into place, with the manifest written last, so a reader never sees
half of one. Restoring checks the manifest's version, the leaf shapes and
dtypes against the family's parameter specs, and the tokenizer; any problem
is a `CheckpointError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer._version import __version__
from jaxinfer.config import GenerationDefaults, ModelConfig
from jaxinfer.loading.weights import CONVERTED_MANIFEST
from jaxinfer.models import get_family
from jaxinfer.ops.quant import is_quantized
from jaxinfer.ops.spec import abstract, check_tree, is_spec
from jaxinfer.text.tokenizer import Tokenizer

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointError",
    "ConvertedModel",
    "is_converted_dir",
    "load_converted",
    "load_converted_tokenizer",
    "read_manifest",
    "save_model",
    "write_model_dir",
]

# Bump when the directory layout, the manifest or a family's parameter tree changes:
# cache entries of another version are rebuilt, converted directories are refused.
# 2: the typed parameter tree (`jaxinfer.models.Params` of `Layer` blocks; 1 was nested dicts).
FORMAT_VERSION = 2
FORMAT_NAME = "jaxinfer-model"
MANIFEST = CONVERTED_MANIFEST
PARAMS_DIR = "params"
DTYPES = ("float32", "bfloat16", "float16")


class CheckpointError(ValueError):
    """A converted model directory is missing, incomplete, corrupt or of another format version."""


@dataclass
class ConvertedModel:
    """A converted model in memory: what `LLM` needs to serve it."""

    config: ModelConfig
    params: Any
    generation: GenerationDefaults
    tokenizer: Any  # jaxinfer.text.tokenizer.Tokenizer or None
    manifest: dict
    path: Optional[Path] = None


def dtype_name(dtype: Any) -> str:
    """The name of a float dtype the engine stores weights in (`DTYPES`); ValueError for another."""
    name = jnp.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return name


def _config_from_dict(d: dict) -> ModelConfig:
    return ModelConfig(**d)  # ModelConfig rebuilds RopeScaling and the tuples from JSON's dicts and lists


def _generation_from_dict(d: dict) -> GenerationDefaults:
    d = dict(d)
    d["eos_token_ids"] = tuple(int(i) for i in d.get("eos_token_ids") or ())
    return GenerationDefaults(**d)


def _leaf_shapes(specs) -> dict[str, list[int]]:
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    return {jax.tree_util.keystr(path): list(s.shape) for path, s in flat}


def _family(cfg: ModelConfig):
    return get_family(cfg.architecture)


def _orbax():
    # Lazy: orbax.checkpoint (with tensorstore) takes seconds to import, and only saving or
    # restoring a converted model needs it (a model built from params or a source never does).
    import orbax.checkpoint as ocp

    return ocp


def _handler():
    # Uncompressed: bfloat16/float32 weights shrink ~20% with zstd, and restoring pays for it.
    return _orbax().PyTreeCheckpointHandler(use_compression=False)


# --------------------------------------------------------------------------- #
# Writing
# --------------------------------------------------------------------------- #


def _prepare_params(cfg: ModelConfig, params: Any, dtype: Optional[str]) -> tuple[Any, str, Any]:
    """``params`` checked against the family's specs and cast to one dtype; (params, dtype, specs).

    Quantized weights (`jaxinfer.ops.quant.QuantizedWeight`) keep their integer and float16 leaves;
    ``dtype`` is that of the float leaves."""
    leaves = [x for x in jax.tree.leaves(params, is_leaf=is_quantized) if not is_quantized(x)]
    if dtype is None:
        kinds = sorted({jnp.dtype(x.dtype).name for x in leaves})
        if len(kinds) != 1:
            raise ValueError(f"the parameters mix dtypes {kinds}; pass dtype= to save them in one")
        dtype = kinds[0]
    dtype = dtype_name(dtype)
    specs = _family(cfg).param_specs(cfg, jnp.dtype(dtype))
    want, got = jax.tree.structure(specs, is_leaf=is_spec), jax.tree.structure(params)
    if want != got:
        raise ValueError(
            f"the parameter tree does not have the structure of a {cfg.architecture!r} model "
            f"with this config:\n  expected {want}\n  got      {got}"
        )
    check_tree(specs, params)
    params = jax.tree.map(lambda s, x: x if jnp.dtype(x.dtype) == jnp.dtype(s.dtype) else x.astype(s.dtype),
                          specs, params, is_leaf=is_spec)
    return params, dtype, specs


def write_model_dir(
    path: Union[str, os.PathLike],
    model_config: ModelConfig,
    params: Any,
    tokenizer: Any = None,
    generation: Optional[GenerationDefaults] = None,
    *,
    dtype: Any = None,
    source: Optional[dict] = None,
) -> dict:
    """Write a converted model into ``path`` (an empty or absent directory); returns the manifest.

    Not atomic by itself: `save_model` and the model cache write into a
    temporary directory and rename it. The manifest is written last, so a
    directory without one is incomplete.
    """
    path = Path(path).expanduser().absolute()  # orbax takes absolute paths only
    path.mkdir(parents=True, exist_ok=True)
    params, dtype, specs = _prepare_params(model_config, params, None if dtype is None else dtype_name(dtype))
    generation = generation or GenerationDefaults()
    ocp = _orbax()
    with ocp.Checkpointer(_handler()) as ckptr:
        ckptr.save(path / PARAMS_DIR, args=ocp.args.PyTreeSave(params))
    facts = None
    if tokenizer is not None:
        tokenizer.save(path)
        facts = tokenizer.facts()
    gen_path = path / "generation_config.json"
    gen_file = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens"):
        value = getattr(generation, name)
        if value is not None:
            gen_file[name] = value
    eos = set(gen_file.get("eos_token_id") or []) | set(generation.eos_token_ids)
    if eos:
        gen_file["eos_token_id"] = sorted(eos)
    gen_path.write_text(json.dumps(gen_file, indent=2) + "\n")
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "jaxinfer_version": __version__,
        "architecture": model_config.architecture,
        "model_config": dataclasses.asdict(model_config),
        "generation": {**dataclasses.asdict(generation), "eos_token_ids": list(generation.eos_token_ids)},
        "dtype": dtype,
        "params": {"path": PARAMS_DIR, "leaf_shapes": _leaf_shapes(specs), "files": _file_sizes(path / PARAMS_DIR)},
        "tokenizer": facts,
        "source": source,
    }
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path / MANIFEST)
    return manifest


def _file_sizes(root: Path) -> dict[str, int]:
    """Every file under ``root`` with its size: restoring checks them before orbax reads anything."""
    return {f.relative_to(root).as_posix(): f.stat().st_size for f in sorted(root.rglob("*")) if f.is_file()}


def _check_files(root: Path, files: Any) -> None:
    if not isinstance(files, dict):
        raise CheckpointError(f"{root.parent / MANIFEST}: lacks the list of parameter files")
    for name, size in files.items():
        try:
            actual = (root / name).stat().st_size
        except OSError:
            raise CheckpointError(f"{root}: {name} is missing") from None
        if actual != size:
            raise CheckpointError(f"{root}: {name} has {actual} bytes, {size} were written (truncated?)")


def temp_dir_beside(dst: Path) -> Path:
    """A new empty directory in ``dst``'s parent (the same file system, so a rename publishes it)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = dst.parent / f".tmp-{dst.name}-{uuid.uuid4().hex[:12]}"
        try:
            tmp.mkdir()  # with the umask's permissions, unlike tempfile.mkdtemp's 0700
            return tmp
        except FileExistsError:
            continue


def remove_dir(path: Path) -> None:
    """Remove a directory tree; it is first renamed away so nobody sees it half-deleted."""
    trash = path.parent / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def save_model(
    dst: Union[str, os.PathLike],
    model_config: ModelConfig,
    params: Any,
    tokenizer: Any = None,
    generation: Optional[GenerationDefaults] = None,
    *,
    dtype: Any = None,
    overwrite: bool = False,
) -> Path:
    """Save a parameter tree (with its config, tokenizer and defaults) as a directory ``LLM(dst)`` serves.

    ``params`` is the family's tree (`jaxinfer.models.decoder.param_specs`
    describes it), as research code trains it; its leaves may be jax or numpy
    arrays, all of one dtype unless ``dtype`` says which to save them in.
    ``tokenizer``: a `jaxinfer.text.tokenizer.Tokenizer` (e.g. ``llm.tokenizer``),
    or None for a model served with token-id prompts. The directory is
    written beside ``dst`` and renamed into place; an existing ``dst`` is an
    error unless ``overwrite``. Returns the directory's path.
    """
    dst = Path(dst).expanduser().absolute()
    if dst.exists() and not overwrite and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} already exists; pass overwrite=True (or --force) to replace it")
    tmp = temp_dir_beside(dst)
    try:
        write_model_dir(tmp, model_config, params, tokenizer, generation, dtype=dtype)
        if dst.exists():
            remove_dir(dst)
        os.rename(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


# --------------------------------------------------------------------------- #
# Reading
# --------------------------------------------------------------------------- #


def is_converted_dir(path: Union[str, os.PathLike]) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path: Union[str, os.PathLike]) -> dict:
    """The manifest of a converted directory, checked for format and version; CheckpointError if not."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MANIFEST} (not a converted model, or an incomplete one)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / MANIFEST}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path / MANIFEST}: not a {FORMAT_NAME} manifest")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: converted with format version {version}, this jaxinfer ({__version__}) reads "
            f"version {FORMAT_VERSION}; convert the model again"
        )
    for key in ("model_config", "generation", "dtype", "params"):
        if key not in manifest:
            raise CheckpointError(f"{path / MANIFEST}: lacks {key!r}")
    return manifest


def _restore_params(path: Path, specs, sharding: Any = None) -> Any:
    """The parameter tree stored at ``path``, as jax arrays (on ``sharding`` or the first device)."""
    ocp = _orbax()
    target = abstract(specs)
    if sharding is None and jax.devices()[0].platform == "cpu":
        # One CPU device: every leaf into host memory, then placed leaf by leaf, each host copy dropped once
        # placed, so the peak stays about one copy of the weights (measured on SmolLM2-135M, warm page cache:
        # ~0.3 s against ~0.5 s for orbax placing each leaf itself).
        leaves, treedef = jax.tree.flatten(_restore_params(path, specs, jax.tree.map(lambda _: None, target)))
        device = jax.devices()[0]
        for i, leaf in enumerate(leaves):
            leaves[i] = jax.device_put(leaf, device)
            del leaf
        return jax.tree.unflatten(treedef, leaves)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(sharding, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: sharding, target)
    else:
        shardings = sharding
    # No global_shape: orbax would pad or cut a stored array to fit it. We check shapes after.
    # A leaf whose sharding is None is restored into host memory (numpy).
    def restore_args(_, sh):
        if sh is None:
            return ocp.RestoreArgs(restore_type=np.ndarray)
        return ocp.ArrayRestoreArgs(restore_type=jax.Array, sharding=sh)

    leaves, treedef = jax.tree.flatten(target)
    per_leaf = treedef.flatten_up_to(shardings)  # None: a leaf for host memory
    args = jax.tree.unflatten(treedef, [restore_args(t, sh) for t, sh in zip(leaves, per_leaf)])
    with ocp.Checkpointer(_handler()) as ckptr:
        params = ckptr.restore(path, args=ocp.args.PyTreeRestore(item=target, restore_args=args))
    return jax.tree.unflatten(jax.tree.structure(target), jax.tree.leaves(params))


def load_converted_tokenizer(path: Union[str, os.PathLike], manifest: Optional[dict] = None,
                             source: Optional[str] = None) -> Any:
    """The tokenizer of a converted directory (None if it was saved without one)."""
    path = Path(path)
    manifest = manifest if manifest is not None else read_manifest(path)
    facts = manifest.get("tokenizer")
    if not facts:
        return None
    try:
        tok = Tokenizer.from_dir(path)
    except Exception as e:  # a missing or damaged tokenizer file
        raise CheckpointError(f"{path}: tokenizer unreadable ({type(e).__name__}: {e})") from None
    if tok.vocab_size != facts.get("vocab_size"):
        raise CheckpointError(f"{path}: tokenizer has {tok.vocab_size} tokens, the manifest says {facts.get('vocab_size')}")
    return tok.with_facts(facts, source=source)


def load_converted(
    path: Union[str, os.PathLike],
    *,
    dtype: Any = None,
    with_tokenizer: bool = True,
    sharding: Any = None,
    manifest: Optional[dict] = None,
) -> ConvertedModel:
    """Restore a converted directory: config, parameters (as ``dtype``, default as saved), tokenizer.

    ``sharding``: one `jax.sharding.Sharding` for every leaf, a tree of them shaped
    like the parameters (None: that leaf into host memory), or a function of the
    `ModelConfig` giving either (a mesh's
    `jaxinfer.ops.mesh.load_shardings`: each device reads only its shard); default: the
    first device. Raises
    `CheckpointError` for anything missing, corrupt or mismatched.
    """
    path = Path(path).expanduser().absolute()  # orbax takes absolute paths only
    manifest = manifest if manifest is not None else read_manifest(path)
    try:
        cfg = _config_from_dict(manifest["model_config"])
        generation = _generation_from_dict(manifest["generation"])
        saved = dtype_name(manifest["dtype"])
        specs = _family(cfg).param_specs(cfg, jnp.dtype(saved))
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path / MANIFEST}: invalid ({type(e).__name__}: {e})") from None
    if manifest["params"].get("leaf_shapes") != _leaf_shapes(specs):
        raise CheckpointError(f"{path}: the manifest's parameter shapes do not match the {cfg.architecture} specs")
    params_dir = path / manifest["params"].get("path", PARAMS_DIR)
    if not params_dir.is_dir():
        raise CheckpointError(f"{path}: {params_dir.name}/ is missing")
    _check_files(params_dir, manifest["params"].get("files"))
    tokenizer_future = None
    if with_tokenizer:  # built on a thread while orbax reads (tensorstore does its I/O off the GIL)
        src = (manifest.get("source") or {}).get("path")
        tokenizer_future = _executor().submit(load_converted_tokenizer, path, manifest, src)
    failure = None
    try:
        params = _restore_params(params_dir, specs, sharding(cfg) if callable(sharding) else sharding)
    except Exception as e:  # orbax and tensorstore raise many kinds for missing or damaged files
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        failure = f"{type(e).__name__}: {first}"
    if failure is not None:  # raised here, so orbax's traceback (and its pending reads) is not kept alive
        if tokenizer_future is not None:
            tokenizer_future.cancel()
        raise CheckpointError(f"{path}: cannot restore the parameters ({failure})")
    spec_leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    for (key, s), x in zip(spec_leaves, jax.tree.leaves(params)):
        if tuple(x.shape) != tuple(s.shape) or jnp.dtype(x.dtype) != jnp.dtype(s.dtype):
            raise CheckpointError(
                f"{path}: parameter {jax.tree_util.keystr(key)} is {x.dtype}{list(x.shape)}, "
                f"expected {jnp.dtype(s.dtype).name}{list(s.shape)}"
            )
    if dtype is not None and dtype_name(dtype) != saved:  # the float leaves; quantized weights stay
        want = jnp.dtype(dtype_name(dtype))
        params = jax.tree.map(lambda x: x if is_quantized(x) else x.astype(want), params, is_leaf=is_quantized)
    tokenizer = tokenizer_future.result() if tokenizer_future is not None else None
    return ConvertedModel(cfg, params, generation, tokenizer, manifest, path)


_pool = None


def _executor():
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxinfer-restore")
    return _pool
