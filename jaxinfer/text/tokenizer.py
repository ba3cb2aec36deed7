"""Tokenizers: one façade over Hugging Face ``tokenizers`` and ``sentencepiece``.

``load_tokenizer(path)`` accepts

- a ``.gguf`` file: the vocabulary is rebuilt from llama.cpp's metadata keys.
  ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) becomes a HF
  ``tokenizers.Tokenizer`` whose pre-tokenizer follows ``tokenizer.ggml.pre``;
  ``"llama"`` (SentencePiece: tokens, scores, token types) becomes a
  ``sentencepiece`` model built as a ``ModelProto``;
- a Hugging Face directory: ``tokenizer.json`` (or ``tokenizer.model``) with
  ``tokenizer_config.json`` and optionally ``chat_template.jinja`` /
  ``chat_template.json`` and ``generation_config.json``.

The façade adds what the engine needs on top of encode/decode: BOS handling
as the model asks, the special and stop token ids, and the chat template.
"""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Optional, Union

import sentencepiece
import tokenizers
from sentencepiece import sentencepiece_model_pb2 as pb
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from jaxinfer.gguf_file import GGUFFile
from jaxinfer.text.chat_template import render_chat_template

__all__ = ["Tokenizer", "load_tokenizer"]

# Token names that end a turn in common chat formats; they stop generation
# when the vocabulary has them as special tokens.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")

# llama.cpp token types (the same numbers as sentencepiece's piece types).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# ---------------------------------------------------------------------------
# Backends: the minimal surface the façade uses.
# ---------------------------------------------------------------------------


class _HFBackend:
    """A ``tokenizers.Tokenizer``; special tokens are its added tokens marked special."""

    def __init__(self, tok: tokenizers.Tokenizer):
        self.tok = tok
        self.special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str) -> list[int]:
        return self.encode_many([text])[0]

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        # the batch calls release the GIL while they work (encode holds it: a 5 MB text would stall
        # every other Python thread, the server's event loop included, for seconds); the fast one
        # (tokenizers >= 0.21) also skips the character offsets, which the engine never reads
        batch = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [e.ids for e in batch(texts, add_special_tokens=False)]

    def token_texts(self) -> list[str]:
        """Every token's text (special tokens as written)."""
        n = self.tok.get_vocab_size(with_added_tokens=True)
        return self.tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)

    def longest_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token stands for. A byte-level vocabulary's strings name one byte a
        character, so their lengths say it without decoding every token (~0.2 s for 49k tokens); added
        tokens count their text's bytes. Other vocabularies: the longest decoded token text."""
        t = self.tok
        if t.normalizer is None and "ByteLevel" in repr(t.pre_tokenizer):
            added = [len(a.content.encode("utf-8", "surrogatepass")) for a in t.get_added_tokens_decoder().values()]
            return max([1, *(len(k) for k in t.get_vocab(with_added_tokens=False)), *added])
        return max((len(x.encode("utf-8", "surrogatepass")) for x in self.token_texts()), default=1)

    def dropped_bytes(self) -> Optional[bytes]:
        """The bytes the model drops from any text (no token, no unknown token); None if it can shrink text more.

        A byte-level BPE drops the bytes whose byte character is missing from its vocabulary
        (SmolLM2's GGUF vocabulary lacks 21 of 256, control bytes and UTF-8 lead bytes of
        rare planes). Normalizers rewrite text, WordPiece / Unigram and fused unknowns swallow
        runs of it, added tokens that strip eat their neighbours: no bound then.
        """
        t = self.tok
        model = t.model
        if t.normalizer is not None or type(model).__name__ != "BPE" or getattr(model, "fuse_unk", False):
            return None
        if any(a.lstrip or a.rstrip for a in t.get_added_tokens_decoder().values()):
            return None
        if "ByteLevel" in repr(t.pre_tokenizer):
            vocab = t.get_vocab()
            return bytes(b for b, ch in bytes_to_unicode().items() if ch not in vocab)
        return b"" if model.unk_token or getattr(model, "byte_fallback", False) else None

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> Optional[str]:
        return self.tok.id_to_token(i)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)


