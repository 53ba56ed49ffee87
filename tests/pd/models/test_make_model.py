"""Tiny random checkpoints (pd/models/make_model.py): transformers loads them as the real thing."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer

from cli.main import MAKE_MODEL_ARCHS, main
from pd.models.make_model import ARCHS, VOCAB, make_model

TEXTS = [
    "Hello, world! How are you today?",
    "  indented\n\tcode(x) = 42 + 3.14159;\n",
    "Les élèves mangent des crêpes — 中文 日本語 русский 🙂🚀",
    "<not a special token> 12345 it's",
]
USER = "What is the capital of France?"
# Each family's chat markers, as its template must render them around a user turn.
MARKERS = {
    "qwen3": ("<|im_start|>user\n", "<|im_end|>", "<|im_start|>assistant\n"),
    "gemma3": ("<bos><start_of_turn>user\n", "<end_of_turn>", "<start_of_turn>model\n"),
    "bamba": ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>",
              "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "granitehybrid": ("<|start_of_role|>user<|end_of_role|>", "<|end_of_text|>",
                      "<|start_of_role|>assistant<|end_of_role|>"),
}
# What transformers must make of each config.json.
EXPECTED_CONFIG = {
    "qwen3": {"tie_word_embeddings": True, "num_hidden_layers": 4, "head_dim": 64,
              "layer_types": ["full_attention"] * 4, "sliding_window": None},
    "gemma3": {"tie_word_embeddings": True, "sliding_window": 128, "query_pre_attn_scalar": 64,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
               "rope_parameters": {
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                   "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}},
    "bamba": {"tie_word_embeddings": False, "attn_layer_indices": [2, 5], "mamba_n_heads": 8,
              "mamba_d_head": 64, "mamba_d_state": 64,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0,
                                  "partial_rotary_factor": 0.5}},
    "granitehybrid": {"tie_word_embeddings": True, "num_local_experts": 0,
                      "shared_intermediate_size": 512, "position_embedding_type": "nope",
                      "layer_types": ["linear_attention", "linear_attention", "full_attention"] * 2,
                      "embedding_multiplier": 12.0, "logits_scaling": 8.0},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("seed0")
    return {arch: make_model(arch, root / arch, seed=0) for arch in ARCHS}


@pytest.fixture(scope="module")
def seed1_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("seed1")
    return {arch: make_model(arch, root / arch, seed=1) for arch in ARCHS}


@pytest.fixture(scope="module")
def loaded(checkpoints: dict[str, Path]) -> Callable[[str], tuple[Any, dict[str, list]]]:
    """transformers' model for an arch and its loading info, loaded once per module."""
    cache: dict[str, tuple[Any, dict[str, list]]] = {}

    def load(arch: str) -> tuple[Any, dict[str, list]]:
        if arch not in cache:
            cache[arch] = transformers.AutoModelForCausalLM.from_pretrained(
                checkpoints[arch], dtype=torch.float32, output_loading_info=True)
        return cache[arch]

    return load


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_transformers_loads_every_weight(arch: str, checkpoints: dict[str, Path],
                                         loaded: Callable) -> None:
    model_dir = checkpoints[arch]
    model, info = loaded(arch)
    assert {key: value for key, value in info.items() if value} == {}
    assert type(model).__name__ == read_json(model_dir / "config.json")["architectures"][0]
    # The loaded parameters are ours, not a fresh init.
    saved = load_file(model_dir / "model.safetensors")
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in saved.items())
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(state) == set(saved) | tied


