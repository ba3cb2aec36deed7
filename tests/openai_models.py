"""Models for the OpenAI-compatible server's tests: a tiny random model with a real tokenizer and chat template,
and a tiny model whose output is forced, so tool calls and reasoning can be tested end to end.

The forced model is a real model run by the real engine: its weights make the next token a fixed function of
the current one. Attention and MLP outputs are zero, so the residual stream is the current token's embedding;
each token of the script gets its own one-hot embedding, and the LM head maps it to the script's next token
(a margin of ~80 in the logits, so greedy and sampled decoding both follow it). The tokenizer is a byte-level
BPE whose added tokens are the script's pieces, each used once, so the chain of tokens is the script's text.
"""

from __future__ import annotations

import json
from dataclasses import replace

import jax.numpy as jnp
import numpy as np

import jaxinfer
from conftest import TINY, TINY_ENGINE, tiny_params

ENGINE = TINY_ENGINE.replace(num_pages=256)
# Tool definitions render long in a byte-level vocabulary: a 512-token context for the forced model.
TOOLS_ENGINE = TINY_ENGINE.replace(page_size=16, num_pages=128, chunk_buckets=(16, 64))

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A Qwen-style template with tools: what the hermes parser's models render.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call a tool inside <tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# What the forced model writes, piece by piece (each piece one token): reasoning, then one hermes tool call.
SCRIPT = (
    "<think>", "\nThe user asks for the weather", " in Paris.", "\n</think>\n\n", "<tool_call>",
    '\n{"name": "get_weather", ', '"arguments": {"city": "Paris", ', '"unit": "celsius"}}', "\n</tool_call>",
)
SCRIPT_TEXT = "".join(SCRIPT)
TOOL_ARGS = {"city": "Paris", "unit": "celsius"}
REASONING = "The user asks for the weather in Paris."


def sp_llm(path, name: str = "tiny-chat", **train) -> "jaxinfer.LLM":
    """The tiny random model with a 340-piece SentencePiece tokenizer (``train``: SentencePiece trainer options)
    and a ChatML template."""
    from test_tokenizer import train_tiny_sentencepiece

    from jaxinfer.text.tokenizer import Tokenizer

    (path / "tokenizer.model").write_bytes(train_tiny_sentencepiece(**train))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return jaxinfer.LLM.from_params(TINY, tiny_params(), tokenizer=Tokenizer.from_dir(path), engine_config=ENGINE,
                                    name=name)


def _script_tokenizer(path) -> "jaxinfer.text.tokenizer.Tokenizer":
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from jaxinfer.text.tokenizer import Tokenizer as JTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    hf = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    hf.add_tokens([AddedToken(p, normalized=False, special=False) for p in SCRIPT])
    hf.save(str(path / "tokenizer.json"))
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<|im_end|>", "chat_template": TOOL_TEMPLATE}, f)
    return JTokenizer.from_dir(path)


def forced_llm(path) -> "jaxinfer.LLM":
    """A tiny model that answers every conversation with `SCRIPT`, then its end-of-turn token."""
    tok = _script_tokenizer(path)
    start = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)[-1]  # the prompt's last token
    chain = [start] + [tok.token_to_id(p) for p in SCRIPT] + [tok.eos_token_id]
    assert len(set(chain)) == len(chain) and None not in chain, chain
    params = tiny_params()
    h, v = TINY.hidden_size, TINY.vocab_size
    embed = np.zeros((v, h), np.float32)
    head = np.zeros((h, v), np.float32)
    for slot, (cur, nxt) in enumerate(zip(chain, chain[1:])):
        embed[cur, slot] = 1.0
        head[slot, nxt] = 10.0
    layers = [
        replace(layer, attention=replace(layer.attention, wo=jnp.zeros_like(layer.attention.wo)),
                mlp=replace(layer.mlp, w_down=jnp.zeros_like(layer.mlp.w_down)))
        for layer in params.layers
    ]
    params = replace(params, embed=jnp.asarray(embed), lm_head=jnp.asarray(head), final_norm=jnp.ones((h,)),
                     layers=layers)
    return jaxinfer.LLM.from_params(TINY, params, tokenizer=tok, engine_config=TOOLS_ENGINE, name="tiny-tools")


def weather_tool() -> dict:
    return {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                       "required": ["city"]},
    }}


__all__ = ["CHAT_TEMPLATE", "ENGINE", "REASONING", "SCRIPT", "SCRIPT_TEXT", "TOOL_ARGS", "forced_llm", "sp_llm",
           "weather_tool"]
