"""The terminal: `jaxinfer` commands (`main`), their flag groups (`flags`, `argtypes`) and the
interactive chat (`repl`).

May import every layer below (the library's `LLM`, text, engine, loading) and `jaxinfer.server`
(serve, --server) and `jaxinfer.tools` (bench). JAX-heavy modules are imported inside the
command that needs them, so `jaxinfer --help` and the first progress line come at once.
"""
