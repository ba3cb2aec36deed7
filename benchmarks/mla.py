"""Multi-head latent attention's decode step against grouped-query attention's, side by side in one run (issue 25).

    python -m benchmarks.mla            (from the repository root)

Two random-weight models built in memory (no downloads), alike but for attention, both with dense MLPs so
the difference is the attention alone:

* **mla**: a DeepSeek-V2-shaped model (``deepseek_v2``: ``--heads`` heads, a ``--kv-lora-rank`` latent and a
  ``--qk-rope`` rotary key cached per token, ``--qk-nope`` / ``--v-head`` per-head dims, a plain ``q_proj``
  as V2-Lite has unless ``--q-lora-rank``), attention in the absorbed form over the latent cache
  (`jaxinfer.models.transformer.latent_attention`);
* **gqa**: a Llama-shaped model with ``--kv-heads`` KV heads of ``--head-dim``, its MLP widened so both run
  the same parameters per token (within one multiple of 64 of the MLP width);
* **gqa-jax**: the gqa engine with its attention on the pure-JAX gather path (what GPUs and TPUs run, and CPU
  with ``JAXINFER_CPU_KERNELS=0``), so mla (on CPU: the latent attention kernel) against gqa and gqa-jax
  compares MLA's native kernel with GQA's native and pure-JAX attention.

For each context length and batch size, every engine's real decode step is timed (`benchmarks.core.StepBench`:
the runner's compiled ragged step called with its cache fed back, each request at that context, the prefix
cache off), the systems taking turns each round in rotation (`jaxinfer.tools.harness.alternate`); the report
gives the median over ``--rounds`` rounds of each round's median step, beside what the step must read (every
weight but the embedding table, plus ``batch x context`` cached tokens' entries), the floor those bytes set at
the machine's read bandwidth (`harness.peaks`), and the attention's FLOPs. Then the KV bytes per token of the
real DeepSeek-V3 and V2-Lite against a per-head key/value cache of the same heads, and one conclusion line.
The CPU flags and the load average are printed with the figures.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import jaxinfer
from jaxinfer.config import ModelConfig
from jaxinfer.engine.buckets import pages_needed
from jaxinfer.engine.programs import ProgramTable
from jaxinfer.models import active_params, config_from_hf, describe, get_family
from jaxinfer.ops.backend import engine_preset, resolve_engine_config
from jaxinfer.ops.kv_cache import kv_bytes_per_token, token_entry
from jaxinfer.ops.spec import init_random
from jaxinfer.stats import median
from jaxinfer.tools.harness import Bench, heading, parser, peaks, peaks_line, run, table

from benchmarks.core import StepBench

SYSTEMS = ("mla", "gqa", "gqa-jax")

# The real models' attention, from their config.json (DeepSeek-V3 from transformers' defaults, which are
# V3's; V2-Lite as deepseek-ai/DeepSeek-V2-Lite publishes it)
REAL = {
    "DeepSeek-V3": dict(model_type="deepseek_v3"),
    "DeepSeek-V2-Lite": dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                             num_hidden_layers=27, num_attention_heads=16, kv_lora_rank=512, q_lora_rank=None,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
                             n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408,
                             first_k_dense_replace=1, topk_method="greedy"),
}


# --------------------------------------------------------------------------- #
# The two models
# --------------------------------------------------------------------------- #


def attention_params(cfg: ModelConfig) -> int:
    """One layer's attention projection parameters."""
    d, h = cfg.hidden_size, cfg.num_heads
    if cfg.latent:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q = cfg.q_lora_rank * (d + h * qk) if cfg.q_lora_rank else d * h * qk
        kv = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.head_dim)
        return q + kv + h * cfg.head_dim * d
    return d * (h + 2 * cfg.num_kv_heads) * cfg.head_dim + h * cfg.head_dim * d


def configs(a) -> tuple[ModelConfig, ModelConfig]:
    """(mla, gqa): the DeepSeek-shaped model and the Llama-shaped one with about its parameters per token."""
    mla = config_from_hf(dict(
        model_type="deepseek_v2", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, kv_lora_rank=a.kv_lora_rank,
        q_lora_rank=a.q_lora_rank or None, qk_nope_head_dim=a.qk_nope, qk_rope_head_dim=a.qk_rope,
        v_head_dim=a.v_head, n_routed_experts=0, max_position_embeddings=a.max_position), "mla")
    gqa = ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
                      max_position_embeddings=a.max_position, architecture="llama", name="gqa")
    # the attention parameters MLA has beyond GQA's go to GQA's MLP (gate, up and down: 3 x hidden each)
    extra = attention_params(mla) - attention_params(gqa)
    width = a.intermediate + round(extra / (3 * a.hidden) / 64) * 64
    if width < 64:
        raise ValueError(f"--intermediate {a.intermediate} leaves GQA's MLP {width} wide to match MLA's attention; "
                         f"make it larger")
    return mla, dataclasses.replace(gqa, intermediate_size=width)


