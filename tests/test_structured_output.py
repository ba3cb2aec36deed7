"""Structured output (`jaxinfer.engine.structured`, the sampler's bitmask stage, the engine's sync): outputs that
finish with "stop" parse and validate, on every tokenizer kind and on the real SmolLM2; constraints leave
other rows alone; greedy constrained output is batch-invariant; abort, preemption, prefix hits, min_tokens,
grammars that never end or cannot be spelled, and every bad input behave.

Tiny random-weight models sample their way through the grammars (their choices are arbitrary, so any path
the grammar allows may come out): a validator failing on any seed is a real failure.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import jaxinfer
from conftest import TINY, TINY_ENGINE, requires_smollm2, tiny_params
from jaxinfer import SamplingParams as SP
from jaxinfer import StructuredOutputsParams as SO
from jaxinfer.ops.sampler import init_sampler_state, sample
from jaxinfer.engine.sampling import RowSampling, build_metadata
from jaxinfer.engine.structured import allowed_ids, bitmask_width

ENGINE = TINY_ENGINE.replace(num_pages=256)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "café"]}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"},
        "pos": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                                 "y": {"type": "integer", "minimum": -5, "maximum": 5}},
                "required": ["x", "y"], "additionalProperties": False},
        "kind": {"enum": ["left", "right", "日本"]},
    },
    "required": ["id", "pos", "kind"],
    "additionalProperties": False,
}
REGEX = r"(café|page|日本語) [0-9]{1,3}(\.[0-9])?"
CHOICES = ["yes", "no, never", "naïve", "日本"]
LARK = 'start: "(" item (" " item){0,3} ")"\nitem: /[a-z]{1,4}/ | NUMBER\nNUMBER: /[0-9]{1,3}/\n'
GBNF = 'root ::= "[" num ("," num)? "]"\nnum ::= [0-9] | [1-9] [0-9]\n'


def validates(kind, text) -> bool:
    if kind == "json_person":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "json_nested":
        jsonschema.validate(json.loads(text), NESTED)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "lark":
        assert re.fullmatch(r"\((?:[a-z]{1,4}|[0-9]{1,3})(?: (?:[a-z]{1,4}|[0-9]{1,3})){0,3}\)", text), text
    elif kind == "gbnf":
        assert re.fullmatch(r"\[(?:[0-9]|[1-9][0-9])(?:,(?:[0-9]|[1-9][0-9]))?\]", text), text
    return True


CONSTRAINTS = {
    "json_person": SO(json=PERSON),
    "json_nested": SO(json=json.dumps(NESTED)),
    "json_object": SO(json_object=True),
    "regex": SO(regex=REGEX),
    "choice": SO(choice=CHOICES),
    "lark": SO(grammar=LARK),
    "gbnf": SO(grammar=GBNF),
}


# -- the four tokenizer kinds --------------------------------------------------------------------------


def sp_tokenizer(path, **train):
    from test_tokenizer import train_tiny_sentencepiece

    from jaxinfer.text.tokenizer import Tokenizer

    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.model").write_bytes(train_tiny_sentencepiece(**train))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return Tokenizer.from_dir(path)


def _hf_tokenizer(path):
    """A byte-level BPE in tokenizer.json (HF tokenizers) with a few merges, and ChatML specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from jaxinfer.text.tokenizer import Tokenizer as JTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("\u0120", "c"), ("a", "g"), ("ag", "e"), ('"', ":"), ("{", '"')]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    hf = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    path.mkdir(parents=True, exist_ok=True)
    hf.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return JTokenizer.from_dir(path)


def _gguf_sp_tokenizer(path):
    from test_tokenizer import write_llama_vocab_gguf

    from jaxinfer.text.tokenizer import load_tokenizer

    sp_tokenizer(path / "sp")
    gguf_path = str(path / "vocab.gguf")
    write_llama_vocab_gguf(str(path / "sp" / "tokenizer.model"), gguf_path)
    return load_tokenizer(gguf_path)


# (the fourth kind, a GGUF-built BPE, is SmolLM2's: the real-model test below)
KINDS = {"hf-json": _hf_tokenizer, "sentencepiece": sp_tokenizer, "gguf-sentencepiece": _gguf_sp_tokenizer}


def _llm(tok, **engine):
    cfg = TINY if tok.vocab_size <= TINY.vocab_size else dataclasses.replace(TINY, vocab_size=tok.vocab_size)
    return jaxinfer.LLM.from_params(cfg, tiny_params(cfg), tokenizer=tok, engine_config=ENGINE.replace(**engine))


