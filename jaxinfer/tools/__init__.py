"""Tools, not the engine: the device check, the serving and start-up benchmarks and the soak.

They drive the engine from outside, as a user would (the library, the CLI, the gRPC and HTTP
servers). Nothing in the engine imports them. `python -m jaxinfer.device_check` and
`python -m jaxinfer.server.soak` still run them.
"""
