"""The native fused ops (pd/models/csrc/fused.c) against the torch ops they replace.

In float32 the two agree to float32 rounding; in bfloat16 every rounding of the torch
chain is kept, so outputs are equal but for rare elements one bfloat16 unit apart (sums
and exp() differ in the last float32 bits).
"""

import pytest
import torch
import torch.nn.functional as F

from pd.models import fused
from pd.models.layers import GatedMLP, RMSNorm, RotaryEmbedding


@pytest.fixture(autouse=True)
def _built() -> None:
    assert fused._library() is not None, "the fused kernels did not build"


def torch_path(monkeypatch):
    monkeypatch.setattr(fused, "supports", lambda x: False)


def assert_agree(native: torch.Tensor, reference: torch.Tensor, floor: float = 2.0**-100) -> None:
    """Equal but for < 2 % of elements, each at most one bfloat16 unit of max(|reference|,
    floor) apart (a floor where an output can cancel out of larger inputs)."""
    assert native.dtype == reference.dtype and native.shape == reference.shape
    if native.dtype == torch.float32:
        torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)
        return
    differ = native != reference
    assert differ.float().mean() < 0.02, f"{int(differ.sum())} of {native.numel()} elements differ"
    ulp = reference.float().abs().clamp_min(floor) * 2.0**-7
    assert ((native.float() - reference.float()).abs() <= ulp * 1.01).all(), "an element differs by more than one unit"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(monkeypatch, dtype, offset, residual) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(640, 1e-6, offset).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(37, 700) * 3).to(dtype)[:, 30:670]  # rows 700 apart: strided
    res = torch.randn(37, 640).to(dtype) if residual else None
    with torch.inference_mode():
        native = norm(x, res)
        torch_path(monkeypatch)
        reference = norm(x, res)
    assert_agree(native, reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "silu"])
def test_gated_mlp(monkeypatch, dtype, act) -> None:
    torch.manual_seed(0)
    mlp = GatedMLP(64, 256, act).to(dtype)
    x = torch.randn(2, 9, 64).to(dtype)
    with torch.inference_mode():
        gate_up = mlp.gate_up_proj(x)
        native = fused.act_mul(gate_up, act)
        gate, up = gate_up.split(256, dim=-1)
        reference = mlp.act(gate) * up
        assert_agree(native, reference)
        whole = mlp(x)
        torch_path(monkeypatch)
        torch.testing.assert_close(whole, mlp(x), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rotary_dim, norms", [(256, True), (128, False), (64, True)])
def test_norm_rotate(monkeypatch, dtype, rotary_dim, norms) -> None:
    """q/k per-head norms + RoPE from the fused projection's output, partial rotary too."""
    torch.manual_seed(0)
    heads, kv_heads, size, tokens = 4, 2, 256, 37
    rope = RotaryEmbedding(size, 4096, {"rope_theta": 10000.0, "rope_type": "default"}, rotary_dim)
    q_norm, k_norm = (RMSNorm(size, 1e-6, offset=1.0), RMSNorm(size, 1e-6, offset=1.0)) if norms else (None, None)
    if norms:
        with torch.no_grad():
            q_norm.weight.normal_(), k_norm.weight.normal_()
    width = (heads + 2 * kv_heads) * size
    qkv = (torch.randn(tokens, width + 8) * 2).to(dtype)[:, :width]
    positions = torch.randint(0, 4000, (tokens,))
    with torch.inference_mode():
        native = rope.norm_rotate(positions, qkv, heads, kv_heads, q_norm, k_norm)
        torch_path(monkeypatch)
        reference = rope.norm_rotate(positions, qkv, heads, kv_heads, q_norm, k_norm)
    for a, b in zip(native, reference, strict=True):  # rotated = x cos + x' sin can cancel
        assert_agree(a, b, floor=float(b.float().abs().max()))


def test_positions_out_of_range_are_an_error() -> None:
    """The native path indexes the tables by pointer: a position past them is refused as
    the torch lookup refuses it, not read."""
    rope = RotaryEmbedding(8, 16, {"rope_theta": 10000.0, "rope_type": "default"})
    qkv = torch.randn(2, 24)
    with pytest.raises(IndexError):
        rope.norm_rotate(torch.tensor([3, 16]), qkv, 1, 1)
    q, k, v = rope.norm_rotate(torch.tensor([3, 15]), qkv, 1, 1)
    assert q.shape == k.shape == v.shape == (2, 8)
    for bad in (16, -1):  # the kernel's own bound, for a caller that skips the check
        with pytest.raises(ValueError, match="refused"):
            fused.qk_norm_rope(qkv, 1, 1, 8, None, None, 1e-6, torch.tensor([3, bad]), rope.cos, rope.signed_sin)


def test_fused_ops_are_optional(monkeypatch) -> None:
    monkeypatch.setenv("PD_NATIVE_KERNELS", "0")
    fused._library.cache_clear()
    try:
        assert not fused.supports(torch.zeros(2, 4))
        norm = RMSNorm(4)
        torch.testing.assert_close(norm(torch.ones(2, 4)), F.rms_norm(torch.ones(2, 4), (4,), norm.weight, 1e-6))
    finally:
        fused._library.cache_clear()
