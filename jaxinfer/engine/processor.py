"""The input processor: the one front door every entry point goes through.

    text | chat messages | token ids  +  SamplingParams (or the model's defaults)
        ──► chat template ──► tokenize ──► checks against the model and engine ──► Request

The library (`LLM.generate`, `LLM.chat`, `LLM.stream`), ``jaxinfer generate``
and the gRPC server all build their requests here, so the chat template,
tokenization, length checks and error wording are the same whichever way a
request arrives (vLLM calls this piece the ``Processor``). Errors are
`ValueError`s whose message names the field and the limit.

A prompt whose text alone cannot fit in the context is refused before it is
tokenized: where no token stands for more than `Tokenizer.max_bytes_per_token`
bytes of text, a prompt of ``n`` bytes is at least ``n / max_bytes_per_token``
tokens long (`Tokenizer.min_tokens`, which also leaves out bytes the model drops). Tokenizing is then bounded by the context, not by what a client
sends (a 5 MB prompt is refused in microseconds instead of seconds). Tokenizers
that can drop or collapse text (normalizers, whitespace removal) have no such
bound; their prompts are tokenized and then counted.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from jaxinfer.config import GenerationDefaults
from jaxinfer.text.detokenizer import IncrementalDetokenizer, NullDetokenizer
from jaxinfer.metrics import RequestMetrics
from jaxinfer.engine.request import Request, new_request_id
from jaxinfer.engine.structured import GrammarCompiler
from jaxinfer.sampling_params import SamplingParams

Prompt = Union[str, Sequence[int]]

# Template variables a caller may not set through chat_template_kwargs: the processor sets them.
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "chat_template", "tokenize", "special_tokens")


@dataclass
class TokenizedPrompt:
    """A prompt's token ids, the text they encode (None for token-id input) and the user/template split."""

    ids: list
    text: Optional[str]
    user_tokens: int
    template_tokens: int = 0


