"""Tool-call parsers: a model's generated text -> OpenAI's ``message.tool_calls``, whole and streamed.

A model asked to call a tool writes the call as text in its family's format; a parser reads that
text back into calls. Three formats, each the one its family's chat template teaches:

    hermes       Qwen2.5 / Qwen3 / Hermes / SmolLM3:
                 ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several in a row,
                 content may come before them
    llama3_json  Llama 3.1 / 3.2 / 3.3:  the whole output is ``{"name": ..., "parameters": {...}}`` (or
                 "arguments"), optionally after ``<|python_tag|>``, several separated by ``;``; an output
                 that does not start with ``{`` or the tag is plain content
    mistral      ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (tokenizers up to v7) or
                 ``[TOOL_CALLS]name[ARGS]{...}`` / ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`` (v11 and later),
                 ids of 9 alphanumerics

Use::

    parser = get_tool_parser("hermes", tokenizer)     # or the name tool_parser_for(...) picks for the model
    whole = parser.extract(text)                      # ExtractedToolCalls(tool_calls=[ToolCall...], content=...)

    s = parser.streamer()                             # one per streamed choice
    for piece in pieces: delta = s.feed(piece)        # DeltaMessage(content=..., tool_calls=[ToolCallDelta...])
    last = s.finish()                                 # flushes what was held back
    finish_reason = "tool_calls" if s.tools_called else ...

With a reasoning parser (``reasoning.py``) in front, per streamed choice::

    s = chain(reasoning_parser.streamer(prompt_text), tool_parser.streamer())   # either may be None
    delta = s.feed(piece); ...; delta = s.finish()    # DeltaMessage(reasoning=..., content=..., tool_calls=...)
    reasoning, content, tool_calls = parse_whole(text, reasoning_parser, tool_parser, prompt_text)

How a stream is cut never changes the result: for any split of a text into pieces, the content
pieces concatenate to ``extract(text).content`` and each call's ``ToolCallDelta.arguments`` pieces
concatenate to its ``ToolCall.arguments`` (``extract`` is the streamer fed the whole text at once).
The first delta of call i carries its index, id and name; later ones only arguments. Content that
cannot be part of a call goes out at once; text that may start a call (a partial marker, the
leading ``{`` of a Llama output) is held back until it is known.

What is read, and what becomes of odd output:

* Arguments are re-written as ``json.dumps(value, ensure_ascii=False)`` writes them (", " and ": "
  separators), piece by piece as they are read, so a stream needs no look-ahead beyond the token
  being read (a number or ``true``/``false``/``null`` goes out whole). Arguments given as a JSON
  string are passed through as that string's text. Raw control characters inside strings (a
  model writing code with real newlines) are accepted and escaped.
* A call starts to stream ("is committed") once its name is read and its arguments have begun
  (the first member's value has started, or the arguments are complete): text that is not a call
  (a JSON answer such as ``{"name": "Ada", "age": 36}`` from Llama, a Python-style ``{'a': 1}``, a
  call without a name, an unknown key before the arguments) never becomes one, and stays content
  verbatim, markers included.
* A committed call stays a call. If its JSON breaks later, or the output ends inside it (max_tokens),
  its arguments are closed where the text stopped making sense (an open string is ended, a
  half-read key, number or literal dropped, brackets closed: the arguments are always valid JSON),
  and the text from the character that broke it is content (for hermes, up to the ``</tool_call>``
  that ends the call).
* Whitespace between and after calls is dropped; other text before, between or after calls is
  content as written.

For the mistral format ``[TOOL_CALLS]`` is a special token: decode the output with
``skip_special_tokens=False`` when ``parser.keeps_special_tokens()`` says so, or the marker never
reaches the parser.
"""

from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = [
    "ToolCall", "ToolCallDelta", "ExtractedToolCalls", "DeltaMessage", "ToolParser", "ToolCallStreamer",
    "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser", "TOOL_PARSERS", "get_tool_parser",
    "tool_parser_for", "make_tool_call_id", "chain", "ChainedStreamer", "parse_whole", "merge_deltas",
]

# ---------------------------------------------------------------------------
# The shapes the server sends.
# ---------------------------------------------------------------------------


@dataclass
class ToolCall:
    """One complete call: OpenAI's ``message.tool_calls[i]`` (type "function")."""

    id: str
    name: str
    arguments: str  # JSON text of the arguments


@dataclass
class ToolCallDelta:
    """One streamed piece of a call: OpenAI's ``delta.tool_calls[i]``."""

    index: int
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: str = ""


@dataclass
class ExtractedToolCalls:
    tool_calls: list[ToolCall]
    content: Optional[str]

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass
class DeltaMessage:
    """What one step of a stream adds to a choice: content, reasoning and tool-call pieces."""

    content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """True when there is nothing to send."""
        return not self.content and not self.reasoning and not self.tool_calls


