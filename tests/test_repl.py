"""``jaxinfer chat`` (jaxinfer.cli.repl): a conversation on a tiny random-weight model with a real tokenizer.

The model's tokenizer is character-level (one printable character per token) with a small chat template,
so a conversation's tokens can be counted and checked exactly: every request must carry the whole
conversation so far, rendered by the template. Most cases drive the loop in-process on one loaded model;
Ctrl-C is sent for real to a ``jaxinfer chat`` subprocess while it streams.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import CHAR_CHAT_TEMPLATE as CHAT_TEMPLATE

CMD = [sys.executable, "-m", "jaxinfer"]
# few programs: one batch row bucket for a conversation, two chunk lengths
ENGINE = {"page_size": 4, "num_pages": 160, "max_num_seqs": 2, "max_num_batched_tokens": 64,
          "batch_buckets": [1, 2], "chunk_buckets": [16, 64], "page_buckets": [8, 32, 128], "dtype": "float32",
          "name": "chat-test"}
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight model whose every token is one printable character, with a chat template."""
    import dataclasses

    import jax
    import numpy as np
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    import jaxinfer
    from conftest import TINY
    from jaxinfer.models import llama
    from jaxinfer.ops.spec import is_spec
    from jaxinfer.text.tokenizer import Tokenizer

    src = tmp_path_factory.mktemp("chat-tokenizer")
    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}  # printable ASCII: no id decodes to more or less
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    cfg = dataclasses.replace(TINY, vocab_size=len(vocab))
    rng = np.random.default_rng(0)

    def init(s):
        if s.init in ("ones", "zeros"):
            return (np.ones if s.init == "ones" else np.zeros)(s.shape, s.dtype)
        return (0.3 * rng.standard_normal(s.shape)).astype(s.dtype)

    params = jax.tree.map(init, llama.param_specs(cfg), is_leaf=is_spec)
    return jaxinfer.save_model(tmp_path_factory.mktemp("chat-models") / "tiny", cfg, params,
                               tokenizer=Tokenizer.from_dir(src))


@pytest.fixture(scope="module")
def engine_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat-engine") / "engine.json"
    path.write_text(json.dumps(ENGINE))
    return str(path)


def chat_args(model_dir, engine_json, *extra):
    from jaxinfer.cli.main import build_parser

    return build_parser().parse_args(["chat", "--model", str(model_dir), "--engine-config", engine_json,
                                      "--max-tokens", str(MAX_TOKENS), "--temperature", "0", *extra])


@pytest.fixture(scope="module")
def llm(tiny_model_dir, engine_json):
    import jaxinfer

    with jaxinfer.LLM(str(tiny_model_dir), engine_config=engine_json, max_model_len=160) as m:
        yield m


def new_chat(llm, model_dir, engine_json, *extra, stdin=""):
    from jaxinfer.cli.repl import Chat, LocalBackend, check_chat_args

    args = chat_args(model_dir, engine_json, *extra)
    backend = LocalBackend(llm, args, check_chat_args(args))
    out, err = io.StringIO(), io.StringIO()
    chat = Chat(backend, stdin=io.StringIO(stdin), stdout=out, stderr=err, system=args.system, interactive=False)
    return chat, out, err


def prompt_of(llm, messages) -> list:
    """What the model must be sent for ``messages``: the template's rendering, tokenized."""
    return llm.processor.tokenize(messages=messages, fit_context=False).ids


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_each_request_carries_the_whole_conversation_and_answers_stream_to_stdout(llm, tiny_model_dir, engine_json):
    chat, out, err = new_chat(llm, tiny_model_dir, engine_json, stdin="hello there\nand then?\n")
    assert chat.run() == 0  # end of input: a clean exit
    first, second = chat.answers
    assert len(first.text) == len(second.text) == MAX_TOKENS  # one character per token, no end-of-sequence
    assert out.getvalue() == f"{first.text}\n{second.text}\n"  # the answers alone, one per line
    limit = f"(the answer stopped at the {MAX_TOKENS}-token limit: --max-tokens)"
    assert err.getvalue() == f"{limit}\n{limit}\n"  # each answer ended at --max-tokens, and says so
    want = prompt_of(llm, [user("hello there"), assistant(first.text), user("and then?")])
    assert chat.backend.last_request.prompt_ids == want  # the first exchange is in the second request
    assert second.prompt_tokens == len(want) > first.prompt_tokens + MAX_TOKENS
    assert chat.history == [user("hello there"), assistant(first.text), user("and then?"), assistant(second.text)]


