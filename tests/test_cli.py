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
