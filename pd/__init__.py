"""pd: a disaggregated prefill/decode LLM serving engine."""