def test_the_same_conversation_gives_the_same_answers_as_the_library(llm, tiny_model_dir, engine_json):
    import jaxinfer

    chat, out, _ = new_chat(llm, tiny_model_dir, engine_json, stdin="hello there\nand then?\n")
    chat.run()
    greedy = jaxinfer.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    a1 = llm.chat([user("hello there")], greedy)[0].outputs[0].text
    a2 = llm.chat([user("hello there"), assistant(a1), user("and then?")], greedy)[0].outputs[0].text
    assert [a.text for a in chat.answers] == [a1, a2]


def test_clear_forgets_the_conversation_and_keeps_the_system_prompt(llm, tiny_model_dir, engine_json):
    chat, out, err = new_chat(llm, tiny_model_dir, engine_json, "--system", "be brief")
    system = {"role": "system", "content": "be brief"}
    assert chat.handle("hello") is None
    assert chat.backend.last_request.prompt_ids == prompt_of(llm, [system, user("hello")])
    assert chat.handle("/clear") is None
    assert chat.history == [] and "conversation cleared; the system prompt stays" in err.getvalue()
    chat.handle("again")
    assert chat.backend.last_request.prompt_ids == prompt_of(llm, [system, user("again")])


def test_system_sets_and_removes_the_system_prompt_and_the_conversation_goes_on(llm, tiny_model_dir, engine_json):
    chat, out, err = new_chat(llm, tiny_model_dir, engine_json)
    chat.handle("/system talk like a pirate")
    chat.handle("hi")
    a1 = chat.answers[-1].text
    system = {"role": "system", "content": "talk like a pirate"}
    assert chat.backend.last_request.prompt_ids == prompt_of(llm, [system, user("hi")])
    chat.handle("/system")  # alone: removed
    chat.handle("more")
    assert chat.backend.last_request.prompt_ids == prompt_of(llm, [user("hi"), assistant(a1), user("more")])
    limit = f"(the answer stopped at the {MAX_TOKENS}-token limit: --max-tokens)"
    assert err.getvalue().splitlines() == ["(system prompt set)", limit, "(system prompt removed)", limit]


def test_exit_quit_and_end_of_input_leave_with_status_zero(llm, tiny_model_dir, engine_json):
    for leave in ("/exit", "/quit", "/EXIT"):
        chat, out, _ = new_chat(llm, tiny_model_dir, engine_json, stdin=f"hi\n{leave}\nnever sent\n")
        assert chat.run() == 0
        assert len(chat.answers) == 1 and chat.stdin.readline() == "never sent\n"  # nothing read after /exit
    chat, out, _ = new_chat(llm, tiny_model_dir, engine_json, stdin="")  # nothing at all
    assert chat.run() == 0 and out.getvalue() == "" and chat.answers == []


def test_help_blank_lines_unknown_commands_and_a_double_slash(llm, tiny_model_dir, engine_json):
    chat, out, err = new_chat(llm, tiny_model_dir, engine_json, stdin="/help\n\n   \n/frobnicate\n//etc/hosts\n")
    assert chat.run() == 0
    text = err.getvalue()
    for word in ("/exit", "/clear", "/system TEXT", "/help", "Ctrl-C"):
        assert word in text
    assert "unknown command /frobnicate; /help lists them" in text
    assert chat.history[0] == user("/etc/hosts") and len(chat.answers) == 1  # blank lines send nothing


