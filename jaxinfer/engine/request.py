"""Host-side state of one request, as plain counters.

``num_computed`` counts the tokens whose keys/values are in the cache (or in a
step already dispatched); ``num_sampled`` counts the output tokens drawn on
device, of which ``output_ids`` holds the ones already read back. Whole
prefill, chunked prefill and decode are one arithmetic over these counters.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Optional

from jaxinfer.metrics import RequestMetrics
from jaxinfer.outputs import CompletionOutput, Logprob, RequestOutput
from jaxinfer.sampling_params import SamplingParams

_ids = itertools.count()


def new_request_id() -> str:
    return f"req-{next(_ids)}"


@dataclass
class TokenRef:
    """A token that may still live on device: row `row` of the step output `array`."""

    array: Any
    row: int


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_ids: list,
        params: SamplingParams,
        *,
        seed: int,
        max_tokens: int,
        stop_token_ids: frozenset,
        detokenizer,
        prompt: Optional[str] = None,
        metrics: Optional[RequestMetrics] = None,
        priority: int = 0,
        constraint: Any = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.seed = seed
        self.max_tokens = max_tokens
        self.stop_token_ids = stop_token_ids
        self.detokenizer = detokenizer
        self.metrics = metrics or RequestMetrics()
        self.metrics.prompt_tokens = len(self.prompt_ids)
        self.priority = priority
        # SamplingParams.structured_outputs compiled (`jaxinfer.engine.structured.Constraint`): fed every
        # output token as it is read back; the engine reads a constrained request's tokens before
        # dispatching its next step, so the next mask is known
        self.constraint = constraint
        self.error: Optional[str] = None  # finish_reason "error": why
        self.arrival_order = 0
        # Several choices of one prompt (`SamplingParams.n`, `Engine.submit_group`): the group's
        # requests (one list shared by all, in choice order; None alone), this one's index in it,
        # and the id the group answers to (the caller's request id).
        self.group: Optional[list] = None
        self.choice_index = 0
        self.group_id = request_id
        # prefill/decode disaggregation (`jaxinfer.engine.kv_transfer.KVTransferParams`): the transfer this
        # request's prompt KV goes out by (a prefill engine) or comes in by (a decode engine); None: local
        self.kv_transfer: Any = None
        # device-side progress
        self.pages: list = []  # page of each page-sized run of positions; 0 once released behind a window
        self.num_released_pages = 0  # leading entries of `pages` given back (sliding-window models)
        self.page_hashes: list = []  # names of full pages of the known tokens (prefix cache)
        self.num_registered_pages = 0
        self.num_preemptions = 0
        self.slot: Optional[int] = None
        self.num_computed = 0
        self.num_sampled = 0
        self.prefill_target = len(self.prompt_ids)  # tokens to prefill before decoding (prompt + outputs on recompute)
        self.last_token: Any = None  # int or TokenRef
        # speculative decoding (`jaxinfer.engine.speculative`): this step's draft tokens, verified after
        # the input token, and the request's speculation history (`SpecState`)
        self.drafts: list = []
        self.spec: Any = None
        # host-side results
        self.output_ids: list = []
        self.text = ""
        self.logprobs: Optional[list] = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # SamplingParams.prompt_logprobs: position p holds token p's Logprob given the tokens before
        # it, filled as the prefill chunks are read back (position 0 stays None)
        self.prompt_logprobs: Optional[list] = (
            [None] * len(self.prompt_ids) if params.prompt_logprobs is not None else None
        )
        self.finish_reason: Optional[str] = None
        self.stop_reason: Any = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_known_tokens(self) -> int:
        """Prompt plus the output tokens already read back."""
        return len(self.prompt_ids) + len(self.output_ids)

    def known_token_ids(self) -> list:
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    def all_token_ids(self, start: int, n: int) -> list:
        """Tokens [start, start + n) of prompt + known output (what a prefill chunk feeds)."""
        seq = self.prompt_ids if start + n <= len(self.prompt_ids) else self.prompt_ids + self.output_ids
        if start + n > len(seq):
            raise ValueError(f"{self.request_id}: tokens up to {start + n} asked, {len(seq)} known")
        return seq[start : start + n]

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= self.prefill_target

    @property
    def done_sampling(self) -> bool:
        """No more tokens need drawing (known on the host without reading the device)."""
        return self.finished or self.num_sampled >= self.max_tokens

    def banned_ids(self, ahead: int = 0) -> tuple:
        """Stop tokens suppressed while fewer than min_tokens outputs are drawn; ``ahead``: for the token
        drawn after that many more (the rows of a verify segment, speculative decoding)."""
        if self.num_sampled + ahead < self.params.min_tokens:
            ends = self.constraint.end_ids if self.constraint is not None else ()
            return tuple(sorted(self.stop_token_ids.union(ends)))
        return ()

    def add_token(self, token: int, logprob: Optional[Logprob]) -> str:
        """Record one token read back from the device; returns the text it releases."""
        self.output_ids.append(token)
        if logprob is not None and self.logprobs is not None:
            self.logprobs.append(logprob)
            self.cumulative_logprob += logprob.logprob
        n = len(self.output_ids)
        c = self.constraint
        if c is not None:
            if not c.accept(token):
                return self._fail(c.error)
            if c.ended and not c.complete:  # stuck: no token spells what the grammar needs next
                return self._fail(f"structured output ({c.kind}) cannot go on after {c.tokens - 1} tokens: no token "
                                  f"of this tokenizer spells what the grammar needs next")
            if token in c.end_ids and n > self.params.min_tokens:  # the grammar's own end (ignore_eos or not)
                self.finish_reason, self.stop_reason = "stop", token
                return self.detokenizer.finish()
        if token in self.stop_token_ids and n > self.params.min_tokens:
            self.finish_reason, self.stop_reason = "stop", token
            return self.detokenizer.finish()
        delta = self.detokenizer.add([token])
        if self.detokenizer.stop_reason is not None:
            self.finish_reason, self.stop_reason = "stop", self.detokenizer.stop_reason
            return delta
        if c is not None and c.ended:  # only end-of-sequence could follow: the output is complete
            if n < self.params.min_tokens:
                return delta + self._fail(
                    f"structured output ({c.kind}) is complete after {n} tokens, before min_tokens="
                    f"{self.params.min_tokens}: the grammar allows nothing more")
            self.finish_reason = "stop"
            return delta + self.detokenizer.finish()
        if n >= self.max_tokens:
            self.finish_reason = "length"
            delta += self.detokenizer.finish()
        return delta

    def _fail(self, message: str) -> str:
        """End with finish_reason "error" and ``message`` (the text so far stays)."""
        self.finish_reason, self.error = "error", message
        return self.detokenizer.finish()

    def abort(self, reason: str = "abort") -> None:
        if self.finish_reason is None:
            self.finish_reason = reason

    def to_output(self) -> RequestOutput:
        comp = CompletionOutput(
            text=self.detokenizer.text,
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            index=self.choice_index,
            error=self.error,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            outputs=[comp],
            finished=self.finished,
            metrics=self.metrics,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
        )
