"""A GGUF file's header checked against the file's size before gguf's reader sees it: the reader allocates and
loops per item a count claims, so a hostile count hangs it; here every count, length and tensor must fit in
the bytes the file has."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

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


def read_gguf(path: Path) -> GGUFReader:
    """gguf's reader of `path` once its header is checked; what the reader still refuses is a ModelFileError too."""
    check_gguf_header(path)
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError) as error:
        raise corrupt(path, f"{type(error).__name__}: {error}") from error


def check_gguf_header(path: Path) -> None:
    """Raises ModelFileError naming the field of `path` whose count, length or data does not fit in the file."""
    file_bytes = path.stat().st_size
    if file_bytes == 0:
        raise corrupt(path, "the file is empty")
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        cursor = _HeaderCursor(path, buffer)
        alignment, tensors = _walk_header(cursor)
        data_start = -(-cursor.offset // alignment) * alignment
    for name, data_offset, data_bytes in tensors:
        data_end = data_start + data_offset + data_bytes
        if data_end > file_bytes:
            raise corrupt(
                path,
                f"tensor {name!r} claims {data_bytes} bytes at offset {data_offset} of the data, "
                f"ending at byte {data_end}, the file has {file_bytes} bytes",
            )


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


def _walk_header(cursor: _HeaderCursor) -> tuple[int, list[tuple[str, int, int]]]:
    """Steps over the whole header; the data alignment and each tensor's (name, data offset, data bytes)."""
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
    for key_index in range(key_count):
        key = cursor.string(f"metadata key #{key_index}")
        value_type = _value_type(cursor, f"metadata key {key!r} value type")
        if key == "general.alignment":
            alignment = _alignment(cursor, value_type)
        else:
            _skip_value(cursor, value_type, f"metadata key {key!r}")
    cursor.expect_items(tensor_count, _MIN_TENSOR_INFO_BYTES, "tensor count")
    tensors = [_tensor_info(cursor, tensor_index) for tensor_index in range(tensor_count)]
    return alignment, tensors


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


def _skip_value(cursor: _HeaderCursor, value_type: GGUFValueType, field: str) -> None:
    if value_type == GGUFValueType.STRING:
        cursor.string(f"{field} value")
    elif value_type == GGUFValueType.ARRAY:
        _skip_array(cursor, field)
    else:
        cursor.skip(struct.calcsize(_FIXED_VALUE_FORMATS[value_type]), f"{field} value")


def _skip_array(cursor: _HeaderCursor, field: str) -> None:
    item_type = _value_type(cursor, f"{field} array item type")
    count = cursor.number("Q", f"{field} array item count")
    if item_type == GGUFValueType.ARRAY:  # llama.cpp reads none either
        raise corrupt(cursor.path, f"{field} holds an array of arrays")
    if item_type == GGUFValueType.STRING:
        cursor.expect_items(count, _MIN_STRING_BYTES, f"{field} array of STRING")
        for item_index in range(count):
            cursor.string(f"{field} array item #{item_index}")
        return
    item_bytes = struct.calcsize(_FIXED_VALUE_FORMATS[item_type])
    cursor.expect_items(count, item_bytes, f"{field} array of {item_type.name}")
    cursor.skip(count * item_bytes, f"{field} array")


def _tensor_info(cursor: _HeaderCursor, tensor_index: int) -> tuple[str, int, int]:
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
    return name, data_offset, num_elements // block_size * block_bytes
