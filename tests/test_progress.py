"""Start-up progress (jaxinfer.progress): a long stage shows that it is running before it ends.

On a terminal a stage draws a redrawn line while it runs (a spinner when it has no total, a bar when it
has one); on a log (--verbose to a file) plain lines, never carriage-return frames; turned off
(--quiet, ``LLM(progress=False)``) no output and no thread. The terminal case runs for real on a
pseudo-terminal. (The library's default rule and ``LLM(progress=...)``: tests/test_startup_health.py.)
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import threading
import time

import pytest

from jaxinfer import progress


class _Captured:
    """What has been written to (pytest's captured) stderr so far."""

    def __init__(self, capsys):
        self._capsys = capsys
        self._text = ""

    def getvalue(self) -> str:
        self._text += self._capsys.readouterr().err
        return self._text


@pytest.fixture
def stderr(capsys, monkeypatch):
    """stderr so far; the progress setting restored after the test."""
    monkeypatch.setattr(progress, "_show", progress._show)
    monkeypatch.setattr(progress, "_live", progress._live)
    return _Captured(capsys)


def test_live_stage_without_a_total_spins_while_it_runs_then_leaves_one_line(stderr):
    progress.configure(show=True, live=True)
    with progress.stage("building the kernel") as s:
        time.sleep(1.3)
        during = stderr.getvalue()
        assert s.elapsed > 1.0
    after = stderr.getvalue()
    # before the stage ended: redrawn frames of its title with a spinner and the time so far
    frames = [f for f in during.split("\r") if "jaxinfer: building the kernel" in f]
    assert len(frames) >= 3, during
    drawn = [m.groups() for f in frames for m in [re.search(r"building the kernel (\S) (\d+\.\d)s", f)] if m]
    assert len({spin for spin, _ in drawn}) >= 2, frames  # it turns
    assert float(drawn[-1][1]) >= 1.0 > float(drawn[0][1]), frames  # and counts the time since the stage began
    # after: the closing line with the duration, the live line erased
    assert after.endswith("\n") and re.search(r"jaxinfer: building the kernel \.\.\. 1\.\ds\n$", after), after


def test_live_stage_with_a_total_draws_a_bar_that_moves_without_updates(stderr):
    progress.configure(show=True, live=True)
    with progress.stage("compiling programs", total=3, unit="program") as s:
        s.update()
        time.sleep(1.2)  # one long compile: no update, but the bar's clock goes on
        during = stderr.getvalue()
        s.update(2)
    assert "1/3" in during and "00:01" in during, during
    assert stderr.getvalue().endswith("compiling programs 3/3 programs ... " + stderr.getvalue().split("... ")[-1])


def test_live_spinner_turns_into_a_bar_when_the_total_is_known(stderr):
    progress.configure(show=True, live=True)
    with progress.stage("converting tiny", unit="tensor") as s:
        time.sleep(0.5)
        s.set_total(4)
        for _ in range(4):
            s.update()
        time.sleep(0.3)
        during = stderr.getvalue()
    assert "converting tiny" in during and "4/4" in during, during
    assert "converting tiny 4/4 tensors ... " in stderr.getvalue().splitlines()[-1]


def test_quick_stages_draw_nothing_but_their_line(stderr):
    progress.configure(show=True, live=True)
    with progress.stage("resolving model x"):
        pass
    assert stderr.getvalue() == "jaxinfer: resolving model x ... 0.0s\n"


def test_on_a_log_a_long_stage_writes_a_plain_line_once_it_has_run_a_second(stderr):
    progress.configure(show=True, live=False)
    with progress.stage("compiling programs", total=2, unit="program") as s:
        s.update()
        time.sleep(1.3)
        during = stderr.getvalue()
        s.update()
    assert during == "jaxinfer: compiling programs 1/2 programs ...\n"
    lines = stderr.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("jaxinfer: compiling programs 2/2 programs ... 1.")
    assert "\r" not in stderr.getvalue()


def test_turned_off_it_writes_nothing_and_starts_no_thread(stderr):
    progress.configure(show=False)
    before = threading.active_count()
    with progress.stage("restoring x"):
        assert threading.active_count() == before
        time.sleep(0.3)
    assert stderr.getvalue() == ""


def test_current_names_the_stage_started_last_among_those_running_in_any_thread(stderr):
    progress.configure(show=False)
    assert progress.current() is None
    started, release = threading.Event(), threading.Event()

    def kernel_build():
        with progress.stage("building the CPU matmul kernel"):
            started.set()
            release.wait(10)

    t = threading.Thread(target=kernel_build)
    with progress.stage("restoring tiny"):
        assert progress.current()["stage"] == "restoring tiny"
        t.start()
        started.wait(10)
        assert progress.current()["stage"] == "building the CPU matmul kernel"  # started last
        with progress.stage("compiling programs", total=3, unit="program") as s:
            s.update(2)
            now = progress.current()
            assert (now["stage"], now["done"], now["total"]) == ("compiling programs", 2, 3)
        release.set()
        t.join(10)
        assert progress.current()["stage"] == "restoring tiny" and "total" not in progress.current()
    assert progress.current() is None
    with pytest.raises(RuntimeError):
        with progress.stage("converting x"):
            raise RuntimeError("bad file")
    assert progress.current() is None  # a failed stage is no longer running either


def test_a_failed_stage_stops_its_indicator_and_says_so(stderr):
    progress.configure(show=True, live=True)
    with pytest.raises(RuntimeError):
        with progress.stage("building the kernel"):
            time.sleep(0.4)
            raise RuntimeError("no compiler")
    time.sleep(0.3)
    text = stderr.getvalue()
    assert text.splitlines()[-1].startswith("jaxinfer: building the kernel ... failed after 0.")
    assert text.endswith("\n")  # nothing drawn after the closing line
    assert not any(t.name == "jaxinfer-progress" for t in threading.enumerate())


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
@pytest.mark.parametrize("columns", [100, 0], ids=["sized", "unsized"])
def test_on_a_real_terminal_the_cli_setting_shows_a_running_stage_before_it_ends(columns):
    """configure(show=True), as the CLI does on a terminal: a pty is detected as one, and the stage draws."""
    fcntl = pytest.importorskip("fcntl")
    termios = pytest.importorskip("termios")
    script = (
        "import sys, time\n"
        "from jaxinfer import progress\n"
        "progress.configure(show=True)\n"
        "with progress.stage('building the CPU attention kernel (once per machine)'):\n"
        "    time.sleep(1.5)\n"
        "    sys.stderr.write('<still running>\\n'); sys.stderr.flush()\n"
    )
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24 if columns else 0, columns, 0, 0))
    # 0: a terminal that reports no size (some containers' pseudo-terminals)
    try:
        p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=slave, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        assert p.wait(timeout=60) == 0
    finally:
        os.close(master)
    text = b"".join(chunks).decode("utf-8", "replace")
    before, marker, after = text.partition("<still running>")
    assert marker, text
    assert "building the CPU attention kernel (once per machine)" in before and "\r" in before, before
    assert re.search(r"building the CPU attention kernel \(once per machine\) \.\.\. 1\.\ds", after), after
