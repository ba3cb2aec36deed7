"""Render a model's chat template the way Hugging Face transformers does.

A chat template is a Jinja program shipped with the model that turns a list
of ``{"role": ..., "content": ...}`` messages into the exact prompt text the
model was trained on. To tokenize like the reference we render it in the same
environment as transformers' ``apply_chat_template`` (checked against
transformers 5.23, see ``tests/test_chat_template_features.py``):

- a sandboxed, immutable Jinja environment with ``trim_blocks`` and
  ``lstrip_blocks`` on and the ``loopcontrols`` extension (``break``/``continue``);
- a ``{% generation %}`` block tag that renders its body (transformers uses it
  to mark assistant tokens; here it only renders the body, in the same kind of
  node, a call block, so scoping is the same);
- the globals ``raise_exception(msg)``, ``strftime_now(fmt)`` (local time),
  ``namespace`` (which refuses attribute names starting with ``_``) and a
  ``dict`` constructor;
- a ``tojson`` filter that keeps non-ASCII text as is (``ensure_ascii=False``),
  does not HTML-escape, and accepts ``indent``, ``separators`` and ``sort_keys``
  (Jinja's own filter escapes ``<``, ``>``, ``&`` and ``'`` and sorts keys);
- the variables ``messages``, ``add_generation_prompt``, ``tools``,
  ``documents``, the special token strings that are set (``bos_token``,
  ``eos_token``, ...; unset ones stay undefined) and any extra keyword
  (``enable_thinking``, ``date_string``, ...), which wins over a special token
  of the same name.

The data goes in as transformers passes it: message keys whose value is None
are dropped (so a tool-call message without content has no ``content`` key),
everything is rebuilt from plain JSON-like types (other objects become a
``"<TypeName>"`` placeholder), and a message's reasoning given as
``reasoning_content``, ``thinking`` or ``reasoning`` is visible under both
``reasoning_content`` and ``thinking``.

Failures the template raises (``raise_exception``, undefined values, type
errors on the caller's data) become `ChatTemplateError`, a ValueError, so the
processor and the server report them as bad input. Compiled templates are
cached by source text.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Optional, Union

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["render_chat_template", "compile_chat_template", "validate_messages", "ChatTemplateError"]

# Names a message's reasoning may come under; templates read the first (Qwen3, ...) or "thinking" (gpt-oss).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Appended to the text a reply continues, then looked for in the rendered text to know where to cut.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The template itself failed: a syntax error, a ``raise_exception`` call or an error while rendering."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %} ... {% endgeneration %}``: renders the body unchanged (as a call block)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _SafeNamespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` refusing underscore-prefixed attribute names (no reach into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: B902 - same signature trick as jinja2's Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._refuse_private(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._refuse_private(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _refuse_private(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not set an attribute starting with '_' on a namespace (got {name!r})"
            )


class _DictConstructor:
    """The template's ``dict``: builds dicts, but exposes nothing of the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Unlike Jinja's built-in filter: no HTML escaping, keys kept in order, json.dumps' options exposed.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile ``source`` once per distinct text (cached)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictConstructor()
    env.globals["namespace"] = _SafeNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from e


