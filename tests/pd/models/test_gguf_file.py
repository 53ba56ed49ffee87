"""pd/models/gguf_file.py against the reference reader (gguf.GGUFReader): the same
metadata values and the same tensor views, on a file with every value type and on the
real Gemma 3 270M (in tests/pd/real, which has its reader at hand); bytes that are not a
GGUF file are refused."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from pd.models.gguf_file import GGUFFile
from tests.support.gguf_reference import assert_same_as_the_reference


def test_every_value_type_and_tensor_kind_reads_as_the_reference_reads_it(tmp_path) -> None:
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_string("t.string", "héllo ✓")
    writer.add_uint8("t.u8", 250)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-6)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_array("t.strings", ["a", "", "ünï", "x" * 300])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False, True])
    writer.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    writer.add_tensor("a.f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("b.f16", rng.standard_normal((2, 7)).astype(np.float16))
    writer.add_tensor("c.i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    q8 = gguf.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("d.q8", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_the_reference(path)
    assert GGUFFile(path).fields["t.strings"] == ["a", "", "ünï", "x" * 300]


@pytest.mark.parametrize("content", [b"", b"GGUF", b"GGUX" + b"\0" * 40, b"GGUF\x09\0\0\0" + b"\0" * 16,
                                     b"not a gguf file at all" * 50])
def test_bytes_that_are_not_a_gguf_file_are_refused(tmp_path, content) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises((ValueError, IndexError)):
        GGUFFile(path)


def test_a_file_cut_inside_a_string_array_is_refused(tmp_path) -> None:
    """The array's last string claims more bytes than are left; any cut before it too."""
    path = tmp_path / "cut.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_array("t.strings", ["a", "bc", "def" * 40])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    whole = path.read_bytes()
    assert GGUFFile(path).fields["t.strings"] == ["a", "bc", "def" * 40]
    for cut in (1, 50, len(whole) - len(b"def" * 40) - 4):
        path.write_bytes(whole[:-cut])
        with pytest.raises((ValueError, struct.error)):
            GGUFFile(path)