def test_a_conversation_that_no_longer_fits_says_so_in_one_line_and_suggests_clear(llm, tiny_model_dir,
                                                                                     engine_json):
    chat, out, err = new_chat(llm, tiny_model_dir, engine_json)
    chat.handle("x" * 100)
    history = list(chat.history)
    assert len(history) == 2
    chat.handle("y" * 60)  # 100 + 60 characters and the template: over the 160-token context
    assert chat.history == history  # not sent, not kept
    limit, line = err.getvalue().splitlines()  # the first answer's --max-tokens note, then the refusal
    assert limit == f"(the answer stopped at the {MAX_TOKENS}-token limit: --max-tokens)"
    n = len(prompt_of(llm, [*history, user("y" * 60)]))
    assert line == f"the conversation is {n} tokens with this message and the context holds 160 (max_model_len): " \
                   "/clear to start over"
    assert len(chat.answers) == 1  # no request was made
    chat.handle("/clear")
    chat.handle("y" * 60)
    assert len(chat.answers) == 2 and chat.history[0] == user("y" * 60)


def test_an_answer_shrinks_to_the_room_left_and_says_the_context_is_full(llm, tiny_model_dir, engine_json):
    chat, out, err = new_chat(llm, tiny_model_dir, engine_json, "--max-tokens", "50")
    chat.handle("z" * 130)  # 150 tokens with the template: room for 10
    answer = chat.answers[-1]
    assert answer.prompt_tokens + answer.max_tokens == 160 and answer.max_tokens < 50
    assert len(answer.text) == answer.max_tokens and answer.finish_reason == "length"
    assert "(the answer filled the context (160 tokens): /clear to start over)" in err.getvalue()


def test_ctrl_c_in_process_aborts_the_request_frees_its_pages_and_keeps_the_partial_answer(llm, tiny_model_dir,
                                                                                          engine_json):
    """A real SIGINT once two pieces of an answer are on the terminal, with a third already made when it lands
    (deterministically, where a terminal's would land anywhere: the pseudo-terminal test below does that): the
    third is never printed, the request is aborted and every KV page is free again; the two pieces that were
    printed stay in the conversation."""
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN under nohup / a shell's `&`
    chat, out, err = new_chat(llm, tiny_model_dir, engine_json, "--max-tokens", "100")
    real = chat.backend.answer

    def answer_then_ctrl_c(messages, max_tokens, answer, stop):
        pieces = real(messages, max_tokens, answer, stop)
        try:
            for i, piece in enumerate(pieces):
                if i == 2:
                    deadline = time.time() + 60
                    while len(out.getvalue()) < 2 and time.time() < deadline:  # two pieces printed
                        time.sleep(0.002)
                    signal.raise_signal(signal.SIGINT)
                    while not stop.seen and time.time() < deadline:  # the chat has noticed it
                        time.sleep(0.002)
                yield piece  # after the interrupt: must not reach the terminal
        finally:
            pieces.close()

    chat.backend.answer = answer_then_ctrl_c
    chat.handle("go on")
    stopped = chat.answers[-1]
    assert len(stopped.text) == 2 and stopped.max_tokens == 100 and stopped.finish_reason is None
    assert out.getvalue() == stopped.text + "\n"
    assert chat.history == [user("go on"), assistant(stopped.text)]  # the partial answer is kept
    assert "(stopped; what was said stays in the conversation)" in err.getvalue()
    assert llm.wait_idle(10)
    llm.engine.allocator.check_all_free()  # the aborted request's pages are back
    assert signal.getsignal(signal.SIGINT) is before  # restored after the answer
    assert signal.set_wakeup_fd(-1) == -1  # and no wakeup pipe is left behind
    chat.backend.answer = real
    chat.handle("after")  # and the next turn runs normally, on the conversation so far
    assert len(chat.answers[-1].text) == 100
    assert chat.backend.last_request.prompt_ids == prompt_of(llm, [user("go on"), assistant(stopped.text),
                                                                   user("after")])


def test_ctrl_c_before_the_first_word_drops_the_message(llm, tiny_model_dir, engine_json):
    chat, out, err = new_chat(llm, tiny_model_dir, engine_json)
    real = chat.backend.answer

    def ctrl_c_first(*args):
        signal.raise_signal(signal.SIGINT)  # while the request is being made
        yield from real(*args)

    chat.backend.answer = ctrl_c_first
    chat.handle("hello")
    assert chat.history == [] and out.getvalue() == ""
    assert "(stopped before the answer began; the message was dropped)" in err.getvalue()
    assert llm.wait_idle(10)
    llm.engine.allocator.check_all_free()


