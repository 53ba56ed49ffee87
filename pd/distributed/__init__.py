"""Tensor parallelism: which share of a model a rank holds, and the collectives between ranks."""
