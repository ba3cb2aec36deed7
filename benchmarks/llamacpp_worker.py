"""llama.cpp (through llama-cpp-python) as a benchmark peer, run in its own interpreter.

`benchmarks.llamacpp_peer` and `benchmarks.perplexity` start this file as a
subprocess with a Python that has llama-cpp-python (jax is not needed) and talk to it
in JSON lines, one model file per process:

    stdin  line 1: {"mode": "bench", "model": PATH, "threads": 2, "prompt": [ids],
                    "batch_prompts": [[ids], ...], "decode_tokens": 128, "repeats": 3,
                    "batch_repeats": 3, "parallel": true}
    stdout line 1: {"ready": true, "load_s": ..., "version": ..., ...}
    stdin  "round" -> stdout one JSON object: the medians of `repeats` runs of TTFT and batch-1
                      decode, and of `batch_repeats` runs of the batch
    stdin  "quit"  -> exit

``"mode": "bench"`` measures, always on the token ids it is given (no tokenizer, no BOS
added, greedy = the argmax of the logits, end-of-sequence ignored):

* ``ttft_s``: the prompt decoded in one batch plus the argmax of its last logits;
* ``tpot_s``: batch-1 decode, one `llama_decode` per token after that first one;
* the batch: every prompt of ``batch_prompts`` at once. With ``"parallel": true`` they
  are sequences of one context (``n_seq_max`` = their number, a KV stream each):
  the prompts are prefilled together in batches of ``n_batch`` tokens, then every step
  decodes one token of each sequence in one `llama_decode` call, the way llama.cpp's
  server batches its slots. With ``"parallel": false`` they run one after the other.

``"mode": "perplexity"`` (setup: ``"windows": [[ids], ...]``, ``"score_from": k``) loads
the model with llama-cpp-python's high-level `Llama` (``logits_all=True``), evaluates
each window from an empty cache and returns, for every position from ``score_from``
to the window's second-to-last, the log-probability of the next token and the argmax.

Only this file imports llama_cpp. It is run by path, in an interpreter that may have
neither jax nor jaxinfer installed: from the checkout it imports only
`jaxinfer.tools.harness` (the JSON-lines protocol) and `jaxinfer.stats` (numpy).
"""

from __future__ import annotations

import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's jaxinfer
from jaxinfer.stats import median  # noqa: E402
from jaxinfer.tools.harness import answer, emit, read_setup  # noqa: E402


class Context:
    """A llama.cpp context on a loaded model, with its own batch buffer (low-level API)."""

    def __init__(self, L, np, model, threads: int, n_seq: int, per_seq_ctx: int, n_batch: int):
        self.L, self.np = L, np
        p = L.llama_context_default_params()
        p.n_ctx = n_seq * per_seq_ctx
        p.n_batch = n_batch
        p.n_ubatch = min(n_batch, 512)
        p.n_seq_max = n_seq
        p.n_threads = threads
        p.n_threads_batch = threads
        p.no_perf = True
        if hasattr(p, "kv_unified"):
            p.kv_unified = False  # one KV stream per sequence: each attends only its own tokens
        self.ctx = L.llama_init_from_model(model, p)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.n_batch = n_batch
        self.n_seq = n_seq
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        self.batch = L.llama_batch_init(n_batch, 0, 1)
        self.mem = L.llama_get_memory(self.ctx)
        self.params = {
            "n_ctx": L.llama_n_ctx(self.ctx),
            "n_batch": L.llama_n_batch(self.ctx),
            "n_ubatch": L.llama_n_ubatch(self.ctx),
            "n_seq_max": L.llama_n_seq_max(self.ctx),
            "flash_attn_type": int(getattr(p, "flash_attn_type", -99)),
            "kv_unified": bool(getattr(p, "kv_unified", True)),
        }

    def clear(self) -> None:
        self.L.llama_memory_clear(self.mem, True)

    def decode(self, items) -> list:
        """items: (token, pos, seq, want_logits) tuples, at most n_batch; the argmax for each wanted one."""
        b = self.batch
        want = []
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if out else 0
            if out:
                want.append(i)
        b.n_tokens = len(items)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return [self.argmax(i) for i in want]

    def argmax(self, i: int) -> int:
        ptr = self.L.llama_get_logits_ith(self.ctx, i)
        return int(self.np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def prefill(self, seqs: list) -> tuple:
        """Prompts (seq id, ids) packed into batches of n_batch tokens; (first tokens by seq, seconds)."""
        items = [(t, pos, s, pos == len(ids) - 1) for s, ids in seqs for pos, t in enumerate(ids)]
        first = {}
        last_of = [s for s, ids in seqs]  # the order the wanted logits come back in
        k = 0
        t0 = time.perf_counter()
        for i in range(0, len(items), self.n_batch):
            chunk = items[i : i + self.n_batch]
            for tok in self.decode(chunk):
                first[last_of[k]] = tok
                k += 1
        return first, time.perf_counter() - t0

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)