def test_warm_compiles_every_program_a_turn_can_run_and_no_turn_compiles_after_it(llm, tiny_model_dir,
                                                                                  engine_json):
    """Before the first prompt `LocalBackend.warm` makes the programs of one request alone: every prompt length
    (a longer one after /system, a long message, the new part of a conversation after the prefix cache) and
    every decode step; the turns then compile nothing."""
    chat, out, err = new_chat(llm, tiny_model_dir, engine_json, "--max-tokens", "40")
    backend = chat.backend
    keys = set(backend.chat_program_keys())
    for n in range(1, llm.max_model_len):
        assert set(llm.engine.request_program_keys(n, llm.max_model_len - n)) <= keys, n
    assert len(keys) < len(llm.engine.program_keys())  # one request's programs, not every batch size's
    backend.warm()
    table = llm.engine.runner.programs
    assert [state for _, state in table.status(sorted(keys))] == ["ready"] * len(keys)
    ready = table.num_ready
    for line in ("hi", "/system be a pirate", "x" * 20, "/clear", "y" * 3):
        chat.handle(line)
    assert len(chat.answers) == 3 and table.num_ready == ready, err.getvalue()  # three turns, no program made


def test_bad_flags_are_refused_before_the_model_loads(capsys):
    import jaxinfer.cli.main as cli

    assert cli.main(["chat", "--top-p", "1.5", "--model", "/nonexistent"]) == 2
    assert "top_p must be in (0, 1], got 1.5" in capsys.readouterr().err
    assert cli.main(["chat", "--server", "localhost:1", "--model", "x"]) == 2
    assert "--model: with --server the model and the engine are the server's" in capsys.readouterr().err
    assert cli.main(["chat", "--no-chat"]) == 2  # chat has no --chat/--no-chat: it always chats
    assert "unrecognized arguments: --no-chat (see 'jaxinfer chat --help')" in capsys.readouterr().err


def test_local_and_server_chats_give_the_same_answers(llm, tiny_model_dir, engine_json, monkeypatch, capsys):
    """``chat --server`` holds the same conversation on a running server as ``chat`` does here."""
    import jaxinfer.cli.main as cli
    from jaxinfer.server import ServerConfig, ServerThread

    lines = "hello there\n/system be brief\nand then?\n"
    chat, out, _ = new_chat(llm, tiny_model_dir, engine_json, stdin=lines)
    assert chat.run() == 0
    with ServerThread(llm, ServerConfig(port=0)) as srv:
        monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
        code = cli.main(["chat", "--server", srv.address, "--max-tokens", str(MAX_TOKENS), "--temperature", "0",
                         "--timeout", "60"])
        remote_out, remote_err = capsys.readouterr()
    assert code == 0, remote_err
    assert remote_out == out.getvalue()
    limit = f"(the answer stopped at the {MAX_TOKENS}-token limit: --max-tokens)\n"
    assert remote_err == f"{limit}(system prompt set)\n{limit}"
    assert llm.wait_idle(10)
    llm.engine.allocator.check_all_free()


