"""Tests for the `pd` command line (cli/main.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main, package_version
from wire.fleet import ADMIN_KEY_ENV, SECRET_ENV


def test_version_prints_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == package_version()
    assert out.split(".")[0].isdigit()


def test_no_subcommand_prints_help_and_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: pd" in capsys.readouterr().out


def test_unknown_subcommand_exits_with_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    assert exc.value.code == 2


def test_installed_console_script() -> None:
    script = Path(sys.executable).parent / "pd"
    result = subprocess.run([str(script), "version"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == package_version()


def test_generate_prints_one_json_object_per_prompt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from pd.contracts.sampling_params import SamplingParams
    from pd.llm import LLM

    model = tmp_path / "bamba"
    assert main(["make-model", "--arch", "bamba", "--out", str(model)]) == 0
    capsys.readouterr()
    prompts = ["Hello there", "The sea is"]
    argv = ["generate", "--model", str(model), "--max-tokens", "5", "--kv-cache-memory", str(32 << 20)]
    assert main(argv + [arg for p in prompts for arg in ("--prompt", p)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = LLM(str(model), kv_cache_memory=32 << 20).generate(prompts, SamplingParams(max_tokens=5, temperature=0))
    assert [line["prompt"] for line in lines] == prompts
    assert [line["token_ids"] for line in lines] == [e.token_ids for e in expected]
    assert [line["text"] for line in lines] == [e.text for e in expected]


def test_generate_rejects_bad_flags_with_a_message(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="max_tokens must be positive"):
        main(["generate", "--model", str(tmp_path), "--prompt", "x", "--max-tokens", "0"])
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", str(tmp_path), "--prompt", "x", "--kv-layout", "diagonal"])
    assert exc.value.code == 2  # argparse's usage error


def test_python_dash_m_runs_the_cli() -> None:
    result = subprocess.run([sys.executable, "-m", "cli.main", "version"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == package_version()


def test_every_flag_of_every_command_has_help_text() -> None:
    from cli.main import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            assert action.help, f"pd {name} {action.option_strings or action.dest} has no help text"


def test_a_command_builds_only_its_own_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """`pd serve` starts without importing the proxy's and the benchmarks' modules (their
    flags are not its); `pd serve --help` still lists serve's flags."""
    code = ("import sys; from cli.main import build_parser; parser = build_parser('serve'); "
            "parser.parse_args(['serve', '--model', 'm', '--port', '1']); "
            "print(sorted(m for m in sys.modules if m.startswith(('proxy', 'benchmarks'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0 and "--kv-connector" in capsys.readouterr().out


def test_proxy_needs_servers_or_a_way_for_them_to_join(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)  # with it, prefill servers could register: the proxy would serve
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["proxy", "--decode", "http://127.0.0.1:1"])
    assert "--admin-key" in str(exc.value.code) and "--fleet-secret" in str(exc.value.code)


def test_bench_serve_is_the_serving_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pd bench serve") and "--prefill-url" in out and "--goodput" in out


def test_convert_shows_plain_progress_per_tensor_on_stderr_off_a_terminal(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from pd.models.gguf import GGUFModel
    from pd.models.make_model import make_model
    from tests.support.gguf_files import write_qwen3_gguf

    folder = make_model("qwen3", tmp_path / "qwen3", seed=1)
    write_qwen3_gguf(folder, tmp_path / "qwen3.gguf", quantize_matrices=True)
    total = len(list(GGUFModel(tmp_path / "qwen3.gguf").lazy_weights()))
    # the tiny file has no vocabulary: a stand-in tokenizer, the weights are the work shown
    monkeypatch.setattr(GGUFModel, "tokenizer", lambda self: (Tokenizer(WordLevel({"a": 0}, unk_token="a")), {}))
    assert main(["convert", str(tmp_path / "qwen3.gguf"), str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("pd convert: wrote ")  # stdout keeps its one line
    lines = err.splitlines()
    assert "\r" not in err and 2 <= len(lines) <= 10
    assert lines[0].startswith("converting weights: ") and f"/{total} tensors (" in lines[0]
    assert lines[-1].startswith(f"converting weights: {total}/{total} tensors (100%) in ")
