"""Record how Hugging Face transformers renders a set of chat templates.

``tests/test_chat_template_features.py`` renders the same templates, messages
and variables with ``jaxinfer.text.chat_template`` and checks the text is identical
(or that the same error message comes back), so the tests never need
transformers.

How the fixture was made
------------------------
* Run with the reference environment (transformers 5.23.0, jinja2 3.1.6)::

      /work/refvenv/bin/python scripts/make_chat_template_fixtures.py

  which writes ``tests/fixtures/chat_template_renderings.json``. Both
  versions are recorded in the file.
* The templates below were written for this test in the style of the Qwen3,
  Gemma 3, Llama 3.x and Mistral templates (ChatML with ``<think>`` blocks and
  ``enable_thinking``, turn alternation checks with ``raise_exception``,
  ``strftime_now`` dates, tool and document blocks with ``tojson``,
  ``namespace``, ``{% break %}``/``{% continue %}``, ``{% generation %}``),
  plus small templates aimed at one feature each. None is copied from a model.
* Each case is rendered with ``tokenizer.apply_chat_template(messages,
  chat_template=<template>, tokenize=False, **kwargs)`` on an in-memory
  tokenizer (a three-token ``tokenizers`` WordLevel model wrapped in
  ``PreTrainedTokenizerFast``) whose special tokens are ``bos_token="<s>"``,
  ``eos_token="</s>"`` and ``unk_token="<unk>"`` (no pad token); its
  ``special_tokens_map`` is recorded as ``special_tokens``. ``kwargs`` always
  sets ``add_generation_prompt`` (transformers' default is False, jaxinfer's
  True) and may set ``tools``, ``documents``, ``continue_final_message`` and
  template variables (``enable_thinking``, ...).
* ``strftime_now`` reads the clock, so while rendering the module-level
  ``datetime`` of ``transformers.utils.chat_template_utils`` is replaced by a
  subclass whose ``now()`` returns ``fixed_now`` (recorded); the test does the
  same to ``jaxinfer.text.chat_template``.
* A case whose rendering raises records ``error`` (the exception's type and
  message) instead of ``expected``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime

import jinja2
import transformers
import transformers.utils.chat_template_utils as ctu
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures",
                   "chat_template_renderings.json")
FIXED_NOW = datetime(2025, 3, 7, 9, 5, 30)

# ---------------------------------------------------------------------------
# Templates (raw strings: the backslashes belong to Jinja's string literals).
# ---------------------------------------------------------------------------

# ChatML with a tool block, a "last real user query" found with a namespace over the reversed
# messages, <think> blocks for the turns after it, tool calls and grouped tool responses, and the
# empty think block that enable_thinking=false asks for.
THINKING_CHATML = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nFunction signatures are listed in <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nAnswer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set state = namespace(looking=true, last_query=messages | length - 1) %}
{%- for message in messages[::-1] %}
    {%- set idx = messages | length - 1 - loop.index0 %}
    {%- if state.looking and message.role == 'user' and message.content is string
          and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set state.looking = false %}
        {%- set state.last_query = idx %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set text = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + text + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set thought = '' %}
        {%- if message.reasoning_content is string %}
            {%- set thought = message.reasoning_content %}
        {%- elif '</think>' in text %}
            {%- set thought = text.split('</think>')[0].split('<think>')[-1].strip('\n') %}
            {%- set text = text.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > state.last_query and (loop.last or thought) %}
            {{- '<|im_start|>assistant\n<think>\n' + thought.strip('\n') + '\n</think>\n\n' + text.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + text }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- if text or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {%- set fn = call.function if call.function else call %}
            {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + text + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role != 'system' %}
        {{- raise_exception('Unknown message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# BOS, the system prompt folded into the first user turn, strict user/model alternation,
# 'assistant' shown as 'model', content given as text or as a list of parts (text and images).
TURNS_WITH_PARTS = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set preamble = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set preamble = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set preamble = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Turns must alternate user/assistant/user/assistant/..., got ' + message['role'] + ' at turn ' + loop.index0|string) }}
    {%- endif -%}
    {%- set speaker = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + speaker + '\n' + (preamble if loop.first else '') }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for part in message['content'] -%}
            {%- if part['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif part['type'] == 'text' -%}
                {{ part['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception('Unsupported content type') }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""

# Header tokens, a date from strftime_now unless date_string is given, tools either in the system
# turn or in the first user turn (tojson with indent=4), single tool calls, tool results shown
# with tojson when they are not plain text.
HEADERS_WITH_DATE = r"""{{- bos_token }}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now('%d %b %Y') %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools is not none %}
    {{- 'Environment: ipython\n' }}
{%- endif %}
{{- 'Knowledge cutoff: 2023-12\n' }}
{{- 'Today: ' + date_string + '\n\n' }}
{%- if tools is not none and not tools_in_user_message %}
    {{- 'You can call these functions. Reply with {"name": name, "parameters": {...}}.\n\n' }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- '\n\n' }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- '<|eot_id|>' }}
{%- if tools_in_user_message and tools is not none %}
    {%- if messages | length == 0 %}
        {{- raise_exception('Tools go in the first user message, but there is none!') }}
    {%- endif %}
    {%- set first_user = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
    {{- 'Functions you may call:\n\n' }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- '\n\n' }}
    {%- endfor %}
    {{- first_user + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role in ['ipython', 'tool'] or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if message.tool_calls | length != 1 %}
            {{- raise_exception('Only one tool call per message is supported, got ' + message.tool_calls | length | string) }}
        {%- endif %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}' }}
        {{- '<|eom_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# [INST] blocks: the system prompt goes into the last user turn, eos after each answer.
INST_BLOCKS = r"""
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set rest = messages[1:] %}
{%- else %}
    {%- set rest = messages %}
{%- endif %}
{%- if rest | selectattr('role', 'equalto', 'user') | list | length == 0 %}
    {{- raise_exception('Need at least one user message.') }}
{%- endif %}
{{- bos_token }}
{%- for message in rest %}
    {%- if (message['role'] == 'user') == (loop.index0 % 2 == 1) %}
        {{- raise_exception('After an optional system message, roles must alternate user and assistant.') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- else %}
        {{- ' ' + message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""

# break / continue: only the last `keep` non-system turns, newest first.
LOOP_CONTROLS = r"""
{%- for message in messages | reverse %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {%- if loop.index > keep | default(2) %}{% break %}{% endif %}
    {{- loop.index ~ ':' ~ message.role ~ '=' ~ message.content ~ ';' }}
{%- endfor %}
{%- for n in range(10) %}{% if n is odd %}{% continue %}{% endif %}{% if n > 6 %}{% break %}{% endif %}{{ n }}{% endfor %}
"""

# tojson in all its forms: no HTML escaping, non-ASCII kept, key order kept, options.
TOJSON = r"""{{ payload | tojson }}
{{ payload | tojson(indent=2) }}
{{ payload | tojson(separators=(',', ':')) }}
{{ payload | tojson(sort_keys=true) }}
{{ payload | tojson(ensure_ascii=true) }}
{{ payload | tojson(2) }}
{{ payload | tojson(indent=4, separators=(',', ': '), sort_keys=true) }}
{{ messages | tojson }}
{{ (1, 'a', none, true, 2.5) | tojson }}
{{ 'plain <string> & "quotes"' | tojson }}
"""

# Special token variables: set ones are strings, unset ones (pad, sep, ...) are undefined.
SPECIAL_TOKENS = r"""[{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ pad_token is defined }}|{{ sep_token is defined }}|{{ mask_token is defined }}]"""

# Message keys whose value is None are dropped before rendering.
NONE_KEYS = r"""{% for m in messages %}{{ m.role }} content:{{ m.content is defined }}={{ m.content }} name:{{ 'name' in m }} {{ m | tojson }}
{% endfor %}"""

# Reasoning given under reasoning_content, thinking or reasoning reaches the template under both names.
REASONING_ALIASES = r"""{% for m in messages %}{{ m.role }}|{{ m.reasoning_content }}|{{ m.thinking }}|{{ m | tojson }}
{% endfor %}"""

# namespace with several attributes and the template's dict constructor.
NAMESPACE_DICT = r"""{% set ns = namespace(count=0, roles='', last=none) %}
{% for m in messages %}
    {% set ns.count = ns.count + 1 %}
    {% set ns.roles = ns.roles ~ m.role[0] %}
    {% set ns.last = m.content %}
{% endfor %}
{{ ns.count }} {{ ns.roles }} {{ ns.last }}
{{ dict(a=1, b=[2, 3]) | tojson }} {{ dict.fromkeys(['x', 'y'], 0) | tojson }} {{ dict([('k', 'v')]) | tojson }}
"""

NAMESPACE_PRIVATE_SET = r"""{% set ns = namespace(a=1) %}{% set ns._hidden = 2 %}{{ ns.a }}"""
NAMESPACE_PRIVATE_INIT = r"""{% set ns = namespace(_hidden=1) %}{{ ns._hidden }}"""

# Whitespace control by trim_blocks/lstrip_blocks alone (no '-' markers).
WHITESPACE = r"""{% for message in messages %}
    {% if message.role == 'user' %}
User: {{ message.content }}
    {% else %}
Bot: {{ message.content }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
Bot:{% endif %}
  {# a comment line #}
  {% if true %}
  indented text kept
  {% endif %}
"""

# {% generation %} marks the assistant text; rendering is unchanged.
GENERATION_TAG = r"""{% for m in messages %}{% if m.role == 'assistant' %}<a>{% generation %}{{ m.content }}{% set inner = 'x' %}{% endgeneration %}</a>{{ inner is defined }}{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"""

# Documents for retrieval-augmented answers.
DOCUMENTS = r"""{{ bos_token }}
{%- if documents %}
{{- '<documents>' }}
{%- for doc in documents %}
{{- '\n<doc id="' ~ loop.index0 ~ '" title="' ~ doc.title ~ '">' ~ doc.text ~ '</doc>' }}
{%- endfor %}
{{- '\n</documents>\n' }}
{%- else %}
{{- 'no documents\n' }}
{%- endif %}
{%- for m in messages %}{{ m.role | upper }}: {{ m.content }}
{% endfor %}
{%- if add_generation_prompt %}ANSWER:{% endif %}"""

STRFTIME = r"""{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('%d %B %Y') }}|{{ strftime_now('%H:%M:%S') }}|{{ strftime_now('%A') }}"""

# Plain ChatML, for continue_final_message (its '<|im_end|>' contains "end").
CHATML = r"""{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""

# Errors that are not raise_exception.
UNDEFINED_ATTR = r"""{{ messages[0].content.missing.deeper }}"""

TEMPLATES = {
    "thinking_chatml": THINKING_CHATML,
    "turns_with_parts": TURNS_WITH_PARTS,
    "headers_with_date": HEADERS_WITH_DATE,
    "inst_blocks": INST_BLOCKS,
    "loop_controls": LOOP_CONTROLS,
    "tojson": TOJSON,
    "special_tokens": SPECIAL_TOKENS,
    "none_keys": NONE_KEYS,
    "reasoning_aliases": REASONING_ALIASES,
    "namespace_dict": NAMESPACE_DICT,
    "namespace_private_set": NAMESPACE_PRIVATE_SET,
    "namespace_private_init": NAMESPACE_PRIVATE_INIT,
    "whitespace": WHITESPACE,
    "generation_tag": GENERATION_TAG,
    "documents": DOCUMENTS,
    "strftime": STRFTIME,
    "chatml": CHATML,
    "undefined_attr": UNDEFINED_ATTR,
}

# ---------------------------------------------------------------------------
# Cases: (name, template, messages, kwargs). kwargs always sets add_generation_prompt.
# ---------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city <b>now</b> & later — «météo»",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. 'Zürich'"},
                           "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "now", "description": "The time", "parameters": {"type": "object", "properties": {}}}}

HI = [{"role": "user", "content": "Hi there!"}]
SYS_HI = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"}]
MULTI = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3? «ça va»"},
]
THOUGHTS = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "reasoning_content": "three and three", "content": "6"},
]
TOOL_ROUND = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Zürich and the time?"},
    {"role": "assistant", "content": None, "reasoning_content": "need two calls",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
                    {"type": "function", "function": {"name": "now", "arguments": "{}"}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "tool", "content": "09:05"},
]
LLAMA_TOOL_ROUND = [
    {"role": "system", "content": "  Be helpful.  "},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}], "content": None},
    {"role": "tool", "content": "sunny, 21 C"},
    {"role": "tool", "content": [{"temp": 21}]},
]

