"""Text in and out: the tokenizer (HF tokenizer.json, SentencePiece, a GGUF vocabulary), the
incremental detokenizer, chat templates, and the `InputProcessor` that turns a prompt or a
conversation into a validated engine request.

May import: engine (the request it builds, grammar constraints), loading (a GGUF vocabulary),
and the base modules. Never cli, tools or server.
"""
