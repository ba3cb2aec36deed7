"""Benchmarks shipped with jaxinfer: what a user runs against their own install.

* `jaxinfer.benchmarks.serving`: ``jaxinfer bench``, a load generator over the
  library or a running ``jaxinfer serve``;
* `jaxinfer.benchmarks.startup`: ``python -m jaxinfer.benchmarks.startup``, the
  time to first text, to a ready server and to a loaded ``LLM``.

The peer benchmarks against Hugging Face transformers (and the server's figures)
live in the repository's top-level ``benchmarks/`` folder, which is not installed.
Their statistics, like these, come from `jaxinfer.stats`.
"""
