"""Structured output: a request's constraint (`StructuredOutputsParams`) as a token bitmask per step.

The grammar engine is llguidance (JSON Schema, regex, Lark and GBNF; a mask in tens of microseconds).
This module is the whole seam to it, on the host:

- `GrammarCompiler` (one per `InputProcessor`) builds llguidance's view of our `Tokenizer` once (HF
  ``tokenizers`` JSON as it is; a SentencePiece model piece by piece) and compiles a request's
  constraint into a `Constraint` before the request reaches the engine: a schema, regex or grammar
  that does not compile is a ValueError naming the kind and llguidance's message.
- `Constraint` is one request's matcher: it consumes each output token as the engine reads it back
  and says when the grammar has ended (only end-of-sequence can follow) or failed.
- `fill_bitmasks` writes the next-token masks of a step's constrained rows into one int32
  ``[rows, ceil(vocab / 32)]`` array with llguidance's batch fill (its own threads, GIL released);
  the sampler applies it on device (`jaxinfer.ops.sampler`). Bit t of row r allows token t; a row without
  a constraint is all ones, and ids past the tokenizer's vocabulary (the model's padding) are never
  allowed in a constrained row.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from typing import Any, Optional

import numpy as np

from jaxinfer.sampling_params import MAX_GRAMMAR_BYTES, StructuredOutputsParams

# Bounds on one grammar's work (llguidance's own limits: "fuel" is its unit of lexer work, ~50k per ms
# building the lexer and ~14k per ms per mask step); exceeding one is a ValueError (at compile) or
# ends the request with an error (on a step), never a stalled engine.
MAX_GRAMMAR_SYMBOLS = 200_000
INITIAL_LEXER_FUEL = 2_000_000  # ~40 ms of lexer construction
STEP_LEXER_FUEL = 400_000  # ~30 ms for one mask
COMPILE_WARN_S = 1.0


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # a dependency of the package: only a broken install lacks it
        raise ValueError("structured output needs the llguidance package (pip install llguidance)") from e
    return llguidance


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask over ``vocab_size`` logits."""
    return (vocab_size + 31) // 32


def allowed_ids(mask_row: np.ndarray) -> np.ndarray:
    """The token ids a bitmask row allows (for tests and errors)."""
    return np.nonzero(np.unpackbits(np.ascontiguousarray(mask_row).view(np.uint8), bitorder="little"))[0]


class _SentencePieceView:
    """What llguidance's `TokenizerWrapper` reads: every piece's bytes (control pieces marked special
    by a leading 0xFF, as llguidance expects), end-of-sequence ids and an encode function."""

    def __init__(self, tokenizer: Any, n_vocab: int):
        sp = tokenizer.backend
        n = sp.get_piece_size()
        tokens = []
        for i in range(n):
            piece = sp.id_to_piece(i)
            if sp.is_byte(i):
                tokens.append(bytes([int(piece[3:-1], 16)]))
            elif sp.is_control(i) or sp.is_unknown(i):
                tokens.append(b"\xff" + piece.encode("utf-8"))
            elif sp.is_unused(i):
                tokens.append(b"")
            else:
                tokens.append(piece.replace("\u2581", " ").encode("utf-8"))
        tokens += [b""] * (n_vocab - n)  # the model's padding ids: no bytes, never allowed
        self.tokens = tokens
        self.eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(i for i in tokenizer.all_special_ids if i < n)
        self._tokenizer = tokenizer

    def __call__(self, text) -> list:
        """Token ids spelling exactly ``text`` (llguidance tokenizes forced bytes with this). SentencePiece
        puts a space before the text it encodes (its dummy prefix); encoding after a newline and cutting the
        newline's tokens off leaves the text's own tokens, as they would appear mid-output."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        want = text.encode("utf-8")
        ids = self._tokenizer.encode("\n" + text, add_special_tokens=False)
        seen = b""
        for k, i in enumerate(ids):
            seen += self.tokens[i] if i < len(self.tokens) else b""
            if seen in (b"\n", b" \n"):
                if b"".join(self.tokens[j] for j in ids[k + 1:]) == want:
                    return ids[k + 1:]
                break
            if len(seen) >= 2:
                break
        return self._spell(want)

    def _spell(self, data: bytes) -> list:
        """Longest-match tokens for ``data`` (bytes no piece holds are left out: the grammar then allows
        no token there, and the request ends with that error)."""
        if not hasattr(self, "_by_bytes"):
            self._by_bytes = {}
            for i, b in enumerate(self.tokens):
                if b and not b.startswith(b"\xff"):
                    self._by_bytes.setdefault(b, i)
            self._longest = max(map(len, self._by_bytes), default=1)
        out, at = [], 0
        while at < len(data):
            for n in range(min(self._longest, len(data) - at), 0, -1):
                i = self._by_bytes.get(data[at:at + n])
                if i is not None:
                    out.append(i)
                    at += n
                    break
            else:
                at += 1
        return out


def _is_gbnf(text: str) -> bool:
    """llama.cpp's GBNF writes rules as ``name ::= ...``; Lark as ``name: ...``."""
    return re.search(r"^\s*[A-Za-z_][\w-]*\s*::=", text, re.MULTILINE) is not None


