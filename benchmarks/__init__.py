"""Benchmarks: micro-benchmarks of the KV cache core and, later, serving benchmarks."""
