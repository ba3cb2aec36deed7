"""What a request returns: vLLM-shaped `RequestOutput` and the streamed `StreamDelta`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from jaxinfer.metrics import RequestMetrics


@dataclass
class Logprob:
    """Logprob of a drawn token and the top alternatives at that step."""

    token_id: int
    logprob: float
    top: dict  # token id -> logprob (the N most likely tokens of the raw distribution)


@dataclass
class CompletionOutput:
    text: str
    token_ids: list
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Optional[object] = None  # the stop string or stop token id that ended it
    logprobs: Optional[list] = None  # list[Logprob] when requested
    cumulative_logprob: Optional[float] = None
    index: int = 0

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

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def usage(self) -> dict:
        n_out = len(self.outputs[0].token_ids)
        return {
            "prompt_tokens": len(self.prompt_token_ids),
            "cached_tokens": self.metrics.cached_tokens,
            "completion_tokens": n_out,
            "total_tokens": len(self.prompt_token_ids) + n_out,
        }


@dataclass
class StreamDelta:
    """One streamed piece: new text, the token ids that made it, and the end state."""

    request_id: str
    text: str
    token_ids: list
    logprobs: Optional[list] = None
    finish_reason: Optional[str] = None
    output: Optional[RequestOutput] = None  # set on the final delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __str__(self) -> str:
        return self.text
