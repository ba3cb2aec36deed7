"""The host loop and the device programs it runs.

Host, free of JAX: `request` (a request's state), `page_allocator`, `prefix_cache`, `scheduler`
(which requests run this step, in which chunks), `buckets` (padded shapes). Device side: `step`
(the library's pure `prefill` / `decode_step`), `programs` (the table of compiled steps) and
`runner` (one step's arrays in, tokens out). `core` (the `Engine`: continuous batching),
`engine_stats`, `compile_cache`, `distributed` (the step plan broadcast to other processes),
`processor` (the `InputProcessor`: a prompt, a conversation or token ids in, a validated request
out), `structured` (grammar constraints: compiled per request, masks filled per step) and
`sampling` (each row's sampling settings padded into the sampler's arrays).

May import: ops, models, text, loading and the base modules. Never cli, tools or server.
The scheduler and the modules it imports stay free of JAX (an import-linter contract).
"""