class _SPBackend:
    """A ``sentencepiece.SentencePieceProcessor``.

    SentencePiece never matches control pieces (``<s>``, ``<|im_end|>``...) in
    text, so ``encode`` splits them out first, like llama.cpp and transformers
    do; each remaining segment gets SentencePiece's own dummy-prefix handling.
    ``decode`` drops control and unknown pieces when skipping special tokens,
    and otherwise writes control pieces as their text.
    """

    def __init__(self, sp: Any):
        self.sp = sp
        n = sp.get_piece_size()
        self.control_ids = frozenset(i for i in range(n) if sp.is_control(i))
        self.special_ids = self.control_ids | frozenset(i for i in range(n) if sp.is_unknown(i))
        pieces = sorted((sp.id_to_piece(i) for i in self.control_ids), key=len, reverse=True)
        pieces = [p for p in pieces if p]
        self._split = re.compile("(" + "|".join(map(re.escape, pieces)) + ")") if pieces else None

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return list(self.sp.encode(text))
        ids: list[int] = []
        for k, part in enumerate(self._split.split(text)):
            if k % 2:  # a captured control piece
                ids.append(self.sp.piece_to_id(part))
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]  # sentencepiece releases the GIL in encode

    def token_texts(self) -> list[str]:
        """Every piece as text (the whitespace marker as a space; byte pieces as their 6-character name)."""
        return [self.sp.id_to_piece(i).replace("\u2581", " ") for i in range(self.sp.get_piece_size())]

    def longest_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one piece stands for (its text)."""
        return max((len(x.encode("utf-8", "surrogatepass")) for x in self.token_texts()), default=1)

    def dropped_bytes(self) -> Optional[bytes]:
        """None where normalization can drop or collapse text (NFKC, extra-whitespace removal), else none dropped."""
        spec = pb.ModelProto.FromString(self.sp.serialized_model_proto()).normalizer_spec
        return None if spec.name not in ("identity", "") or spec.remove_extra_whitespaces else b""

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        n = self.sp.get_piece_size()
        ids = [i for i in ids if 0 <= i < n]
        if skip_special_tokens:
            return self.sp.decode([i for i in ids if i not in self.special_ids])
        out, run = [], []
        for i in ids:
            if i in self.control_ids:
                out.append(self.sp.decode(run))
                out.append(self.sp.id_to_piece(i))
                run = []
            else:
                run.append(i)
        out.append(self.sp.decode(run))
        return "".join(out)

    def id_to_token(self, i: int) -> Optional[str]:
        return self.sp.id_to_piece(i) if 0 <= i < self.sp.get_piece_size() else None

    def token_to_id(self, token: str) -> Optional[int]:
        i = self.sp.piece_to_id(token)
        return None if self.sp.is_unknown(i) and token != self.sp.id_to_piece(i) else i

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()


# ---------------------------------------------------------------------------
# The façade.
# ---------------------------------------------------------------------------


class Tokenizer:
    """Encode, decode, special tokens and chat template of one model.

    Build it with ``Tokenizer.from_gguf``, ``Tokenizer.from_dir`` or
    ``load_tokenizer``. ``encode`` adds BOS (and EOS) only where the model
    asks for it (``add_bos_token``); the chat template already writes its own
    markers, so ``apply_chat_template(tokenize=True)`` adds none.
    """

    def __init__(
        self,
        backend: Union[_HFBackend, _SPBackend],
        *,
        bos_token_id: Optional[int] = None,
        eos_token_id: Optional[int] = None,
        pad_token_id: Optional[int] = None,
        unk_token_id: Optional[int] = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: Optional[str] = None,
        extra_stop_ids: Iterable[int] = (),
        source: str = "<memory>",
        named_chat_templates: Optional[Mapping[str, str]] = None,
    ):
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.add_bos_token = bool(add_bos_token)
        self.add_eos_token = bool(add_eos_token)
        self.chat_template = chat_template
        # other templates by name (transformers' list form); "tool_use" renders requests with tools
        self.named_chat_templates: dict[str, str] = {
            k: v for k, v in (named_chat_templates or {}).items() if k != "default" and isinstance(v, str)}
        self.source = source
        named = {i for i in (bos_token_id, eos_token_id, pad_token_id, unk_token_id) if i is not None}
        self.all_special_ids: frozenset[int] = frozenset(backend.special_ids | named)
        stops = {i for i in extra_stop_ids if i is not None}
        if eos_token_id is not None:
            stops.add(eos_token_id)
        for name in _END_OF_TURN_TOKENS:
            i = backend.token_to_id(name)
            if i is not None and i in backend.special_ids:
                stops.add(i)
        self.stop_token_ids: frozenset[int] = frozenset(stops)

    # -- basic operations ---------------------------------------------------

    @property
    def backend(self) -> Any:
        """The wrapped ``tokenizers.Tokenizer`` or ``SentencePieceProcessor``."""
        return self._backend.tok if isinstance(self._backend, _HFBackend) else self._backend.sp

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS/EOS are added only if the model says so."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._with_special(self._backend.encode(text), add_special_tokens)

    def _with_special(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids = [self.bos_token_id] + ids
            if self.add_eos_token and self.eos_token_id is not None:
                ids = ids + [self.eos_token_id]
        return ids

    def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text, in one call."""
        return [self._with_special(ids, add_special_tokens) for ids in self._backend.encode_many(list(texts))]

    @functools.cached_property
    def _token_bound(self) -> Optional[tuple]:
        dropped = self._backend.dropped_bytes()
        if dropped is None:
            return None
        return self._backend.longest_token_bytes() + 1, dropped  # + 1: a leading space that decoding a lone token may drop

    @property
    def max_bytes_per_token(self) -> Optional[int]:
        """A bound on the UTF-8 bytes of input text one token stands for, or None when there is none.

        The longest token text plus one byte. None where the tokenizer can collapse text
        before splitting it (a normalizer, whitespace removal, added tokens that strip their
        neighbours, WordPiece's unknown words): see `min_tokens`.
        """
        bound = self._token_bound
        return None if bound is None else bound[0]

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(self.encode(text))`` found without tokenizing (0 when there is none).

        The bytes the model keeps, over `max_bytes_per_token`: milliseconds for megabytes.
        """
        bound = self._token_bound
        if bound is None:
            return 0
        per_token, dropped = bound
        data = text.encode("utf-8", "surrogatepass")
        if dropped:
            data = data.translate(None, dropped)
        return -(-len(data) // per_token)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        """The id of the vocabulary string `token`, or None if the vocabulary has no such token."""
        return self._backend.token_to_id(token)

    @functools.cached_property
    def _anchor(self) -> tuple:
        ids = self.encode("a", add_special_tokens=False)
        return (ids[-1], self.decode(ids[-1:], skip_special_tokens=False)) if ids else (None, "")

    def token_text(self, token_id: int) -> str:
        """The text a token adds when it follows other text, special tokens as written.

        Decoding a token alone loses what a decoder strips at the start of a text (SentencePiece's
        word-boundary space: ``▁infer`` alone reads ``infer``), so the token is decoded after a fixed
        ordinary token and that token's text is cut off. This is how logprobs spell each token, so the
        pieces of an output add up to its text.
        """
        anchor, prefix = self._anchor
        if anchor is not None:
            full = self.decode([anchor, token_id], skip_special_tokens=False)
            if full.startswith(prefix):
                return full[len(prefix):]
        return self.decode([token_id], skip_special_tokens=False)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """The vocabulary strings of ``ids`` (byte-level or ``▁`` spelling)."""
        out = []
        for i in ids:
            token = self._backend.id_to_token(int(i))
            if token is None:
                raise ValueError(f"token id {int(i)} is out of range for vocab_size {self.vocab_size}")
            out.append(token)
        return out

    def _token_str(self, i: Optional[int]) -> Optional[str]:
        return None if i is None else self._backend.id_to_token(i)

    @property
    def bos_token(self) -> Optional[str]:
        return self._token_str(self.bos_token_id)

    @property
    def eos_token(self) -> Optional[str]:
        return self._token_str(self.eos_token_id)

    @property
    def pad_token(self) -> Optional[str]:
        return self._token_str(self.pad_token_id)

    @property
    def unk_token(self) -> Optional[str]:
        return self._token_str(self.unk_token_id)

    @property
    def special_tokens_map(self) -> dict[str, Optional[str]]:
        """Token strings the chat template sees as variables."""
        return {"bos_token": self.bos_token, "eos_token": self.eos_token,
                "unk_token": self.unk_token, "pad_token": self.pad_token}

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        chat_template: Optional[str] = None,
        **kwargs: Any,
    ) -> Union[str, list[int]]:
        """Render ``messages`` with the model's template (or ``chat_template``).

        Extra keywords (``tools``, ``enable_thinking``, ...) become template
        variables. With ``tokenize=True`` returns the ids of the rendered text,
        encoded without adding BOS/EOS (the template writes them).
        """
        template = chat_template
        if template is None and kwargs.get("tools") is not None:
            template = self.named_chat_templates.get("tool_use")  # as transformers picks it
        if template is None:
            template = self.chat_template
        if template is None:
            raise ValueError(f"tokenizer from {self.source} has no chat_template; pass chat_template=...")
        text = render_chat_template(
            template, messages, add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens_map, **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        kind = type(self.backend).__name__
        return f"Tokenizer({kind}, vocab_size={self.vocab_size}, source={self.source!r})"

    def facts(self) -> dict[str, Any]:
        """What `from_dir` must rebuild: special ids, BOS/EOS flags, stop ids, backend kind."""
        return {
            "backend": "sentencepiece" if isinstance(self._backend, _SPBackend) else "tokenizers",
            "vocab_size": self.vocab_size,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "unk_token_id": self.unk_token_id,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "stop_token_ids": sorted(self.stop_token_ids),
        }

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write a tokenizer directory that `from_dir` reads back as this tokenizer.

        ``tokenizer.json`` (``tokenizers`` backend) or ``tokenizer.model`` (the
        SentencePiece processor's serialized model), ``tokenizer_config.json``
        (special tokens by text, ``add_bos_token``/``add_eos_token``, the chat
        template) and ``generation_config.json`` whose ``eos_token_id`` lists
        every stop id (merged into the file if it exists).
        """
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        if isinstance(self._backend, _SPBackend):
            with open(os.path.join(path, "tokenizer.model"), "wb") as f:
                f.write(self._backend.sp.serialized_model_proto())
        else:
            self._backend.tok.save(os.path.join(path, "tokenizer.json"))
        config: dict[str, Any] = {"add_bos_token": self.add_bos_token, "add_eos_token": self.add_eos_token}
        for name in ("bos", "eos", "pad", "unk"):
            token = self._token_str(getattr(self, f"{name}_token_id"))
            if token is not None:
                config[f"{name}_token"] = token
        if self.chat_template is not None and self.named_chat_templates:
            config["chat_template"] = [{"name": "default", "template": self.chat_template}] + [
                {"name": k, "template": v} for k, v in self.named_chat_templates.items()]
        elif self.chat_template is not None:
            config["chat_template"] = self.chat_template
        _write_json(os.path.join(path, "tokenizer_config.json"), config)
        gen_path = os.path.join(path, "generation_config.json")
        generation = _read_json(gen_path) or {}
        eos = generation.get("eos_token_id")
        eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        generation["eos_token_id"] = sorted({int(i) for i in eos} | set(self.stop_token_ids))
        _write_json(gen_path, generation)

    def with_facts(self, facts: Mapping[str, Any], source: Optional[str] = None) -> "Tokenizer":
        """This tokenizer's backend and template with the special ids and flags of `facts`."""
        return Tokenizer(
            self._backend,
            bos_token_id=facts.get("bos_token_id"),
            eos_token_id=facts.get("eos_token_id"),
            pad_token_id=facts.get("pad_token_id"),
            unk_token_id=facts.get("unk_token_id"),
            add_bos_token=bool(facts.get("add_bos_token")),
            add_eos_token=bool(facts.get("add_eos_token")),
            chat_template=self.chat_template,
            extra_stop_ids=facts.get("stop_token_ids") or (),
            source=self.source if source is None else source,
            named_chat_templates=self.named_chat_templates,
        )

    # -- constructors -------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: Union[str, os.PathLike], gguf_file: Any = None) -> "Tokenizer":
        """Build the tokenizer described by a GGUF file's ``tokenizer.*`` metadata.

        ``gguf_file``: the file's header already parsed (`jaxinfer.gguf_file.GGUFFile`),
        so a load that also reads the weights parses it once.
        """
        path = os.fspath(path)
        meta = _read_gguf_tokenizer_metadata(path, gguf_file)
        kind = meta.get("tokenizer.ggml.model")
        if kind == "gpt2":
            backend: Union[_HFBackend, _SPBackend] = _HFBackend(_bpe_from_gguf(meta, path))
        elif kind == "llama":
            backend = _SPBackend(_sentencepiece_from_gguf(meta, path))
        else:
            raise ValueError(f"{path}: unsupported tokenizer.ggml.model {kind!r} (supported: 'gpt2', 'llama')")
        get = meta.get
        return cls(
            backend,
            bos_token_id=get("tokenizer.ggml.bos_token_id"),
            eos_token_id=get("tokenizer.ggml.eos_token_id"),
            pad_token_id=get("tokenizer.ggml.padding_token_id"),
            unk_token_id=get("tokenizer.ggml.unknown_token_id"),
            # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
            add_bos_token=get("tokenizer.ggml.add_bos_token", kind == "llama"),
            add_eos_token=get("tokenizer.ggml.add_eos_token", False),
            chat_template=get("tokenizer.chat_template"),
            extra_stop_ids=(get("tokenizer.ggml.eot_token_id"), get("tokenizer.ggml.eom_token_id")),
            source=path,
            # llama.cpp's converter writes named templates as tokenizer.chat_template.<name>
            named_chat_templates={n: get(f"tokenizer.chat_template.{n}") for n in get("tokenizer.chat_templates") or ()},
        )

    @classmethod
    def from_dir(cls, path: Union[str, os.PathLike]) -> "Tokenizer":
        """Load a Hugging Face tokenizer directory (``tokenizer.json`` or ``tokenizer.model``)."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ValueError(f"{path} is not a directory")
        config = _read_json(os.path.join(path, "tokenizer_config.json")) or {}
        tj, tm = os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer.model")
        if os.path.isfile(tj):
            backend: Union[_HFBackend, _SPBackend] = _HFBackend(tokenizers.Tokenizer.from_file(tj))
        elif os.path.isfile(tm):
            backend = _SPBackend(sentencepiece.SentencePieceProcessor(model_file=tm))
        else:
            ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
            if len(ggufs) == 1:
                return cls.from_gguf(os.path.join(path, ggufs[0]))
            raise ValueError(
                f"{path}: no tokenizer found (expected tokenizer.json, tokenizer.model or a single .gguf file)"
            )

        def token_id(name: str) -> Optional[int]:
            value = config.get(name)
            if isinstance(value, Mapping):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        bos, eos = token_id("bos_token"), token_id("eos_token")
        if isinstance(backend, _SPBackend):  # the model file names them too
            sp = backend.sp
            bos = bos if bos is not None else (sp.bos_id() if sp.bos_id() >= 0 else None)
            eos = eos if eos is not None else (sp.eos_id() if sp.eos_id() >= 0 else None)
        add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")
        if isinstance(backend, _HFBackend):
            # Without a flag, tokenizer.json's post-processor says what gets added.
            with_special = backend.tok.encode("a", add_special_tokens=True).ids
            plain = backend.tok.encode("a", add_special_tokens=False).ids
            added = len(with_special) > len(plain)
            if add_bos is None:
                add_bos = added and bos is not None and with_special[0] == bos
            if add_eos is None:
                add_eos = added and eos is not None and with_special[-1] == eos
        elif add_bos is None:
            add_bos = True  # SentencePiece llama-style default
        generation = _read_json(os.path.join(path, "generation_config.json")) or {}
        gen_eos = generation.get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        chat_template, named_templates = _chat_templates_in_dir(path, config)
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=token_id("pad_token"),
            unk_token_id=token_id("unk_token"),
            add_bos_token=bool(add_bos),
            add_eos_token=bool(add_eos),
            chat_template=chat_template,
            extra_stop_ids=[i for i in gen_eos if isinstance(i, int)],
            source=path,
            named_chat_templates=named_templates,
        )


def load_tokenizer(path: Union[str, os.PathLike]) -> Tokenizer:
    """A ``Tokenizer`` from a ``.gguf`` file or a Hugging Face tokenizer directory."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return Tokenizer.from_dir(path)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return Tokenizer.from_gguf(path)
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic) and not a tokenizer directory")
    raise ValueError(f"{path} does not exist (expected a .gguf file or a tokenizer directory)")


