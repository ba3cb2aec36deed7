"""Mixture-of-experts decode step against a dense model with the same active parameters.

    python -m benchmarks.moe            (from the repository root)

Two random-weight models built in memory (no downloads), alike in everything but the MLP:
a Qwen3-MoE config with ``--experts`` experts of ``--expert-size`` and top ``--top-k``
routing, and a Qwen3 config whose dense MLP is ``top_k * expert_size`` wide, so both run
the same active parameters per token. For each batch size the engine decodes that many
requests and the steady decode step time is read from the engine's counters
(`benchmarks.engine.steady_window`), alternating the two models over ``--rounds`` rounds
(`jaxinfer.tools.harness.alternate`); medians are printed with the machine line (CPU flags, load). The MoE step reads only its tokens' experts
(`jaxinfer.models.moe`), so at batch 1 it should cost about what the dense step costs,
and at larger batches what the union of the chosen experts costs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import jaxinfer
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.models import describe, get_family
from jaxinfer.ops.backend import engine_preset
from jaxinfer.ops.spec import init_random
from jaxinfer.stats import median
from jaxinfer.tools.harness import Bench, heading, parser, run

from benchmarks.engine import Ids, steady_window


def configs(a) -> tuple[ModelConfig, ModelConfig]:
    moe = ModelConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.top_k * a.expert_size, num_layers=a.layers,
        num_heads=8, num_kv_heads=4, head_dim=a.hidden // 8, architecture="qwen3_moe", qk_norm=True,
        num_experts=a.experts, num_experts_per_tok=a.top_k, moe_intermediate_size=a.expert_size, name="moe",
    )
    dense = dataclasses.replace(moe, architecture="qwen3", num_experts=0, num_experts_per_tok=0,
                                moe_intermediate_size=0, name="dense")
    return moe, dense


def build(cfg: ModelConfig, ecfg: EngineConfig):
    params = init_random(get_family(cfg.architecture).param_specs(cfg, jnp.dtype(ecfg.dtype)), jax.random.key(0),
                         scale=0.05)
    return jaxinfer.LLM.from_params(cfg, params, engine_config=ecfg, name=cfg.name)


def measure(b: Bench) -> None:
    a = b.args
    moe, dense = configs(a)
    ecfg = engine_preset().replace(dtype=a.dtype, max_num_seqs=max(a.batches),
                                   batch_buckets=tuple(sorted({1, *a.batches})))
    llms = {"moe": build(moe, ecfg), "dense": build(dense, ecfg)}
    ids = Ids(a.vocab, 0)  # fresh random prompts, away from the vocabulary's special ends
    b.figures.update(moe=describe(moe), dense=describe(dense), step_ms={})
    for n in a.batches:
        for llm in llms.values():  # compile and settle this batch size once
            steady_window(llm, n, 16, ids, skip=2, window=4)
        b.figures["step_ms"][n] = b.rounds({k: lambda i, llm=llm: steady_window(llm, n, 16, ids, skip=4, window=16)[
            "step_ms"] for k, llm in llms.items()}, tag=f"batch {n}: ")
    for llm in llms.values():
        llm.close()


def report(res: dict) -> str:
    L = heading("mixture-of-experts decode step against a dense model with the same active parameters",
                res["system"]) + [f"moe:   {res['moe']}", f"dense: {res['dense']}"]
    for n, t in res["step_ms"].items():
        m, d = median(t["moe"]), median(t["dense"])
        L.append(f"batch {n:3d}: decode step moe {m:7.2f} ms, dense {d:7.2f} ms, moe/dense {m / d:.2f}"
                 f"  (rounds: moe {['%.2f' % x for x in t['moe']]}, dense {['%.2f' % x for x in t['dense']]})")
    return "\n".join(L)


def main(argv=None) -> int:
    p = parser("python -m benchmarks.moe", __doc__, model=None, rounds=3)
    for flag, default in (("experts", 32), ("top-k", 4), ("expert-size", 256), ("hidden", 512), ("layers", 8),
                          ("vocab", 8192)):
        p.add_argument(f"--{flag}", type=int, default=default, help=f"(default {default})")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--dtype", default="float32")
    return run(measure, report, p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
