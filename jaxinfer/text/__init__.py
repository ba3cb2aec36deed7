"""Text: the tokenizer (HF tokenizer.json, SentencePiece, a GGUF vocabulary), the incremental
detokenizer and chat templates.

May import: the base modules (a GGUF vocabulary is read with `jaxinfer.gguf_file`). Never ops,
models, loading, engine, cli, tools or server: loading builds and stores tokenizers, the
engine's `processor` uses them.
"""