def per_head_values(cfg: ModelConfig) -> int:
    """Values a layer would cache per token for MLA's heads as per-head keys and values (no latent):
    heads x (nope + rope key dims + value dims)."""
    return cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.head_dim)


def real_models(dtype: str = "bfloat16") -> dict:
    """KV bytes per token of the real DeepSeek configs: the latent cache against per-head keys and values."""
    out = {}
    for name, d in REAL.items():
        cfg = config_from_hf(dict(d), name)
        rows, width = token_entry(cfg)
        latent = kv_bytes_per_token(cfg, dtype)
        per_head = per_head_values(cfg) * cfg.num_layers * jnp.dtype(dtype).itemsize
        out[name] = {"layers": cfg.num_layers, "heads": cfg.num_heads, "latent_values": rows * width,
                     "per_head_values": per_head_values(cfg), "qk_dim": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                     "v_dim": cfg.head_dim, "latent_bytes": latent, "per_head_bytes": per_head,
                     "smaller_by": per_head / latent, "dtype": dtype}
    return out


def attention_flops(cfg: ModelConfig, batch: int, context: int) -> float:
    """Multiply-adds x 2 of one decode step's attention over the cache (scores and weighted values; the
    projections are counted with the weights): each head scores every cached token's key and sums its value."""
    if cfg.latent:  # every head: the whole entry as its key, the latent as its value
        per_token = cfg.num_heads * (cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.kv_lora_rank)
    else:
        per_token = cfg.num_heads * 2 * cfg.head_dim
    return 2.0 * per_token * context * batch * cfg.num_layers


def weight_bytes(params) -> int:
    """Bytes a decode step reads of the weights: every one but the embedding table (a row per token), the
    LM head included (tied: the table is the head, read whole)."""
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    return total if params.lm_head is None else total - params.embed.nbytes


# --------------------------------------------------------------------------- #
# The engines
# --------------------------------------------------------------------------- #


def build(cfg: ModelConfig, ecfg, dtype):
    params = init_random(get_family(cfg.architecture).param_specs(cfg, jnp.dtype(dtype)), jax.random.key(0),
                         scale=0.05)
    return jaxinfer.LLM.from_params(cfg, params, engine_config=ecfg, name=cfg.name, enable_prefix_caching=False)


def without_attention_kernel(llm):
    """A twin engine on `llm`'s weights whose programs take the pure-JAX attention path (the native CPU matmul
    kept): its runner's kernel choice with the attention kernel off, and a program table traced with it."""
    twin = jaxinfer.LLM.from_params(llm.model_config, llm.runner.params, engine_config=llm.engine_config,
                                    name=f"{llm.model_config.name}-jax", enable_prefix_caching=False)
    r = twin.runner
    r.kernels = dataclasses.replace(r.kernels, cpu_attention=False)
    r.programs = ProgramTable(r)
    return twin


def engine_config(a, dtype):
    base = engine_preset()
    ps = base.page_size
    need = max(a.batches) * max(pages_needed(c, ps) for c in a.contexts)
    pages = tuple(sorted({*base.page_buckets, *(pages_needed(c, ps) for c in a.contexts)}))
    return resolve_engine_config(base.replace(
        dtype=dtype or base.dtype, num_pages=need + 1, max_num_seqs=max(a.batches),
        batch_buckets=tuple(sorted({*base.batch_buckets, *a.batches})), page_buckets=pages))