def _join(a: Optional[str], b: Optional[str]) -> Optional[str]:
    return (a or "") + (b or "") or None


def _add_call_delta(calls: list[ToolCallDelta], d: ToolCallDelta) -> None:
    """Append `d`, folding it into the last delta when that one is the same call."""
    if calls and calls[-1].index == d.index and d.id is None and d.name is None:
        calls[-1].arguments += d.arguments
    elif d.id is not None or d.name is not None or d.arguments:
        calls.append(ToolCallDelta(d.index, d.id, d.name, d.arguments))


def merge_deltas(*deltas: Optional[DeltaMessage]) -> DeltaMessage:
    """One DeltaMessage saying what `deltas` say in order (None entries are skipped)."""
    out = DeltaMessage()
    for d in deltas:
        if d is None:
            continue
        out.content = _join(out.content, d.content)
        out.reasoning = _join(out.reasoning, d.reasoning)
        for c in d.tool_calls:
            _add_call_delta(out.tool_calls, c)
    return out


_ALNUM = string.ascii_letters + string.digits
_random = random.SystemRandom()


def make_tool_call_id(length: int = 24, prefix: str = "call_") -> str:
    """A fresh call id: ``call_`` and 24 random alphanumerics (OpenAI's shape)."""
    return prefix + "".join(_random.choices(_ALNUM, k=length))


def _mistral_id() -> str:
    return "".join(_random.choices(_ALNUM, k=9))


# ---------------------------------------------------------------------------
# JSON, a character at a time.
# ---------------------------------------------------------------------------

_MORE, _DONE, _DONE_UNREAD, _ERROR = 0, 1, 2, 3  # DONE_UNREAD: the value ended before this character
_WS = " \t\n\r"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_PLAIN_RUN = re.compile(r'[^"\\]+')  # characters that stand for themselves inside a JSON string
_LITERALS = ("true", "false", "null")
_ENCODE = re.compile('["\\\\\x00-\x1f\ud800-\udfff]')
_SURROGATE = re.compile("[\ud800-\udfff]")
_ENCODED = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


def _encode(s: str) -> str:
    """The inside of a JSON string holding `s`, as json.dumps(ensure_ascii=False) writes it.

    Lone surrogates are escaped (json.dumps would leave them raw, and they cannot go out as UTF-8).
    """
    return _ENCODE.sub(lambda m: _ENCODED.get(m.group()) or "\\u%04x" % ord(m.group()), s)


def _number_text(token: str) -> str:
    """json.dumps(json.loads(token)) for a valid JSON number, or the token where that is not JSON."""
    try:
        text = json.dumps(json.loads(token))
    except ValueError:  # an integer longer than Python converts
        return token
    return token if text in ("Infinity", "-Infinity", "NaN") else text


class _StringReader:
    """The body of a JSON string after its opening quote, decoded a character at a time."""

    __slots__ = ("escape", "high")

    def __init__(self) -> None:
        self.escape: Optional[str] = None  # "" after a backslash, "u", "u1", ... inside \\uXXXX
        self.high = ""  # a high surrogate waiting for its low half

    def feed(self, c: str) -> tuple[int, str]:
        """(_MORE | _DONE | _ERROR, decoded text)."""
        esc = self.escape
        if esc is not None:
            if esc == "":
                if c == "u":
                    self.escape = "u"
                    return _MORE, ""
                ch = _ESCAPES.get(c)
                if ch is None:
                    return _ERROR, ""
                self.escape = None
                return _MORE, self._plain(ch)
            if c not in _HEX:
                return _ERROR, ""
            esc += c
            if len(esc) < 5:
                self.escape = esc
                return _MORE, ""
            self.escape = None
            return _MORE, self._code(int(esc[1:], 16))
        if c == "\\":
            self.escape = ""
            return _MORE, ""
        if c == '"':
            out, self.high = self.high, ""
            return _DONE, out
        return _MORE, self._plain(c)

    def _plain(self, ch: str) -> str:
        if self.high:
            ch, self.high = self.high + ch, ""
        return ch

    def _code(self, cp: int) -> str:
        if 0xD800 <= cp < 0xDC00:
            out, self.high = self.high, chr(cp)
            return out
        if 0xDC00 <= cp < 0xE000 and self.high:
            ch = chr(0x10000 + ((ord(self.high) - 0xD800) << 10) + (cp - 0xDC00))
            self.high = ""
            return ch
        return self._plain(chr(cp))


