"""The proxy's live tests reuse the server tests' harness (real `pd serve` processes)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "pd" / "server"))

from conftest_models import colocated, tiny_models  # noqa: E402,F401  (the session fixtures)