def measure(b: Bench) -> None:
    a = b.args
    mla, gqa = configs(a)
    ecfg = engine_config(a, a.dtype)
    b.log("building the engines")
    llms = {"mla": build(mla, ecfg, ecfg.dtype), "gqa": build(gqa, ecfg, ecfg.dtype)}
    if "gqa-jax" in a.systems:
        llms["gqa-jax"] = without_attention_kernel(llms["gqa"])
    llms = {k: v for k, v in llms.items() if k in a.systems}
    cfgs = {k: llm.model_config for k, llm in llms.items()}
    dtype = str(jnp.dtype(next(iter(llms.values())).runner.params.final_norm.dtype))
    cache_dtype = str(jnp.dtype(ecfg.cache_dtype))
    f = b.figures
    f.update(engine={"page_size": ecfg.page_size, "num_pages": ecfg.num_pages, "weights": dtype,
                     "kv_cache": cache_dtype},
             models={k: {"describe": describe(c), "active_params": active_params(c),
                         "attention_params_per_layer": attention_params(c),
                         "cache_values_per_token_layer": token_entry(c)[0] * token_entry(c)[1],
                         "kv_bytes_per_token": kv_bytes_per_token(c, ecfg.cache_dtype),
                         "weights_read_bytes": weight_bytes(llms[k].runner.params),
                         "cache_bytes": sum(x.nbytes for x in jax.tree.leaves(llms[k].runner.kv_cache)),
                         "kernels": str(llms[k].runner.kernels)} for k, c in cfgs.items()},
             real=real_models(), steps={})
    f["peaks"] = peaks()
    prompt = [7, 8, 9, 10]
    for ctx in a.contexts:
        for n in a.batches:
            key = f"b{n}_c{ctx}"
            b.log(f"batch {n}, context {ctx}: compiling each engine's step")
            benches = {k: StepBench(llm, prompt, ctx, n) for k, llm in llms.items()}
            times = b.rounds({k: lambda i, sb=sb: median(sb.direct(a.steps)) for k, sb in benches.items()},
                             tag=f"batch {n}, context {ctx}: ")
            for sb in benches.values():
                sb.close()
            row = {"batch": n, "context": ctx}
            for k, c in cfgs.items():
                m = f["models"][k]
                kv = n * ctx * m["kv_bytes_per_token"]
                step_s = median(times[k])
                floor_s = (kv + m["weights_read_bytes"]) / (f["peaks"]["bandwidth_gbs"] * 1e9)
                row[k] = {"step_ms": 1e3 * step_s, "min_ms": 1e3 * min(times[k]),
                          "rounds_ms": [1e3 * t for t in times[k]], "kv_read_bytes": kv,
                          "weights_read_bytes": m["weights_read_bytes"], "floor_ms": 1e3 * floor_s,
                          "of_floor": floor_s / step_s, "attention_gflop": attention_flops(c, n, ctx) / 1e9}
            f["steps"][key] = row
    for llm in llms.values():
        llm.close()


# --------------------------------------------------------------------------- #
# The report
# --------------------------------------------------------------------------- #


def conclusion(res: dict) -> str:
    """The conclusion, from the figures: does MLA's smaller cache make its decode step faster at the longest
    context and largest batch, and what does MLA's step cost over GQA's at batch 1 where the cache is small?"""
    rows = list(res["steps"].values())
    peers = [k for k in ("gqa", "gqa-jax") if rows and k in rows[0]]
    if not rows or "mla" not in rows[0] or not peers:
        return "conclusion: (needs mla and a GQA system measured)"
    last = max(rows, key=lambda r: (r["context"] * r["batch"], r["context"]))
    m, p = last["mla"], last[peers[0]]
    kv, fl = m["kv_read_bytes"] / p["kv_read_bytes"], m["attention_gflop"] / p["attention_gflop"]
    took = " and ".join(f"{m['step_ms'] / last[k]['step_ms']:.2f}x {k}'s" for k in peers)
    slower_than = [k for k in peers if m["step_ms"] >= last[k]["step_ms"]]
    if not slower_than:
        verdict = "MLA's smaller cache makes its decode step faster there on this CPU"
    else:
        verdict = (f"the smaller cache does not make MLA's step faster than {' or '.join(slower_than)}'s on this "
                   f"CPU: its absorbed attention does {fl:.1f}x the attention FLOPs (every head scores the whole "
                   f"{res['models']['mla']['cache_values_per_token_layer']}-value entry and sums the latent) on the "
                   f"pure-JAX path, and that outweighs reading {kv:.2f}x the KV bytes")
    out = (f"conclusion: at batch {last['batch']}, context {last['context']}, MLA's step takes {took} "
           f"(reading {kv:.2f}x the KV bytes and doing {fl:.1f}x the attention FLOPs of {peers[0]}); {verdict}.")
    ones = sorted((r for r in rows if r["batch"] == min(x["batch"] for x in rows)), key=lambda r: r["context"])
    extra = [(r["context"], r["mla"]["step_ms"] - r[peers[0]]["step_ms"]) for r in ones]
    if extra:
        out += (f" At batch {ones[0]['batch']} MLA's step costs " + ", ".join(f"{d:+.0f} ms at context {c}"
                                                                              for c, d in extra)
                + f" over {peers[0]}'s, where the KV read is a small share of the step.")
    return out