class _JsonWriter:
    """One JSON value read a character at a time and written out again, as json.dumps would write it.

    `out` collects the canonical text as it becomes certain. A separator, a key and a number or
    literal are held until the value after them begins (or ends), so that `close` can always turn
    what went out into valid JSON.
    """

    def __init__(self, null_as: Optional[str] = None) -> None:
        self.out: list[str] = []
        self.hold = ""
        self.frames: list[list[str]] = [["t", "v"]]  # [kind, state]: t(op) v/end; o(bject) k0 k : v ,; a(rray) v0 v ,
        self.token: Any = None  # _StringReader, or a list of characters (number, literal)
        self.kind = ""  # "s" string value, "k" key, "n" number, "l" literal
        self.key: list[str] = []
        self.started = False
        self.member_started = False  # the top-level object's first member's value began, or it closed
        self.null_as = null_as

    @property
    def done(self) -> bool:
        return self.frames[0][1] == "end"

    def feed(self, c: str) -> int:
        kind = self.kind
        if kind:
            if kind == "s" or kind == "k":
                status, text = self.token.feed(c)
                if status == _ERROR:
                    return _ERROR
                if kind == "s":
                    if text:
                        self.out.append(_encode(text))
                    if status == _DONE:
                        self.out.append('"')
                        self.kind = ""
                        return self._value_done()
                else:
                    if text:
                        self.key.append(text)
                    if status == _DONE:
                        self.hold += '"' + _encode("".join(self.key)) + '"'
                        self.key = []
                        self.kind = ""
                        self.frames[-1][1] = ":"
                return _MORE
            if kind == "n":
                if c in _NUMBER_CHARS:
                    self.token.append(c)
                    return _MORE
                if not self._end_number():
                    return _ERROR
                if self._value_done() == _DONE:
                    return _DONE_UNREAD
                return self.feed(c)
            self.token.append(c)  # literal
            word = "".join(self.token)
            if word in _LITERALS:
                if word == "null" and self.null_as is not None and len(self.frames) == 1:
                    word = self.null_as
                self.out.append(self.hold + word)
                self.hold = ""
                self.kind = ""
                return self._value_done()
            return _MORE if any(w.startswith(word) for w in _LITERALS) else _ERROR
        if c in _WS:
            return _MORE
        frame = self.frames[-1]
        fkind, state = frame
        if fkind == "o":
            if state == "k0" or state == "k":
                if c == '"':
                    self.kind, self.token = "k", _StringReader()
                    return _MORE
                if c == "}" and state == "k0":
                    return self._close()
                return _ERROR
            if state == ":":
                if c != ":":
                    return _ERROR
                self.hold += ": "
                frame[1] = "v"
                return _MORE
            if state == "v":
                if len(self.frames) == 2:
                    self.member_started = True
                return self._begin(c)
            if c == ",":  # state ","
                self.hold += ", "
                frame[1] = "k"
                return _MORE
            return self._close() if c == "}" else _ERROR
        if fkind == "a":
            if state == ",":
                if c == ",":
                    self.hold += ", "
                    frame[1] = "v"
                    return _MORE
                return self._close() if c == "]" else _ERROR
            if c == "]" and state == "v0":
                return self._close()
            return self._begin(c)
        if state == "v":  # the top
            self.started = True
            return self._begin(c)
        return _ERROR

    def _begin(self, c: str) -> int:
        if c == '"':
            self.kind, self.token = "s", _StringReader()
            self.out.append(self.hold + '"')
        elif c == "{":
            self.frames.append(["o", "k0"])
            self.out.append(self.hold + "{")
        elif c == "[":
            self.frames.append(["a", "v0"])
            self.out.append(self.hold + "[")
        elif c == "-" or "0" <= c <= "9":
            self.kind, self.token = "n", [c]
            return _MORE
        elif c in "tfn":
            self.kind, self.token = "l", [c]
            return _MORE
        else:
            return _ERROR
        self.hold = ""
        return _MORE

    def _close(self) -> int:
        kind = self.frames.pop()[0]
        self.out.append("}" if kind == "o" else "]")
        if len(self.frames) == 1:
            self.member_started = True
        return self._value_done()

    def _value_done(self) -> int:
        frame = self.frames[-1]
        if frame[0] == "t":
            frame[1] = "end"
            return _DONE
        frame[1] = ","
        return _MORE

    def _end_number(self) -> bool:
        token = "".join(self.token)
        if not _NUMBER.match(token):
            return False
        self.out.append(self.hold + _number_text(token))
        self.hold = ""
        self.kind = ""
        return True

    def finish(self) -> int:
        """The text ended here: a number in progress ends with it. _DONE, _MORE (cut short) or _ERROR."""
        if self.kind == "n":
            if not self._end_number():
                return _ERROR
            return self._value_done()
        return _DONE if self.done else _MORE

    def close(self) -> str:
        """The text that makes what went out valid JSON (empty when the value is complete)."""
        if self.done or not self.started:
            return ""
        parts = []
        if self.kind == "s":
            parts.append(_encode(self.token.high) + '"')
        self.kind, self.token, self.hold = "", None, ""
        for fkind, _ in reversed(self.frames[1:]):
            parts.append("}" if fkind == "o" else "]")
        self.frames = [["t", "end"]]
        return "".join(parts)

    def take(self) -> str:
        text = "".join(self.out)
        self.out.clear()
        return text


