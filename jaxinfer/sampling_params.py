"""`SamplingParams`: what a request asks of the sampler, with vLLM's names and meanings.

Validation messages follow vLLM's wording (``top_p must be in (0, 1], got 1.5.``)
so users recognise them. Limits that depend on the model or the engine (the
vocabulary size, the context length, the largest logprobs count) are checked
by `SamplingParams.check_against`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import math
import re
from typing import Mapping, Optional, Sequence, Union

_GREEDY_EPS = 1e-5
MAX_SEED = 2**32 - 1
# Stop conditions are matched on every step for the life of a request, so their size is bounded
# (vLLM bounds the count of stop strings, SGLang also their length): beyond these, a request is refused.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_BYTES = 256  # UTF-8 bytes of one stop string
MAX_STOP_TOKEN_IDS = 128
# logit_bias is a padded per-row array of this many (token id, bias) pairs in every step (data, not a
# compile key): OpenAI's own limit on the number of entries.
MAX_LOGIT_BIAS = 300
MAX_LOGIT_BIAS_VALUE = 100.0  # |bias| limit, as OpenAI's
MAX_N = 128  # choices per request (`n`)
# Structured output (`StructuredOutputsParams`): a constraint is compiled for every request that carries
# one and runs its matcher on every step, so its size is bounded (named in the error when exceeded).
MAX_GRAMMAR_BYTES = 64 * 1024  # UTF-8 bytes of a JSON schema (serialised), a regex or a grammar
MAX_CHOICES = 1024  # strings in a choice list
MAX_CHOICE_BYTES = 1024  # UTF-8 bytes of one choice


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output, with vLLM's names (v0.11+): exactly one of

    - ``json``: a JSON Schema (a dict, or its text); the output is one JSON value it validates;
    - ``json_object``: True: the output is any JSON object;
    - ``regex``: the output matches the regular expression (whole);
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: a Lark grammar, or llama.cpp's GBNF (told apart by its ``::=`` rules).

    ``disable_any_whitespace`` (JSON only): True (jaxinfer's default, unlike vLLM's) gives compact JSON,
    ``{"a":1,"b":[2,3]}``: no whitespace between tokens, so a sampled request cannot wander in runs of
    spaces and newlines until max_tokens; False lets JSON's whitespace appear between tokens, as the
    JSON grammar allows (``whitespace_pattern``, a regex, then says which whitespace).

    The grammar engine is llguidance (`jaxinfer.engine.structured`); a constraint that does not compile is a
    ValueError naming its kind and llguidance's message, raised before the request reaches the engine.
    """

    json: Union[None, str, Mapping] = None
    regex: Optional[str] = None
    choice: Optional[Sequence[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = True
    whitespace_pattern: Optional[str] = None

    KINDS = ("json", "json_object", "regex", "choice", "grammar")

    def __post_init__(self):
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must give exactly one of json, json_object, regex, choice or grammar, got "
                + (", ".join(given) if given else "none") + "."
            )
        if self.json is not None:
            if isinstance(self.json, str):
                text = self.json
            elif isinstance(self.json, Mapping):
                import json as _json

                try:
                    text = _json.dumps(self.json)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"structured_outputs.json: the schema is not JSON: {e}.") from None
            else:
                raise ValueError(f"structured_outputs.json must be a JSON Schema (a dict or its text), got "
                                 f"{type(self.json).__name__}.")
            _check_size("json", text)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be true or false, got {self.json_object!r}.")
        for kind in ("regex", "grammar"):
            v = getattr(self, kind)
            if v is not None:
                if not isinstance(v, str) or not v:
                    raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {v!r}.")
                _check_size(kind, v)
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, Sequence) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
            self.choice = list(self.choice)
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice may hold at most {MAX_CHOICES} strings, got "
                                 f"{len(self.choice)}.")
            for c in self.choice:
                if not isinstance(c, str) or not c:
                    raise ValueError(f"structured_outputs.choice must hold non-empty strings, got {c!r}.")
                if len(c.encode("utf-8", "surrogatepass")) > MAX_CHOICE_BYTES:
                    raise ValueError(f"each choice may be at most {MAX_CHOICE_BYTES} bytes (UTF-8), got one of "
                                     f"{len(c.encode('utf-8', 'surrogatepass'))} bytes: {c[:32]!r}...")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be true or false, got "
                             f"{self.disable_any_whitespace!r}.")
        if self.whitespace_pattern is not None and (not isinstance(self.whitespace_pattern, str)
                                                     or not self.whitespace_pattern):
            raise ValueError(f"structured_outputs.whitespace_pattern must be a non-empty regex, got "
                             f"{self.whitespace_pattern!r}.")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of `KINDS`."""
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def from_dict(cls, d: Mapping) -> "StructuredOutputsParams":
        """From a JSON object with these field names (an HTTP body's ``structured_outputs``); an unknown
        field is an error naming it."""
        if isinstance(d, StructuredOutputsParams):
            return d
        if not isinstance(d, Mapping):
            raise ValueError(f"structured_outputs must be an object, got {type(d).__name__}.")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(names))}.")
        return cls(**d)


def _check_size(kind: str, text: str) -> None:
    n = len(text.encode("utf-8", "surrogatepass"))
    if n > MAX_GRAMMAR_BYTES:
        raise ValueError(f"structured_outputs.{kind} is {n:,} bytes; the limit is {MAX_GRAMMAR_BYTES:,} bytes.")


@dataclass
class SamplingParams:
    max_tokens: Optional[int] = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Union[None, str, Sequence[str]] = None
    stop_token_ids: Optional[Sequence[int]] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI's meaning: token id -> a bias in [-100, 100] added to that token's logit before sampling
    # (greedy too). Keys may be digit strings (JSON object keys); they are normalised to ints.
    logit_bias: Optional[Mapping[int, float]] = None
    # Choices for one prompt: the engine prefills the prompt once and forks the others from it
    # (`jaxinfer.LLM.make_requests`); choice i samples with seed + i when a seed is given.
    n: int = 1
    # vLLM's meaning: the logprob of every prompt token after the first under the model given the
    # tokens before it, plus the top-k alternatives at that position (0: the token's own only).
    # Such a request is never served from the prefix cache nor forked (every position is computed).
    prompt_logprobs: Optional[int] = None
    # A constraint on the output (JSON Schema, regex, choice, grammar): `StructuredOutputsParams`, or a
    # dict of its fields. Applied on device as a token bitmask before every other sampling stage.
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self):
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        self._verify()

    # -- validation -------------------------------------------------------

    def _verify(self) -> None:
        def num(name, v, kind=(int, float)):
            if isinstance(v, bool) or not isinstance(v, kind):
                raise ValueError(f"{name} must be a number, got {v!r}.")
            if isinstance(v, float) and v != v:
                raise ValueError(f"{name} must not be NaN, got {v}.")

        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
                raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}.")
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        num("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if self.temperature == float("inf"):
            raise ValueError(f"temperature must be finite, got {self.temperature}.")
        num("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        num("top_k", self.top_k, int)
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        num("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            num(name, v)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}.")
        num("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}.")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise ValueError(f"seed must be an integer, got {self.seed!r}.")
            if not 0 <= self.seed <= MAX_SEED:
                raise ValueError(f"seed must be in [0, {MAX_SEED}], got {self.seed}.")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs is not None:
            if isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int) or self.logprobs < 0:
                raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None:
            v = self.prompt_logprobs
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"prompt_logprobs must be a non-negative integer (or None), got {v!r}.")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}.")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}.")
            if len(s.encode("utf-8", "surrogatepass")) > MAX_STOP_STRING_BYTES:
                raise ValueError(
                    f"each stop string may be at most {MAX_STOP_STRING_BYTES} bytes (UTF-8), got one of "
                    f"{len(s.encode('utf-8', 'surrogatepass'))} bytes: {s[:32]!r}..."
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}."
            )
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}.")
        if isinstance(self.n, bool) or not isinstance(self.n, int):
            raise ValueError(f"n must be an integer, got {self.n!r}.")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}.")

    def check_against(self, *, vocab_size: Optional[int], max_logprobs: Optional[int]) -> None:
        """Checks that need the model and engine: vocabulary size and logprobs limit (None: not checked)."""
        if vocab_size is None:
            vocab_size = float("inf")
        if max_logprobs is None:
            max_logprobs = float("inf")
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be at most the vocabulary size ({vocab_size}), got {self.top_k}.")
        if self.logprobs is not None and self.logprobs > max_logprobs:
            raise ValueError(f"Requested logprobs of {self.logprobs}, which is greater than max allowed: {max_logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs > max_logprobs:
            raise ValueError(
                f"prompt_logprobs must be at most the engine's max_logprobs ({max_logprobs}), got "
                f"{self.prompt_logprobs}."
            )
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids must be smaller than the vocabulary size ({vocab_size}), got {t}.")
        for t in self.logit_bias or ():
            if t >= vocab_size:
                raise ValueError(
                    f"logit_bias token id {t} is out of range: token ids must be smaller than the vocabulary "
                    f"size ({vocab_size})."
                )

    # -- derived ------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_filters(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None

    @property
    def has_logit_bias(self) -> bool:
        return bool(self.logit_bias)

    def clone(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


_DIGITS = re.compile(r"[0-9]+")


def _normalise_logit_bias(bias) -> Optional[dict]:
    """``logit_bias`` as {int token id: float bias}, checked; None stays None."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a mapping of token id -> bias, got {type(bias).__name__}.")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}.")
    out: dict = {}
    for key, value in bias.items():
        if isinstance(key, str) and _DIGITS.fullmatch(key):
            tok = int(key)
        elif isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            tok = key
        else:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}.")
        if tok in out:
            raise ValueError(f"logit_bias names token {tok} more than once.")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"logit_bias value for token {tok} must be a number, got {value!r}.")
        if not math.isfinite(value):
            raise ValueError(f"logit_bias value for token {tok} must be finite, got {value}.")
        if not -MAX_LOGIT_BIAS_VALUE <= value <= MAX_LOGIT_BIAS_VALUE:
            raise ValueError(
                f"logit_bias value for token {tok} must be in [-{MAX_LOGIT_BIAS_VALUE:g}, "
                f"{MAX_LOGIT_BIAS_VALUE:g}], got {value}."
            )
        out[tok] = float(value)
    return out


GREEDY_EPS = _GREEDY_EPS
