"""What a request returns: vLLM-shaped `RequestOutput` and the streamed `StreamDelta`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from jaxinfer.metrics import RequestMetrics


@dataclass
class Logprob:
    """Logprob of a token and the top alternatives at its position.

    For a drawn token: the step's raw distribution. For a prompt token (`RequestOutput.prompt_logprobs`):
    the distribution the model gives at that position from the tokens before it, computed the same way.
    """

    token_id: int
    logprob: float
    top: dict  # token id -> logprob (the N most likely tokens of the raw distribution)
    rank: Optional[int] = None  # prompt tokens: 1 + how many tokens were likelier (vLLM's rank)


@dataclass
class CompletionOutput:
    text: str
    token_ids: list
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Optional[object] = None  # the stop string or stop token id that ended it
    logprobs: Optional[list] = None  # list[Logprob] when requested
    cumulative_logprob: Optional[float] = None
    index: int = 0
    error: Optional[str] = None  # finish_reason "error": what went wrong (e.g. a grammar that allows no token)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    outputs: list  # [CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # With SamplingParams.prompt_logprobs (vLLM's): one entry per prompt token, None for the first
    # (nothing precedes it), then a Logprob of that token given the tokens before it.
    prompt_logprobs: Optional[list] = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def usage(self) -> dict:
        """Token counts, OpenAI's way: the prompt once, the completion tokens of every choice."""
        n_out = sum(len(o.token_ids) for o in self.outputs)
        return {
            "prompt_tokens": len(self.prompt_token_ids),
            "cached_tokens": self.metrics.cached_tokens,
            "completion_tokens": n_out,
            "total_tokens": len(self.prompt_token_ids) + n_out,
        }


def merge_choices(request_id: str, outputs: list) -> RequestOutput:
    """One RequestOutput for the choices of one prompt (the outputs of a group's requests, one
    choice each, in any order): ``outputs`` holds their CompletionOutputs by ``index``, the
    metrics (queue, TTFT, cached tokens) are choice 0's, which prefilled the prompt."""
    if len(outputs) == 1 and outputs[0].request_id == request_id:
        return outputs[0]
    choices = sorted((c for o in outputs for c in o.outputs), key=lambda c: c.index)
    first = min(outputs, key=lambda o: o.outputs[0].index)
    return RequestOutput(
        request_id=request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=choices,
        finished=all(o.finished for o in outputs),
        metrics=first.metrics,
        prompt_logprobs=first.prompt_logprobs,
    )


@dataclass
class StreamDelta:
    """One streamed piece: new text, the token ids that made it, and the end state."""

    request_id: str
    text: str
    token_ids: list
    logprobs: Optional[list] = None
    finish_reason: Optional[str] = None
    output: Optional[RequestOutput] = None  # set on the final delta
    prompt_logprobs: Optional[list] = None  # on the first token's delta, with SamplingParams.prompt_logprobs

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __str__(self) -> str:
        return self.text