class _CallReader:
    """One call object ``{"name": ..., "arguments": ...}`` read a character at a time.

    With `name` given (``bare``) it reads only the arguments value (mistral's ``name[ARGS]{...}``).
    `feed` returns _MORE, _DONE or _ERROR; `committed` turns True once the call is surely a call
    (see the module docstring); `take()` hands out the arguments text read since the last call.
    """

    ARG_KEYS = ("arguments", "parameters")
    SKIPPED_KEYS = ("type", "id")  # allowed before the call is committed; any other key makes it no call

    def __init__(self, name: Optional[str] = None, call_id: Optional[str] = None) -> None:
        self.name = name
        self.call_id = call_id
        self.committed = False
        self.announced = False  # the streamer has sent this call's id and name
        self.bare = name is not None
        self.state = "v" if self.bare else "start"
        self.key: Optional[str] = "arguments" if self.bare else None
        self.value = ""  # what the value being read is: name, id, args, argstr, skip, key
        self.reader: Any = None  # _StringReader or _JsonWriter of that value
        self.chars: list[str] = []
        self.args: Optional[_JsonWriter] = None
        self.args_seen = False  # the arguments value began
        self.args_done = False
        self.pending: list[str] = []  # arguments text not yet taken

    def take(self) -> str:
        if self.args is not None and self.args.out:
            self.pending.append(self.args.take())
        text = "".join(self.pending)
        self.pending.clear()
        return text

    def _check_commit(self) -> None:
        if not self.committed and self.name is not None and (
                self.args_done or (self.args is not None and self.args.member_started)
                or self.value == "argstr"):
            self.committed = True

    def feed(self, c: str) -> int:
        status = self._feed(c)
        if status != _ERROR:
            self._check_commit()
        return status

    def run(self, text: str, pos: int) -> int:
        """Read the run of plain characters at text[pos:] when inside a string; the position after it.

        The fast path of `feed` (the same result, a run at a time): a string never commits a call.
        """
        value = self.value
        if not value:
            return pos
        if value == "args" or value == "skip":
            writer = self.reader
            if writer.kind != "s":
                return pos
            reader = writer.token
        else:
            reader = self.reader
        if reader.escape is not None or reader.high:
            return pos
        m = _PLAIN_RUN.match(text, pos)
        if m is None:
            return pos
        if value == "args":
            writer.out.append(_encode(m.group()))
        elif value == "argstr":
            self.pending.append(_SURROGATE.sub("\ufffd", m.group()))
        elif value != "skip":
            self.chars.append(m.group())
        return m.end()

    def _feed(self, c: str) -> int:
        value = self.value
        if value:
            if value == "args" or value == "skip":
                status = self.reader.feed(c)
                if status == _ERROR:
                    return _ERROR
                if status == _MORE:
                    return _MORE
                self._value_end()
                if self.bare:
                    return status
                return self._feed(c) if status == _DONE_UNREAD else _MORE
            status, text = self.reader.feed(c)
            if status == _ERROR:
                return _ERROR
            if value == "argstr":
                if text:
                    self.pending.append(_SURROGATE.sub("\ufffd", text))
            else:
                self.chars.append(text)
            if status == _DONE:
                self._value_end()
                if self.bare:
                    return _DONE
            return _MORE
        if c in _WS:
            return _MORE
        state = self.state
        if state == "start":
            if c != "{":
                return _ERROR
            self.state = "k0"
            return _MORE
        if state == "k0" or state == "k":
            if c == '"':
                self.value, self.reader, self.chars = "key", _StringReader(), []
                return _MORE
            if c == "}" and state == "k0":
                return self._end_object()
            return _ERROR
        if state == ":":
            if c != ":":
                return _ERROR
            self.state = "v"
            return _MORE
        if state == "v":
            return self._begin_value(c)
        if c == ",":  # state ","
            self.state = "k"
            return _MORE
        return self._end_object() if c == "}" else _ERROR

    def _begin_value(self, c: str) -> int:
        key = self.key
        if key == "name" and self.name is None:
            if c != '"':
                return _ERROR
            self.value, self.reader, self.chars = "name", _StringReader(), []
            return _MORE
        if key == "id" and c == '"' and not self.committed and self.call_id is None:
            self.value, self.reader, self.chars = "id", _StringReader(), []
            return _MORE
        if key in self.ARG_KEYS and not self.args_seen:
            self.args_seen = True
            if c == '"':
                self.value, self.reader = "argstr", _StringReader()
                return _MORE
            self.args = self.reader = _JsonWriter(null_as="{}")
            self.value = "args"
            return self._feed(c)
        if not self.committed and key not in self.SKIPPED_KEYS and key not in self.ARG_KEYS and key != "name":
            return _ERROR  # not the shape of a call
        self.value, self.reader = "skip", _JsonWriter()
        return self._feed(c)

    def _value_end(self) -> None:
        value = self.value
        self.value, self.reader = "", None
        if value == "key":
            self.key = "".join(self.chars)
            self.state = ":"
            return
        self.state = ","
        if value == "name":
            self.name = "".join(self.chars)
        elif value == "id":
            self.call_id = "".join(self.chars)
        elif value in ("args", "argstr"):
            self.args_done = True

    def _end_object(self) -> int:
        if not self.name:
            return _ERROR
        if not self.args_seen:
            self.pending.append("{}")
            self.args_seen = self.args_done = True
        self.committed = True
        return _DONE

    def finish(self) -> None:
        """The text ended inside this call: let a number that was being read end with it."""
        if self.value == "args" and self.reader.finish() == _DONE:
            self.value, self.reader = "", None
            self.args_done = True
            self._check_commit()

    def close(self) -> str:
        """The arguments text that completes a committed call cut short (valid JSON overall)."""
        text = self.take()
        if self.args is not None and not self.args_done:
            text += self.args.close()
        elif not self.args_seen:
            text += "{}"
        self.args_done = True
        return text


