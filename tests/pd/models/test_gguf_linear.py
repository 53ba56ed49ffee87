"""`--quantization gguf`: each block type unpacked to gguf's own dequantized values, the
native kernel (VNNI and plain C) equal to a float32 matmul of the dequantized weight with
the quantized activations, and an engine computing from a GGUF's blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from pd import native
from pd.config import EngineConfig
from pd.distributed.shard import TPShard
from pd.models import gguf_linear
from pd.models.gguf_linear import TYPES, Blocks, pack, quantize_activations, unpack
from pd.models.loader import load_model
from pd.models.make_model import make_model
from pd.models.model_config import ModelConfig
from pd.worker.rank_setup import build_model
from tests.support.gguf_files import write_qwen3_gguf
from tests.support.mappings import vm_flags

# Where each type keeps its float16 scales, per block: (block bytes, offsets of float16 fields).
_LAYOUT = {"Q8_0": (34, (0,)), "Q5_0": (22, (0,)), "Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}


def random_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """(n, bytes per row) of valid random blocks: random bytes, finite float16 scales."""
    rng = np.random.default_rng(seed)
    size, scales = _LAYOUT[kind]
    elements = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, kind)][0]
    raw = rng.integers(0, 256, size=(n, k // elements, size), dtype=np.uint8)
    for offset in scales:
        d = (rng.standard_normal((n, k // elements)) * 0.01).astype(np.float16)
        raw[..., offset:offset + 2] = d[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def dequantized(kind: str, raw: np.ndarray) -> torch.Tensor:
    values = gguf.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(raw.shape[0], -1)


def run_kernel(blocks: Blocks, x: torch.Tensor, plain: bool = False) -> torch.Tensor:
    library = gguf_linear._library(plain)
    if library is None:
        pytest.skip("no native kernels here")
    n = blocks.u.shape[0]
    packed = pack(blocks)
    out = torch.full((x.shape[0], n + 3), 7.0, dtype=x.dtype)  # 3 columns past n: must stay untouched
    kernel = getattr(library, f"gguf_linear_{gguf_linear._SUFFIX[x.dtype]}")
    status = kernel(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], packed.data_ptr(), n, blocks.bs,
                    blocks.scales, blocks.bits, out.data_ptr(), out.stride(0), 2)
    assert status == 0
    assert (out[:, n:] == 7.0).all()
    return out[:, :n]


@pytest.mark.parametrize("kind", TYPES)
def test_unpacked_blocks_are_gguf_s_dequantized_values_bitwise(kind) -> None:
    raw = random_blocks(kind, 37, 512, seed=1)
    assert torch.equal(unpack(kind, raw).dequantize(), dequantized(kind, raw))


@pytest.mark.parametrize("plain", [False, True], ids=["vnni", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows, n", [(1, 64), (3, 45), (8, 96), (13, 33), (41, 70)])
def test_kernel_equals_a_float32_matmul_of_the_dequantized_weight(kind, dtype, plain, rows, n) -> None:
    """Odd shapes: rows past a register tile (4) and its remainder, channels past a
    packed tile (32) that are not a multiple of it."""
    raw = random_blocks(kind, n, 512, seed=rows * 100 + n)
    x = (torch.randn(rows, 512, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    blocks = unpack(kind, raw)
    expected = torch.nn.functional.linear(quantize_activations(x, blocks.scales), dequantized(kind, raw))
    got = run_kernel(blocks, x, plain)
    scale = expected.abs().max()
    ulp = 2 ** -8 if dtype == torch.bfloat16 else 1e-5  # the output's rounding; float32 summation order
    torch.testing.assert_close(got.float(), expected, rtol=ulp, atol=ulp * scale)


@pytest.mark.parametrize("kind", TYPES)
def test_the_activations_are_quantized_as_llama_cpp_quantizes_them_for_the_type(kind) -> None:
    """The kernel's rows equal the torch reference's bitwise: Q8_0 rows (per 32, the scale
    rounded to float16) for Q8_0 and Q5_0, Q8_K rows (per 256, scaled by the signed
    largest input) for Q4_K and Q6_K; and both equal ggml's own Q8_0 / Q8_K rows, as
    gguf-py's reference quantizer and dequantizer compute them."""
    library = gguf_linear._library()
    if library is None:
        pytest.skip("no native kernels here")
    scales = unpack(kind, random_blocks(kind, 1, 512, seed=0)).scales
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 3, 512)
    x[2] = 0  # all-zero blocks: zeros
    x[3, :256] = -x[3, :256].abs()  # a block whose largest input is negative
    x[4, 10], x[4, 20], x[4, 300], x[4, 400] = 5e3, -5e3, -5e3, 5e3  # |largest| twice, of both signs
    xq, dx = torch.empty(5, 512, dtype=torch.int8), torch.empty(5, 16)
    assert library.gguf_quantize_rows(x.data_ptr(), 5, 512, scales, xq.data_ptr(), dx.data_ptr()) == 0
    got = (xq.float().view(5, 16, 32) * dx[..., None]).view(5, 512)
    assert torch.equal(got, quantize_activations(x, scales))
    assert torch.equal(got[2], torch.zeros(512))
    if scales == 2:
        ggml = gguf.dequantize(gguf.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
    else:  # gguf-py has no Q8_K quantizer
        ggml = np.concatenate([ggml_q8_k(block) for block in x.numpy().reshape(-1, 256)]).reshape(5, 512)
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(ggml, dtype=np.float32)))


