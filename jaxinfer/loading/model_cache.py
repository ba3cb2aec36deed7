"""The converted-model cache: convert a GGUF file or a Hugging Face directory once, restore it after.

The first load of a source parses it, dequantizes its tensors, builds the
family's parameter tree in the engine's dtype and its tokenizer, and saves
all of it as a converted model (`jaxinfer.loading.checkpoint`: orbax parameters,
config, tokenizer). Later loads restore that instead: no GGUF parse, no
dequantization.

* **Where**: ``$JAXINFER_MODEL_CACHE`` if set, else
  ``$XDG_CACHE_HOME/jaxinfer/models``, else ``~/.cache/jaxinfer/models``; one
  directory per entry, ``<name>-<key>``.
* **Key**: the source's identity (its resolved path, size and mtime_ns; for a
  Hugging Face directory every file's name, size and mtime_ns), the engine
  dtype, `checkpoint.FORMAT_VERSION` and `READER_VERSION`. Touching or replacing the source
  makes a new entry; the old one is removed once the new one is written.
* **Off**: ``JAXINFER_MODEL_CACHE=0`` (or off/false/no), ``LLM(...,
  model_cache=False)``, ``--no-model-cache``.
* **Safe**: an entry is written into a temporary directory beside it and
  renamed into place, so two processes converting at once publish one whole
  entry (the loser keeps its own in-memory result and deletes its copy). An
  entry that cannot be restored (missing or truncated files, a manifest of
  another version, shapes that do not match the specs, an identity that does
  not match) is removed and rebuilt with one warning; failing to write an
  entry is a warning too, never an error.

`stats` counts what happened in this process (conversions, restores,
rebuilds), so tests can check a load used the cache without timing it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.loading import checkpoint
from jaxinfer import progress
from jaxinfer.loading.checkpoint import DTYPES, dtype_name
from jaxinfer.env import cache_root, switched_off
from jaxinfer.config import GenerationDefaults, ModelConfig
from jaxinfer.loading.weights import ModelSource, load_model, open_gguf
from jaxinfer.models import get_family
from jaxinfer.ops import quant
from jaxinfer.text.tokenizer import Tokenizer, load_tokenizer as tokenizer_from_source

__all__ = [
    "ENV",
    "LoadedModel",
    "cache_dir",
    "cache_key",
    "convert",
    "entry_path",
    "load",
    "load_tokenizer",
    "source_identity",
    "stats",
]

log = logging.getLogger("jaxinfer")

ENV = "JAXINFER_MODEL_CACHE"
_STALE_TMP_S = 3600.0  # a temporary directory this old was left by a process that died

# What this process did: "converted", "restored", "rebuilt" (a bad entry replaced),
# "saved", "lost_race" (another process published the entry first), "save_failed".
stats: collections.Counter = collections.Counter()


@dataclass
class LoadedModel:
    """A model ready for the engine: config, parameter tree (host or device arrays), defaults, tokenizer."""

    config: ModelConfig
    params: Any
    generation: GenerationDefaults
    tokenizer: Any
    source: ModelSource
    cache_path: Optional[Path] = None  # the entry restored or written, if any
    from_cache: bool = False

    def take_params(self) -> Any:
        """The parameter tree, handed over: this object lets go of it (so it can be freed once placed)."""
        params, self.params = self.params, None
        return params


# --------------------------------------------------------------------------- #
# Where and under which key
# --------------------------------------------------------------------------- #


def cache_dir() -> Optional[Path]:
    """The cache's root directory, or None when ``$JAXINFER_MODEL_CACHE`` turns it off."""
    value = os.environ.get(ENV, "").strip()
    if switched_off(value):
        return None
    if value:
        return Path(value).expanduser()
    return Path(cache_root()) / "models"