# ---------------------------------------------------------------------------
# Streamers.
# ---------------------------------------------------------------------------


def _held_prefix(text: str, start: int, markers: tuple[str, ...]) -> int:
    """How many characters at the end of text[start:] could begin one of `markers`."""
    best = 0
    n = len(text) - start
    for m in markers:
        for k in range(min(len(m) - 1, n), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class ToolCallStreamer:
    """State for one streamed choice. Subclasses implement `_run` over `self.text` from `self.pos`."""

    def __init__(self, parser: "ToolParser") -> None:
        self.parser = parser
        self.text = ""
        self.pos = 0
        self.region: Optional[int] = None  # where the call attempt being read began (None: no attempt open)
        self.state = "content"
        self.reader: Optional[_CallReader] = None
        self.tools_called = False
        self.calls = 0
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._finished = False

    # -- the public side ------------------------------------------------------

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

    # -- helpers for _run -----------------------------------------------------

    def _take(self) -> DeltaMessage:
        cut = self.pos if self.region is None else min(self.pos, self.region)
        if cut:
            self.text = self.text[cut:]
            self.pos -= cut
            if self.region is not None:
                self.region -= cut
        content = "".join(self._content) or None
        self._content.clear()
        deltas, self._deltas = self._deltas, []
        return DeltaMessage(content=content, tool_calls=deltas)

    def _emit(self, text: str) -> None:
        if text:
            self._content.append(text)

    def _open(self, region: int, reader: _CallReader) -> None:
        self.region = region
        self.reader = reader

    def _read_call(self, final: bool) -> Optional[str]:
        """Feed the open call reader from `pos`. Returns "done", "broken" (a committed call broke at
        `pos`), "fallback" (not a call: its text went out as content, `pos` is where to go on) or
        None (the text ran out)."""
        reader = self.reader
        text = self.text
        n = len(text)
        while self.pos < n:
            end = reader.run(text, self.pos)
            if end != self.pos:
                self.pos = end
                if reader.committed:
                    self._args(reader.take())
                continue
            status = reader.feed(text[self.pos])
            self._sync()
            if status == _ERROR:
                return self._broken()
            if status != _DONE_UNREAD:
                self.pos += 1
            if status == _DONE or status == _DONE_UNREAD:
                self.reader, self.region = None, None
                return "done"
        if not final:
            return None
        reader.finish()
        self._sync()
        if reader.committed:
            self._args(reader.close())
            self.reader = None
            return "done"
        return self._fallback()

    def _broken(self) -> str:
        if self.reader.committed:
            self._args(self.reader.close())
            self.reader, self.region = None, None
            return "broken"
        return self._fallback()

    def _fallback(self) -> str:
        self._emit(self.text[self.region:self.pos])
        self.reader, self.region = None, None
        return "fallback"

    def _sync(self) -> None:
        reader = self.reader
        if reader.committed:
            if not reader.announced:
                reader.announced = True
                self.region = None
                index = self.calls
                self.calls += 1
                self.tools_called = True
                self._deltas.append(ToolCallDelta(index, self.parser.call_id(reader.call_id), reader.name, ""))
            self._args(reader.take())

    def _args(self, text: str) -> None:
        if text:
            _add_call_delta(self._deltas, ToolCallDelta(self.calls - 1, arguments=text))

    def _skip_ws(self) -> bool:
        """Skip whitespace from `pos`; True when a character follows."""
        text, n = self.text, len(self.text)
        while self.pos < n and text[self.pos] in _WS:
            self.pos += 1
        return self.pos < n

    def _content_until(self, markers: tuple[str, ...], final: bool) -> Optional[tuple[int, str]]:
        """Emit content from `pos` up to the first of `markers`: (its position, the marker), or None
        after emitting all that cannot begin a marker (the rest is held unless `final`)."""
        text = self.text
        hit = None
        for m in markers:
            i = text.find(m, self.pos)
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, m)
        if hit is not None:
            self._emit(text[self.pos:hit[0]])
            self.pos = hit[0]
            return hit
        keep = 0 if final else _held_prefix(text, self.pos, markers)
        self._emit(text[self.pos:len(text) - keep])
        self.pos = len(text) - keep
        return None

    def _run(self, final: bool) -> None:
        raise NotImplementedError