class GrammarCompiler:
    """Compiles constraints for one tokenizer and a model whose logits are ``vocab_size`` wide."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids=()):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = sorted(set(stop_token_ids) | set(tokenizer.stop_token_ids)) if tokenizer else []
        self._ll_tokenizer = None
        self._lock = threading.Lock()

    def ll_tokenizer(self) -> Any:
        """llguidance's tokenizer, built on first use (~0.5 s for a 49k vocabulary) and kept."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._build()
            return self._ll_tokenizer

    def _build(self) -> Any:
        lg = _llguidance()
        tok = self.tokenizer
        n_vocab = max(self.vocab_size, tok.vocab_size)
        eos = self.stop_token_ids or ([tok.eos_token_id] if tok.eos_token_id is not None else None)
        if not eos:
            raise ValueError("structured output needs an end-of-sequence token; this tokenizer names none")
        backend = tok.backend
        if hasattr(backend, "to_str"):  # HF tokenizers (tokenizer.json, or the GGUF's BPE built as one)
            raw = copy.copy(backend)
            raw.no_padding()
            raw.no_truncation()
            return lg.LLTokenizer(raw.to_str(), n_vocab=n_vocab, eos_token=eos)
        view = lg.TokenizerWrapper(_SentencePieceView(tok, n_vocab))
        return lg.LLTokenizer(view, n_vocab=n_vocab, eos_token=eos)

    # -- constraints -----------------------------------------------------------------------------

    def grammar(self, sop: StructuredOutputsParams) -> str:
        """llguidance's grammar text for a constraint (ValueError for what llguidance cannot read)."""
        lg = _llguidance()
        kind = sop.kind
        if kind in ("json", "json_object"):
            schema = sop.json if kind == "json" else {"type": "object"}
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}.") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON Schema object, got {type(schema).__name__}.")
            opts: dict = {"whitespace_flexible": not sop.disable_any_whitespace}
            if sop.whitespace_pattern is not None:
                opts["whitespace_pattern"] = sop.whitespace_pattern
            try:
                return lg.LLMatcher.grammar_from_json_schema(schema, overrides=opts)
            except ValueError as e:
                raise ValueError(f"structured_outputs.{kind}: {e}") from None
        if kind == "regex":
            return lg.LLMatcher.grammar_from_regex(sop.regex)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in sop.choice)
            return lg.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
        text = sop.grammar
        if _is_gbnf(text):
            try:
                text = lg.gbnf_to_lark.gbnf_to_lark(text)
            except Exception as e:  # its own error type, or a plain one on malformed input
                raise ValueError(f"structured_outputs.grammar (GBNF) does not convert to Lark: {e}") from None
        return lg.LLMatcher.grammar_from_lark(text)

    def compile(self, sop: StructuredOutputsParams) -> "Constraint":
        """A fresh matcher for one request; ValueError naming the kind and llguidance's message."""
        if self.tokenizer is None:
            raise ValueError("structured output needs a tokenizer; this model has none")
        lg = _llguidance()
        grammar = self.grammar(sop)
        if len(grammar.encode("utf-8")) > 4 * MAX_GRAMMAR_BYTES:  # choice lists and GBNF expand
            raise ValueError(f"structured_outputs.{sop.kind}: the compiled grammar is too large "
                             f"({len(grammar):,} bytes; the limit is {4 * MAX_GRAMMAR_BYTES:,}).")
        limits = lg.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS, initial_lexer_fuel=INITIAL_LEXER_FUEL,
                                   step_lexer_fuel=STEP_LEXER_FUEL, verbose_errors=False)
        t0 = time.perf_counter()
        matcher = lg.LLMatcher(self.ll_tokenizer(), grammar, log_level=0, limits=limits)
        seconds = time.perf_counter() - t0
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{sop.kind} does not compile: {_one_line(matcher.get_error())}")
        return Constraint(matcher, sop.kind, self.tokenizer.vocab_size, self.ll_tokenizer().vocab_size, seconds,
                          end_ids=self.stop_token_ids)


