"""Device code: pure functions of arrays, jitted by the layers above.

`backend` (the `KernelChoice`: which kernels a step program calls, decided once and passed to the
steps as a static argument; dtype "auto"), attention (`attention`: the one entry point;
`gather_attention`: the pure-JAX path; `attention_pallas`: the TPU kernel's adapter), the paged KV
cache pytree, the sampler, quantized weights, the mesh's sharding rules, parameter specs, the batch-invariant
reductions, the native CPU kernels (`kernels/`: C++ built on first use) and their JAX adapters.

May import: the base modules at the package root (config, env, sampling_params, progress) and
third-party libraries. Never the host layers (engine, loading, text, cli, tools, server) nor
`jaxinfer.models`, which is built on this layer.
"""
