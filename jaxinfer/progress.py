"""Start-up progress: one line per stage, with its duration, and a live indicator while it runs.

Every stage of a start (resolving the model, converting it, restoring it,
building the CPU kernels, compiling programs) runs inside `stage(...)`:

    with progress.stage("converting SmolLM2-135M-Instruct", total=272, unit="tensor") as s:
        for t in tensors:
            ...
            s.update()

What it shows depends on one process-wide setting (`configure`, or ``LLM(progress=...)``):

* library default (no `configure` call, ``LLM(...)`` in a script or a notebook):
  what the CLI does without flags, shown when stderr is a terminal or a
  notebook's output (plain lines there), not when it is a file or a pipe,
  unless logging already shows or silences the stages. The rule
  (`library_shows`): nothing is written when the ``"jaxinfer"`` logger's INFO
  records reach a handler of the user's logging (e.g. after
  ``logging.basicConfig(level=logging.INFO)``: the stages are its log lines
  instead), when a level above INFO is set on the ``"jaxinfer"`` logger
  itself, or when ``logging.disable`` covers INFO. ``LLM(..., progress=False)``
  (or ``configure(show=False)``) turns the lines off for the process,
  ``progress=True`` turns them on (on any stderr);
* whatever is shown, each stage is logged through
  ``logging.getLogger("jaxinfer")`` at INFO when it ends, with its duration
  (and at DEBUG when it starts);
* shown (``show=True``, the CLI on a terminal or with ``--verbose``): each
  stage is also one line on stderr when it ends,
  ``jaxinfer: <stage> ... 1.2s``. While it runs:

  - on a terminal (``live``), a tqdm line redrawn several times a second: a
    bar for a stage with a ``total``, a spinner and the time so far for one
    without (a kernel build, a single compile, a restore), so a long stage
    never looks like a hang; the line is erased when the stage ends;
  - elsewhere (a log file, a pipe, a notebook's stderr), no redrawn frames,
    only plain lines: ``jaxinfer: <stage> ...`` once the stage has run for a
    second, then one every 30 s with the time so far (and the count).

  The CLI turns ``show`` on when stderr is a terminal or ``--verbose`` is
  given, and ``--quiet`` turns it off; ``live`` follows whether stderr is a
  terminal unless `configure` says otherwise.

Whatever is shown, `current` tells which stage is running now (from any
thread): ``jaxinfer serve`` answers ``/health`` with it while it loads.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import threading
import time
from typing import Callable, Iterator, Optional

log = logging.getLogger("jaxinfer")

_show: Optional[bool] = None  # None: not configured, the library's rule (`library_shows`) decides
_live: Optional[bool] = None  # None: whether stderr is a terminal
_running: list = []  # the stages running now, oldest first (any thread); guarded by _running_lock
_running_lock = threading.Lock()

SPINNER_DELAY_S = 0.25  # a live indicator appears once a stage has run this long (quick stages never flicker)
FIRST_LINE_S = 1.0  # not live: the "<stage> ..." line once a stage has run this long
REPEAT_LINE_S = 30.0  # not live: then a line this often
_TICK_S = 0.1


def configure(show: Optional[bool], live: Optional[bool] = None) -> None:
    """Show stage lines on stderr (True), or only log them (False); None: the library's rule (`library_shows`).
    ``live``: redraw an indicator while a stage runs (None: when stderr is a terminal)."""
    global _show, _live
    _show = None if show is None else bool(show)
    _live = live


def library_shows() -> bool:
    """The library's default, the CLI's own: stage lines on a terminal (or a notebook), unless logging has them.

    Shown when stderr is a terminal or a Jupyter notebook's output, as the CLI shows them on a
    terminal; not on a stderr that is a file or a pipe (a log, a test runner's capture). And each
    stage is reported once: nothing is written when the "jaxinfer" logger's INFO records reach a
    handler that takes them (the user's logging, e.g. ``logging.basicConfig(level=logging.INFO)``:
    the stages are its lines instead), nor when they are silenced on purpose (a level above INFO
    set on the "jaxinfer" logger itself, or ``logging.disable(logging.INFO)``). A handler at the
    default WARNING (the one absl installs at its first log line) changes nothing.
    """
    if logging.root.manager.disable >= logging.INFO:
        return False
    if log.level > logging.INFO:  # set on "jaxinfer" itself (NOTSET, 0, is not a choice)
        return False
    if _logged_at_info():
        return False
    return _isatty(sys.stderr) or _notebook_stream(sys.stderr)


def _notebook_stream(stream) -> bool:
    """Whether ``stream`` is a Jupyter kernel's output stream (a notebook cell shows what is written to it)."""
    return type(stream).__module__.startswith("ipykernel")


def _logged_at_info() -> bool:
    """Whether an INFO record of the "jaxinfer" logger reaches a handler that takes it."""
    if not log.isEnabledFor(logging.INFO):
        return False
    logger = log
    while logger is not None:
        if any(h.level <= logging.INFO for h in logger.handlers):
            return True
        if not logger.propagate:
            return False
        logger = logger.parent
    return False


def showing() -> bool:
    """Whether stage lines are written to stderr now (the configured setting, else the library's rule)."""
    return _show if _show is not None else library_shows()


def keyword(init: Callable) -> Callable:
    """Give a constructor (``LLM.__init__``) a keyword-only ``progress`` argument, handled here.

    ``progress=None`` (the default) leaves the setting as it is (the CLI's `configure`, or the
    library's rule); True or False sets it for the process, as ``configure(show=...)`` does, before
    the constructor runs, so its stages (and the compiles that follow on first use) show or not.
    """

    @functools.wraps(init)
    def wrapper(*args, progress: Optional[bool] = None, **kwargs):
        if progress is not None:
            if not isinstance(progress, bool):
                raise ValueError(f"progress must be True, False or None, got {progress!r}.")
            configure(show=progress, live=_live)
        return init(*args, **kwargs)

    sig = inspect.signature(init)
    params = list(sig.parameters.values())
    extra = inspect.Parameter("progress", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Optional[bool]")
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    wrapper.__signature__ = sig.replace(parameters=params[:at] + [extra] + params[at:])
    return wrapper


def current() -> Optional[dict]:
    """The stage started last among those running now (any thread), or None when none runs.

    ``{"stage": title, "elapsed_s": seconds so far}``, with ``"done"`` and ``"total"`` when it has a total.
    """
    with _running_lock:
        s = _running[-1] if _running else None
    if s is None:
        return None
    out = {"stage": s.title, "elapsed_s": round(s.elapsed, 1)}
    if s.total:
        out.update(done=s.done, total=s.total)
    return out


def _isatty(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, OSError, ValueError):  # a closed or odd stderr
        return False


def live() -> bool:
    """Whether running stages are drawn as redrawn lines (shown, on a terminal)."""
    return showing() and (_live if _live is not None else _isatty(sys.stderr))


def _line(text: str) -> None:
    try:
        sys.stderr.write(f"jaxinfer: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed or broken stderr is no reason to fail a start
        pass


def _terminal_width(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # not a terminal, or no file descriptor
        return 0


def _spinner_frames() -> str:
    encoding = (getattr(sys.stderr, "encoding", None) or "").lower().replace("-", "")
    return "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏" if encoding == "utf8" else "|/-\\"


class Stage:
    """A running stage: `update` advances its count, `note` adds text to its closing line."""

    def __init__(self, title: str, total: Optional[int], unit: str):
        self.title = title
        self.total = total
        self.unit = unit
        self.done = 0
        self.detail = ""
        self.t0 = time.perf_counter()
        self._bar = None  # the tqdm line (live)
        self._bar_total: Optional[int] = None  # the total it was opened with (None: a spinner)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: Optional[threading.Thread] = None
        self._show = showing()  # decided once per stage: its indicator and its closing line agree
        self._live = self._show and (_live if _live is not None else _isatty(sys.stderr))
        with _running_lock:
            _running.append(self)
        if self._show:
            self._ticker = threading.Thread(target=self._tick, name="jaxinfer-progress", daemon=True)
            self._ticker.start()

    # -- what the stage's code calls ---------------------------------------------------------

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
            if self._bar is not None and self._bar_total:
                self._bar.update(n)

    def set_total(self, total: int) -> None:
        """Give the stage a total once it is known (a live spinner becomes a bar)."""
        with self._lock:
            self.total = total
            if self._bar is not None and self._bar_total != total:
                self._close_bar()
                self._open_bar()

    def note(self, text: str) -> None:
        self.detail = text

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    # -- the indicator -------------------------------------------------------------------------

    def _count(self) -> str:
        return f" {self.done}/{self.total} {self.unit}s" if self.total else ""

    def _open_bar(self) -> None:
        try:
            from tqdm import tqdm
        except ImportError:  # tqdm is a dependency; a broken install still starts, with plain lines
            self._live = False
            return
        self._bar_total = self.total or None
        common = dict(file=sys.stderr, leave=False, mininterval=_TICK_S)
        if _terminal_width(sys.stderr):  # follow the window's width
            common["dynamic_ncols"] = True
        else:  # a terminal that reports no size (some containers' pseudo-terminals): tqdm would draw nothing
            common.update(ncols=80, nrows=24)
        if self._bar_total:
            self._bar = tqdm(total=self._bar_total, initial=self.done, desc=f"jaxinfer: {self.title}",
                             unit=f" {self.unit}", **common)
            self._bar.start_t -= self.elapsed  # its clock starts with the stage, not with the drawing
        else:  # no total: an indeterminate line, the spinner and the time so far in its description
            self._bar = tqdm(total=None, desc=self._spin_text(""), bar_format="{desc}", **common)

    def _spin_text(self, frame: str) -> str:
        return f"jaxinfer: {self.title} {frame} {self.elapsed:.1f}s" if frame else f"jaxinfer: {self.title} ..."

    def _close_bar(self) -> None:
        if self._bar is not None:
            try:
                self._bar.close()  # leave=False: the line is erased
            except (OSError, ValueError):
                pass
            self._bar = None

    def _tick(self) -> None:
        """The indicator's thread: redraws the live line, or writes the plain 'still running' lines."""
        frames = _spinner_frames()
        if self._live:
            if self._stop.wait(SPINNER_DELAY_S):
                return
            i = 0
            while True:
                with self._lock:
                    if self._stop.is_set():
                        return
                    try:
                        if self._bar is None:
                            self._open_bar()
                            if not self._live:  # no tqdm
                                break
                        elif not self._bar_total:
                            self._bar.set_description_str(self._spin_text(frames[i % len(frames)]), refresh=False)
                        self._bar.refresh()  # the time so far moves even when the count does not
                    except (OSError, ValueError):  # stderr closed under us: stop drawing
                        return
                i += 1
                if self._stop.wait(_TICK_S):
                    return
        # not live: plain lines, the first after a second, then every REPEAT_LINE_S
        wait = FIRST_LINE_S
        while not self._stop.wait(wait):
            with self._lock:
                if self._stop.is_set():
                    return
                so_far = f" ({self.elapsed:.0f}s so far)" if self.elapsed >= REPEAT_LINE_S else ""
                _line(f"{self.title}{self._count()} ...{so_far}")
            wait = REPEAT_LINE_S

    def _close(self, failed: bool) -> None:
        with _running_lock:
            if self in _running:
                _running.remove(self)
        with self._lock:
            self._stop.set()
            self._close_bar()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join(timeout=1.0)
        detail = f" ({self.detail})" if self.detail else ""
        status = "failed after" if failed else ""
        text = f"{self.title}{self._count()}{detail} ... {status + ' ' if status else ''}{self.elapsed:.1f}s"
        log.info(text)
        if self._show:
            _line(text)


@contextlib.contextmanager
def stage(title: str, total: Optional[int] = None, unit: str = "item") -> Iterator[Stage]:
    """Run a stage of a start: shown while it runs (when stages are shown), logged with its duration when it ends."""
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
    if showing():
        _line(text)


def ready(t_start: float, what: str = "ready") -> None:
    """The closing line of a start: total time since ``t_start`` (a `time.perf_counter` value)."""
    text = f"{what} in {time.perf_counter() - t_start:.1f}s"
    log.info(text)
    if showing():
        _line(text)