CASES = [
    # --- Qwen3-like: enable_thinking, tools, reasoning, tool calls --------------------------------
    ("thinking_default", "thinking_chatml", SYS_HI, {"add_generation_prompt": True}),
    ("thinking_enabled", "thinking_chatml", SYS_HI, {"add_generation_prompt": True, "enable_thinking": True}),
    ("thinking_disabled", "thinking_chatml", SYS_HI, {"add_generation_prompt": True, "enable_thinking": False}),
    ("thinking_disabled_no_prompt", "thinking_chatml", SYS_HI, {"add_generation_prompt": False, "enable_thinking": False}),
    ("thinking_history", "thinking_chatml", THOUGHTS, {"add_generation_prompt": False}),
    ("thinking_history_prompt", "thinking_chatml", THOUGHTS + [{"role": "user", "content": "Thanks"}],
     {"add_generation_prompt": True, "enable_thinking": False}),
    ("thinking_tools", "thinking_chatml", TOOL_ROUND, {"add_generation_prompt": True, "tools": [WEATHER_TOOL, TIME_TOOL]}),
    ("thinking_tools_empty_list", "thinking_chatml", SYS_HI, {"add_generation_prompt": True, "tools": []}),
    ("thinking_unknown_role", "thinking_chatml", [{"role": "narrator", "content": "Once upon a time"}],
     {"add_generation_prompt": True}),
    ("thinking_continue_content", "thinking_chatml",
     HI + [{"role": "assistant", "content": "The answer is"}], {"add_generation_prompt": False, "continue_final_message": True}),
    ("thinking_continue_reasoning", "thinking_chatml",
     HI + [{"role": "assistant", "reasoning_content": "Let me think", "content": ""}],
     {"add_generation_prompt": False, "continue_final_message": "reasoning_content"}),
    # --- Gemma-3-like: bos, alternation, parts ------------------------------------------------------
    ("turns_system_folded", "turns_with_parts", MULTI, {"add_generation_prompt": True}),
    ("turns_parts", "turns_with_parts",
     [{"role": "system", "content": [{"type": "text", "text": "Describe images."}]},
      {"role": "user", "content": [{"type": "image", "url": "http://x/cat.png"}, {"type": "text", "text": "  What is this?  "}]}],
     {"add_generation_prompt": True}),
    ("turns_not_alternating", "turns_with_parts",
     [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], {"add_generation_prompt": True}),
    ("turns_continue_trimmed", "turns_with_parts",
     HI + [{"role": "assistant", "content": "Sure, "}], {"add_generation_prompt": False, "continue_final_message": True}),
    ("turns_continue_parts", "turns_with_parts",
     HI + [{"role": "assistant", "content": [{"type": "text", "text": "Well"}, {"type": "image", "url": "u"}]}],
     {"add_generation_prompt": False, "continue_final_message": True}),
    # --- Llama-3-like: dates, tools with tojson(indent=4) --------------------------------------------
    ("headers_date_given", "headers_with_date", MULTI, {"add_generation_prompt": True, "date_string": "01 Jan 2025"}),
    ("headers_date_from_clock", "headers_with_date", SYS_HI, {"add_generation_prompt": True}),
    ("headers_tools_in_user", "headers_with_date", LLAMA_TOOL_ROUND,
     {"add_generation_prompt": True, "tools": [WEATHER_TOOL], "date_string": "26 Jul 2024"}),
    ("headers_tools_in_system", "headers_with_date", LLAMA_TOOL_ROUND,
     {"add_generation_prompt": True, "tools": [WEATHER_TOOL], "tools_in_user_message": False, "date_string": "26 Jul 2024"}),
    ("headers_two_tool_calls", "headers_with_date",
     [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
         {"function": {"name": "a", "arguments": {}}}, {"function": {"name": "b", "arguments": {}}}]}],
     {"add_generation_prompt": False, "date_string": "26 Jul 2024"}),
    # --- Mistral-like: [INST], eos, alternation -------------------------------------------------------
    ("inst_multi", "inst_blocks", MULTI, {"add_generation_prompt": True}),
    ("inst_not_alternating", "inst_blocks",
     [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "assistant", "content": "c"}],
     {"add_generation_prompt": True}),
    # --- single features -------------------------------------------------------------------------------
    ("loop_controls_default", "loop_controls", MULTI, {"add_generation_prompt": True}),
    ("loop_controls_keep3", "loop_controls", MULTI, {"add_generation_prompt": True, "keep": 3}),
    ("tojson_payload", "tojson", [{"role": "user", "content": "héllo <b>&</b> 'q' \"dq\" 日本語 🙂"}],
     {"add_generation_prompt": False,
      "payload": {"z": 1, "a": [1.5, 1e-07, -0.0, 10**20, True, None], "html": "<script>&'\"</script>",
                  "text": "naïve 日本語 🙂", "nested": {"b": {}, "a": []}}}),
    ("special_tokens_default", "special_tokens", HI, {"add_generation_prompt": True}),
    ("special_tokens_overridden", "special_tokens", HI, {"add_generation_prompt": True, "bos_token": "<BOS>", "pad_token": "<pad>"}),
    ("none_keys_dropped", "none_keys",
     [{"role": "user", "content": "hi", "name": None},
      {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}], "name": "bot"}],
     {"add_generation_prompt": False}),
    ("reasoning_aliases", "reasoning_aliases",
     [{"role": "user", "content": "q"},
      {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
      {"role": "assistant", "content": "a2", "thinking": "r2"},
      {"role": "assistant", "content": "a3", "reasoning": "r3"},
      {"role": "assistant", "content": "a4", "reasoning": None, "thinking": "t4", "reasoning_content": None}],
     {"add_generation_prompt": False}),
    ("namespace_dict", "namespace_dict", MULTI, {"add_generation_prompt": False}),
    ("namespace_private_set", "namespace_private_set", HI, {"add_generation_prompt": False}),
    ("namespace_private_init", "namespace_private_init", HI, {"add_generation_prompt": False}),
    ("whitespace_prompt", "whitespace", MULTI[1:], {"add_generation_prompt": True}),
    ("whitespace_no_prompt", "whitespace", MULTI[1:], {"add_generation_prompt": False}),
    ("generation_tag", "generation_tag", MULTI, {"add_generation_prompt": False}),
    ("documents_given", "documents", HI,
     {"add_generation_prompt": True,
      "documents": [{"title": "Zürich", "text": "A city <in> Switzerland."}, {"title": "Bern", "text": "The capital."}]}),
    ("documents_none", "documents", HI, {"add_generation_prompt": True}),
    ("strftime", "strftime", HI, {"add_generation_prompt": False}),
    ("chatml_continue_end", "chatml",
     [{"role": "user", "content": "Say end"}, {"role": "assistant", "content": "end"}],
     {"add_generation_prompt": False, "continue_final_message": True}),
    ("chatml_continue_trailing_space", "chatml",
     [{"role": "user", "content": "Start"}, {"role": "assistant", "content": "Once upon a "}],
     {"add_generation_prompt": False, "continue_final_message": True}),
    ("undefined_attr", "undefined_attr", HI, {"add_generation_prompt": False}),
]