def validate_messages(messages: Any) -> list[dict]:
    """Check ``messages`` is a list of dicts with a str ``role`` and a ``content``.

    ``content`` must be a str; a list of content parts (dicts, for multimodal
    templates) is accepted too, and ``None`` (or no ``content`` at all) only on
    a message carrying ``tool_calls``. Raises ValueError naming the offending
    message and field. Returns the messages as a list of plain dicts.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages must not be empty")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        if "role" not in message:
            raise ValueError(f"messages[{i}] is missing 'role'")
        if not isinstance(message["role"], str):
            raise ValueError(f"messages[{i}]['role'] must be a str, got {type(message['role']).__name__}")
        has_tool_calls = bool(message.get("tool_calls"))
        if "content" not in message and not has_tool_calls:
            raise ValueError(f"messages[{i}] is missing 'content'")
        content = message.get("content")
        ok = isinstance(content, str)
        ok = ok or (isinstance(content, list) and all(isinstance(part, Mapping) for part in content))
        ok = ok or (content is None and has_tool_calls)
        if not ok:
            raise ValueError(
                f"messages[{i}]['content'] must be a str (or a list of content-part dicts, or None with "
                f"tool_calls), got {type(content).__name__}"
            )
        out.append(dict(message))
    return out


def _plain(value: Any) -> Any:
    """``value`` rebuilt from plain types, as transformers hands data to a template.

    Exact str/int/float/bool/None pass; subclasses of them (enums, numpy
    scalars) lose their extra methods; mappings, lists and tuples are copied
    with their items converted; dataclasses and pydantic models become dicts;
    anything else becomes the placeholder string ``"<TypeName>"``, so the
    sandbox never sees an object with methods it does not know about.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)  # IntEnum, numpy-like int subclasses
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(message: dict) -> dict:
    """A message with reasoning under any of `REASONING_FIELDS` gets it as ``thinking`` and ``reasoning_content``."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    # Same key order as transformers: "thinking" first unless the message has it, "reasoning_content" in place.
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final_message(chat: list[dict], field: str, template: str) -> str:
    """Append the continue tag to the final message's ``field``; returns the text being continued."""
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f"continue_final_message: the final message has no {field!r} to continue")
    fields = [field]
    if field in REASONING_FIELDS:  # reasoning is copied under several names: tag every copy
        fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in template for f in fields):
        raise ValueError(f"continue_final_message: the chat template never reads the field {field!r}")
    if isinstance(final, (list, tuple)):
        blocks = list(final)
        for i in range(len(blocks) - 1, -1, -1):
            block = blocks[i]
            if isinstance(block, Mapping) and "text" in block:
                text = block["text"]
                if not isinstance(text, str):
                    break
                blocks[i] = {**block, "text": text + _CONTINUE_TAG}
                chat[-1][field] = blocks
                return text
        raise ValueError("continue_final_message: the final message has no text part to continue")
    if not isinstance(final, str):
        raise ValueError(f"continue_final_message: the final message's {field!r} must be text")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def _cut_at_tag(rendered: str, final: str) -> str:
    """The rendered text up to where the final message's text ends (the tag's position)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError(
            "continue_final_message: the final message does not appear in the text the chat template renders "
            "(the template drops or changes part of it)"
        )
    at = rendered.rindex(tag)
    if rendered[at: at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]  # the template kept the text as written
    return rendered[:at].rstrip()  # the template trimmed trailing space: cut without it


def render_chat_template(
    template: str,
    messages: Any,
    /,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: Union[bool, str] = False,
    tools: Optional[list] = None,
    documents: Optional[list] = None,
    special_tokens: Optional[Mapping[str, Optional[str]]] = None,
    **kwargs: Any,
) -> str:
    """Render ``messages`` with the Jinja ``template`` source.

    ``special_tokens`` maps names such as ``bos_token`` to their strings (None:
    not set, left undefined in the template); any further keyword becomes a
    template variable, winning over a special token of the same name. With
    ``continue_final_message`` (True for ``content``, or the name of the field,
    e.g. ``"reasoning_content"``) the text is cut right after the final
    message's text, so the model continues it; it excludes
    ``add_generation_prompt``. ``tools`` and ``documents`` must be lists of
    dicts (JSON schemas / ``{"title", "text"}`` documents) when given.
    """
    if not isinstance(template, str) or not template:
        raise ValueError("this tokenizer has no chat template")
    chat = validate_messages(messages)
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    if isinstance(tools, (list, tuple)):
        for i, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise ValueError(f"tools[{i}] must be a dict (a JSON schema), got {type(tool).__name__}")
    if documents is not None:
        if isinstance(documents, (str, bytes)) or not isinstance(documents, Sequence):
            raise ValueError(f"documents must be a list of dicts, got {type(documents).__name__}")
        for i, document in enumerate(documents):
            if not isinstance(document, Mapping):
                raise ValueError(
                    f"documents[{i}] must be a dict (with 'title' and 'text'), got {type(document).__name__}"
                )

    # What transformers does before rendering: drop None-valued message keys, plain data, reasoning aliases.
    chat = [_with_reasoning_aliases(_plain({k: v for k, v in m.items() if v is not None})) for m in chat]
    variables: dict[str, Any] = {k: str(v) for k, v in (special_tokens or {}).items() if v is not None}
    variables.update(kwargs)
    variables = _plain(variables)
    tools, documents = _plain(tools), _plain(documents)

    compiled = compile_chat_template(template)
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = _tag_final_message(chat, field, template)
    try:
        rendered = compiled.render(
            messages=chat, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt, **variables,
        )
    except jinja2.exceptions.TemplateError as e:  # raise_exception, undefined values, sandbox refusals
        raise ChatTemplateError(f"chat template failed: {e}") from e
    except (TypeError, AttributeError, KeyError, IndexError, ValueError, ArithmeticError, RecursionError) as e:
        # the template met a value it cannot handle (e.g. a template variable of the wrong type)
        raise ChatTemplateError(f"chat template failed on the messages or variables given: {e}") from e
    if final is not None:
        rendered = _cut_at_tag(rendered, final)
    return rendered