@pytest.mark.parametrize("arch", list(ARCHS))
def test_transformers_forward_gives_varied_finite_logits(arch: str, loaded: Callable) -> None:
    model, _ = loaded(arch)
    ids = torch.tensor([[10, 300, 1200, 7, 2048, 99, 3000, 512]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 8, VOCAB)
    assert torch.isfinite(logits).all()
    assert logits.std(dim=1).mean() > 1e-3  # positions differ
    assert logits.std(dim=2).min() > 1e-3  # the vocab is not flat at any position


@pytest.mark.parametrize("arch", list(ARCHS))
def test_config_reads_as_the_family_does(arch: str, checkpoints: dict[str, Path]) -> None:
    config = transformers.AutoConfig.from_pretrained(checkpoints[arch])
    assert config.vocab_size == VOCAB
    assert config.dtype == torch.float32
    for key, value in EXPECTED_CONFIG[arch].items():
        assert getattr(config, key) == value, key


def test_gemma_norms_are_nonzero_offsets(checkpoints: dict[str, Path]) -> None:
    weights = load_file(checkpoints["gemma3"] / "model.safetensors")
    norms = [name for name in weights if "norm" in name]
    assert len(norms) == 6 * 6 + 1  # four layer norms, q_norm, k_norm; the final norm
    assert all(0.01 < weights[name].abs().mean() < 0.5 for name in norms)


def test_mamba_parameters_have_published_shapes(checkpoints: dict[str, Path]) -> None:
    weights = load_file(checkpoints["bamba"] / "model.safetensors")
    assert weights["model.layers.0.mamba.conv1d.weight"].shape == (640, 1, 4)
    assert weights["model.layers.0.mamba.in_proj.weight"].shape == (2 * 512 + 2 * 64 + 8, 256)
    assert (weights["model.layers.0.mamba.A_log"].exp() >= 1).all()
    dt = torch.nn.functional.softplus(weights["model.layers.0.mamba.dt_bias"])
    assert ((dt > 0.9e-3) & (dt < 0.11)).all()
    assert "model.layers.2.mamba.in_proj.weight" not in weights
    assert "model.layers.2.self_attn.q_proj.weight" in weights


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tokenizer_has_exactly_the_model_vocab(arch: str, checkpoints: dict[str, Path]) -> None:
    model_dir = checkpoints[arch]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert len(tokenizer) == raw.get_vocab_size(with_added_tokens=True) == VOCAB
    assert max(raw.get_vocab(with_added_tokens=True).values()) == VOCAB - 1
    generation = read_json(model_dir / "generation_config.json")
    stops = generation["eos_token_id"]
    assert tokenizer.eos_token_id == (stops if isinstance(stops, int) else stops[0])
    assert tokenizer.pad_token_id == generation["pad_token_id"]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tokenizer_round_trips_text(arch: str, checkpoints: dict[str, Path]) -> None:
    model_dir = checkpoints[arch]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        # tokenizer_class must not change tokenization from what tokenizer.json says.
        assert ids == raw.encode(text).ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert raw.decode(ids, skip_special_tokens=True) == text
        assert len(ids) < len(text.encode())  # merges happen


def test_only_gemma_and_bamba_prepend_bos(checkpoints: dict[str, Path]) -> None:
    firsts = {arch: Tokenizer.from_file(str(path / "tokenizer.json")).encode("hi").ids[0]
              for arch, path in checkpoints.items()}
    bos = {arch: read_json(path / "config.json")["bos_token_id"]
           for arch, path in checkpoints.items()}
    assert firsts["gemma3"] == bos["gemma3"] == 2
    assert firsts["bamba"] == bos["bamba"]
    assert firsts["qwen3"] != bos["qwen3"] and firsts["granitehybrid"] != bos["granitehybrid"]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_chat_template_renders_family_markers(arch: str, checkpoints: dict[str, Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints[arch])
    messages = [{"role": "user", "content": USER}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    opener, closer, generation_prompt = MARKERS[arch]
    assert prompt == opener + USER + closer + ("\n" if arch != "bamba" else "") + generation_prompt
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                        return_dict=False)
    assert tokenizer.decode(ids) == prompt


@pytest.mark.parametrize("arch", list(ARCHS))
def test_same_seed_same_bytes_other_seed_other_weights(
        arch: str, checkpoints: dict[str, Path], seed1_checkpoints: dict[str, Path],
        tmp_path: Path) -> None:
    again = make_model(arch, tmp_path / arch, seed=0)
    names = sorted(path.name for path in checkpoints[arch].iterdir())
    assert names == sorted(path.name for path in again.iterdir())
    for name in names:
        assert (again / name).read_bytes() == (checkpoints[arch] / name).read_bytes(), name
    other = seed1_checkpoints[arch]
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_checkpoint_files_and_size(arch: str, checkpoints: dict[str, Path]) -> None:
    names = {path.name for path in checkpoints[arch].iterdir()}
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json"}
    assert names == expected | ({"special_tokens_map.json"} if arch != "qwen3" else set())
    tokenizer_config = read_json(checkpoints[arch] / "tokenizer_config.json")
    assert tokenizer_config["model_max_length"] == 4096
    assert tokenizer_config["add_bos_token"] == (arch in ("gemma3", "bamba"))
    assert (checkpoints[arch] / "model.safetensors").stat().st_size < 32 << 20


def test_cli_make_model_writes_the_same_checkpoint(seed1_checkpoints: dict[str, Path],
                                                   tmp_path: Path) -> None:
    out = tmp_path / "cli-qwen3"
    assert main(["make-model", "--arch", "qwen3", "--out", str(out), "--seed", "1"]) == 0
    expected = seed1_checkpoints["qwen3"]
    for path in expected.iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name


def test_cli_arch_choices_match_make_model() -> None:
    assert MAKE_MODEL_ARCHS == tuple(ARCHS)


def test_unknown_arch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown arch"):
        make_model("llama", tmp_path)
    with pytest.raises(SystemExit):
        main(["make-model", "--arch", "llama", "--out", str(tmp_path)])
