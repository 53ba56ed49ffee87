"""Fixtures of the multi-host tests."""

from tests.support.real_gemma import gemma_gguf  # noqa: F401  (the session fixture)
