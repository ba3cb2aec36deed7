"""Incremental, UTF-8 safe detokenization with stop strings.

Decoding one token at a time is wrong in two ways: a character may be split
across byte-level tokens (an emoji is four bytes, often two or three tokens),
and some decoders change a token's text depending on what precedes it
(SentencePiece drops the leading space of the first piece it sees). So we
keep two offsets into the output ids, as vLLM and TGI do:

    ids:  ... [prefix_offset ........ read_offset) [new tokens ...]
               '---- already released ----'

Each step decodes the short window ``ids[prefix_offset:]`` and the part of
it already released, ``ids[prefix_offset:read_offset]``; the difference is
new text. It is released only when the window's text does not end in U+FFFD,
i.e. when the bytes seen so far form whole characters; then both offsets move
up (the window start stays put while the newest tokens decode to no text,
so SentencePiece's trim of a leading space never lands on a later piece). Every offset the window starts at is a point where released text ended
on a whole character, so decoding from there agrees with decoding the whole
sequence, and a step costs O(window), not O(sequence).

Stop strings are matched on the released text. The longest tail of it that
could still begin a stop string (at most ``len(longest stop) - 1``
characters) is held back, so a stop string is never half-emitted; on a match
the text is cut before it (or after it with ``include_stop_str_in_output``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turn a growing list of output token ids into text deltas.

    ``tokenizer`` needs ``decode(ids, skip_special_tokens=...)``.
    ``prompt_ids`` are kept for reference; the text produced is that of the
    output ids alone, so the concatenated deltas equal
    ``tokenizer.decode(output_ids, skip_special_tokens)`` (when no stop
    string matched).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
    ):
        if isinstance(stop, str):
            stop = (stop,)
        stops = tuple(stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        self.tokenizer = tokenizer
        self.prompt_ids = list(prompt_ids)
        self.skip_special_tokens = skip_special_tokens
        self.stop = stops
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_reason: Optional[str] = None
        self.text = ""  # everything released so far
        self.output_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(output_ids[prefix_offset:read_offset])
        self._held = ""  # decoded text not yet released: it may start a stop string
        self._decoded_len = 0  # characters decoded so far (released + held)
        self._finished = False

    @property
    def finished(self) -> bool:
        """True once a stop string matched or ``finish`` was called."""
        return self._finished or self.stop_reason is not None

    def add(self, token_ids: Iterable[int]) -> str:
        """Append ``token_ids``; return the text that became releasable."""
        if self.finished:
            return ""
        self.output_ids.extend(int(i) for i in token_ids)
        return self._release(self._decode_new(final=False), final=False)

    def finish(self) -> str:
        """Release everything still held: trailing incomplete UTF-8 comes out
        as U+FFFD, exactly as decoding the whole sequence gives it."""
        if self.finished:
            return ""
        delta = self._release(self._decode_new(final=True), final=True)
        self._finished = True
        return delta

    # -- internals ----------------------------------------------------------

    def _decode_new(self, final: bool) -> str:
        """Text of tokens past ``read_offset`` if it ends on a whole character."""
        if self._read_offset == len(self.output_ids):
            return ""
        window = self.tokenizer.decode(self.output_ids[self._prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if not final and window.endswith(_REPLACEMENT):
            return ""  # wait: the last character may still be incomplete
        if not window.startswith(self._prefix_text):
            # Cannot happen for decoders that are concatenative at character
            # boundaries; fall back to re-deriving from the full decode.
            full = self.tokenizer.decode(self.output_ids, skip_special_tokens=self.skip_special_tokens)
            delta = full[self._decoded_len:]
        else:
            delta = window[len(self._prefix_text):]
        self._decoded_len += len(delta)
        newest = self.tokenizer.decode(
            self.output_ids[self._read_offset:], skip_special_tokens=self.skip_special_tokens
        )
        if newest:
            self._prefix_offset, self._prefix_text = self._read_offset, newest
        else:
            # The newest tokens made no text (e.g. skipped special tokens). A
            # window starting there would let a decoder that trims the first
            # piece's leading space (SentencePiece) trim a later piece, so
            # keep the old start.
            self._prefix_text = window
        self._read_offset = len(self.output_ids)
        return delta

    def _release(self, new_text: str, final: bool) -> str:
        """Run stop-string matching over held + new text; return what may go out."""
        if not new_text and not (final and self._held):
            return ""
        buffer = self._held + new_text
        if self.stop:
            match = self._find_stop(buffer)
            if match is not None:
                at, s = match
                end = at + len(s) if self.include_stop_str_in_output else at
                self.stop_reason = s
                self._held = ""
                return self._emit(buffer[:end])
        keep = 0 if final else self._partial_stop_len(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return self._emit(buffer[: len(buffer) - keep])

    def _emit(self, delta: str) -> str:
        self.text += delta
        return delta

    def _find_stop(self, buffer: str) -> Optional[tuple[int, str]]:
        """Earliest stop string in ``buffer`` (longest on a tie)."""
        best: Optional[tuple[int, str]] = None
        for s in self.stop:
            at = buffer.find(s)
            if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(s) > len(best[1]))):
                best = (at, s)
        return best

    def _partial_stop_len(self, buffer: str) -> int:
        """Length of the longest tail of ``buffer`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buffer)), longest, -1):
                if buffer.endswith(s[:n]):
                    longest = n
                    break
        return longest


class NullDetokenizer:
    """Stands in when a model has no tokenizer: token ids only, no text, no stop strings."""

    text = ""
    stop_reason = None

    def add(self, token_ids) -> str:
        return ""

    def finish(self) -> str:
        return ""
