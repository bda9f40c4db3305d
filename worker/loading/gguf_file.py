"""A GGUF file's header read in one pass that checks it against the file's size: every count, length and tensor
must fit in the bytes the file has (gguf's GGUFReader allocates and loops per item a count claims, so a hostile
count hangs it). It yields what GGUFReader yields, the metadata's values (`ReaderField.contents()`) and the tensors
as read-only views of the file, in ~0.08 s for SmolLM2's file where GGUFReader takes ~3.3 s (it builds a NumPy
view per item of the 49152-token vocabulary and its merges): a worker, and a test that loads the model, starts that
much sooner. tests/unit/test_gguf_corrupt.py holds it to GGUFReader's values on the default model's file and on
little- and big-endian files of every value type."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

from worker.loading.model_file_error import ModelFileError

_SUPPORTED_VERSIONS = (2, 3)
_MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp reads no tensor with more
_FIXED_VALUE_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
_MIN_KEY_VALUE_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset
_MIN_STRING_BYTES = 8  # its length


def corrupt(path: Path, detail: str) -> ModelFileError:
    """The error for a GGUF file that is not what its header says."""
    return ModelFileError(f"this GGUF is corrupt: {path}: {detail}")


# The NumPy type of a tensor's items where GGUFReader reads them as numbers; every other type (the quantized
# blocks, BF16) is read as bytes, a row of blocks to a row of the array.
_TENSOR_ITEM_TYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GgufTensor(NamedTuple):
    """One tensor as GGUFReader's ReaderTensor has it: `shape` in the file's order (fastest dimension first),
    `data` a read-only view of the file in NumPy's order (reversed), quantized rows as their bytes."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_bytes: int
    data: np.ndarray


class GgufFile(NamedTuple):
    """A checked GGUF file's metadata (key -> value: str, int, float, bool or a list of them) and tensors."""

    metadata: dict[str, Any]
    tensors: list[GgufTensor]


class _TensorInfo(NamedTuple):
    name: str
    dims: list[int]
    tensor_type: GGMLQuantizationType
    data_offset: int
    data_bytes: int


