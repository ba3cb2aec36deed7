"""The host loop and the device programs it runs.

Host, free of JAX: `request` (a request's state), `page_allocator`, `prefix_cache`, `scheduler`
(which requests run this step, in which chunks), `buckets` (padded shapes). Device side: `step`
(the library's pure `prefill` / `decode_step`), `programs` (the table of compiled steps) and
`runner` (one step's arrays in, tokens out). `core` (the `Engine`: continuous batching),
`engine_stats`, `compile_cache`, `distributed` (the step plan broadcast to other processes) and
`structured` (grammar constraints: compiled per request, masks filled per step).

May import: ops, models, loading and the base modules. Never text, cli, tools or server.
The scheduler and the modules it imports stay free of JAX (an import-linter contract).
"""
