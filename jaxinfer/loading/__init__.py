"""Getting weights in, one straight path: source -> tensors -> parameter tree -> cache entry.

`weights` finds a model (a name, a directory, a GGUF file, the hub) and reads Hugging Face
safetensors; `gguf_file` reads a GGUF header and tensors, `gguf_models` maps them onto a family's
tree; `checkpoint` is the engine's own orbax format; `model_cache` converts a source once and
restores it after.

May import: ops, models and the base modules. Never engine, text, cli, tools or server (a
tokenizer is handed in and out as an object; loading never builds one).
"""
