"""Getting weights in, one straight path: source -> tensors -> parameter tree -> cache entry.

`weights` finds a model (a name, a directory, a GGUF file, the hub) and reads Hugging Face
safetensors; `gguf_models` maps a GGUF file's tensors (read with `jaxinfer.gguf_file`) onto a
family's tree; `checkpoint` is the engine's own orbax format; `model_cache` converts a source once and
restores it after.

May import: ops, models, text (a model's tokenizer is loaded and stored with it) and the base
modules. Never engine, cli, tools or server.
"""