def read_gguf(path: Path) -> GgufFile:
    """`path`'s metadata and tensors; ModelFileError naming the field whose count, length or data does not fit in
    the file, or that GGUF does not allow."""
    file_bytes = path.stat().st_size
    if file_bytes == 0:
        raise corrupt(path, "the file is empty")
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        cursor = _HeaderCursor(path, buffer)
        alignment, metadata, infos = _walk_header(cursor)
        data_start = -(-cursor.offset // alignment) * alignment
    for info in infos:
        data_end = data_start + info.data_offset + info.data_bytes
        if data_end > file_bytes:
            raise corrupt(
                path,
                f"tensor {info.name!r} claims {info.data_bytes} bytes at offset {info.data_offset} of the data, "
                f"ending at byte {data_end}, the file has {file_bytes} bytes",
            )
    names: set[str] = set()
    for info in infos:
        if info.name in names:
            raise corrupt(path, f"duplicated tensor {info.name!r}: two tensors of one name")
        names.add(info.name)
    if not infos:
        return GgufFile(metadata, [])
    data = np.memmap(path, mode="r")
    return GgufFile(metadata, [_tensor(data, data_start, info, cursor.byte_order) for info in infos])


def _tensor(data: np.memmap, data_start: int, info: _TensorInfo, byte_order: str) -> GgufTensor:
    start = data_start + info.data_offset
    item_type = _TENSOR_ITEM_TYPES.get(info.tensor_type)
    shape = tuple(reversed(info.dims))
    if item_type is None:
        item_type, shape = np.uint8, quant_shape_to_byte_shape(shape, info.tensor_type)
    view = data[start : start + info.data_bytes].view(np.dtype(item_type).newbyteorder(byte_order)).reshape(shape)
    return GgufTensor(info.name, info.tensor_type, np.array(info.dims, dtype=np.uint64), info.data_bytes, view)


class _HeaderCursor:
    """Reads the header's fields in order, each only if the file still holds its bytes."""

    def __init__(self, path: Path, buffer: mmap.mmap):
        self.path = path
        self.buffer = buffer
        self.offset = 0
        self.byte_order = "<"

    @property
    def bytes_left(self) -> int:
        return len(self.buffer) - self.offset

    def skip(self, num_bytes: int, field: str) -> int:
        """Steps over `num_bytes` of `field`; where they started."""
        if num_bytes > self.bytes_left:
            raise corrupt(self.path, f"{field} needs {num_bytes} bytes, the file has {self.bytes_left} bytes left")
        start = self.offset
        self.offset += num_bytes
        return start

    def number(self, struct_format: str, field: str) -> int | float | bool:
        start = self.skip(struct.calcsize(struct_format), field)
        return struct.unpack_from(self.byte_order + struct_format, self.buffer, start)[0]

    def array(self, struct_format: str, count: int, field: str) -> list:
        start = self.skip(count * struct.calcsize(struct_format), field)
        dtype = np.dtype(struct_format).newbyteorder(self.byte_order)
        return np.frombuffer(self.buffer, dtype=dtype, count=count, offset=start).tolist()

    def string(self, field: str) -> str:
        num_bytes = self.number("Q", f"{field} length")
        start = self.skip(num_bytes, field)
        try:
            return self.buffer[start : self.offset].decode("utf-8")
        except UnicodeDecodeError as error:
            raise corrupt(self.path, f"{field} is not UTF-8 ({error.reason} at byte {error.start})") from None

    def expect_items(self, count: int, min_item_bytes: int, field: str) -> None:
        """Fails at once where `count` items of at least `min_item_bytes` each cannot fit in what is left."""
        if count * min_item_bytes > self.bytes_left:
            raise corrupt(self.path, f"{field} claims {count} items, the file has {self.bytes_left} bytes left")


def _walk_header(cursor: _HeaderCursor) -> tuple[int, dict[str, Any], list[_TensorInfo]]:
    """Reads the whole header: the data alignment, the metadata and each tensor's info."""
    magic = cursor.number("I", "magic")
    if magic != GGUF_MAGIC:
        raise corrupt(cursor.path, f"magic is {magic:#010x}, not GGUF's {GGUF_MAGIC:#010x}")
    version = cursor.number("I", "version")
    if version & 0xFFFF == 0:  # as gguf's reader tells a big-endian file
        cursor.byte_order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in _SUPPORTED_VERSIONS:
        raise corrupt(cursor.path, f"version is {version}, not one of {_SUPPORTED_VERSIONS}")
    tensor_count = cursor.number("Q", "tensor count")
    key_count = cursor.number("Q", "metadata key count")
    cursor.expect_items(key_count, _MIN_KEY_VALUE_BYTES, "metadata key count")
    alignment = GGUF_DEFAULT_ALIGNMENT
    metadata: dict[str, Any] = {}
    for key_index in range(key_count):
        key = cursor.string(f"metadata key #{key_index}")
        value_type = _value_type(cursor, f"metadata key {key!r} value type")
        if key == "general.alignment":
            alignment = metadata[key] = _alignment(cursor, value_type)
        else:
            metadata[key] = _value(cursor, value_type, f"metadata key {key!r}")
    cursor.expect_items(tensor_count, _MIN_TENSOR_INFO_BYTES, "tensor count")
    tensors = [_tensor_info(cursor, tensor_index) for tensor_index in range(tensor_count)]
    return alignment, metadata, tensors


def _value_type(cursor: _HeaderCursor, field: str) -> GGUFValueType:
    raw_type = cursor.number("I", field)
    try:
        return GGUFValueType(raw_type)
    except ValueError:
        raise corrupt(cursor.path, f"{field} {raw_type} is unknown") from None


def _alignment(cursor: _HeaderCursor, value_type: GGUFValueType) -> int:
    field = "metadata key 'general.alignment'"
    if value_type != GGUFValueType.UINT32:
        raise corrupt(cursor.path, f"{field} is a {value_type.name}, not a UINT32")
    alignment = cursor.number("I", field)
    if alignment == 0 or alignment & (alignment - 1):
        raise corrupt(cursor.path, f"{field} is {alignment}, not a power of two")
    return alignment


def _value(cursor: _HeaderCursor, value_type: GGUFValueType, field: str) -> Any:
    if value_type == GGUFValueType.STRING:
        return cursor.string(f"{field} value")
    if value_type == GGUFValueType.ARRAY:
        return _array(cursor, field)
    return cursor.number(_FIXED_VALUE_FORMATS[value_type], f"{field} value")


def _array(cursor: _HeaderCursor, field: str) -> list:
    item_type = _value_type(cursor, f"{field} array item type")
    count = cursor.number("Q", f"{field} array item count")
    if item_type == GGUFValueType.ARRAY:  # llama.cpp reads none either
        raise corrupt(cursor.path, f"{field} holds an array of arrays")
    if item_type == GGUFValueType.STRING:
        cursor.expect_items(count, _MIN_STRING_BYTES, f"{field} array of STRING")
        return [cursor.string(f"{field} array item #{item_index}") for item_index in range(count)]
    item_format = _FIXED_VALUE_FORMATS[item_type]
    cursor.expect_items(count, struct.calcsize(item_format), f"{field} array of {item_type.name}")
    return cursor.array(item_format, count, f"{field} array")


def _tensor_info(cursor: _HeaderCursor, tensor_index: int) -> _TensorInfo:
    name = cursor.string(f"tensor #{tensor_index} name")
    field = f"tensor {name!r}"
    num_dims = cursor.number("I", f"{field} n_dims")
    if num_dims > _MAX_DIMS:
        raise corrupt(cursor.path, f"{field} claims {num_dims} dimensions, GGUF allows at most {_MAX_DIMS}")
    dims = [cursor.number("Q", f"{field} dims") for _ in range(num_dims)]
    raw_type = cursor.number("I", f"{field} type")
    try:
        tensor_type = GGMLQuantizationType(raw_type)
    except ValueError:
        raise corrupt(cursor.path, f"{field} type {raw_type} is unknown") from None
    data_offset = cursor.number("Q", f"{field} offset")
    block_size, block_bytes = GGML_QUANT_SIZES[tensor_type]
    if dims and dims[0] % block_size:
        raise corrupt(
            cursor.path, f"{field} rows of {dims[0]} values are not whole {tensor_type.name} blocks of {block_size}"
        )
    num_elements = 1
    for dim in dims:
        num_elements *= dim
    return _TensorInfo(name, dims, tensor_type, data_offset, num_elements // block_size * block_bytes)
