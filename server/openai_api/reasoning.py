"""Reasoning parsers: ``<think>...</think>`` in a model's output -> OpenAI-style ``reasoning_content``.

Two parsers, the same tags, different defaults for an output that does not open with ``<think>``:

    qwen3        Qwen3 (and QwQ, SmolLM3): the model writes ``<think>...</think>`` itself, so an output
                 without the opening tag is all content
    deepseek_r1  DeepSeek-R1 and its distills: the chat template opens the block, so the output starts
                 inside the reasoning and everything before ``</think>`` is reasoning (all of it when
                 ``</think>`` never comes)

The prompt says more than the family does, so pass it when you have it (``streamer(prompt_text)``,
``split(text, prompt_text=...)``): a prompt that ends inside an open ``<think>`` (Qwen3-Thinking-2507,
DeepSeek-R1's newer template) means the output starts in the reasoning whatever the family; a prompt
that ends with a closed ``<think>...</think>`` (Qwen3 with ``enable_thinking=false`` writes an empty
``<think>\\n\\n</think>\\n\\n``) means the output is all content.

Use::

    parser = get_reasoning_parser("qwen3", tokenizer)
    reasoning, content = parser.split(text, prompt_text=prompt)       # None where there is none
    s = parser.streamer(prompt)
    delta = s.feed(piece)      # DeltaMessage(reasoning=..., content=...); s.finish() at the end

Newlines next to the tags are dropped, as Qwen3's own template drops them when it renders the
message back (``reasoning.strip("\\n")``, ``content.lstrip("\\n")``), so ``<think>\\nA\\n</think>\\n\\nB``
splits into "A" and "B". Text that may be a tag cut in two (``</thi``) and newlines that may precede
``</think>`` are held back until the next piece says what they are; however a stream is cut, the
pieces concatenate to what `split` returns.

With a tool-call parser behind it, per choice (see ``tool_parsers.py``)::

    s = chain(reasoning_parser.streamer(prompt), tool_parser.streamer())
    reasoning, content, tool_calls = parse_whole(text, reasoning_parser, tool_parser, prompt_text=prompt)
"""

from __future__ import annotations

from typing import Any, Optional

from .tool_parsers import DeltaMessage, chain, parse_whole

__all__ = [
    "ReasoningParser", "ReasoningStreamer", "Qwen3ReasoningParser", "DeepSeekR1ReasoningParser",
    "REASONING_PARSERS", "get_reasoning_parser", "chain", "parse_whole",
]

_WS = " \t\n\r"


def _held_prefix(text: str, start: int, marker: str) -> int:
    """How many characters at the end of text[start:] could begin `marker`."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningStreamer:
    """State for one streamed choice: `feed` pieces of output, then `finish`."""

    tools_called = False  # as a tool-call streamer says it, so either kind can stand for a choice

    def __init__(self, parser: "ReasoningParser", mode: str, default: str) -> None:
        self.start, self.end = parser.start_tag, parser.end_tag
        self.mode = mode  # "auto" (the output's first text decides), "reasoning" or "content"
        self.default = default  # what "auto" becomes when the output does not open with the start tag
        self.lead = True  # at the start of the reasoning or of the content: newlines are dropped
        self.text = ""
        self.pos = 0
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._finished = False

    def feed(self, delta_text: str) -> DeltaMessage:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if delta_text:
            self.text += delta_text
            self._run(final=False)
        return self._take()

    def finish(self) -> DeltaMessage:
        if not self._finished:
            self._finished = True
            self._run(final=True)
        return self._take()

    def _take(self) -> DeltaMessage:
        if self.pos:
            self.text = self.text[self.pos:]
            self.pos = 0
        out = DeltaMessage(reasoning="".join(self._reasoning) or None, content="".join(self._content) or None)
        self._reasoning.clear()
        self._content.clear()
        return out

    def _run(self, final: bool) -> None:
        text = self.text
        n = len(text)
        while True:
            if self.mode == "auto":
                j = self.pos
                while j < n and text[j] in _WS:
                    j += 1
                if text.startswith(self.start, j):
                    self.pos = j + len(self.start)
                    self.mode, self.lead = "reasoning", True
                    continue
                if not final and (j == n or self.start.startswith(text[j:])):
                    return  # blank so far, or the start tag cut short: wait
                # no start tag: reasoning from the first character, or the output verbatim as content
                self.mode, self.lead = self.default, self.default == "reasoning"
                continue
            if self.mode == "reasoning":
                i = text.find(self.end, self.pos)
                stop = i if i >= 0 else n - (0 if final else _held_prefix(text, self.pos, self.end))
                piece = text[self.pos:stop]
                if self.lead:
                    stripped = piece.lstrip("\n")
                    if stripped:
                        self.lead = False
                    self.pos += len(piece) - len(stripped)
                    piece = stripped
                body = piece.rstrip("\n")  # newlines that may come right before the end tag wait
                if i >= 0 or final:
                    self._reasoning.append(body)
                    if i < 0:
                        self.pos = n
                        return
                    self.pos = i + len(self.end)
                    self.mode, self.lead = "content", True
                    continue
                self._reasoning.append(body)
                self.pos += len(body)
                return
            piece = text[self.pos:]  # content
            self.pos = n
            if self.lead:
                stripped = piece.lstrip("\n")
                if stripped:
                    self.lead = False
                piece = stripped
            self._content.append(piece)
            return


class ReasoningParser:
    """Splits ``<think>...</think>`` reasoning from the content; one subclass per family."""

    name: str = ""
    start_tag = "<think>"
    end_tag = "</think>"
    default_mode = "content"  # where an output without the start tag begins

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def _modes(self, prompt_text: Optional[str]) -> tuple[str, str]:
        if prompt_text:
            tail = prompt_text.rstrip()
            if tail.endswith(self.start_tag):
                return "auto", "reasoning"  # the prompt opened the block
            if tail.endswith(self.end_tag):
                return "content", "content"  # the prompt closed it: thinking is off
        return "auto", self.default_mode

    def streamer(self, prompt_text: Optional[str] = None) -> ReasoningStreamer:
        """Fresh state for one streamed choice; `prompt_text` is the rendered prompt, if known."""
        mode, default = self._modes(prompt_text)
        return ReasoningStreamer(self, mode, default)

    def split(self, text: str, prompt_text: Optional[str] = None) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content) of a whole output; None for a part that is empty."""
        s = self.streamer(prompt_text)
        a, b = s.feed(text), s.finish()
        reasoning = (a.reasoning or "") + (b.reasoning or "")
        content = (a.content or "") + (b.content or "")
        return reasoning or None, content or None

    def keeps_special_tokens(self) -> bool:
        """True when the think tags are special tokens of the tokenizer, so the output must be decoded
        with ``skip_special_tokens=False`` for the parser to see them."""
        tok = self.tokenizer
        if tok is None:
            return False
        special = getattr(tok, "all_special_ids", ())
        for tag in (self.start_tag, self.end_tag):
            i = tok.token_to_id(tag)
            if i is not None and i in special:
                return True
        return False


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    default_mode = "content"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    default_mode = "reasoning"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}


def get_reasoning_parser(name: str, tokenizer: Any = None) -> ReasoningParser:
    """The parser called `name` (a key of REASONING_PARSERS)."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown reasoning parser {name!r} (choices: {', '.join(sorted(REASONING_PARSERS))})")
    return cls(tokenizer)