class Bench:
    def __init__(self, setup: dict):
        import numpy as np

        import llama_cpp as L

        self.L, self.np = L, np
        self.threads = int(setup.get("threads") or os.cpu_count())
        self.prompt = list(setup["prompt"])
        self.batch_prompts = [list(p) for p in setup["batch_prompts"]]
        self.n = int(setup["decode_tokens"])
        self.repeats = int(setup.get("repeats", 3))
        self.batch_repeats = int(setup.get("batch_repeats") or self.repeats)
        self.parallel = bool(setup.get("parallel", True))
        L.llama_backend_init()
        t0 = time.perf_counter()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(setup["model"].encode(), mp)
        if not self.model:
            raise RuntimeError(f"could not load {setup['model']}")
        self.load_s = time.perf_counter() - t0
        span = len(self.prompt) + self.n
        per_seq = max(256, -(-(max(span, max(len(p) for p in self.batch_prompts) + self.n) + 8) // 256) * 256)
        self.one = Context(L, np, self.model, self.threads, 1, per_seq, 512)
        nb = len(self.batch_prompts) if self.parallel else 1
        self.many = Context(L, np, self.model, self.threads, nb, per_seq, 2048) if self.parallel else self.one

    def info(self) -> dict:
        L = self.L
        return {
            "ready": True,
            "load_s": self.load_s,
            "version": getattr(L, "__version__", "?"),
            "threads": self.threads,
            "model_bytes": int(L.llama_model_size(self.model)),
            "model_params": int(L.llama_model_n_params(self.model)),
            "system_info": L.llama_print_system_info().decode(errors="replace").strip(),
            "batch_mode": "parallel" if self.parallel else "sequential",
            "context_one": self.one.params,
            "context_batch": self.many.params,
        }

    # one run of each figure ------------------------------------------------------------ #

    def ttft(self) -> tuple:
        c = self.one
        c.clear()
        t0 = time.perf_counter()
        first, _ = c.prefill([(0, self.prompt)])
        return time.perf_counter() - t0, first[0]

    def decode1(self) -> tuple:
        c = self.one
        c.clear()
        first, _ = c.prefill([(0, self.prompt)])
        toks = [first[0]]
        pos = len(self.prompt)
        t1 = time.perf_counter()
        for _ in range(self.n - 1):
            toks += c.decode([(toks[-1], pos, 0, True)])
            pos += 1
        return (time.perf_counter() - t1) / (self.n - 1), toks

    def batch_parallel(self) -> dict:
        c = self.many
        c.clear()
        seqs = list(enumerate(self.batch_prompts))
        t0 = time.perf_counter()
        first, _ = c.prefill(seqs)
        t_first = time.perf_counter()
        toks = {s: [first[s]] for s, _ in seqs}
        pos = {s: len(p) for s, p in seqs}
        for _ in range(self.n - 1):
            items = [(toks[s][-1], pos[s], s, True) for s, _ in seqs]
            for s, tok in zip((s for s, _ in seqs), c.decode(items)):
                toks[s].append(tok)
                pos[s] += 1
        t_end = time.perf_counter()
        nb = len(seqs)
        return {
            "batch_wall_s": t_end - t0,
            "batch_all_first_s": t_first - t0,
            "batch_e2e_tok_s": nb * self.n / (t_end - t0),
            "batch_decode_tok_s": nb * (self.n - 1) / (t_end - t_first),
            "batch_tokens_first": toks[0],
        }

    def batch_sequential(self) -> dict:
        c = self.one
        t0 = time.perf_counter()
        prefill_s = 0.0
        rows = []
        for p in self.batch_prompts:
            c.clear()
            ta = time.perf_counter()
            first, _ = c.prefill([(0, p)])
            prefill_s += time.perf_counter() - ta
            toks, pos = [first[0]], len(p)
            for _ in range(self.n - 1):
                toks += c.decode([(toks[-1], pos, 0, True)])
                pos += 1
            rows.append(toks)
        wall = time.perf_counter() - t0
        nb = len(self.batch_prompts)
        return {
            "batch_wall_s": wall,
            "batch_all_first_s": None,  # each request's first token comes after the previous one finished
            "batch_e2e_tok_s": nb * self.n / wall,
            "batch_decode_tok_s": nb * (self.n - 1) / (wall - prefill_s),
            "batch_tokens_first": rows[0],
        }

    def round(self) -> dict:
        k = self.repeats
        ttft = [self.ttft() for _ in range(k)]
        dec = [self.decode1() for _ in range(k)]
        run = self.batch_parallel if self.parallel else self.batch_sequential
        bat = [run() for _ in range(self.batch_repeats)]
        out = {
            "ttft_s": median([t for t, _ in ttft]),
            "tpot_s": median([t for t, _ in dec]),
            "ttft_samples_s": [t for t, _ in ttft],
            "tpot_samples_s": [t for t, _ in dec],
            "tokens": dec[-1][1],
        }
        for key in ("batch_wall_s", "batch_e2e_tok_s", "batch_decode_tok_s", "batch_all_first_s"):
            vals = [b[key] for b in bat if b[key] is not None]
            out[key] = median(vals) if vals else None
        out["batch_e2e_samples"] = [b["batch_e2e_tok_s"] for b in bat]
        out["batch_tokens_first"] = bat[-1]["batch_tokens_first"]
        return out

    def warm(self) -> None:
        self.ttft()
        c = self.one
        c.clear()
        c.prefill([(0, self.prompt)])
        c.decode([(1, len(self.prompt), 0, True)])
        if self.parallel:  # one batched step over every sequence
            m = self.many
            m.clear()
            first, _ = m.prefill(list(enumerate(self.batch_prompts)))
            m.decode([(first[s], len(p), s, True) for s, p in enumerate(self.batch_prompts)])


def perplexity(setup: dict) -> dict:
    import numpy as np
    from llama_cpp import Llama, __version__

    windows = [list(w) for w in setup["windows"]]
    ctx = max(len(w) for w in windows)
    first = int(setup["score_from"])
    threads = int(setup.get("threads") or os.cpu_count())
    t0 = time.perf_counter()
    llm = Llama(
        model_path=setup["model"], n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, n_threads=threads,
        n_threads_batch=threads, logits_all=True, verbose=False,
    )
    load_s = time.perf_counter() - t0
    logp, top1 = [], []
    t0 = time.perf_counter()
    for w in windows:
        llm.reset()
        llm.eval(w)
        x = np.asarray(llm.scores[first : len(w) - 1], dtype=np.float64)
        m = x.max(axis=-1, keepdims=True)
        lse = (m[:, 0] + np.log(np.exp(x - m).sum(axis=-1)))
        nxt = np.asarray(w[first + 1 :])
        logp.append((x[np.arange(len(nxt)), nxt] - lse).tolist())
        top1.append(x.argmax(axis=-1).tolist())
    return {"load_s": load_s, "eval_s": time.perf_counter() - t0, "logp": logp, "top1": top1,
            "version": __version__, "threads": threads}


def main() -> int:
    setup = read_setup()
    mode = setup.get("mode", "bench")
    if mode == "perplexity":
        try:
            emit(perplexity(setup))
        except Exception as e:  # report it to the driver
            emit({"error": f"{type(e).__name__}: {e}"})
            return 1
        return 0
    if mode != "bench":
        emit({"error": f"unknown mode {mode!r}; use 'bench' or 'perplexity'"})
        return 2
    try:
        bench = Bench(setup)
        t0 = time.perf_counter()
        bench.warm()
        info = bench.info()
        info["warmup_s"] = time.perf_counter() - t0
    except Exception as e:
        emit({"error": f"{type(e).__name__}: {e}"})
        return 1
    emit(info)
    return answer({"round": bench.round})


if __name__ == "__main__":
    sys.exit(main())