class _HermesStreamer(ToolCallStreamer):
    START, END = "<tool_call>", "</tool_call>"

    def _run(self, final: bool) -> None:
        while True:
            state = self.state
            if state == "content":
                hit = self._content_until((self.START,), final)
                if hit is None:
                    return
                self._open(self.pos, _CallReader())
                self.pos += len(self.START)
                self.state = "call"
            elif state == "call":
                result = self._read_call(final)
                if result is None:
                    return
                self.state = {"done": "call_end", "broken": "tail", "fallback": "content"}[result]
            elif state == "call_end":  # whitespace, then </tool_call>
                if not self._skip_ws():
                    return
                if self.text.startswith(self.END, self.pos):
                    self.pos += len(self.END)
                    self.state = "after"
                elif self.END.startswith(self.text[self.pos:]):
                    if final:  # a closing tag cut short
                        self.pos = len(self.text)
                    return
                else:
                    self.state = "tail"
            elif state == "tail":  # text after a call, inside its tags: content; the closing tag is dropped
                hit = self._content_until((self.END,), False)
                if hit is None:
                    if final:
                        self.pos = len(self.text)
                    return
                self.pos += len(self.END)
                self.state = "after"
            else:  # after a call: drop whitespace
                if not self._skip_ws():
                    return
                self.state = "content"


class _Llama3Streamer(ToolCallStreamer):
    TAG = "<|python_tag|>"

    def __init__(self, parser: "ToolParser") -> None:
        super().__init__(parser)
        self.state = "start"

    def _run(self, final: bool) -> None:
        text = self.text
        n = len(text)
        while True:
            state = self.state
            if state == "start":  # the output's first non-blank text decides
                j = self.pos
                while j < n and text[j] in _WS:
                    j += 1
                if j == n:
                    if final:
                        self._emit(text[self.pos:])
                        self.pos = n
                    return
                if text[j] == "{":
                    self._open(self.pos, _CallReader())
                    self.pos = j
                    self.state = "call"
                elif text.startswith(self.TAG, j):
                    self.region = self.pos
                    self.pos = j + len(self.TAG)
                    self.state = "tag"
                elif self.TAG.startswith(text[j:]) and not final:
                    return
                else:
                    self.state = "plain"
            elif state == "tag":  # after <|python_tag|>: a call must follow
                if not self._skip_ws():
                    if final:
                        self._emit(text[self.region:])
                        self.pos, self.region = n, None
                    return
                if text[self.pos] == "{":
                    self.reader = _CallReader()
                    self.state = "call"
                else:
                    self._emit(text[self.region:self.pos])
                    self.region = None
                    self.state = "plain"
            elif state == "call":
                result = self._read_call(final)
                if result is None:
                    return
                self.state = "between" if result == "done" else "plain"
            elif state == "between":  # after a call: ";" and another call, or the end
                if not self._skip_ws():
                    return
                if text[self.pos] == ";":
                    self.pos += 1
                    self.state = "next"
                else:
                    self.state = "plain"
            elif state == "next":
                if not self._skip_ws():
                    return
                if text[self.pos] == "{":
                    self._open(self.pos, _CallReader())
                    self.state = "call"
                else:
                    self.state = "plain"
            else:  # plain content to the end
                self._emit(text[self.pos:])
                self.pos = n
                return


_NAME_CHARS = frozenset(_ALNUM + "_-.")


