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

    def __post_init__(self):
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
