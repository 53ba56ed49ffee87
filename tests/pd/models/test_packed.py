"""`pack_linears`: bfloat16 CPU linears with weights packed once for oneDNN give bitwise
the logits of the unpacked model and drop their own weights (a tied lm_head's embedding
stays); float32 ones give them to float32 rounding (oneDNN sums in another order than
the BLAS F.linear calls); bfloat16 ones widened to float32 (a CPU without oneDNN's
bfloat16 kernels) give them to bfloat16 rounding; other dtypes are left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pd.models import packed as packed_module
from pd.models.loader import load_model
from pd.models.make_model import make_model
from pd.models.model_config import ModelConfig
from pd.models.packed import pack_linears, packing_supported
from tests.support.model_runs import run_prompt


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "bamba"])
def test_packed_bfloat16_model_gives_bitwise_the_same_logits(arch, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(packed_module, "widens", lambda *args: False)  # oneDNN's bfloat16 packing only
    config = ModelConfig.from_dir(make_model(arch, tmp_path / arch, seed=3), dtype="bfloat16")
    plain, packed = load_model(config), load_model(config)
    linears = [m for m in packed.modules() if isinstance(m, nn.Linear)]
    supported = packing_supported(torch.bfloat16, torch.device("cpu"))  # not on an AVX2-only CPU
    assert pack_linears(packed) == (len(linears) if supported else 0) and linears
    tokens = torch.randint(0, config.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(run_prompt(packed, tokens), run_prompt(plain, tokens))
    assert all((linear.weight.numel() == 0) == supported for linear in linears)  # a packed copy replaces the weight
    assert torch.equal(packed.model.embed_tokens.weight, plain.model.embed_tokens.weight)  # a tied one's too


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "bamba"])
def test_packed_float32_model_gives_the_same_logits_to_rounding(arch, tmp_path) -> None:
    config = ModelConfig.from_dir(make_model(arch, tmp_path / arch, seed=3), dtype="float32")
    plain, packed = load_model(config), load_model(config)
    assert pack_linears(packed) == len([m for m in packed.modules() if isinstance(m, nn.Linear)]) > 0
    tokens = torch.randint(0, config.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(run_prompt(packed, tokens), run_prompt(plain, tokens), rtol=1e-4, atol=1e-4)


def test_float16_models_are_not_packed(tmp_path) -> None:
    model = load_model(ModelConfig.from_dir(make_model("qwen3", tmp_path / "q", seed=3), dtype="float16"))
    assert pack_linears(model) == 0
    assert all(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "bamba"])
def test_widened_bfloat16_model_gives_the_same_logits_to_bfloat16_rounding(arch, tmp_path, monkeypatch) -> None:
    """Where oneDNN packs float32 but not bfloat16 (forced here, so that this runs on any
    CPU): bfloat16 linears run on float32 copies of their weights, outputs rounded back to
    bfloat16: the logits of the plain bfloat16 model within bfloat16 rounding (the sums
    run in another order), and the weights are dropped for the packed copies."""
    monkeypatch.setattr(packed_module, "_packs", lambda dtype: dtype == torch.float32)
    config = ModelConfig.from_dir(make_model(arch, tmp_path / arch, seed=3), dtype="bfloat16")
    plain, widened = load_model(config), load_model(config)
    linears = [m for m in widened.modules() if isinstance(m, nn.Linear)]
    assert pack_linears(widened) == len(linears) > 0
    assert all(linear.weight.numel() == 0 and linear.packed_weight.dtype == torch.float32 for linear in linears)
    tokens = torch.randint(0, config.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    got, want = run_prompt(widened, tokens), run_prompt(plain, tokens)
    assert got.dtype == want.dtype
    similarity = torch.nn.functional.cosine_similarity(got.float().flatten(), want.float().flatten(), dim=0)
    assert similarity > 0.999, similarity
    assert (got.float().argmax(-1) == want.float().argmax(-1)).float().mean() > 0.95
