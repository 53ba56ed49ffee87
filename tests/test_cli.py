"""Tests for the `pd` command line (pd/cli.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

from pd.cli import main, package_version


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

    from pd.llm import LLM
    from pd.request import SamplingParams

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
    result = subprocess.run([sys.executable, "-m", "pd.cli", "version"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == package_version()
