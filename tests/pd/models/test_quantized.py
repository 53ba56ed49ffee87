"""`--quantization int8` (pd.models.quantized, pd/csrc/int8_linear.c): the native kernel
computes what the torch reference computes, for every shape the kernel tiles unevenly;
the Hadamard rotation is the matrix it claims and is what keeps an outlier channel from
ruining a row; quantized tiny models stay close to their unquantized logits on both
paths."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from pd.config import EngineConfig
from pd.models import quantized
from pd.models.loader import load_model
from pd.models.make_model import make_model
from pd.models.model_config import ModelConfig
from pd.models.quantized import HADAMARD_ROWS, hadamard, quantize_linears, quantize_weight, reference, rotation_block
from tests.support.mappings import vm_flags
from tests.support.model_runs import run_prompt


def sylvester(order: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < order:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_the_kernel_is_built_on_this_machine() -> None:
    """The speed of --quantization int8 depends on it; a broken build must not pass
    quietly as the torch fallback."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    assert quantized._library() is not None


@pytest.mark.parametrize("width, block", [(640, 128), (2048, 128), (96, 32), (100, 4), (37, 1)])
def test_rotation_block_is_the_largest_power_of_two_dividing_the_width(width, block) -> None:
    assert rotation_block(width) == block


@pytest.mark.parametrize("block", [1, 2, 16, 32, 128])
def test_hadamard_is_the_block_sylvester_matrix(block) -> None:
    x = torch.randn(3, 4 * block, dtype=torch.float64).float()
    expected = (x.reshape(3, 4, block) @ sylvester(block)).reshape(3, 4 * block)
    torch.testing.assert_close(hadamard(x, block), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hadamard(hadamard(x, block), block) / block, x, rtol=1e-5, atol=1e-5)


def test_hadamard_of_many_rows_with_leading_dims_leaves_its_input_alone() -> None:
    """Rows past HADAMARD_ROWS (rotated in place, a slice at a time) and leading dims."""
    x = torch.randn(2, HADAMARD_ROWS + 7, 64)
    before = x.clone()
    expected = (x.reshape(-1, 2, 32) @ sylvester(32)).reshape(x.shape)
    torch.testing.assert_close(hadamard(x, 32), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, k, n, bias", [(1, 640, 2048, False), (8, 640, 4096, False), (13, 96, 45, True),
                                              (100, 2048, 640, False), (3, 37, 33, True), (12, 100, 32, False),
                                              (0, 64, 64, False)])
def test_native_kernel_computes_the_reference(dtype, rows, k, n, bias) -> None:
    """Uneven tiles: rows past 12 (a register tile), widths that are not a multiple of 4
    (a VNNI group) nor of 32 (a packed tile), a bias, rows spread over threads (100)."""
    if quantized._library() is None:
        pytest.skip("no native kernels here")
    gen = torch.Generator().manual_seed(rows * 7 + k)
    linear = nn.Linear(k, n, bias=bias).to(dtype).requires_grad_(False)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weight_q, scale, block = quantize_weight(linear.weight)
    expected = reference(x, weight_q, scale, None if linear.bias is None else linear.bias.float(), block)
    quantize_linears(linear)
    assert linear.weight_packed is not None and linear.weight.numel() == 0
    got = linear(x)
    assert got.shape == (rows, n) and got.dtype == dtype
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -22  # the last step's rounding, in another order
    torch.testing.assert_close(got, expected, rtol=ulp, atol=ulp)


def test_native_kernel_takes_rows_with_a_stride_and_leading_dims() -> None:
    if quantized._library() is None:
        pytest.skip("no native kernels here")
    linear = nn.Linear(64, 48).requires_grad_(False)
    quantize_linears(linear)
    wide = torch.randn(2, 5, 80)
    x = wide[..., 8:72]  # rows 80 apart
    assert linear(x).shape == (2, 5, 48)
    torch.testing.assert_close(linear(x), linear(x.contiguous()), rtol=0, atol=0)


def test_an_outlier_channel_costs_little_because_of_the_rotation() -> None:
    """One input channel 100x the others (as in real models' activations): with the
    rotation the product stays within ~1 % of float; without it (block 1) the other
    channels keep a couple of levels each and the error is several times larger."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 640, generator=gen)
    x = torch.randn(16, 640, generator=gen)
    x[:, 5] *= 100
    exact = x @ w.T
    weight_q, scale, block = quantize_weight(w)
    assert block == 128
    rotated = relative_error(reference(x, weight_q, scale, None, block), exact)
    plain_q, plain_scale = quantized.quantize_rows(w)
    plain = relative_error(reference(x, plain_q, plain_scale[:, 0], None, 1), exact)
    assert rotated < 0.015
    assert plain > 3 * rotated


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "bamba"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_quantized_tiny_models_stay_close_to_their_logits(arch, dtype, tmp_path, monkeypatch) -> None:
    """Every linear quantized (lm_head too, its tied embedding kept); logits within a few
    percent of the unquantized model's, native and torch paths closer still."""
    config = ModelConfig.from_dir(make_model(arch, tmp_path / arch, seed=3), dtype=dtype)
    plain, native, fallback = load_model(config), load_model(config), load_model(config)
    linears = [m for m in native.modules() if isinstance(m, nn.Linear)]
    assert quantize_linears(native) == len(linears) > 0
    if quantized._library() is not None:  # the packed weights: one mapping of 2 MiB pages, in a step's order
        starts = [m.weight_packed.data_ptr() for m in linears]
        assert starts == sorted(starts) and all("hg" in vm_flags(start) for start in starts)
    tokens = torch.randint(0, config.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    want, got = run_prompt(plain, tokens), run_prompt(native, tokens)
    monkeypatch.setattr(quantized, "_library", lambda: None)
    quantize_linears(fallback)
    assert all(m.weight_q is not None for m in fallback.modules() if isinstance(m, nn.Linear))
    got_fallback = run_prompt(fallback, tokens)
    assert relative_error(got, want) < 0.06  # measured 2.4-4.1 %
    assert relative_error(got_fallback, got) < 0.03  # measured 0.4-2.0 %: roundings flip a few int8 levels
    assert all(m.weight.numel() == 0 for m in linears)
    assert torch.equal(native.model.embed_tokens.weight, plain.model.embed_tokens.weight)


def test_engine_config_refuses_an_unknown_quantization(tmp_path) -> None:
    model = make_model("qwen3", tmp_path / "q", seed=3)
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8, gguf"):
        EngineConfig.from_flat(model=model, quantization="int4").resolve()
    assert EngineConfig.from_flat(model=model, quantization="int8").resolve().model.quantization == "int8"