def test_an_unreachable_server_is_one_line_and_status_1(monkeypatch, capsys):
    import jaxinfer.cli.main as cli

    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert cli.main(["chat", "--server", "127.0.0.1:1", "--timeout", "10"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("jaxinfer: error: no server answered at 127.0.0.1:1: "), err


def test_chat_refuses_a_model_without_a_chat_template(tmp_path, capsys):
    import jaxinfer
    from conftest import TINY, tiny_params
    import jaxinfer.cli.main as cli

    jaxinfer.save_model(tmp_path / "bare", TINY, tiny_params())  # no tokenizer, so no template
    assert cli.main(["chat", "--model", str(tmp_path / "bare"), "--engine-config", "cpu", "--max-model-len", "32",
                     "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no chat template, which 'jaxinfer chat' needs" in err, err


@pytest.mark.slow
def test_ctrl_c_stops_the_streaming_answer_and_the_conversation_goes_on(tiny_model_dir, engine_json):
    """A real ``jaxinfer chat`` process: SIGINT while the first answer streams stops it (the request is aborted),
    the second line is still answered, and end of input exits 0."""
    argv = ["chat", "--model", str(tiny_model_dir), "--engine-config", engine_json, "--max-model-len", "512",
            "--max-tokens", "400", "--temperature", "0", "--quiet"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with tempfile.TemporaryFile("w+") as f:  # the child keeps its own handle on the file
        f.write("tell me a long story\nand a short one\n")
        f.seek(0)
        p = subprocess.Popen(CMD + argv, stdin=f, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = p.stdout.read(1)  # blocks until the first answer streams
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    out = first + out
    assert p.returncode == 0, err
    assert "(stopped; what was said stays in the conversation)" in err, err
    answers = out.split("\n")
    assert len(answers) == 3 and answers[2] == "", out  # two answers, each ended by a newline
    stopped, second = answers[0], answers[1]
    assert 1 <= len(stopped) < 400  # cut short
    assert len(second) > len(stopped) or len(second) == 400 or "filled the context" in err  # answered in full
    assert "Traceback" not in err


def _read_until(fd: int, needle: bytes, buf: bytearray, timeout: float = 120.0) -> bytes:
    """Read the terminal until ``needle`` appears in what came after ``buf``'s current end; returns that part."""
    import select
    import time

    start = len(buf)
    deadline = time.time() + timeout
    while needle not in buf[start:]:
        left = deadline - time.time()
        if left <= 0:
            raise AssertionError(f"no {needle!r} on the terminal after {timeout}s: {bytes(buf[start:])!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                data = os.read(fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                data = b""
            if not data:
                raise AssertionError(f"the terminal closed before {needle!r}: {bytes(buf[start:])!r}")
            buf += data
    return bytes(buf[start:])


# The child runs with the pty as its controlling terminal and SIGINT at its default, as in a person's
# terminal (a test run under nohup, or started with a shell's `&`, ignores SIGINT, and exec keeps that).
TAKE_TERMINAL = ("import fcntl, os, signal, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                 "signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_on_a_terminal_it_prompts_and_ctrl_c_at_the_prompt_clears_the_line(tiny_model_dir, engine_json):
    """``jaxinfer chat`` on a real (pseudo-)terminal: a banner, the >>> prompt with readline, answers; Ctrl-C at
    the prompt clears the line and says how to leave, a second one leaves with status 0 (Ctrl-D: the test
    below)."""
    leave = "ctrl-c twice"
    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))

    # the child runs in its own session with the pty as its controlling terminal, so ^C is its SIGINT
    # (set by a small exec wrapper: a preexec_fn would fork this multithreaded JAX process)
    take_terminal = TAKE_TERMINAL
    argv = ["chat", "--model", str(tiny_model_dir), "--engine-config", engine_json, "--max-tokens", "5",
            "--temperature", "0", "--quiet"]
    p = subprocess.Popen([sys.executable, "-c", take_terminal, "-m", "jaxinfer", *argv], stdin=slave, stdout=slave,
                         stderr=slave, start_new_session=True, env={**os.environ, "JAX_PLATFORMS": "cpu", "TERM": "dumb"})
    os.close(slave)

    def ctrl_c():
        # after a person's pause: for the instant readline redraws the line it blocks SIGINT on the main thread,
        # and a Ctrl-C that lands then goes to another thread and waits for the next key (no person is that quick)
        time.sleep(0.3)
        os.write(master, b"\x03")

    buf = bytearray()
    try:
        banner = _read_until(master, b">>> ", buf)
        assert b"chatting with tiny" in banner and b"/help" in banner
        os.write(master, b"hello\r")
        turn = _read_until(master, b">>> ", buf)
        answer = turn.split(b"hello\r\n", 1)[1].split(b"\r\n")[0]
        assert len(answer) == 5, turn  # the answer, streamed on its own line
        os.write(master, b"half a line")
        _read_until(master, b"half a line", buf)
        ctrl_c()  # clears "half a line"
        after = _read_until(master, b">>> ", buf)
        assert b"(Ctrl-C again, Ctrl-D or /exit to leave)" in after
        time.sleep(0.5)
        assert p.poll() is None  # one Ctrl-C does not leave
        os.write(master, b"/help\r")  # and the line was cleared: /help alone is run
        assert b"/system TEXT" in _read_until(master, b">>> ", buf)
        if leave == "ctrl-c twice":
            ctrl_c()
            _read_until(master, b"(Ctrl-C again", buf)
            ctrl_c()
        else:
            os.write(master, b"\x04")  # Ctrl-D on an empty line: end of input
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)
    assert b"Traceback" not in buf


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_on_a_terminal_only_prompts_and_answers_show_and_ctrl_c_cuts_the_answer_where_it_is(tiny_model_dir,
                                                                                             engine_json):
    """``jaxinfer chat`` on a pseudo-terminal with its start-up progress shown (no --quiet): once the first prompt
    is up, the terminal shows only prompts, what is typed, answers and the chat's own notes (no engine line, no
    compile: before /system and after it); Ctrl-C in the middle of an answer cuts it: nothing follows the
    terminal's ^C but the end of the line and the chat's note; Ctrl-D then leaves with status 0."""
    import fcntl
    import re
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    attrs = termios.tcgetattr(slave)
    attrs[3] |= termios.ECHO | termios.ECHOCTL | termios.ISIG  # Ctrl-C shows as ^C where it lands
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    take_terminal = TAKE_TERMINAL
    n = 300
    argv = ["chat", "--model", str(tiny_model_dir), "--engine-config", engine_json, "--max-model-len", "512",
            "--max-tokens", str(n), "--temperature", "0"]
    p = subprocess.Popen([sys.executable, "-c", take_terminal, "-m", "jaxinfer", *argv], stdin=slave, stdout=slave,
                         stderr=slave, start_new_session=True, env={**os.environ, "JAX_PLATFORMS": "cpu", "TERM": "dumb"})
    os.close(slave)
    limit = f"(the answer stopped at the {n}-token limit: --max-tokens)".encode()

    def answered(line: bytes, buf: bytearray) -> bytes:
        """Type ``line``; the answer, checked to be all that came between it and the next prompt."""
        os.write(master, line + b"\r")
        turn = _read_until(master, b">>> ", buf)
        head, sep, rest = turn.partition(line + b"\r\n")
        assert sep and b"jaxinfer" not in head, turn
        answer, sep, tail = rest.partition(b"\r\n\r\n")  # the answer's line, ended by a blank one
        assert sep and len(answer) == n and re.fullmatch(rb"[ -~]+", answer), turn  # all of it, nothing else
        assert tail == limit + b"\r\n>>> ", turn  # then only the chat's note and the prompt
        return answer

    buf = bytearray()
    try:
        start = _read_until(master, b">>> ", buf)  # the start: progress lines are fine here
        assert b"chatting with tiny" in start and b"/help" in start, start
        answered(b"hi", buf)
        os.write(master, b"/system be brief\r")
        assert _read_until(master, b">>> ", buf).endswith(b"/system be brief\r\n(system prompt set)\r\n>>> ")
        os.write(master, b"/clear\r")
        _read_until(master, b">>> ", buf)
        answered(b"hello there", buf)  # a longer prompt (the system prompt's): no compile, no engine line
        os.write(master, b"/clear\r")
        _read_until(master, b">>> ", buf)
        os.write(master, b"go on\r")
        _read_until(master, b"go on\r\n", buf)
        mark = len(buf)
        first = os.read(master, 1)  # the answer's first character: it has begun
        os.write(master, b"\x03")  # Ctrl-C at once, while the rest streams
        buf += first
        _read_until(master, b">>> ", buf)
        turn = bytes(buf[mark:])
        cut = turn.rindex(b"^C")  # where the terminal shows the interrupt
        assert turn[cut:] == b"^C\r\n\r\n(stopped; what was said stays in the conversation)\r\n>>> ", turn
        assert 0 < cut < n and re.fullmatch(rb"[ -~]+", turn[:cut]), turn  # cut short, after it had begun
        os.write(master, b"\x04")  # Ctrl-D at the prompt: leave
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)
    after_start = bytes(buf[len(start):])
    assert b"jaxinfer:" not in after_start and b"compiling" not in after_start and b"loading" not in after_start
    assert b"Traceback" not in buf