@pytest.fixture(scope="module")
def sp_llm(tmp_path_factory):
    llm = _llm(sp_tokenizer(tmp_path_factory.mktemp("sp")))
    yield llm
    llm.close()


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_tokenizer_kind_spells_what_the_grammar_allows(kind, tmp_path):
    """llguidance's view of each kind of our tokenizers (HF tokenizer.json, SentencePiece, and both GGUF-built
    kinds) must give it every token's true bytes: sampled outputs, non-ASCII included, decode to text the
    constraint accepts. A wrong byte in the view shows up as text outside the grammar."""
    tok = KINDS[kind](tmp_path)
    llm = _llm(tok)
    try:
        names = ["regex", "choice", "json_person", "gbnf"]
        params = [SP(max_tokens=100, temperature=1.0, seed=s, structured_outputs=CONSTRAINTS[n])
                  for n in names for s in range(2)]
        outs = llm.generate(["page cache"] * len(params), params)
        for p, o in zip(params, outs):
            c = o.outputs[0]
            assert c.finish_reason == "stop", (kind, p.structured_outputs.kind, c.finish_reason, c.text, c.error)
            validates(names[params.index(p) // 2], c.text)
        llm.engine.allocator.check_all_free()
    finally:
        llm.close()


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_sampled_outputs_parse_and_validate_and_finish(sp_llm, name):
    """Temperature 1.0 over many seeds: every output ends with "stop" (bounded grammars, compact JSON) and
    validates; the grammar's end finishes the request without spending a token on end-of-sequence. A free
    JSON object is not bounded (a random model may write a key for ever): one cut by max_tokens is an
    object begun and not finished, and most seeds finish it."""
    params = [SP(max_tokens=100, temperature=1.0, seed=s, structured_outputs=CONSTRAINTS[name]) for s in range(8)]
    outs = sp_llm.generate(["hello world"] * len(params), params)
    if name == "json_object":
        cut = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "length"]
        assert len(cut) < len(outs) / 2 and all(c.text.startswith("{") for c in cut), [c.text for c in cut]
        outs = [o for o in outs if o.outputs[0].finish_reason != "length"]
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text, c.error)
        validates(name, c.text)
        if name.startswith("json") or name == "choice":  # complete: nothing could follow, no EOS drawn
            assert c.token_ids[-1] not in sp_llm.tokenizer.stop_token_ids
    if name != "json_object":  # (a random model may well answer {} every time)
        assert len({o.outputs[0].text for o in outs}) > 1  # the seeds explore the grammar


def _space_outside_strings(text: str) -> bool:
    inside = escaped = False
    for ch in text:
        if inside:
            inside, escaped = (escaped or ch != '"'), (not escaped and ch == "\\")
        elif ch == '"':
            inside = True
        elif ch.isspace():
            return True
    return False


def test_flexible_whitespace_on_request(sp_llm):
    """The default is compact JSON (no whitespace between tokens); disable_any_whitespace=False lets JSON's
    whitespace in (here limited by whitespace_pattern), and the output still validates."""
    def run(**so):
        params = [SP(max_tokens=100, temperature=1.0, seed=s, structured_outputs=SO(json=PERSON, **so))
                  for s in range(6)]
        outs = [o.outputs[0] for o in sp_llm.generate(["x"] * 6, params)]
        for c in outs:
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), PERSON)
        return [c.text for c in outs]

    assert not any(_space_outside_strings(t) for t in run())
    assert any(_space_outside_strings(t) for t in run(disable_any_whitespace=False, whitespace_pattern=r"[ \n]{1,2}"))


def test_unconstrained_rows_are_untouched_and_greedy_constrained_rows_are_batch_invariant(sp_llm):
    plain = SP(max_tokens=12, temperature=0.9, seed=7)
    greedy = SP(max_tokens=64, temperature=0, structured_outputs=SO(json=NESTED))
    alone_plain = sp_llm.generate(["cache page"], plain)[0].outputs[0].token_ids
    alone_greedy = sp_llm.generate(["hello"], greedy)[0].outputs[0]
    validates("json_nested", alone_greedy.text)
    prompts = ["cache page", "hello", "world engine", "jax jax jax token"]
    params = [plain, greedy, SP(max_tokens=30, temperature=1.0, seed=3, structured_outputs=SO(regex=REGEX)),
              SP(max_tokens=20, temperature=0.5, seed=4)]
    outs = sp_llm.generate(prompts, params)
    assert outs[0].outputs[0].token_ids == alone_plain
    assert outs[1].outputs[0].token_ids == alone_greedy.token_ids
    assert sp_llm.engine.stats.grammar_syncs > 0


