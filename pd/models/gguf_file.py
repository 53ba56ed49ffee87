"""A GGUF file's header, read fast: metadata as Python values, tensors as memory-mapped
numpy views, laid out as `gguf.GGUFReader` lays them out (the reference it is tested
against). The reference walks every array element through numpy views: on Gemma 3's
262,144-entry vocabulary that is ~14 s per process; this reads the same header in well
under a second by slicing the mapped bytes.

Format (little-endian; a big-endian file is refused): magic "GGUF", version (u32, 2 or
3), tensor count and metadata count (u64 each), the metadata (key string, value type
u32, value), the tensor infos (name, number of dims u32, dims u64..., type u32, offset
u64), padding to `general.alignment` (default 32), then the tensors' data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
_LENGTH = struct.Struct("<Q")  # a string's byte count
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF value types: id -> struct format of a scalar (8: string, 9: array)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
         7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
PLAIN_TENSORS = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as GGUF lists it: innermost dimension first
    data: np.ndarray  # a read-only view of the mapped file (bytes per row for quantized types)


class GGUFFile:
    """`fields` (key -> value: str, int, float, bool or a list of them) and `tensors`.
    ValueError (or struct.error, IndexError) on bytes that are not such a file."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if Path(path).stat().st_size else b""
        self._pos = 0
        if self._read(4) != MAGIC:
            raise ValueError("GGUF magic invalid")
        version = self._scalar("<I")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (big-endian files are not)")
        tensor_count, field_count = self._scalar("<Q"), self._scalar("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid general.alignment {alignment!r}: must be a power of two")
        data_start = -(-self._pos // alignment) * alignment
        array = np.frombuffer(self._map, dtype=np.uint8)
        names = [name for name, *_ in infos]
        if len(set(names)) != len(names):
            raise ValueError("duplicated tensor names")
        self.tensors = [self._tensor(array, data_start, *info) for info in infos]

    def _read(self, n: int) -> bytes:
        if self._pos + n > len(self._map):
            raise ValueError(f"truncated GGUF header (wanted {n} bytes at offset {self._pos})")
        data = self._map[self._pos:self._pos + n]
        self._pos += n
        return data

    def _scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self._read(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._read(self._scalar("<Q")).decode("utf-8")

    def _strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary: 262k for Gemma), in one tight loop."""
        data, pos, size, strings = self._map, self._pos, len(self._map), []
        length_at = _LENGTH.unpack_from
        for _ in range(count):
            end = pos + 8 + length_at(data, pos)[0]
            if end > size:
                raise ValueError(f"truncated GGUF header (a string past the end at offset {pos})")
            strings.append(data[pos + 8:end].decode("utf-8"))
            pos = end
        self._pos = pos
        return strings

    def _value(self, kind: int) -> Any:
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item_kind, count = self._scalar("<I"), self._scalar("<Q")
            if item_kind in NUMPY:  # numbers: one slice of the map
                size = np.dtype(NUMPY[item_kind]).itemsize * count
                return np.frombuffer(self._read(size), dtype=NUMPY[item_kind]).tolist()
            if item_kind == STRING:
                return self._strings(count)
            return [self._value(item_kind) for _ in range(count)]
        if kind not in SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self._scalar(SCALARS[kind])

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
        return name, dims, GGMLQuantizationType(self._scalar("<I")), self._scalar("<Q")

    @staticmethod
    def _tensor(array: np.ndarray, data_start: int, name: str, dims: tuple[int, ...],
                kind: GGMLQuantizationType, offset: int) -> GGUFTensor:
        shape = tuple(reversed(dims))
        count = int(np.prod(dims))
        start = data_start + offset
        if kind in PLAIN_TENSORS:
            dtype = np.dtype(PLAIN_TENSORS[kind])
            data = array[start:start + count * dtype.itemsize].view(dtype)
        else:
            block_size, type_size = GGML_QUANT_SIZES[kind]
            data = array[start:start + count * type_size // block_size]
            shape = quant_shape_to_byte_shape(shape, kind)
        return GGUFTensor(name, kind, dims, data.reshape(shape))