def ggml_q8_k(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_K_ref for one block of 256, then its dequantized values, in
    float32 scalars as the C computes them (nearest_int rounds ties to even)."""
    f32 = np.float32
    amax, largest = f32(0), f32(0)
    for v in x:
        if abs(v) > amax:
            amax, largest = abs(v), v
    if not amax:
        return np.zeros(256, dtype=f32)
    iscale = f32(-127) / largest
    q = np.minimum(127, np.rint(iscale * x.astype(f32))).astype(f32)
    return q * (f32(1) / iscale)


def test_rows_with_a_stride_and_the_torch_reference_path() -> None:
    """A strided input gives what its contiguous copy gives; the reference path (another
    device, no compiler) the kernel's products to float32 order."""
    raw = random_blocks("Q5_0", 40, 256, seed=3)
    blocks = unpack("Q5_0", raw)
    wide = torch.randn(6, 300)
    x = wide[:, 10:266]
    got = run_kernel(blocks, x)
    torch.testing.assert_close(got, run_kernel(blocks, x.contiguous()), rtol=0, atol=0)
    torch.testing.assert_close(gguf_linear.reference(x, blocks.dequantize(), blocks.scales), got, rtol=1e-5,
                               atol=1e-5)


def test_the_kernel_refuses_widths_it_cannot_block() -> None:
    library = gguf_linear._library()
    if library is None:
        pytest.skip("no native kernels here")
    x, out = torch.zeros(2, 40), torch.zeros(2, 8)
    w = torch.zeros(4096, dtype=torch.uint8)
    assert library.gguf_linear_f32(x.data_ptr(), 40, 2, 40, w.data_ptr(), 8, 32, 0, 8, out.data_ptr(), 8, 1) == 1
    assert library.gguf_linear_f32(x.data_ptr(), 32, 2, 32, w.data_ptr(), 8, 8, 0, 8, out.data_ptr(), 8, 1) == 1
    assert library.gguf_linear_f32(x.data_ptr(), 32, 2, 32, w.data_ptr(), 8, 32, 0, 7, out.data_ptr(), 8, 1) == 1
    assert library.gguf_linear_f32(x.data_ptr(), 32, 2, 32, w.data_ptr(), 8, 32, 3, 8, out.data_ptr(), 8, 1) == 1


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    folder = make_model("qwen3", tmp_path_factory.mktemp("hf") / "qwen3", seed=5)
    path = tmp_path_factory.mktemp("gguf") / "qwen3-q8.gguf"
    write_qwen3_gguf(folder, path, quantize_matrices=True)
    return path


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "reference"])
def test_a_gguf_model_computes_its_linears_from_the_blocks(q8_gguf, native, monkeypatch) -> None:
    """Every linear of the tiny Q8_0 Qwen 3 as an engine builds it (the fused q/k/v and
    gate/up one segment per part, the lm_head) computes the dequantized weight times the
    quantized activations; on the kernel and on the torch reference path."""
    if not native:
        monkeypatch.setattr(gguf_linear, "_library", lambda plain=False: None)
    elif gguf_linear._library() is None:
        pytest.skip("no native kernels here")
    _, model = build_model(EngineConfig.from_flat(model=q8_gguf, dtype="bfloat16", quantization="gguf").resolve(),
                           TPShard(), "cpu")
    reference = load_model(ModelConfig.from_dir(q8_gguf, "float32", 64))
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert {len(m.gguf_segments) for m in linears.values()} == {1, 2, 3}  # gate/up and q/k/v: a segment a part
    assert not model.gguf_sources  # the file's blocks are let go
    if native:  # the packed weights: one mapping advised for 2 MiB pages, in the order a step reads them
        starts = [s.packed.data_ptr() for m in linears.values() for s in m.gguf_segments]
        assert starts == sorted(starts) and all("hg" in vm_flags(start) for start in starts)
    for name, linear in linears.items():
        assert linear.weight.numel() == 0  # the bfloat16 copy is dropped
        x = torch.randn(5, linear.in_features, generator=torch.Generator().manual_seed(len(name))).bfloat16()
        weight = reference.get_submodule(name).weight.detach()
        expected = torch.nn.functional.linear(quantize_activations(x, 2), weight)  # Q8_0 weights: Q8_0 rows
        torch.testing.assert_close(linear(x).float(), expected, rtol=2 ** -8, atol=2 ** -8 * expected.abs().max())


