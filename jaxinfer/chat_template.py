"""Render a model's chat template the way Hugging Face transformers does.

A chat template is a Jinja program shipped with the model that turns a list
of ``{"role": ..., "content": ...}`` messages into the exact prompt text the
model was trained on. To tokenize like the reference we render it in the same
environment transformers uses:

- a sandboxed, immutable Jinja environment with ``trim_blocks`` and
  ``lstrip_blocks`` on and the ``loopcontrols`` extension (``break``/``continue``);
- a ``{% generation %}`` block tag that renders its body (transformers uses it
  to mark assistant tokens; here it is a no-op);
- the globals ``raise_exception(msg)`` and ``strftime_now(fmt)``;
- a ``tojson`` filter that keeps non-ASCII text as is (``ensure_ascii=False``)
  and accepts ``indent``, ``separators`` and ``sort_keys``;
- the variables ``messages``, ``add_generation_prompt``, ``tools``,
  ``documents``, the special token strings (``bos_token``, ``eos_token``, ...)
  and any extra keyword (``enable_thinking``, ``date_string``, ...).

Compiled templates are cached by source text.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Optional

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["render_chat_template", "compile_chat_template", "validate_messages", "ChatTemplateError"]


class ChatTemplateError(ValueError):
    """The template itself failed: a syntax error or a ``raise_exception`` call."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %} ... {% endgeneration %}``: renders the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Unlike Jinja's built-in filter this does not HTML-escape, like transformers'.
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
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from e


def validate_messages(messages: Any) -> list[dict]:
    """Check ``messages`` is a list of dicts with a str ``role`` and a ``content``.

    ``content`` must be a str; a list of content parts (dicts, for multimodal
    templates) is accepted too, and ``None`` only on a message carrying
    ``tool_calls``. Raises ValueError naming the offending message and field.
    Returns the messages as a list of plain dicts.
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
        if "content" not in message:
            raise ValueError(f"messages[{i}] is missing 'content'")
        content = message["content"]
        ok = isinstance(content, str)
        ok = ok or (isinstance(content, list) and all(isinstance(part, Mapping) for part in content))
        ok = ok or (content is None and bool(message.get("tool_calls")))
        if not ok:
            raise ValueError(
                f"messages[{i}]['content'] must be a str (or a list of content-part dicts, or None with "
                f"tool_calls), got {type(content).__name__}"
            )
        out.append(dict(message))
    return out


def render_chat_template(
    template: str,
    messages: Any,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Optional[list] = None,
    documents: Optional[list] = None,
    special_tokens: Optional[Mapping[str, Optional[str]]] = None,
    **kwargs: Any,
) -> str:
    """Render ``messages`` with the Jinja ``template`` source.

    ``special_tokens`` maps names such as ``bos_token`` to their strings; any
    further keyword becomes a template variable. With ``continue_final_message``
    the text is cut right after the last message's content, so the model
    continues it (it excludes ``add_generation_prompt``).
    """
    if not isinstance(template, str) or not template:
        raise ValueError("this tokenizer has no chat template")
    chat = validate_messages(messages)
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    variables: dict[str, Any] = {k: v for k, v in (special_tokens or {}).items()}
    variables.update(kwargs)
    compiled = compile_chat_template(template)
    try:
        rendered = compiled.render(
            messages=chat, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt, **variables,
        )
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as e:
        # the template met a value it cannot handle (e.g. a template variable of the wrong type)
        raise ChatTemplateError(f"chat template failed on the messages or variables given: {e}") from e
    if continue_final_message:
        final = chat[-1]["content"]
        if not isinstance(final, str) or final.strip() == "":
            raise ValueError("continue_final_message needs a final message with non-empty str content")
        # Prefer the content as written; templates that strip it leave only the stripped form.
        needle = final if final in rendered else final.strip()
        if needle not in rendered:
            raise ValueError("continue_final_message: the final message's content is not in the rendered text")
        rendered = rendered[: rendered.rindex(needle) + len(needle)]
    return rendered