# ---------------------------------------------------------------------------
# Hugging Face directory helpers.
# ---------------------------------------------------------------------------


def _read_json(path: str) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, indent=2)
        f.write("\n")


def _chat_templates_in_dir(path: str, config: Mapping) -> tuple[Optional[str], dict[str, str]]:
    """The default chat template and the other named ones, as transformers finds them:
    ``chat_template.jinja`` (with ``additional_chat_templates/<name>.jinja``), then
    ``chat_template.json``, then the config's entry (a string, or a list of named templates)."""
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            default = f.read()
        named = {}
        extra = os.path.join(path, "additional_chat_templates")
        if os.path.isdir(extra):
            for name in sorted(os.listdir(extra)):
                if name.endswith(".jinja"):
                    with open(os.path.join(extra, name), encoding="utf-8") as f:
                        named[name[: -len(".jinja")]] = f.read()
        return default, named
    template = (_read_json(os.path.join(path, "chat_template.json")) or {}).get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        default = named.pop("default", None)
        return (default if isinstance(default, str) else None), {
            k: v for k, v in named.items() if isinstance(k, str) and isinstance(v, str)}
    return (template if isinstance(template, str) else None), {}


# ---------------------------------------------------------------------------
# GGUF helpers.
# ---------------------------------------------------------------------------