def test_auto_chooses_gguf_only_where_it_is_fast_and_asked_for_bfloat16(q8_gguf, tmp_path) -> None:
    hf = make_model("qwen3", tmp_path / "hf", seed=2)
    assert EngineConfig.from_flat(model=hf).resolve().model.quantization == "none"
    assert EngineConfig.from_flat(model=q8_gguf, dtype="float32").resolve().model.quantization == "none"
    config = EngineConfig.from_flat(model=q8_gguf, dtype="bfloat16", device="cpu").resolve()
    expected = "gguf" if native.cpu_has("avx512_vnni") and gguf_linear._library() is not None else "none"
    assert config.model.quantization == expected, config.model.quantization_reason
    with pytest.raises(ValueError, match="not one"):
        EngineConfig.from_flat(model=hf, quantization="gguf").resolve()
    with pytest.raises(ValueError, match="one rank"):
        EngineConfig.from_flat(model=q8_gguf, quantization="gguf", tensor_parallel_size=2).resolve()


@pytest.mark.parametrize("plain", [False, True], ids=["vnni", "plain"])
@pytest.mark.parametrize("kind", TYPES)
def test_many_rows_read_tiles_unpacked_once_to_the_same_bits(kind, plain) -> None:
    """Past 32 rows the VNNI path rewrites a tile's blocks as bytes once for all its rows (the
    plain one reads the packed values at any count): every row comes out bitwise as it does
    in a call of 8 rows or fewer."""
    raw = random_blocks(kind, 70, 256, seed=3)
    blocks = unpack(kind, raw)
    x = torch.randn(45, 256, generator=torch.Generator().manual_seed(4))
    many = run_kernel(blocks, x, plain)
    for first in range(0, 45, 8):
        assert torch.equal(run_kernel(blocks, x[first:first + 8].contiguous(), plain), many[first:first + 8])
