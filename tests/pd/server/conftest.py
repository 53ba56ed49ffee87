"""Fixtures shared by the server tests."""

from conftest_models import tiny_models  # noqa: F401  (the session fixture)