def test_reported_logprobs_are_the_models_before_the_mask(sp_llm):
    """The drawn token's logprob is the raw distribution's (what a trainer scores), not the masked one's:
    scoring the output as a prompt gives back the same numbers."""
    sp = SP(max_tokens=10, temperature=1.0, seed=2, logprobs=2, structured_outputs=SO(choice=CHOICES))
    out = sp_llm.generate(["page"], sp)[0]
    comp = out.outputs[0]
    ids = out.prompt_token_ids + comp.token_ids
    scored = sp_llm.generate([ids], SP(max_tokens=1, temperature=0, prompt_logprobs=0))[0].prompt_logprobs
    for j, lp in enumerate(comp.logprobs):
        assert lp.logprob == pytest.approx(scored[len(out.prompt_token_ids) + j].logprob, abs=1e-4)
    assert any(lp.logprob < -0.01 for lp in comp.logprobs)  # the raw model is not sure of the grammar's pick


def test_sampler_stage_masks_before_everything_and_skips_all_ones():
    rng = np.random.default_rng(0)
    b, v = 6, 100
    logits = jnp.asarray(rng.normal(size=(b, v)) * 3, jnp.float32)
    masks = np.zeros((b, bitmask_width(v)), np.int32)
    allowed_sets = []
    for i in range(b):
        ids = rng.choice(v, size=1 + i * 7, replace=False)
        for t in ids:
            masks[i, t // 32] |= np.array(1 << (t % 32), np.uint32).view(np.int32)
        allowed_sets.append(set(ids.tolist()))
        assert set(allowed_ids(masks[i]).tolist()) == allowed_sets[-1]
    params = [SP(temperature=0), SP(temperature=1.0, seed=1), SP(temperature=1.3, top_k=3, seed=2),
              SP(temperature=0, logit_bias={int(max(allowed_sets[3])): -100.0}),
              SP(temperature=0.7, top_p=0.5, repetition_penalty=1.5, seed=3), SP(temperature=2.0, min_p=0.2, seed=4)]
    rows = [RowSampling(p.clone(logprobs=1), seed=10 + i, sample_pos=5, slot=i) for i, p in enumerate(params)]
    md = build_metadata(rows, b, num_slots=8, max_logprobs=3, vocab_size=v)
    assert (md.allowed == -1).all()  # no row carries a constraint: all ones
    run = jax.jit(sample)
    out_free, _ = run(logits, md, init_sampler_state(8, v))
    md_none = build_metadata(rows, b, num_slots=8, max_logprobs=3)
    out_none, _ = run(logits, md_none, init_sampler_state(8, v))
    assert np.array_equal(out_free.tokens, out_none.tokens)
    md_masked = dataclasses.replace(md, allowed=jnp.asarray(masks))
    out, _ = run(logits, md_masked, init_sampler_state(8, v))
    for i in range(b):
        assert int(out.tokens[i]) in allowed_sets[i]
    lg = np.asarray(logits)
    assert int(out.tokens[0]) == max(allowed_sets[0], key=lambda t: lg[0, t])  # greedy: argmax of the allowed
    biased = max(allowed_sets[3])  # the bias applies after the mask: the greedy row 3 avoids it
    assert int(out.tokens[3]) == max(allowed_sets[3] - {biased}, key=lambda t: lg[3, t])
    raw = jax.nn.log_softmax(logits)
    for i in range(b):
        assert float(out.logprob[i]) == pytest.approx(float(raw[i, int(out.tokens[i])]), abs=1e-5)


# -- lifecycle: abort, preemption, prefix hits, min_tokens, endless and impossible grammars ------------


def test_abort_mid_way_frees_everything(sp_llm):
    sp = SP(max_tokens=100, temperature=1.0, seed=1, structured_outputs=SO(grammar='start: /[a-z]+/'))
    stream = sp_llm.submit(sp_llm.make_request("hello", sp))
    next(iter(stream))
    stream.abort()
    assert sp_llm.wait_idle()
    sp_llm.engine.allocator.check_all_free()
    assert sp_llm.generate(["x"], SP(max_tokens=8, temperature=0, structured_outputs=SO(choice=CHOICES)))[0] \
        .outputs[0].text in CHOICES


def test_preempted_and_prefix_hit_requests_keep_their_grammar(tmp_path):
    """With few KV pages the engine preempts and recomputes; the matcher keeps the tokens already read, so
    outputs equal a roomy run's, token for token (greedy), and still validate. A second identical request
    hits the prefix cache and draws the same."""
    tok = sp_tokenizer(tmp_path)
    prompts = [f"hello world {i} jax engine page cache token" for i in range(4)]
    params = [SP(max_tokens=60, temperature=0, structured_outputs=SO(json=PERSON)) for _ in prompts]
    roomy = _llm(tok)
    tight = _llm(tok, num_pages=40)
    try:
        want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
        got = tight.generate(prompts, params)
        assert tight.engine.scheduler.num_preemptions > 0
        assert [o.outputs[0].token_ids for o in got] == want
        for o in got:
            validates("json_person", o.outputs[0].text)
        again = roomy.generate(prompts[:1], params[:1])[0]
        assert again.metrics.cached_tokens > 0 and again.outputs[0].token_ids == want[0]
        tight.engine.allocator.check_all_free()
    finally:
        roomy.close()
        tight.close()


def test_min_tokens_holds_the_end_back_and_a_grammar_too_short_is_an_error(sp_llm):
    """The grammar's end (end-of-sequence) is banned until min_tokens; a grammar that allows nothing more
    before then ends the request with finish_reason "error" naming min_tokens, and the engine goes on."""
    ok = sp_llm.generate(["x"], SP(max_tokens=40, min_tokens=6, temperature=1.0, seed=3,
                                    structured_outputs=SO(regex="[a-z]{1,20}")))[0].outputs[0]
    assert ok.finish_reason == "stop" and len(ok.token_ids) >= 6 and re.fullmatch("[a-z]{1,20}", ok.text)
    short = sp_llm.generate(["x"], SP(max_tokens=40, min_tokens=30, temperature=0,
                                       structured_outputs=SO(choice=["yes", "no"])))[0].outputs[0]
    assert short.finish_reason == "error" and "min_tokens=30" in short.error
    assert short.text in ("yes", "no")
    sp_llm.engine.allocator.check_all_free()


def test_stop_strings_still_cut_a_constrained_output(sp_llm):
    params = [SP(max_tokens=40, temperature=1.0, seed=s, stop=["e"], structured_outputs=SO(regex="[a-z ]{8,30}"))
              for s in range(6)]
    outs = [o.outputs[0] for o in sp_llm.generate(["hello"] * 6, params)]
    cut = [c for c in outs if c.stop_reason == "e"]
    assert cut, [c.text for c in outs]
    for c in cut:
        assert c.finish_reason == "stop" and "e" not in c.text and re.fullmatch("[a-z ]*", c.text)


def test_ids_past_the_tokenizers_vocabulary_are_never_allowed(sp_llm):
    """The tiny model's logits are 512 wide, its SentencePiece vocabulary 340: a grammar that allows any
    text allows many tokens, none of them a padding id."""
    from jaxinfer.engine.structured import fill_bitmasks

    c = sp_llm.processor.grammars.compile(SO(regex="[\\s\\S]*"))
    ids = allowed_ids(fill_bitmasks([(c, 0)], 1, TINY.vocab_size)[0])
    assert len(ids) > 200 and ids.max() < sp_llm.tokenizer.vocab_size == 340


def test_the_grammars_end_is_never_text_even_with_ignore_eos(sp_llm):
    """With ignore_eos the end-of-sequence token is no stop token, but it is still the grammar's end: drawn
    where the output is complete, it ends the request ("stop") and is not written, special tokens or not."""
    params = [SP(max_tokens=40, temperature=1.0, seed=s, ignore_eos=True, skip_special_tokens=False,
                 structured_outputs=SO(regex="(yes|no)-[0-9]{1,3}")) for s in range(8)]
    outs = [o.outputs[0] for o in sp_llm.generate(["x"] * 8, params)]
    for c in outs:
        assert c.finish_reason == "stop" and re.fullmatch("(yes|no)-[0-9]{1,3}", c.text), (c.text, c.finish_reason)
    assert any(c.stop_reason in sp_llm.tokenizer.stop_token_ids for c in outs)  # some drew the end, not written


def test_a_grammar_that_never_ends_cannot_hang_a_request(sp_llm):
    """A grammar whose end the model never reaches is cut at max_tokens ("length"); one that has no end at
    all (infinite recursion) is refused by the grammar engine's step limit: "error", at once."""
    z = sp_llm.tokenizer.token_to_id("<0x7A>")  # 'z' is not in the tiny vocabulary but as a byte
    sp = SP(max_tokens=17, temperature=1.0, seed=0, logit_bias={z: -100.0},
            structured_outputs=SO(grammar='start: /a+/ "z"'))
    out = sp_llm.generate(["x"], sp)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 17 and set(out.text) == {"a"}
    endless = sp_llm.generate(["x"], SP(max_tokens=17, temperature=1.0, seed=0,
                                        structured_outputs=SO(grammar='start: "a" start')))[0].outputs[0]
    assert endless.finish_reason == "error" and endless.token_ids[:-1] == [] and "grammar" in endless.error
    sp_llm.engine.allocator.check_all_free()


def test_a_constraint_the_tokenizer_cannot_spell_ends_with_an_error_not_a_crash(tmp_path):
    """A tokenizer without byte fallback cannot write '€': no token is allowed, so that request ends with
    finish_reason "error" and a message; the request beside it in the batch finishes normally."""
    tok = sp_tokenizer(tmp_path, byte_fallback=False, vocab_size=120)
    llm = _llm(tok)
    try:
        outs = llm.generate(["hello", "world"], [
            SP(max_tokens=8, temperature=0, structured_outputs=SO(regex="€[0-9]")),
            SP(max_tokens=8, temperature=0, structured_outputs=SO(choice=["hello", "world"])),
        ])
        bad, good = outs[0].outputs[0], outs[1].outputs[0]
        assert bad.finish_reason == "error" and "structured output (regex)" in bad.error, (bad.finish_reason, bad.error)
        assert good.finish_reason == "stop" and good.text in ("hello", "world")
        llm.engine.allocator.check_all_free()
    finally:
        llm.close()


# -- bad input: one clean ValueError, before the request takes any engine resources -------------------


@pytest.mark.parametrize("bad, words", [
    (dict(json={"type": "nonsense"}), ["json", "does not compile"]),
    (dict(json="{not json"), ["json", "not valid JSON"]),
    (dict(regex="(ab"), ["regex", "does not compile"]),
    (dict(grammar="start: missing_rule"), ["grammar", "does not compile"]),
    (dict(grammar='root ::= "a" undefined'), ["grammar", "GBNF"]),
    (dict(json={"type": "object"}, regex="a"), ["exactly one", "json, regex"]),
    (dict(), ["exactly one", "none"]),
    (dict(choice=[]), ["choice"]),
    (dict(choice=["a", 3]), ["choice"]),
    (dict(regex="a" * 70_000), ["regex", "65,536 bytes"]),
    (dict(json={"enum": ["x" * 40] * 2000}), ["json", "65,536 bytes"]),
    (dict(choice=[str(i) for i in range(2000)]), ["choice", "1024"]),
])
def test_bad_constraints_are_one_clear_error_and_take_nothing(sp_llm, bad, words):
    def make():
        return sp_llm.make_request("hello", SP(max_tokens=4, structured_outputs=bad))

    with pytest.raises(ValueError) as e:
        make()
    for w in words:
        assert w in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    assert sp_llm.engine.is_idle() and sp_llm.engine.scheduler.num_waiting == 0
    sp_llm.engine.allocator.check_all_free()
    assert sp_llm.generate(["x"], SP(max_tokens=4, temperature=0))[0].outputs[0].finish_reason in ("stop", "length")


def test_structured_output_needs_a_tokenizer(tiny_llm):
    with pytest.raises(ValueError, match="tokenizer"):
        tiny_llm.make_request([1, 2, 3], SP(structured_outputs=SO(regex="a")))


# -- the real model -------------------------------------------------------------------------------------


@requires_smollm2
def test_smollm2_constraints_at_temperature_one_parse_validate_and_finish(smollm2_llm):
    """The real model (its GGUF-built BPE tokenizer: the fourth tokenizer kind), chat-templated, several
    seeds per constraint at temperature 1.0: every output finishes ("stop") and validates."""
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    # one request at a time: the programs other SmolLM2 tests compile (batch 1), no new ones
    for seed, name in enumerate(["json_person", "json_person", "json_nested", "json_nested", "regex", "choice"]):
        sp = SP(max_tokens=80, temperature=1.0, seed=seed, structured_outputs=CONSTRAINTS[name])
        c = smollm2_llm.chat(msgs, sp)[0].outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        validates(name, c.text)
