"""A GGUF file's header, read once: metadata values, tensor descriptions, tensor bytes.

`gguf.GGUFReader` builds a numpy object for every part of every metadata
value (about 150k of them for a 49k-token vocabulary, seconds per file); the
weights and the tokenizer each built one. `GGUFFile` walks the same header
with `struct` over one memory map and decodes a value only when it is asked
for, so one parse serves both. Tensor data stays in the mapping:
`GGUFFile.tensor_data` returns the same array view `GGUFReader` would
(float types typed, quantized types as bytes) for `gguf.quants.dequantize`.

Format (GGUF v2/v3, either byte order): magic ``GGUF``, version (u32),
tensor count and key/value count (u64), the key/value pairs, the tensor
descriptions (name, dims in ggml order, type, offset), then the tensor data
from the next multiple of ``general.alignment`` (default 32).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

__all__ = ["GGUFFile", "GGUFTensorInfo", "parse_count"]

# GGUF value types (gguf.GGUFValueType): scalar struct code per type.
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR = {
    _UINT8: "B", _INT8: "b", _UINT16: "H", _INT16: "h", _UINT32: "I", _INT32: "i",
    _FLOAT32: "f", _BOOL: "?", _UINT64: "Q", _INT64: "q", _FLOAT64: "d",
}
_NP_SCALAR = {
    _UINT8: "u1", _INT8: "i1", _UINT16: "u2", _INT16: "i2", _UINT32: "u4", _INT32: "i4",
    _FLOAT32: "f4", _BOOL: "?", _UINT64: "u8", _INT64: "i8", _FLOAT64: "f8",
}
_DEFAULT_ALIGNMENT = 32

# Counts how many GGUF headers this process parsed (tests check that a cached load parses none).
parse_count = 0


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's description: ``shape`` is in ggml order (fastest dimension first)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def np_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))


class _Lazy:
    """An array value not decoded yet: where it starts, its item type and count."""

    __slots__ = ("offset", "item_type", "count")

    def __init__(self, offset: int, item_type: int, count: int):
        self.offset, self.item_type, self.count = offset, item_type, count


class GGUFFile:
    """The header of a GGUF file: ``get(key)``, ``tensors``, ``tensor_data(t)``.

    Raises ValueError for a file that is not GGUF v2/v3 or is cut short.
    """

    def __init__(self, path: os.PathLike | str):
        global parse_count
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file cannot be mapped
                raise ValueError(f"{self.path}: cannot read as GGUF: {e}") from None
        self._buf = memoryview(self._map)
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.path}: cannot read as GGUF: truncated or malformed header ({e})") from None
        parse_count += 1

    # -- parsing ---------------------------------------------------------------

    def _parse(self) -> None:
        buf = self._buf
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path}: cannot read as GGUF: bad magic {bytes(buf[:4])!r}")
        (version,) = struct.unpack_from("<I", buf, 4)
        self._e = "<"
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self._e = ">"
            (version,) = struct.unpack_from(">I", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        self.version = version
        n_tensors, n_kv = struct.unpack_from(self._e + "QQ", buf, 8)
        pos = 24
        self._fields: dict[str, Any] = {}
        self._types: dict[str, int] = {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (vtype,) = struct.unpack_from(self._e + "I", buf, pos)
            pos += 4
            value, pos = self._value(vtype, pos)
            self._fields[key] = value
            self._types[key] = vtype
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from(self._e + "I", buf, pos)
            dims = struct.unpack_from(self._e + "Q" * n_dims, buf, pos + 4)
            pos += 4 + 8 * n_dims
            ttype, offset = struct.unpack_from(self._e + "IQ", buf, pos)
            pos += 12
            infos.append((name, tuple(int(d) for d in dims), ttype, offset))
        align = self._fields.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"{self.path}: invalid general.alignment {align!r}")
        self.alignment = align
        self.data_offset = pos + (-pos % align)
        self.tensors = self._tensor_infos(infos)

    def _tensor_infos(self, infos) -> list[GGUFTensorInfo]:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        out, seen = [], set()
        for name, dims, ttype, offset in infos:
            if name in seen:
                raise ValueError(f"{self.path}: duplicated tensor {name!r}")
            seen.add(name)
            try:
                qtype = GGMLQuantizationType(ttype)
            except ValueError:
                raise ValueError(f"{self.path}: tensor {name!r} has unknown GGML type {ttype}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims, dtype=np.int64)) if dims else 1
            n_bytes = n * type_size // block
            start = self.data_offset + offset
            if start + n_bytes > len(self._buf):
                raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
            out.append(GGUFTensorInfo(name, dims, qtype, start, n_bytes))
        return out

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from(self._e + "Q", self._buf, pos)
        end = pos + 8 + n
        if end > len(self._buf):
            raise IndexError("string runs past the end of the file")
        return str(self._buf[pos + 8:end], "utf-8"), end

    def _value(self, vtype: int, pos: int) -> tuple[Any, int]:
        if vtype in _SCALAR:
            code = _SCALAR[vtype]
            return struct.unpack_from(self._e + code, self._buf, pos)[0], pos + struct.calcsize(code)
        if vtype == _STRING:
            return self._string(pos)
        if vtype == _ARRAY:
            item_type, count = struct.unpack_from(self._e + "IQ", self._buf, pos)
            pos += 12
            lazy = _Lazy(pos, item_type, count)
            return lazy, self._skip_array(item_type, count, pos)
        raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")

    def _skip_array(self, item_type: int, count: int, pos: int) -> int:
        if item_type in _SCALAR:
            return pos + count * struct.calcsize(_SCALAR[item_type])
        if item_type == _STRING:
            q = struct.Struct(self._e + "Q").unpack_from
            buf = self._buf
            for _ in range(count):
                pos += 8 + q(buf, pos)[0]
            return pos
        if item_type == _ARRAY:
            for _ in range(count):
                sub_type, sub_count = struct.unpack_from(self._e + "IQ", self._buf, pos)
                pos = self._skip_array(sub_type, sub_count, pos + 12)
            return pos
        raise ValueError(f"{self.path}: unknown GGUF array item type {item_type}")

    def _decode_array(self, a: _Lazy) -> list:
        if a.item_type in _NP_SCALAR:
            dt = np.dtype(_NP_SCALAR[a.item_type]).newbyteorder(self._e)
            return np.frombuffer(self._buf, dtype=dt, count=a.count, offset=a.offset).tolist()
        if a.item_type == _STRING:
            q = struct.Struct(self._e + "Q").unpack_from
            buf, pos, out = self._buf, a.offset, []
            for _ in range(a.count):
                n = q(buf, pos)[0]
                out.append(str(buf[pos + 8:pos + 8 + n], "utf-8"))
                pos += 8 + n
            return out
        out, pos = [], a.offset
        for _ in range(a.count):  # arrays of arrays: rare, decoded eagerly
            sub_type, sub_count = struct.unpack_from(self._e + "IQ", self._buf, pos)
            out.append(self._decode_array(_Lazy(pos + 12, sub_type, sub_count)))
            pos = self._skip_array(sub_type, sub_count, pos + 12)
        return out

    # -- access ----------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def keys(self) -> list[str]:
        return list(self._fields)

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python data (arrays as lists), or ``default``."""
        v = self._fields.get(key, default)
        if isinstance(v, _Lazy):
            v = self._decode_array(v)
            self._fields[key] = v
        return v

    def array_len(self, key: str) -> Optional[int]:
        v = self._fields.get(key)
        if v is None:
            return None
        return v.count if isinstance(v, _Lazy) else len(v) if isinstance(v, list) else 1

    def metadata(self, prefix: str = "") -> dict[str, Any]:
        """Every value whose key starts with ``prefix``, decoded."""
        return {k: self.get(k) for k in self._fields if k.startswith(prefix)}

    def tensor_data(self, t: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as `gguf.GGUFReader` presents them (a view of the mapping).

        Float and integer types are typed arrays in numpy order; quantized types
        are ``uint8`` rows of blocks. Feed it to `gguf.quants.dequantize`.
        """
        from gguf.constants import GGMLQuantizationType as Q
        from gguf.quants import quant_shape_to_byte_shape

        typed = {Q.F32: "f4", Q.F16: "f2", Q.F64: "f8", Q.I8: "i1", Q.I16: "i2", Q.I32: "i4", Q.I64: "i8"}
        shape = t.np_shape
        if t.tensor_type in typed:
            dt = np.dtype(typed[t.tensor_type]).newbyteorder(self._e)
            count = t.n_bytes // dt.itemsize
        else:
            dt, count = np.dtype(np.uint8), t.n_bytes
            shape = quant_shape_to_byte_shape(shape, t.tensor_type)
        return np.frombuffer(self._buf, dtype=dt, count=count, offset=t.offset).reshape(shape)

    @property
    def buffer(self) -> np.ndarray:
        """The whole file as a read-only ``uint8`` array (to test what aliases it)."""
        return np.frombuffer(self._buf, dtype=np.uint8)

    def close(self) -> None:
        """Release the mapping (arrays from `tensor_data` must be gone or copied first)."""
        try:
            self._buf.release()
            self._map.close()
        except BufferError:  # a view is still alive: the mapping goes when it does
            pass