def report(res: dict) -> str:
    L = heading("multi-head latent attention (DeepSeek-shaped) against grouped-query attention (Llama-shaped): "
                "the engine's decode step", res["system"])
    e = res["engine"]
    L.append(f"weights {e['weights']}, KV cache {e['kv_cache']}, page size {e['page_size']}, "
             f"{e['num_pages']} pages, prefix cache off")
    L.append(peaks_line(res["peaks"]))
    for k, m in res["models"].items():
        L.append(f"{k + ':':9s}{m['describe']}, {m['active_params'] / 1e6:.1f}M per token, attention "
                 f"{m['attention_params_per_layer'] / 1e6:.2f}M a layer; cache {m['cache_values_per_token_layer']} "
                 f"values a token a layer = {m['kv_bytes_per_token']:,} B a token (the engine's cache: "
                 f"{m['cache_bytes'] / 1e6:.0f} MB); weights read "
                 f"{m['weights_read_bytes'] / 1e6:.1f} MB a step; kernels: {m['kernels']}")
    rows = []
    for r in res["steps"].values():
        for k in res["models"]:
            s = r[k]
            rows.append([f"{r['batch']:>3} x {r['context']:<5}", k, f"{s['step_ms']:.1f}", f"{s['min_ms']:.1f}",
                         f"{s['kv_read_bytes'] / 1e6:.1f}", f"{(s['kv_read_bytes'] + s['weights_read_bytes']) / 1e6:.1f}",
                         f"{s['floor_ms']:.1f}", f"{100 * s['of_floor']:.0f}%", f"{s['attention_gflop']:.2f}",
                         f"{s['step_ms'] / r['mla']['step_ms']:.2f}" if "mla" in r else "-",
                         " ".join(f"{t:.1f}" for t in s["rounds_ms"])])
    L += ["", "decode step, median of rounds (each round's median step):",
          table(["batch x ctx", "system", "ms", "min ms", "KV MB", "read MB", "floor ms", "of floor", "attn GFLOP",
                 "x mla", "rounds (ms)"], rows)]
    L += ["", "KV cache per token, the real configs (bfloat16): the latent against per-head keys and values"]
    rr = [[name, f"{m['layers']}", f"{m['heads']}", f"{m['latent_values']}", f"{m['latent_bytes']:,}",
           f"{m['heads']} x ({m['qk_dim']} + {m['v_dim']}) = {m['per_head_values']}", f"{m['per_head_bytes']:,}",
           f"{m['smaller_by']:.1f}x"] for name, m in res["real"].items()]
    L.append(table(["model", "layers", "heads", "latent values/layer", "latent B/token", "per-head values/layer",
                    "per-head B/token", "smaller by"], rr))
    L += ["", conclusion(res)]
    return "\n".join(L)


def main(argv=None) -> int:
    p = parser("python -m benchmarks.mla", __doc__, model=None, rounds=3)
    for flag, default in (("hidden", 1024), ("layers", 4), ("heads", 16), ("kv-lora-rank", 512), ("q-lora-rank", 0),
                          ("qk-nope", 128), ("qk-rope", 64), ("v-head", 128), ("kv-heads", 4), ("head-dim", 128),
                          ("intermediate", 2816), ("vocab", 8192), ("max-position", 8192)):
        p.add_argument(f"--{flag}", type=int, default=default, help=f"(default {default})")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="batch sizes (default 1 8 32)")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048], help="context lengths (default 512 2048)")
    p.add_argument("--steps", type=int, default=4, help="step calls a round per system (default 4)")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS, help="(default: all)")
    p.add_argument("--dtype", default=None, choices=("auto", "float32", "bfloat16"),
                   help="weights' dtype (default: the cpu preset's)")
    a = p.parse_args(argv)
    for name in ("batches", "contexts"):
        bad = [v for v in getattr(a, name) if v < 1]
        if bad:
            p.error(f"--{name} must be at least 1, got {bad[0]}")
    if max(a.contexts) > a.max_position:
        p.error(f"--contexts must be at most --max-position {a.max_position}, got {max(a.contexts)}")
    if a.steps < 1 or a.rounds < 1:
        p.error(f"--steps and --rounds must be at least 1, got {a.steps} and {a.rounds}")
    return run(measure, report, a)


if __name__ == "__main__":
    raise SystemExit(main())
