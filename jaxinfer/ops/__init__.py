"""Device code: pure functions of arrays, jitted by the layers above.

Attention (the paged kernel's adapters for CPU, GPU and TPU), the paged KV cache pytree, the
sampler, quantized weights, the mesh's sharding rules, parameter specs, the batch-invariant
reductions, the native CPU kernels (`kernels/`: C++ built on first use) and their JAX adapters.

May import: the base modules at the package root (config, env, sampling_params, progress) and
third-party libraries. Never the host layers (engine, loading, text, cli, tools, server) nor
`jaxinfer.models`, which is built on this layer.
"""