def _read_gguf_tokenizer_metadata(path: str, gguf_file: Any = None) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of a GGUF file as Python values."""
    if gguf_file is None:
        if not os.path.isfile(path):
            raise ValueError(f"{path} does not exist")
        try:
            gguf_file = GGUFFile(path)
        except OSError as e:
            raise ValueError(f"{path}: cannot read as GGUF: {e}") from e
    meta = gguf_file.metadata("tokenizer.")
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{path}: GGUF file has no tokenizer.ggml.tokens (no embedded tokenizer)")
    return meta


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: each byte as a printable character.

    Printable Latin-1 bytes stand for themselves; the rest (controls, space,
    ...) are shifted to code points from 256 upwards in byte order.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


# Split patterns that run before byte-level mapping, by tokenizer.ggml.pre.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_FAMILIES = {
    "gpt2": ("gpt2", "default", "gpt-2"),
    # Digits split out one by one, then GPT-2's regex (SmolLM's tokenizer.json;
    # llama.cpp groups these names under one rule).
    "digits+gpt2": ("smollm", "starcoder", "refact"),
    "llama3": ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"),
    "qwen2": ("qwen2", "deepseek-r1-qwen", "megrez"),
}


def _pre_tokenizer_for(pre: Optional[str], path: str) -> tuple[Any, bool]:
    """``(pre_tokenizer, ignore_merges)`` for a ``tokenizer.ggml.pre`` value."""
    family = next((f for f, names in _PRE_FAMILIES.items() if pre in names), None)
    if family is None:
        warnings.warn(f"{path}: unknown tokenizer.ggml.pre {pre!r}; using GPT-2's pre-tokenizer", stacklevel=3)
        family = "gpt2"
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "gpt2":
        return byte_level, False
    if family == "digits+gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]), False
    split = _LLAMA3_SPLIT if family == "llama3" else _QWEN2_SPLIT
    seq = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    # Llama 3 takes a word that is itself a token whole, before any merge.
    return seq, family == "llama3"


def _bpe_from_gguf(meta: Mapping[str, Any], path: str) -> tokenizers.Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` from GGUF tokens, types and merges."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    merges_raw: list[str] = meta.get("tokenizer.ggml.merges") or []
    alphabet = set(bytes_to_unicode().values())
    spell = bytes_to_unicode()
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind not in (_CONTROL, _USER_DEFINED, _UNKNOWN) and not set(token) <= alphabet:
            token = "".join(spell[b] for b in token.encode("utf-8"))  # stored as raw text
        vocab.setdefault(token, i)
    merges = []
    for m in merges_raw:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ValueError(f"{path}: malformed merge {m!r} in tokenizer.ggml.merges")
        merges.append((left, right))
    pre, ignore_merges = _pre_tokenizer_for(meta.get("tokenizer.ggml.pre"), path)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k in (_CONTROL, _UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(f"{path}: rebuilt vocabulary has {tok.get_vocab_size()} entries, file has {len(tokens)}")
    return tok


def _sentencepiece_from_gguf(meta: Mapping[str, Any], path: str) -> Any:
    """A ``SentencePieceProcessor`` from GGUF tokens, scores and types (llama-style BPE)."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    proto = pb.ModelProto()
    for token, score, kind in zip(tokens, scores, types):
        piece = proto.pieces.add()
        piece.piece, piece.score = token, float(score)
        piece.type = kind if kind in (_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE) else _NORMAL
    spec = proto.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.vocab_size = len(tokens)
    spec.byte_fallback = _BYTE in types
    for name, key in (("unk", "unknown_token_id"), ("bos", "bos_token_id"), ("eos", "eos_token_id"),
                      ("pad", "padding_token_id")):
        i = meta.get(f"tokenizer.ggml.{key}")
        setattr(spec, f"{name}_id", i if i is not None else -1)
        if i is not None:
            setattr(spec, f"{name}_piece", tokens[i])
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(proto.SerializeToString())
    except Exception as e:
        raise ValueError(f"{path}: cannot build a SentencePiece model from its vocabulary: {e}") from e
    return sp
