"""Ctrl-C while a stream of output is being made, for `jaxinfer generate` and `jaxinfer chat`: one mechanism.

`StopOnInterrupt` turns the first Ctrl-C into a request to stop that is seen the moment it arrives;
`PiecePump` reads the stream on a thread of its own, so the main thread waits for pieces and for that
request at once, and nothing that arrives after the interrupt is printed.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
from typing import Iterator, Optional


class StopOnInterrupt:
    """While an answer is being made (chat's, or generate's output), the first Ctrl-C asks it to stop; a second
    one interrupts at once (KeyboardInterrupt). Outside the main thread it does nothing.

    The first one never raises: a KeyboardInterrupt raised inside a JAX call can leave the runtime's threads
    in a state that aborts the process at exit, and one that lands in a gc callback (JAX's) is printed and
    lost; a flag, checked between pieces, ends the request cleanly instead.

    `requested` is exact: Python runs a signal handler only when the main thread next reaches a check
    point (after a blocking wait returns, a piece may already be on its way to the terminal), so the
    signal is also written to a wakeup pipe by the C-level handler the moment it arrives, on whatever
    thread, and `requested` reads that pipe. A piece is printed only after `requested` said no.
    """

    def __init__(self):
        self._signals = 0  # SIGINTs the Python handler has run for
        self._seen = False  # a SIGINT has arrived (handler or wakeup pipe)
        self._previous = None
        self._pipe: Optional[tuple] = None
        self._previous_fd: Optional[int] = None

    def _handler(self, signum, frame):
        self._signals += 1
        self._seen = True
        if self._signals > 1:
            raise KeyboardInterrupt

    @property
    def seen(self) -> bool:
        """Whether `requested` has found a Ctrl-C (a plain read: for the thread that makes the answer)."""
        return self._seen

    @property
    def requested(self) -> bool:
        if not self._seen and self._pipe is not None:
            try:
                data = os.read(self._pipe[0], 512)
            except (BlockingIOError, InterruptedError, OSError, TypeError):  # empty, or closed on the way out
                data = b""
            if bytes([signal.SIGINT]) in data:
                self._seen = True
        return self._seen

    def __enter__(self) -> "StopOnInterrupt":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
            try:
                r, w = os.pipe()
                os.set_blocking(r, False)
                os.set_blocking(w, False)
                self._previous_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
                self._pipe = (r, w)
            except (OSError, ValueError):  # no pipe: the handler's flag alone
                self._pipe = None
        return self

    def __exit__(self, *exc) -> None:
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_fd if self._previous_fd is not None else -1)
            pipe, self._pipe = self._pipe, None
            for fd in pipe:
                os.close(fd)
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


class _Failure:
    """An exception raised while an answer was being made, carried to the main thread."""

    def __init__(self, error: BaseException):
        self.error = error


_END = object()
POLL_S = 0.05  # how often the main thread looks for a Ctrl-C while it waits for the next piece


class PiecePump:
    """Reads a stream (chat's answer, generate's deltas) on a thread of its own, so that the main thread can wait
    for its pieces and notice a Ctrl-C (`StopOnInterrupt.requested`) at the same time: the stream is cut at the interrupt, whether a
    piece is on its way or the engine is still busy with the prompt."""

    def __init__(self, pieces: Iterator[str]):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._quit = False
        self.finished = False  # the answer ended by itself (or failed), not by the reader leaving
        self._thread = threading.Thread(target=self._run, args=(pieces,), name="jaxinfer-chat-answer", daemon=True)
        self._thread.start()

    def _run(self, pieces) -> None:
        try:
            for piece in pieces:
                if self._quit:
                    break
                self._q.put(piece)
        except BaseException as e:  # noqa: BLE001 - raised again on the main thread
            self._q.put(_Failure(e))
        finally:
            try:
                pieces.close()  # an unfinished request is aborted (local) or its call cancelled (server)
            except Exception:  # noqa: BLE001 - the answer is over either way
                pass
            self._q.put(_END)

    def pieces(self, stop: StopOnInterrupt) -> Iterator[str]:
        """The answer's pieces until it ends, fails (raised here) or a Ctrl-C (checked before each piece)."""
        while not stop.requested:
            try:
                item = self._q.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item is _END:
                self.finished = True
                return
            if isinstance(item, _Failure):
                self.finished = True
                raise item.error
            if stop.requested:  # arrived after the interrupt: never printed
                return
            yield item

    def close(self, timeout: float = 10.0) -> None:
        """Stop reading and wait (up to ``timeout``) for the answer's thread to close the stream."""
        self._quit = True
        self._thread.join(timeout)