def source_identity(source: ModelSource) -> dict:
    """What names a source's content cheaply: resolved path, and each file's size and mtime_ns."""
    path = Path(source.path).resolve()
    if source.format == "gguf":
        st = path.stat()
        return {"format": "gguf", "path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if source.format == "hf":
        files = []
        for f in sorted(path.iterdir()):
            if f.name.startswith(".") or not f.is_file():
                continue
            st = f.stat()  # follows Hub snapshot symlinks to their blobs
            files.append([f.name, st.st_size, st.st_mtime_ns])
        return {"format": "hf", "path": str(path), "files": files}
    raise ValueError(f"a {source.format!r} source is not cached (it is already converted)")


# What a conversion understands of a source. Raised when reading a source can give a different
# model than before: 2 = model families (a Mistral sliding window, say, was read as full attention).
READER_VERSION = 2


def cache_key(identity: dict, dtype: Any, quantization: Optional[str] = None) -> str:
    key = {"source": identity, "dtype": dtype_name(dtype), "format_version": checkpoint.FORMAT_VERSION,
           "reader_version": READER_VERSION}
    if quantization:
        key["quantization"] = quantization
    blob = json.dumps(key, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _label(identity: dict) -> str:
    """A readable name for an entry: the file or directory name (a Hub snapshot's repo name)."""
    path = Path(identity["path"])
    name = path.parent.parent.name if path.parent.name == "snapshots" else path.name
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._-")[:80] or "model"


def entry_path(source: ModelSource, dtype: Any, root: Optional[Path] = None,
               identity: Optional[dict] = None, quantization: Optional[str] = None) -> Optional[Path]:
    """The cache entry of ``source`` in ``dtype`` and ``quantization`` (it may not exist yet); None if
    the cache is off."""
    root = root if root is not None else cache_dir()
    if root is None:
        return None
    identity = identity if identity is not None else source_identity(source)
    return root / f"{_label(identity)}-{cache_key(identity, dtype, quantization)}"


# --------------------------------------------------------------------------- #
# Converting
# --------------------------------------------------------------------------- #


def _convert_in_memory(source: ModelSource, dtype: str, quantization: Optional[str] = None) -> LoadedModel:
    """Parse ``source`` (a GGUF parsed once for weights and tokenizer) into the tree: dequantized to
    ``dtype``, or with ``quantization`` its big weights quantized (`jaxinfer.ops.quant`: GGUF blocks of
    the scheme's format are kept as they are, others are requantized once, here)."""
    what = dtype if quantization is None else f"{quantization} ({dtype} activations)"
    with progress.stage(f"converting {source.name} to {what}", unit="tensor") as s:
        def on_tensor(total: int) -> None:
            if s.total is None:
                s.set_total(total)
            s.update()

        gguf_file = open_gguf(source.path) if source.format == "gguf" else None
        loaded = load_model(source, np.float32, gguf_file=gguf_file, on_tensor=on_tensor,
                            keep_blocks=quantization is not None)
        if gguf_file is not None:
            tokenizer = Tokenizer.from_gguf(source.path, gguf_file=gguf_file)
        else:
            tokenizer = tokenizer_from_source(source.path)
        family = get_family(loaded.config.architecture)
        config = loaded.config
        if quantization is not None:
            kinds = {n: t.kind for n, t in loaded.tensors.items() if isinstance(t, quant.Blocks)}
            head = [k for n, k in kinds.items() if n in quant.HEAD_TENSORS]
            layers = [k for n, k in kinds.items() if n not in quant.HEAD_TENSORS]
            config = dataclasses.replace(config, quant=quant.scheme_for(quantization, layers, head))
            s.note(f"{config.quant}: {quant.describe_sources(loaded.tensors, config.quant)}")
        params = family.params_from_hf(loaded.tensors, config, jnp.dtype(dtype))
        loaded.tensors.clear()
        del loaded.tensors
        if gguf_file is not None:
            gguf_file.close()
    stats["converted"] += 1
    return LoadedModel(config, params, loaded.generation, tokenizer, source)


def _source_record(source: ModelSource, identity: dict) -> dict:
    return {"name": source.name, "format": source.format, "path": identity["path"], "identity": identity}


def convert(source: ModelSource, dst: Union[str, os.PathLike], dtype: Any, *, overwrite: bool = False) -> Path:
    """``jaxinfer convert``: write ``source`` as a converted directory ``dst`` (atomically)."""
    dtype = dtype_name(dtype)
    dst = Path(dst).expanduser().absolute()
    if dst.exists() and not overwrite and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} already exists; pass --force to replace it")
    if source.format == "jaxinfer":
        with progress.stage(f"restoring {source.name}"):
            m = checkpoint.load_converted(source.path, dtype=dtype)
        model = LoadedModel(m.config, m.params, m.generation, m.tokenizer, source)
        record = m.manifest.get("source")
    else:
        identity = source_identity(source)
        model = _convert_in_memory(source, dtype)
        record = _source_record(source, identity)
    tmp = checkpoint.temp_dir_beside(dst)
    try:
        with progress.stage(f"saving {source.name} to {dst}"):
            checkpoint.write_model_dir(tmp, model.config, model.params, model.tokenizer, model.generation,
                                       dtype=dtype, source=record)
        if dst.exists():
            checkpoint.remove_dir(dst)
        os.rename(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


# --------------------------------------------------------------------------- #
# The cache
# --------------------------------------------------------------------------- #


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _quant_mode(manifest: dict) -> Optional[str]:
    """The quantization ("int8", "int4") of a converted model's manifest, None for float weights."""
    scheme = (manifest.get("model_config") or {}).get("quant") or ""
    return scheme.split("-")[0] or None


def _check_entry(entry: Path, identity: dict, dtype: str, quantization: Optional[str] = None) -> dict:
    """The entry's manifest if it was made from this source in this dtype and quantization;
    CheckpointError if not."""
    manifest = checkpoint.read_manifest(entry)
    if manifest.get("dtype") != dtype:
        raise checkpoint.CheckpointError(f"{entry}: holds {manifest.get('dtype')} parameters, expected {dtype}")
    if _quant_mode(manifest) != quantization:
        raise checkpoint.CheckpointError(
            f"{entry}: holds {_quant_mode(manifest) or 'float'} weights, expected {quantization or 'float'}")
    if (manifest.get("source") or {}).get("identity") != identity:
        raise checkpoint.CheckpointError(f"{entry}: was converted from another source (or an older version of it)")
    return manifest


def _restore_entry(entry: Path, source: ModelSource, identity: dict, dtype: str,
                   with_tokenizer: bool = True, placement: Any = None,
                   quantization: Optional[str] = None) -> LoadedModel:
    manifest = _check_entry(entry, identity, dtype, quantization)
    with progress.stage(f"restoring {source.name} ({quantization or dtype}) from the model cache"):
        m = checkpoint.load_converted(entry, with_tokenizer=with_tokenizer, manifest=manifest, sharding=placement)
    if with_tokenizer and m.tokenizer is not None:
        m.tokenizer.source = str(source.path)
    config = m.config if m.config.name == source.name else _renamed(m.config, source.name)
    stats["restored"] += 1
    return LoadedModel(config, m.params, m.generation, m.tokenizer, source, entry, True)


def _renamed(config: ModelConfig, name: str) -> ModelConfig:
    return dataclasses.replace(config, name=name)


def _publish(model: LoadedModel, entry: Path, identity: dict, dtype: str) -> None:
    """Write ``model`` as ``entry``: into a temporary sibling, then one rename."""
    tmp = checkpoint.temp_dir_beside(entry)
    try:
        with progress.stage(f"saving {model.source.name} to the model cache"):
            checkpoint.write_model_dir(tmp, model.config, model.params, model.tokenizer, model.generation,
                                       dtype=dtype, source=_source_record(model.source, identity))
        try:
            os.rename(tmp, entry)
        except OSError:
            if not entry.exists():
                raise
            # Another process published this entry first: use theirs next time, keep ours in memory.
            stats["lost_race"] += 1
            log.info("model cache entry %s was written by another process first", entry)
            return
        stats["saved"] += 1
        model.cache_path = entry
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale(root: Path, keep: Path, identity: dict, dtype: str, quantization: Optional[str] = None) -> None:
    """Remove entries of older versions of this source (same path, dtype and quantization) and dead
    temporaries."""
    now = time.time()
    prefix = keep.name.rsplit("-", 1)[0] + "-"
    try:
        children = list(root.iterdir())
    except OSError:
        return
    for d in children:
        if d == keep or not d.is_dir():
            continue
        if d.name.startswith((".tmp-", ".trash-")):
            try:
                if now - d.stat().st_mtime > _STALE_TMP_S:
                    shutil.rmtree(d, ignore_errors=True)
            except OSError:
                pass
            continue
        if not d.name.startswith(prefix):
            continue
        try:
            manifest = json.loads((d / checkpoint.MANIFEST).read_text())
            src = manifest.get("source") or {}
            if (src.get("path") == identity["path"] and manifest.get("dtype") == dtype
                    and _quant_mode(manifest) == quantization):
                log.info("removing stale model cache entry %s", d)
                checkpoint.remove_dir(d)
        except (OSError, ValueError, AttributeError):
            continue


def enabled(use_cache: bool = True) -> bool:
    return use_cache and cache_dir() is not None


def load(source: ModelSource, dtype: Any, *, use_cache: bool = True, placement: Any = None,
         quantization: Optional[str] = None) -> LoadedModel:
    """``source`` as the engine's parameter tree in ``dtype``, with its tokenizer and defaults.

    ``quantization`` ("int8", "int4"): the big weights quantized (`jaxinfer.ops.quant`); a cache
    entry holds the quantized tree. A converted directory saved with float weights is
    quantized as it is restored; one saved quantized is restored as it is (asking for another
    quantization is an error).

    A converted directory is restored directly. A GGUF file or a Hugging Face
    directory is restored from the cache when it has an entry for it, else
    converted (and, with the cache on, saved as the entry). ``placement``: where
    a restore puts the parameters (`jaxinfer.loading.checkpoint.load_converted`'s
    ``sharding``); a conversion leaves them in host memory.
    """
    dtype = dtype_name(dtype)
    quantization = quant.check_mode(quantization)
    if source.format == "jaxinfer":
        saved = _quant_mode(checkpoint.read_manifest(source.path))
        if saved and quantization not in (None, saved):
            raise ValueError(f"{source.path} holds {saved} weights; it cannot be loaded as {quantization}")
        requantize = quantization is not None and saved is None
        with progress.stage(f"restoring {source.name} ({saved or dtype})"):
            m = checkpoint.load_converted(source.path, dtype=dtype, sharding=None if requantize else placement)
        config, params = m.config, m.params
        if requantize:
            with progress.stage(f"quantizing {source.name} to {quantization}"):
                config, params = quant.quantize_params(params, config, quantization)
        stats["restored"] += 1
        return LoadedModel(config, params, m.generation, m.tokenizer, source, Path(source.path), True)
    root = cache_dir() if use_cache else None
    if root is None:
        return _convert_in_memory(source, dtype, quantization)
    identity = source_identity(source)
    entry = entry_path(source, dtype, root, identity, quantization)
    if entry.exists():
        try:
            return _restore_entry(entry, source, identity, dtype, placement=placement, quantization=quantization)
        except checkpoint.CheckpointError as e:
            _warn(f"model cache entry {entry} is unusable, rebuilding it: {e}")
            checkpoint.remove_dir(entry)
            stats["rebuilt"] += 1
    model = _convert_in_memory(source, dtype, quantization)
    if jax.process_index() != 0:  # several processes converting at once: process 0 writes the entry
        return model
    try:
        _publish(model, entry, identity, dtype)
        _remove_stale(root, entry, identity, dtype, quantization)
    except Exception as e:  # a full disk, a read-only cache: the model is loaded, only the cache is lost
        stats["save_failed"] += 1
        _warn(f"could not write the model cache entry {entry}: {type(e).__name__}: {e}")
    return model


def load_tokenizer(source: ModelSource, *, use_cache: bool = True) -> Any:
    """The tokenizer of ``source``, from a converted directory or a cache entry when there is one.

    Without an entry it is built from the source (a GGUF's header only;
    no weights are read). Any entry of the source serves, whatever its dtype.
    """
    if source.format == "jaxinfer":
        tok = checkpoint.load_converted_tokenizer(source.path)
        if tok is None:
            raise ValueError(f"{source.path} was saved without a tokenizer")
        return tok
    root = cache_dir() if use_cache else None
    if root is not None:
        identity = source_identity(source)
        for dtype in DTYPES:
            entry = entry_path(source, dtype, root, identity)
            if not entry.is_dir():
                continue
            try:
                manifest = _check_entry(entry, identity, dtype)
                tok = checkpoint.load_converted_tokenizer(entry, manifest, source=str(source.path))
            except checkpoint.CheckpointError as e:
                log.info("model cache entry %s not used for the tokenizer: %s", entry, e)
                continue
            if tok is not None:
                stats["tokenizer_restored"] += 1
                return tok
    return tokenizer_from_source(source.path)
