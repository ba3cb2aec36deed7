"""Peer benchmarks of a jaxinfer checkout; not installed with the package.

Run them from the repository root, e.g. ``python -m benchmarks.core``; see
``benchmarks/README.md`` for what each one measures and what it needs.
Importing this package imports nothing.
"""
