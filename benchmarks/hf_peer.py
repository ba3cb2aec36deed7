"""Hugging Face transformers as the benchmark's peer, run in its own interpreter.

`benchmarks.core` starts this file as a subprocess (with a Python
that has torch + transformers; jax is not needed) and talks to it in JSON
lines, so both engines are measured in one invocation, in alternating rounds:

    stdin  line 1: {"model": PATH, "threads": 2, "prompt": [ids], "batch_prompts": [[ids], ...],
                    "decode_tokens": 64, "attn": "sdpa", "mode": "full"}
    stdout line 1: {"ready": true, "load_s": ..., "versions": {...}, ...}
    stdin  "round" -> stdout one JSON object of timings (seconds) for one round
    stdin  "quit"  -> exit

``"mode": "batch"`` (used by `benchmarks.engine`) times only the static
batch: ``model.generate`` over all of ``batch_prompts`` at once, for one token
and for ``decode_tokens`` tokens (min_new_tokens = max_new_tokens, greedy);
``"prompt"`` may then be omitted. The default ``"full"`` mode also times the
batch-1 paths (`benchmarks.core`).

Only this file imports torch and transformers. It is run by path (``python
benchmarks/hf_peer.py``), in an interpreter that may have neither jax nor
jaxinfer installed: from the checkout it imports only `jaxinfer.tools.harness`
(the JSON-lines protocol; the standard library alone). It keeps no statistics of its own; the driver takes
the medians of its rounds.
A GGUF file is loaded dequantized to float32 (or the ``dtype`` the setup line names),
the same weights jaxinfer uses.
"""

from __future__ import annotations

import inspect
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's jaxinfer
from jaxinfer.tools.harness import answer, emit, read_setup  # noqa: E402


def load(model_path: str, threads: int, attn: str, dtype: str = "float32"):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.set_num_threads(threads)
    kw = dict(dtype=getattr(torch, dtype), attn_implementation=attn)
    if os.path.isfile(model_path):
        d, f = os.path.split(os.path.abspath(model_path))
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, **kw)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, **kw)
    model.eval()
    return model


class Peer:
    def __init__(self, model, prompt, batch_prompts, decode_tokens: int):
        import torch

        self.torch = torch
        self.model = model
        self.n = decode_tokens
        self.ids = torch.tensor([prompt], dtype=torch.long) if prompt else None
        self.batch = torch.tensor(batch_prompts, dtype=torch.long)
        eos = model.generation_config.eos_token_id
        self.pad = eos[0] if isinstance(eos, (list, tuple)) else (eos if eos is not None else 0)
        # transformers 5.x renamed forward's `past_key_values` to `cache` (the old name warns)
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def _generate(self, ids, new_tokens: int):
        torch = self.torch
        # all prompts have the same length, so the mask is all ones (no padding needed)
        mask = torch.ones_like(ids)
        t0 = time.perf_counter()
        out = self.model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=self.pad,
        )
        dt = time.perf_counter() - t0
        return dt, out[:, ids.shape[1] :].tolist()

    def _manual(self):
        """Prefill over the prompt, then one forward per token with past_key_values (greedy)."""
        t0 = time.perf_counter()
        out = self.model(self.ids, use_cache=True, **self.keep)  # logits for the last position only
        tok = out.logits[:, -1].argmax(-1)
        toks = [int(tok.item())]
        t1 = time.perf_counter()
        pkv = getattr(out, self.cache_kw)
        for _ in range(self.n - 1):
            out = self.model(tok[:, None], use_cache=True, **{self.cache_kw: pkv})
            pkv = getattr(out, self.cache_kw)
            tok = out.logits[:, -1].argmax(-1)
            toks.append(int(tok.item()))
        t2 = time.perf_counter()
        return t1 - t0, (t2 - t1) / (self.n - 1), toks

    def batch_round(self) -> dict:
        """The static batch alone: first token (prefill) and the whole generation, wall clock."""
        with self.torch.inference_mode():
            b1, _ = self._generate(self.batch, 1)
            bn, btoks = self._generate(self.batch, self.n)
        nb = self.batch.shape[0]
        return {
            "batch_size": nb,
            "batch_first_s": b1,
            "batch_generate_s": bn,
            "batch_decode_tok_s": nb * (self.n - 1) / (bn - b1),
            "batch_e2e_tok_s": nb * self.n / bn,
            "batch_tokens_first": btoks[0],
        }

    def warm_batch(self) -> None:
        with self.torch.inference_mode():
            self._generate(self.batch, 2)

    def round(self) -> dict:
        with self.torch.inference_mode():
            ttft, tpot, toks = self._manual()
            g1, _ = self._generate(self.ids, 1)
            gn, gen_toks = self._generate(self.ids, self.n)
            b1, _ = self._generate(self.batch, 1)
            bn, btoks = self._generate(self.batch, self.n)
        nb = self.batch.shape[0]
        return {
            "ttft_manual_s": ttft,
            "tpot_manual_s": tpot,
            "ttft_generate_s": g1,
            "generate_s": gn,
            "tpot_generate_s": (gn - g1) / (self.n - 1),
            "batch_first_s": b1,
            "batch_generate_s": bn,
            "batch_decode_tok_s": nb * (self.n - 1) / (bn - b1),
            "batch_e2e_tok_s": nb * self.n / bn,
            "tokens_manual": toks,
            "tokens_generate": gen_toks[0],
            "batch_tokens_first": btoks[0],
        }


def main() -> int:
    setup = read_setup()
    t0 = time.perf_counter()
    model = load(setup["model"], int(setup.get("threads", 2)), setup.get("attn", "sdpa"), setup.get("dtype", "float32"))
    load_s = time.perf_counter() - t0
    mode = setup.get("mode", "full")
    if mode not in ("full", "batch"):
        emit({"error": f"unknown mode {mode!r}; use 'full' or 'batch'"})
        return 2
    peer = Peer(model, setup.get("prompt"), setup["batch_prompts"], int(setup["decode_tokens"]))
    run_round = peer.round if mode == "full" else peer.batch_round
    t0 = time.perf_counter()
    # warm-up: first-call allocations, one-time kernels
    peer.round() if mode == "full" else peer.warm_batch()
    warm_s = time.perf_counter() - t0

    import torch
    import transformers

    emit(
        {
            "ready": True,
            "mode": mode,
            "load_s": load_s,
            "warmup_round_s": warm_s,
            "attn": model.config._attn_implementation,
            "dtype": str(next(model.parameters()).dtype),
            "threads": torch.get_num_threads(),
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        }
    )
    return answer({"round": run_round})


if __name__ == "__main__":
    sys.exit(main())