def _one_line(message: str, limit: int = 400) -> str:
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Constraint:
    """One request's grammar state: fed each output token in order (`accept`), asked for the next mask."""

    def __init__(self, matcher: Any, kind: str, tokenizer_vocab: int, mask_vocab: int, compile_s: float = 0.0,
                 end_ids=()):
        self.matcher = matcher
        # the tokens that end the grammar (llguidance's end-of-sequence ids): one drawn where the output
        # is complete ends the request, with ignore_eos too, and is never text
        self.end_ids = frozenset(end_ids)
        self.kind = kind
        self.tokenizer_vocab = tokenizer_vocab  # ids at or past it are never allowed
        self.mask_vocab = mask_vocab  # the width llguidance fills (its tokenizer's n_vocab)
        self.compile_s = compile_s
        self.tokens = 0  # tokens accepted so far
        self.error: Optional[str] = None

    def accept(self, token: int) -> bool:
        """Advance by one drawn token; False (and `error` set) when the grammar refuses it."""
        if self.error is not None:
            return False
        if not self.matcher.consume_token(int(token)):
            why = _one_line(self.matcher.get_error()) or f"token {token} is not allowed here"
            self.error = f"structured output ({self.kind}) failed after {self.tokens} tokens: {why}"
            return False
        self.tokens += 1
        return True

    @property
    def ended(self) -> bool:
        """The grammar is complete and nothing but end-of-sequence may follow."""
        return self.matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """The output so far is a whole sentence of the grammar. (llguidance also stops, allowing only
        end-of-sequence, when no token can continue a sentence that is not complete: `ended` without
        `complete`.)"""
        return self.matcher.is_accepting()

    def fail(self, message: str) -> None:
        if self.error is None:
            self.error = message

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` accepted tokens (for outputs that are discarded)."""
        if n:
            self.matcher.rollback(n)
            self.tokens -= n


_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> Any:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = _llguidance().LLExecutor()
        return _EXECUTOR


def fill_bitmasks(rows: list, batch: int, vocab_size: int) -> np.ndarray:
    """The ``[batch, ceil(vocab_size / 32)]`` int32 masks of a step: all ones, but for each
    (`Constraint`, row) in ``rows`` the tokens its grammar allows next (llguidance's batch fill).

    A constrained row whose grammar allows no token at all (a tokenizer that cannot spell what the
    grammar needs, a step's fuel exhausted) gets its constraint's `error` set; its row still samples
    (some token), and the engine ends that request with the error when it reads the token back.
    """
    w = bitmask_width(vocab_size)
    out = np.full((batch, w), -1, np.int32)
    if not rows:
        return out
    lg_np = _llguidance_numpy()
    widths = {c.mask_vocab for c, _ in rows}  # one tokenizer per engine: one width
    if len(widths) != 1:
        raise RuntimeError(f"constraints of one step were built for different vocabularies: {sorted(widths)}")
    buf = np.zeros((batch, bitmask_width(widths.pop())), np.int32)  # llguidance fills exactly its width
    try:
        lg_np.fill_next_token_bitmask_par(_executor(), [(c.matcher, i) for c, i in rows], buf)
    except Exception as e:  # never the whole batch's step: the constrained rows end with the error
        for c, _ in rows:
            c.fail(f"structured output ({c.kind}): the grammar engine failed: {_one_line(str(e))}")
        return out
    n = min(w, buf.shape[1])
    for c, i in rows:
        keep = np.zeros(w, np.int32)
        keep[:n] = buf[i, :n]
        _clear_from(keep, min(c.tokenizer_vocab, vocab_size))
        out[i] = keep
        if not keep.any():
            c.fail(f"structured output ({c.kind}) allows no token after {c.tokens} tokens"
                   + (f": {_one_line(c.matcher.get_error())}" if c.matcher.is_error() else ""))
    return out


def draft_prefix(c: "Constraint", drafts: list) -> list:
    """The leading drafts the grammar accepts from its state now (speculative decoding: a draft the grammar
    forbids would be rejected anyway, so it and those after it are not verified). Consumes nothing."""
    if c.error is not None or not drafts:
        return []
    return list(drafts[: c.matcher.validate_tokens([int(t) for t in drafts])])


def segment_masks(c: "Constraint", drafts: list, vocab_size: int) -> np.ndarray:
    """The masks of a verify segment's rows ``[len(drafts) + 1, ceil(vocab_size / 32)]``: row j the tokens
    the grammar allows after the tokens so far and ``drafts[:j]`` (each `draft_prefix`-valid). The matcher
    consumes the drafts to compute them and rolls them back: its state is unchanged."""
    out = np.empty((len(drafts) + 1, bitmask_width(vocab_size)), np.int32)
    taken = 0
    try:
        for j in range(len(drafts) + 1):
            out[j] = fill_bitmasks([(c, 0)], 1, vocab_size)[0]
            if j < len(drafts):
                if not c.matcher.consume_token(int(drafts[j])):
                    raise RuntimeError(f"draft token {drafts[j]} refused after validation")
                taken += 1
    finally:
        if taken:
            c.matcher.rollback(taken)
    return out


def _clear_from(row: np.ndarray, n: int) -> None:
    """Clear bits n.. of one bitmask row (ids past the tokenizer's vocabulary are never allowed)."""
    word, bit = divmod(n, 32)
    if word < row.shape[0]:
        row[word] &= np.array((1 << bit) - 1, np.uint32).view(np.int32) if bit else 0
        row[word + 1:] = 0


def _llguidance_numpy():
    _llguidance()
    import llguidance.numpy

    return llguidance.numpy