class _FixedDatetime(datetime):
    @classmethod
    def now(cls, tz=None):
        return FIXED_NOW if tz is None else FIXED_NOW.replace(tzinfo=tz)


def _tokenizer() -> PreTrainedTokenizerFast:
    model = WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>")
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(model), bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def main() -> int:
    tok = _tokenizer()
    names = [c[0] for c in CASES]
    assert len(names) == len(set(names)), "case names must be unique"
    ctu.datetime = _FixedDatetime  # strftime_now reads this module global at call time
    cases = []
    for name, template, messages, kwargs in CASES:
        assert "add_generation_prompt" in kwargs, name
        case = {"name": name, "template": template, "messages": messages, "kwargs": kwargs}
        try:
            case["expected"] = tok.apply_chat_template(
                json.loads(json.dumps(messages)), chat_template=TEMPLATES[template], tokenize=False,
                **json.loads(json.dumps(kwargs)),
            )
        except Exception as e:  # noqa: BLE001 - the error is what the case records
            case["error"] = {"type": type(e).__name__, "message": str(e)}
        cases.append(case)
    fixture = {
        "about": "transformers' apply_chat_template renderings; made by scripts/make_chat_template_fixtures.py",
        "transformers_version": transformers.__version__,
        "jinja2_version": jinja2.__version__,
        "fixed_now": FIXED_NOW.isoformat(),
        "special_tokens": tok.special_tokens_map,
        "templates": TEMPLATES,
        "cases": cases,
    }
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=1)
        f.write("\n")
    for case in cases:
        status = "error " + case["error"]["type"] if "error" in case else f"{len(case['expected'])} chars"
        print(f"{case['name']:32s} {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
