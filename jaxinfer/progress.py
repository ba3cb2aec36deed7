"""Start-up progress: one line per stage, with its duration, and bars for long stages.

Every stage of a start (resolving the model, converting it, restoring it,
building the CPU kernel, compiling programs) runs inside `stage(...)`:

    with progress.stage("converting SmolLM2-135M-Instruct", total=272, unit="tensor") as s:
        for t in tensors:
            ...
            s.update()

What it shows depends on one process-wide setting (`configure`):

* library default (``show=False``): nothing on stderr; each stage is logged
  through ``logging.getLogger("jaxinfer")`` at INFO when it ends, with its
  duration (and at DEBUG when it starts);
* CLI (``show=True``): each stage is also one line on stderr, ``jaxinfer:
  <stage> ... 1.2s``, and a stage with a ``total`` draws a tqdm bar while it
  runs. The CLI turns this on when stderr is a terminal or ``--verbose`` is
  given, and ``--quiet`` turns it off.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Iterator, Optional

log = logging.getLogger("jaxinfer")

_show = False


def configure(show: bool) -> None:
    """Show stage lines (and bars) on stderr, or only log them."""
    global _show
    _show = bool(show)


def showing() -> bool:
    return _show


def _line(text: str) -> None:
    try:
        sys.stderr.write(f"jaxinfer: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed or broken stderr is no reason to fail a start
        pass


class Stage:
    """A running stage: `update` advances its bar, `note` adds text to its closing line."""

    def __init__(self, title: str, total: Optional[int], unit: str):
        self.title = title
        self.total = total
        self.unit = unit
        self.done = 0
        self.detail = ""
        self.t0 = time.perf_counter()
        self._bar = None
        if _show and total:
            self._open_bar()

    def _open_bar(self) -> None:
        try:
            from tqdm import tqdm
        except ImportError:  # tqdm is a dependency; a broken install still starts, without bars
            return
        self._bar = tqdm(
            total=self.total, desc=f"jaxinfer: {self.title}", unit=f" {self.unit}", file=sys.stderr,
            leave=False, dynamic_ncols=True, mininterval=0.2,
        )

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)

    def set_total(self, total: int) -> None:
        """Give the stage a total once it is known (opens the bar)."""
        self.total = total
        if _show and total and self._bar is None:
            self._open_bar()
            if self._bar is not None and self.done:
                self._bar.update(self.done)

    def note(self, text: str) -> None:
        self.detail = text

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def _close(self, failed: bool) -> None:
        if self._bar is not None:
            self._bar.close()
        count = f" {self.done}/{self.total} {self.unit}s" if self.total else ""
        detail = f" ({self.detail})" if self.detail else ""
        status = "failed after" if failed else ""
        text = f"{self.title}{count}{detail} ... {status + ' ' if status else ''}{self.elapsed:.1f}s"
        log.info(text)
        if _show:
            _line(text)


@contextlib.contextmanager
def stage(title: str, total: Optional[int] = None, unit: str = "item") -> Iterator[Stage]:
    """Run a stage of a start: logged (and shown) with its duration when it ends."""
    log.debug("%s ...", title)
    s = Stage(title, total, unit)
    try:
        yield s
    except BaseException:
        s._close(failed=True)
        raise
    s._close(failed=False)


def say(text: str) -> None:
    """One line of a start that is not a timed stage (logged, and shown when stages are)."""
    log.info(text)
    if _show:
        _line(text)


def ready(t_start: float, what: str = "ready") -> None:
    """The closing line of a start: total time since ``t_start`` (a `time.perf_counter` value)."""
    text = f"{what} in {time.perf_counter() - t_start:.1f}s"
    log.info(text)
    if _show:
        _line(text)
