"""F32 / BF16 / Q8_0 copies of a GGUF file, for the llama.cpp peer and the perplexity benchmark.

The shipped SmolLM2 file is Q4_1 (its token embedding Q8_0). To run llama.cpp at
the precisions jaxinfer runs, this module rewrites it with the `gguf` package:
every quantized tensor is dequantized (`gguf.quants.dequantize`) and stored again
in the target type (`gguf.quants.quantize`), every metadata field is copied as it
is, except ``general.file_type``, which names the new type. One-dimensional
tensors (the norms) stay F32, as llama.cpp's own converter keeps them, and a
tensor whose row length the target's block size does not divide stays F32 too.

So every variant holds the weights of the Q4_1 file (plus the rounding of the
target type): F32 exactly them, BF16 and Q8_0 them rounded once more. The
files go to ``~/.cache/jaxinfer/bench-gguf/`` (``JAXINFER_BENCH_GGUF_DIR``
overrides it), never into the repository, and are made once per source file
(the name carries its size and modification time):

    python -m benchmarks.gguf_variants                 # F32, BF16, Q8_0 of the default model
    python -m benchmarks.gguf_variants --types Q8_0 --model PATH.gguf
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

# target name -> (tensor type, general.file_type); imported lazily so `--help` is quick
TYPES = ("F32", "BF16", "Q8_0", "Q4_1")


def cache_dir() -> Path:
    """``JAXINFER_BENCH_GGUF_DIR``, else ``bench-gguf`` under jaxinfer's cache root (`jaxinfer.env.cache_root`)."""
    from jaxinfer.env import cache_root

    return Path(os.environ.get("JAXINFER_BENCH_GGUF_DIR") or Path(cache_root()) / "bench-gguf")


def _file_type(gguf, name: str) -> int:
    f = gguf.LlamaFileType
    return int({"F32": f.ALL_F32, "BF16": f.MOSTLY_BF16, "Q8_0": f.MOSTLY_Q8_0, "Q4_1": f.MOSTLY_Q4_1}[name])


def source_type(path: Path) -> Optional[str]:
    """The type most of the file's matrices have (e.g. "Q4_1"), by bytes."""
    import gguf

    r = gguf.GGUFReader(str(path))
    count: dict = {}
    for t in r.tensors:
        if len(t.shape) > 1 or int(np.prod(t.shape)) > 1 << 16:
            count[t.tensor_type.name] = count.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return max(count, key=count.get) if count else None


def variant_path(src: Path, target: str) -> Path:
    st = src.stat()
    return cache_dir() / f"{src.stem}.{st.st_size}-{int(st.st_mtime)}.{target}.gguf"


def _copy_fields(reader, writer, gguf, file_type: int) -> int:
    """Every key-value field of `reader` into `writer` (general.file_type replaced); how many."""
    n = 0
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # header fields; the writer adds these
            continue
        vtype = field.types[0]
        if key == "general.file_type":
            writer.add_key_value(key, file_type, vtype)
        elif vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
        else:
            writer.add_key_value(key, field.contents(), vtype)
        n += 1
    return n


def make_variant(src: Path, target: str, dst: Optional[Path] = None, log=print) -> Path:
    """Write `src` with its matrices in `target` (F32, BF16 or Q8_0); returns the path (cached)."""
    import gguf
    from gguf import quants

    target = target.upper()
    if target not in ("F32", "BF16", "Q8_0"):
        raise ValueError(f"target type {target!r}: one of F32, BF16, Q8_0")
    dst = dst or variant_path(src, target)
    if dst.is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    qtype = getattr(gguf.GGMLQuantizationType, target)
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    fields = _copy_fields(reader, writer, gguf, _file_type(gguf, target))
    kinds: dict = {}
    for t in reader.tensors:
        # reader order is numpy order: [rows, row bytes] for quantized types, [rows, cols] for float ones
        w = quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32, copy=False)
        keep_f32 = w.ndim < 2 or w.shape[-1] % block != 0
        if target == "F32" or keep_f32:
            writer.add_tensor(t.name, np.ascontiguousarray(w))
            kind = "F32"
        else:
            q = quants.quantize(w, qtype)
            writer.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=qtype)
            kind = target
        kinds[kind] = kinds.get(kind, 0) + 1
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    log(
        f"wrote {dst} ({dst.stat().st_size / 1e6:.0f} MB, {fields} metadata fields, tensors {kinds}) "
        f"in {time.perf_counter() - t0:.1f} s"
    )
    return dst


def variants(src: Path, targets=("F32", "BF16", "Q8_0"), log=print) -> dict:
    """{type: path} for each target; the source itself for its own type."""
    own = source_type(src)
    out = {}
    for t in targets:
        out[t] = src if t == own else make_variant(src, t, log=log)
    return out


def default_model_path() -> Path:
    from jaxinfer.loading.weights import resolve_model

    return Path(resolve_model("smollm2-135m-instruct").path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gguf_variants", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="the source GGUF file (default: the bundled SmolLM2 Q4_1)")
    p.add_argument("--types", nargs="+", default=["F32", "BF16", "Q8_0"], choices=TYPES)
    a = p.parse_args(argv)
    src = Path(a.model) if a.model else default_model_path()
    print(f"source {src} ({source_type(src)}); cache {cache_dir()}")
    for t, path in variants(src, a.types).items():
        print(f"{t:>5}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
