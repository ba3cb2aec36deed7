"""The measured life of a request: timings and token counts, and their readable account.

All times are `time.perf_counter()` seconds. Durations are derived, so a
finished request can report queue wait, prefill, time to first token (TTFT),
every inter-token gap (ITL), time per output token (TPOT) and end-to-end.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class RequestMetrics:
    arrival_time: float = 0.0
    tokenize_s: float = 0.0
    template_tokens: int = 0  # prompt tokens added by the chat template
    user_tokens: int = 0  # prompt tokens of the user's own text
    prompt_tokens: int = 0
    cached_tokens: int = 0
    scheduled_time: Optional[float] = None  # left the queue
    prefill_chunks: list = field(default_factory=list)  # dispatch time of each prefill chunk
    prefill_done_time: Optional[float] = None
    first_token_time: Optional[float] = None
    token_times: list = field(default_factory=list)  # when each output token reached the host
    finished_time: Optional[float] = None
    decode_steps: int = 0
    output_tokens: int = 0

    # -- derived -------------------------------------------------------------

    @property
    def queue_s(self) -> Optional[float]:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def prefill_s(self) -> Optional[float]:
        if self.prefill_done_time is None or self.scheduled_time is None:
            return None
        return self.prefill_done_time - self.scheduled_time

    @property
    def ttft_s(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itl_s(self) -> list:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> Optional[float]:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2e_s(self) -> Optional[float]:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    def summary(self) -> dict:
        itl = self.itl_s
        return {
            "prompt_tokens": self.prompt_tokens,
            "template_tokens": self.template_tokens,
            "user_tokens": self.user_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "tokenize_s": self.tokenize_s,
            "queue_s": self.queue_s,
            "prefill_s": self.prefill_s,
            "prefill_chunks": len(self.prefill_chunks),
            "ttft_s": self.ttft_s,
            "decode_steps": self.decode_steps,
            "tpot_s": self.tpot_s,
            "itl_mean_s": statistics.fmean(itl) if itl else None,
            "itl_max_s": max(itl) if itl else None,
            "e2e_s": self.e2e_s,
        }

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(self.summary())
        return d

    def trace(self) -> str:
        """A readable account of the request's life (``jaxinfer generate --trace``)."""

        def ms(x):
            return "-" if x is None else f"{x * 1e3:.1f} ms"

        s = self.summary()
        lines = [
            "── request trace ──",
            f"prompt tokens     {self.prompt_tokens} ({self.user_tokens} user + {self.template_tokens} template"
            + (f", {self.cached_tokens} cached" if self.cached_tokens else "")
            + ")",
            f"tokenize          {ms(self.tokenize_s)}",
            f"queue wait        {ms(s['queue_s'])}",
            f"prefill           {ms(s['prefill_s'])} in {s['prefill_chunks']} chunk(s)",
            f"time to 1st token {ms(s['ttft_s'])}",
            f"decode steps      {self.decode_steps}, mean step {ms(s['tpot_s'])} (TPOT)",
            f"inter-token gap   mean {ms(s['itl_mean_s'])}, max {ms(s['itl_max_s'])}",
            f"output tokens     {self.output_tokens}"
            + (f" ({self.output_tokens / s['e2e_s']:.1f} tok/s end to end)" if s["e2e_s"] else ""),
            f"total             {ms(s['e2e_s'])}",
        ]
        return "\n".join(lines)
