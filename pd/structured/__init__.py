"""Structured outputs: the grammar a request's output must follow (`grammar.py`, which
the server builds and the engine receives) and the engine's per-request matchers that
turn it into a mask of the tokens allowed next (`matchers.py`, llguidance)."""
