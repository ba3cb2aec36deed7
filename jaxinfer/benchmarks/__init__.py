"""Benchmarks: `python -m jaxinfer.benchmarks.core` (jaxinfer vs transformers on this machine)."""