class _MistralStreamer(ToolCallStreamer):
    MARK, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"

    def __init__(self, parser: "ToolParser") -> None:
        super().__init__(parser)
        self.in_list = False
        self.name: list[str] = []
        self.model_id: list[str] = []

    def _fallback_here(self) -> None:
        self._emit(self.text[self.region:self.pos])
        self.region = None
        self.state = "content"

    def _run(self, final: bool) -> None:
        while True:
            text = self.text
            n = len(text)
            state = self.state
            if state == "content":
                hit = self._content_until((self.MARK,), final)
                if hit is None:
                    return
                self.region = self.pos
                self.pos += len(self.MARK)
                self.state = "detect"
            elif state == "detect":  # the form of the calls after [TOOL_CALLS]
                if not self._skip_ws():
                    if final:
                        self._fallback_here()
                        continue
                    return
                c = text[self.pos]
                if c == "[":
                    self.pos += 1
                    self.in_list = True
                    self.state = "list"
                elif c == "{":
                    self.in_list = False
                    self.reader = _CallReader()
                    self.state = "call"
                elif c in _NAME_CHARS:
                    self.name, self.model_id = [], []
                    self.state = "name"
                else:
                    self._fallback_here()
            elif state == "list":  # after "[": a call object or "]"
                if not self._skip_ws():
                    if final:
                        self._fallback_here()
                        continue
                    return
                c = text[self.pos]
                if c == "{":
                    self.reader = _CallReader()
                    self.state = "call"
                elif c == "]":
                    self.pos += 1
                    self.region = None
                    self.state = "after"
                else:
                    self._fallback_here()
            elif state == "call":
                result = self._read_call(final)
                if result is None:
                    return
                self.state = "list_next" if result == "done" and self.in_list else (
                    "after" if result == "done" else "content")
            elif state == "list_next":  # "," and another call, or "]"
                if not self._skip_ws():
                    return
                c = text[self.pos]
                if c == ",":
                    self.pos += 1
                    self.state = "list_item"
                elif c == "]":
                    self.pos += 1
                    self.state = "after"
                else:
                    self.state = "content"
            elif state == "list_item":
                if not self._skip_ws():
                    return
                if text[self.pos] == "{":
                    self._open(self.pos, _CallReader())
                    self.state = "call"
                else:
                    self.state = "content"
            elif state in ("name", "call_id"):  # [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}
                chars = self.name if state == "name" else self.model_id
                while self.pos < n and text[self.pos] in _NAME_CHARS:
                    chars.append(text[self.pos])
                    self.pos += 1
                if self.pos == n:
                    if final:
                        self._fallback_here()
                        continue
                    return
                c = text[self.pos]
                if c == "[" and text.startswith(self.CALL_ID, self.pos) and state == "name":
                    self.pos += len(self.CALL_ID)
                    self.state = "call_id"
                    continue
                if c == "[" and text.startswith(self.ARGS, self.pos):
                    self.pos += len(self.ARGS)
                elif c == "[" and not final and (self.ARGS.startswith(text[self.pos:])
                                                 or (state == "name" and self.CALL_ID.startswith(text[self.pos:]))):
                    return
                elif c != "{":
                    self._fallback_here()
                    continue
                if not self.name or (state == "call_id" and not self.model_id):
                    self._fallback_here()
                    continue
                self.reader = _CallReader(name="".join(self.name), call_id="".join(self.model_id) or None)
                self.state = "bare_call"
            elif state == "bare_call":
                result = self._read_call(final)
                if result is None:
                    return
                self.state = "after" if result == "done" else "content"
            else:  # after calls: drop whitespace
                if not self._skip_ws():
                    return
                self.state = "content"


# ---------------------------------------------------------------------------
# Parsers.
# ---------------------------------------------------------------------------