class InputProcessor:
    """Turns what a caller sends into a validated `Request`; owns no engine state.

    `tokenizer` may be None (token ids only). Without `max_model_len` (``jaxinfer
    tokenize``: no model loaded) prompts are tokenized but not checked against a context.
    """

    def __init__(
        self,
        tokenizer=None,
        *,
        vocab_size: Optional[int] = None,
        max_model_len: Optional[int] = None,
        max_logprobs: Optional[int] = None,
        generation: Optional[GenerationDefaults] = None,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size if vocab_size is not None else (tokenizer.vocab_size if tokenizer else None)
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.generation = generation or GenerationDefaults()
        stops = set(self.generation.eos_token_ids)
        if tokenizer is not None:
            stops |= set(tokenizer.stop_token_ids)
            if max_model_len is not None:
                tokenizer.min_tokens("")  # the bound is computed now (~40 ms), not on the first request
        self.eos_token_ids = frozenset(stops)
        self._grammars = None  # jaxinfer.engine.structured.GrammarCompiler, made for the first constrained request

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and self.tokenizer.chat_template is not None

    # -- sampling parameters ---------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the sampling defaults in force where they are set: the model's generation config as
        ``--generation-config`` resolved it (`jaxinfer.loading.generation_config`: every field set), or for a model
        wrapped in memory the `GenerationDefaults` it was given; the library's (vLLM's) defaults for the rest."""
        g = self.generation
        kw = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            v = getattr(g, name)
            if v is not None:
                kw[name] = v
        return SamplingParams(**kw)

    # -- tokenizing ----------------------------------------------------------------

    def _need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise ValueError(f"this model has no tokenizer: {what}")
        return self.tokenizer

    def _check_text_fits(self, text: str, what: str) -> None:
        """Refuse text that is longer than the context in tokens whatever it says (before tokenizing it)."""
        if self.max_model_len is None or self.tokenizer is None:
            return
        at_least = self.tokenizer.min_tokens(text)
        if at_least >= self.max_model_len:
            n_bytes = len(text.encode("utf-8", "surrogatepass"))
            raise ValueError(
                f"the {what} is {n_bytes:,} bytes long. No token of this model stands for more than "
                f"{self.tokenizer.max_bytes_per_token} bytes, so it is at least {at_least:,} tokens, but the model's "
                f"context length (max_model_len) is {self.max_model_len} tokens, which must also leave room for at "
                f"least one output token."
            )

    def check_messages(self, messages: Any) -> list:
        """A list of message dicts, each with a non-empty string role; returns it as a list."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts.")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}.")
            role = m.get("role")
            if not isinstance(role, str) or not role:
                raise ValueError(f"messages[{i}].role must be a non-empty string (e.g. 'user', 'system', 'assistant').")
        return list(messages)

    def tokenize(
        self,
        prompt: Optional[Prompt] = None,
        *,
        messages: Optional[Sequence[dict]] = None,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Optional[dict] = None,
        fit_context: bool = True,
        continue_final_message: bool = False,
    ) -> TokenizedPrompt:
        """Token ids of a text prompt, a conversation (with the chat template) or token ids (checked).

        With ``fit_context`` text that cannot fit in the context is refused before tokenizing.
        With ``continue_final_message`` the conversation ends inside its last message (no
        end-of-turn after it, no generation prompt), so the model continues that message, as
        transformers' ``apply_chat_template(continue_final_message=True)`` renders it.
        """
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one input: a prompt (text or token ids) or chat messages.")
        if continue_final_message and messages is None:
            raise ValueError("continue_final_message needs chat messages.")
        if messages is not None:
            return self._tokenize_chat(messages, add_generation_prompt, chat_template_kwargs, fit_context,
                                       continue_final_message)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: it must contain at least one character.")
            tok = self._need_tokenizer("pass the prompt as token ids.")
            if fit_context:
                self._check_text_fits(prompt, "prompt")
            ids = tok.encode(prompt, add_special_tokens=add_special_tokens)
            return TokenizedPrompt(ids, prompt, user_tokens=len(ids))
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
            raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}.")
        ids = list(prompt)
        vocab = self.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or (vocab is not None and not 0 <= t < vocab) or t < 0:
                raise ValueError(
                    f"prompt token id {t!r} at position {i} is out of range: token ids must be integers in "
                    f"[0, {vocab}) (the vocabulary size is {vocab})."
                )
        return TokenizedPrompt(ids, None, user_tokens=len(ids))

    def _tokenize_chat(self, messages, add_generation_prompt, chat_template_kwargs, fit_context,
                       continue_final_message: bool = False) -> TokenizedPrompt:
        if not self.has_chat_template:
            raise ValueError("this model has no chat template: send a plain prompt or token ids instead of messages.")
        messages = self.check_messages(messages)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the model "
                             "continues the last message instead of starting a new one.")
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}.")
        contents = [m["content"] for m in messages if isinstance(m.get("content"), str)]
        tok = self.tokenizer
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        if continue_final_message:
            text = _cut_after_final_message(text, messages[-1])
        if fit_context:
            self._check_text_fits(text, "conversation (rendered with the chat template)")
        ids = tok.encode(text, add_special_tokens=False)
        user = sum(len(x) for x in tok.encode_many(contents, add_special_tokens=False))
        return TokenizedPrompt(ids, text, user_tokens=user, template_tokens=max(0, len(ids) - user))

    # -- requests ------------------------------------------------------------------

    def process(
        self,
        prompt: Optional[Prompt] = None,
        params: Optional[SamplingParams] = None,
        *,
        messages: Optional[Sequence[dict]] = None,
        chat_template_kwargs: Optional[dict] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        request_id: Optional[str] = None,
        priority: int = 0,
        metrics: Optional[RequestMetrics] = None,
        fit_max_tokens: bool = False,
    ) -> Request:
        """A text prompt, token ids or a conversation, with its sampling parameters, as a validated Request.

        `params` None takes the model's defaults. With ``fit_max_tokens`` a ``max_tokens``
        larger than the context has room for shrinks to fit instead of being refused
        (``jaxinfer generate``'s default); otherwise it is an error naming both numbers.
        """
        metrics = metrics if metrics is not None else RequestMetrics(arrival_time=time.perf_counter())
        params = self.default_sampling_params() if params is None else params
        self.check_params(params)  # before the (possibly long) tokenization
        t0 = time.perf_counter()
        tp = self.tokenize(
            prompt, messages=messages, chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
        )
        metrics.tokenize_s = time.perf_counter() - t0
        metrics.user_tokens, metrics.template_tokens = tp.user_tokens, tp.template_tokens
        return self.make_request(
            tp.ids, params, prompt=tp.text, metrics=metrics, request_id=request_id, priority=priority,
            fit_max_tokens=fit_max_tokens,
        )

    def check_params(self, params: Any) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        params.check_against(vocab_size=self.vocab_size, max_logprobs=self.max_logprobs)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids).")

    @property
    def grammars(self):
        """The `jaxinfer.engine.structured.GrammarCompiler` of this model's tokenizer (built on first use)."""
        if self._grammars is None:
            tok = self._need_tokenizer("structured output needs one to read the grammar's text.")
            self._grammars = GrammarCompiler(tok, self.vocab_size or tok.vocab_size, self.eos_token_ids)
        return self._grammars

    def max_tokens_for(self, prompt_len: int, params: SamplingParams, fit: bool = False) -> int:
        """How many tokens a request of `prompt_len` prompt tokens may generate; raises when it cannot fit."""
        limit = self.max_model_len
        if prompt_len == 0:
            raise ValueError("the prompt is empty: it must contain at least one token.")
        if prompt_len >= limit:
            raise ValueError(
                f"the prompt is {prompt_len} tokens long, but the model's context length (max_model_len) is "
                f"{limit} tokens, which must also leave room for at least one output token."
            )
        room = limit - prompt_len
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if fit:
            max_tokens = min(max_tokens, room)
        if prompt_len + max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length (max_model_len) is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for max_tokens)."
            )
        if params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {params.min_tokens}.")
        return max_tokens

    def make_request(
        self,
        prompt_ids: list,
        params: SamplingParams,
        *,
        prompt: Optional[str] = None,
        metrics: Optional[RequestMetrics] = None,
        request_id: Optional[str] = None,
        priority: int = 0,
        fit_max_tokens: bool = False,
    ) -> Request:
        """A Request for token ids already checked against the vocabulary (see `tokenize`)."""
        self.check_params(params)
        max_tokens = self.max_tokens_for(len(prompt_ids), params, fit_max_tokens)
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= self.eos_token_ids
        if self.tokenizer is None:
            detok = NullDetokenizer()
        else:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer (lower runs first), got {priority!r}.")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}.")
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        constraint = None
        if params.structured_outputs is not None:  # compiled here: a bad one never reaches the engine
            constraint = self.grammars.compile(params.structured_outputs)
        return Request(
            request_id or new_request_id(), prompt_ids, params, seed=seed, max_tokens=max_tokens,
            stop_token_ids=frozenset(stops), detokenizer=detok, prompt=prompt, metrics=metrics, priority=priority,
            constraint=constraint,
        )


def _cut_after_final_message(text: str, final: dict) -> str:
    """The rendered conversation cut right after the last message's text (its end-of-turn and anything later
    dropped), as transformers does for ``continue_final_message``."""
    content = final.get("content")
    if isinstance(content, list):  # content parts: the last text part is what continues
        texts = [p.get("text") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        content = texts[-1] if texts else None
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message needs a last message with text to continue.")
    for needle in (content, content.strip()):
        at = text.rfind(needle)
        if at >= 0:
            return text[: at + len(needle)]
    raise ValueError("continue_final_message: the last message's text does not appear in the conversation as the "
                     "chat template renders it, so it cannot be continued.")
