"""The real Gemma's session fixtures (tests/support/real_gemma.py)."""

from tests.support.real_gemma import english_text, gemma_gguf  # noqa: F401  (the session fixtures)