class ToolParser:
    """Reads one family's tool calls out of generated text; one subclass per format."""

    name: str = ""
    streamer_class: type[ToolCallStreamer] = ToolCallStreamer
    marker_tokens: tuple[str, ...] = ()  # marker texts that must survive detokenization

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def streamer(self) -> ToolCallStreamer:
        """Fresh state for one streamed choice."""
        return self.streamer_class(self)

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls and the content of a whole output (the streamer fed all of it at once)."""
        s = self.streamer()
        d = merge_deltas(s.feed(text), s.finish())
        calls: list[ToolCall] = []
        for piece in d.tool_calls:
            if piece.index == len(calls):
                calls.append(ToolCall(piece.id or "", piece.name or "", piece.arguments))
            else:
                calls[piece.index].arguments += piece.arguments
        return ExtractedToolCalls(tool_calls=calls, content=d.content)

    def call_id(self, model_id: Optional[str]) -> str:
        """The id a call gets: the model's own where it wrote one, else a fresh one."""
        return model_id if model_id else make_tool_call_id()

    def keeps_special_tokens(self) -> bool:
        """True when this parser's markers are special tokens of the tokenizer, so the output must be
        decoded with ``skip_special_tokens=False`` for the parser to see them."""
        tok = self.tokenizer
        if tok is None:
            return self.name == "mistral"
        special = getattr(tok, "all_special_ids", ())
        for m in self.marker_tokens:
            i = tok.token_to_id(m)
            if i is not None and i in special:
                return True
        return False


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Qwen2.5, Qwen3, Hermes 2/3)."""

    name = "hermes"
    streamer_class = _HermesStreamer
    marker_tokens = ("<tool_call>", "</tool_call>")


class Llama3JsonToolParser(ToolParser):
    """``{"name": ..., "parameters": ...}`` calls, ``;``-separated, as the whole output (Llama 3.x)."""

    name = "llama3_json"
    streamer_class = _Llama3Streamer
    marker_tokens = ()  # <|python_tag|> may go: the JSON is recognized without it


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{...}, ...]`` and ``[TOOL_CALLS]name[ARGS]{...}`` (Mistral, Mixtral, Ministral)."""

    name = "mistral"
    streamer_class = _MistralStreamer
    marker_tokens = ("[TOOL_CALLS]",)

    def call_id(self, model_id: Optional[str]) -> str:
        # mistral's chat template refuses ids that are not 9 alphanumerics on the next turn
        if model_id and len(model_id) == 9 and model_id.isascii() and model_id.isalnum():
            return model_id
        return _mistral_id()


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def get_tool_parser(name: str, tokenizer: Any = None) -> ToolParser:
    """The parser called `name` (a key of TOOL_PARSERS)."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r} (choices: {', '.join(sorted(TOOL_PARSERS))})")
    return cls(tokenizer)


def tool_parser_for(architecture_or_model_type: str, chat_template: Optional[str]) -> Optional[str]:
    """The parser a model's outputs need, or None when neither its template nor its family says.

    The chat template decides where it shows a format: ``<tool_call>`` -> hermes, ``[TOOL_CALLS]``
    -> mistral, ``<|python_tag|>`` or the ``ipython`` role -> llama3_json. Otherwise the family
    (an HF architecture such as ``Qwen3ForCausalLM`` or a model_type such as ``qwen3_moe``):
    Qwen2/Qwen3 -> hermes, Mistral/Mixtral -> mistral. A Llama architecture alone says nothing
    (SmolLM2 and Llama 2 are Llama too).
    """
    if chat_template:
        if "<tool_call>" in chat_template:
            return "hermes"
        if "[TOOL_CALLS]" in chat_template:
            return "mistral"
        if "<|python_tag|>" in chat_template or "ipython" in chat_template:
            return "llama3_json"
    family = re.sub(r"[^a-z0-9]", "", (architecture_or_model_type or "").lower())
    if family.startswith(("qwen2", "qwen3")):
        return "hermes"
    if family.startswith(("mistral", "mixtral", "ministral")):
        return "mistral"
    return None


# ---------------------------------------------------------------------------
# Reasoning parser + tool parser, per choice.
# ---------------------------------------------------------------------------


class ChainedStreamer:
    """A reasoning streamer feeding its content to a tool-call streamer; either may be None."""

    def __init__(self, reasoning: Any = None, tools: Optional[ToolCallStreamer] = None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @property
    def tools_called(self) -> bool:
        return bool(self.tools is not None and self.tools.tools_called)

    def _through(self, r: DeltaMessage, final: bool) -> DeltaMessage:
        if self.tools is None:
            return DeltaMessage(content=r.content, reasoning=r.reasoning)
        t = self.tools.feed(r.content) if r.content else DeltaMessage()
        if final:
            t = merge_deltas(t, self.tools.finish())
        t.reasoning = r.reasoning
        return t

    def feed(self, delta_text: str) -> DeltaMessage:
        r = self.reasoning.feed(delta_text) if self.reasoning is not None else DeltaMessage(content=delta_text or None)
        return self._through(r, final=False)

    def finish(self) -> DeltaMessage:
        r = self.reasoning.finish() if self.reasoning is not None else DeltaMessage()
        return self._through(r, final=True)


def chain(reasoning_streamer: Any = None, tool_streamer: Optional[ToolCallStreamer] = None) -> ChainedStreamer:
    """One streamer for a choice: text -> reasoning streamer -> its content -> tool-call streamer.

    ``feed``/``finish`` return one DeltaMessage (reasoning, content, tool_calls); ``tools_called``
    is the tool streamer's.
    """
    return ChainedStreamer(reasoning_streamer, tool_streamer)


def parse_whole(text: str, reasoning_parser: Any = None, tool_parser: Optional[ToolParser] = None,
                prompt_text: Optional[str] = None) -> tuple[Optional[str], Optional[str], list[ToolCall]]:
    """(reasoning, content, tool_calls) of a whole output; either parser may be None."""
    if reasoning_parser is not None:
        reasoning, content = reasoning_parser.split(text, prompt_text=prompt_text)
    else:
        reasoning, content = None, text or None
    if tool_parser is None or not content:
        return reasoning, content, []
    found = tool_parser.extract(content)
    return reasoning, found.content, found.tool_calls
