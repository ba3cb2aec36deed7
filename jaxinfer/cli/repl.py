"""``jaxinfer chat``: a conversation with the model, one line at a time, as llama-cli and ollama start.

    $ jaxinfer chat
    >>> What is a KV cache?
    (the answer streams here)
    >>> /system Answer in one sentence.
    >>> /clear

Each line the user types is sent with the whole conversation so far (and the
system prompt) through the model's chat template; the answer streams to stdout
as it is made and joins the conversation. The model is loaded here, with the
same model, engine and sampling flags and defaults as ``jaxinfer generate``, or
reached with ``--server HOST:PORT`` (a running ``jaxinfer serve``, over gRPC).

Commands: ``/exit`` (or ``/quit``), ``/clear`` (forget the conversation, keep
the system prompt), ``/system TEXT`` (set the system prompt; without TEXT,
remove it), ``/help``. A line that starts with ``//`` is sent with one slash
less.

Before the first prompt the model's chat programs are made (compiled, or loaded
from the program cache), with the start-up's progress: those of one request
alone, for every prompt length and decode step, so that no turn waits for a
compile (a longer prompt after ``/system`` included). Once the prompt is shown
the engine's progress lines and INFO logging stay out of the conversation
(``--verbose`` keeps them): the terminal shows prompts, answers and the chat's
notes.

Ctrl-C while an answer streams stops that answer where it is: the answer is read
on a thread of its own while the main thread waits for its pieces and for the
interrupt (noticed through a wakeup pipe the moment it arrives), so no piece is
printed after it; the request is aborted at once (its KV pages are freed at the
engine's next step) and what was already printed stays in the conversation, so
that the turns keep alternating; an answer stopped before its first word is
dropped with its question. Ctrl-C at the prompt
clears the line; a second one in a row, Ctrl-D (end of input) or ``/exit``
leaves with status 0.

Without a terminal on stdin (``printf 'Hi\\nWhat is 2+2?\\n' | jaxinfer chat``)
there is no prompt and no line editing: each line is answered in turn, the
answers alone go to stdout (one per line, as they stream), and end of input ends
the conversation. Notes (a stopped answer, a full context, a command's effect)
go to stderr.

Each answer may use up to ``--max-tokens`` tokens, fewer when the context has
less room left; an answer that stops at either limit says so on stderr. When
the conversation no longer fits in the context at all, the line is not sent:
one line on stderr says so and suggests ``/clear``.

Imports: ``jaxinfer chat`` checks its flags and shows its first progress line before
anything slow is imported, so the engine (`jaxinfer.engine`, `jaxinfer.llm`: JAX) and the
gRPC client (`jaxinfer.server`: grpc) are imported inside the function that uses them.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, TextIO

from jaxinfer import progress
from jaxinfer.cli.flags import (
    UsageError,
    check_engine_flags,
    generate_sampling,
    load_llm,
    one_line,
    print_logprobs,
    refuse_local_flags,
    sampling_overrides,
)
from jaxinfer.cli.interrupt import PiecePump, StopOnInterrupt
from jaxinfer.cli.serve import server_error_message
from jaxinfer.sampling_params import SamplingParams

PROMPT = ">>> "
EXIT_SERVER_ERROR = 1

HELP = """commands:
  /exit, /quit    leave (also Ctrl-D, or Ctrl-C twice at the prompt)
  /clear          forget the conversation (the system prompt stays)
  /system TEXT    set the system prompt (/system alone removes it); the conversation goes on
  /help           this list
  //TEXT          send /TEXT as a message
Ctrl-C while an answer streams stops it (what was said stays in the conversation)."""


@dataclass
class Answer:
    """What one turn produced."""

    text: str = ""
    finish_reason: Optional[str] = None  # "stop" | "length" | ... ; None when stopped by the user
    max_tokens: int = 0  # what the request was allowed
    prompt_tokens: int = 0
    logprobs: Optional[list] = None
    token_text: Callable[[int], Optional[str]] = field(default=lambda i: None)


# --------------------------------------------------------------------------- #
# Where answers come from: the model loaded here, or a server
# --------------------------------------------------------------------------- #


class LocalBackend:
    """The conversation on a model loaded in this process (`jaxinfer.LLM`)."""

    def __init__(self, llm, args: argparse.Namespace, overrides: dict):
        self.llm = llm
        self.name = llm.model_name
        self.max_model_len = llm.max_model_len
        self.chat_template_kwargs = getattr(args, "chat_template_kwargs", None)
        kw = generate_sampling(overrides, llm.generation_defaults.temperature)
        self.max_tokens = kw.pop("max_tokens")
        self.params = llm.get_default_sampling_params().clone(**kw)
        self.logprobs = self.params.logprobs is not None
        if not llm.processor.has_chat_template:
            raise UsageError(f"model {self.name!r} has no chat template, which 'jaxinfer chat' needs; "
                             "use 'jaxinfer generate --no-chat'.")
        self.last_request = None  # the last turn's Request (its prompt_ids: the whole conversation)
        self._stream = None  # the last turn's RequestStream

    def count(self, messages: list) -> int:
        """The conversation's length in tokens, as the next request would send it."""
        return len(self.llm.processor.tokenize(messages=messages, chat_template_kwargs=self.chat_template_kwargs,
                                               fit_context=False).ids)

    def chat_program_keys(self) -> list:
        """Every program a turn of this chat can run: the steps of one request alone (its decode steps and
        prefill chunks of any length, a conversation's new part after the prefix cache too), with
        speculative decoding's verify rows where they apply."""
        engine = self.llm.engine
        table = engine.runner.programs
        keys = engine.program_keys()
        alone = {(k.batch, k.tokens) for k in (table.step_key(t, 1, 1) for t in sorted({k.tokens for k in keys}))}
        return [k for k in keys if (k.batch, k.tokens) in alone]

    def warm(self) -> int:
        """Compile (or load from the program cache) `chat_program_keys` now, with progress, so that no turn
        (a longer prompt after ``/system``, a long message) waits for a compile; returns how many."""
        engine = self.llm.engine
        n = engine.runner.warmup(self.chat_program_keys(), complete=False)
        speculator = getattr(engine, "speculator", None)
        if speculator is not None:
            n += speculator.warmup()
        return n

    def answer(self, messages: list, max_tokens: int, answer: Answer, stop: StopOnInterrupt) -> Iterator[str]:
        llm = self.llm
        req = llm.make_request(None, self.params.clone(max_tokens=max_tokens), messages=messages,
                               chat_template_kwargs=self.chat_template_kwargs)
        self.last_request = req
        answer.max_tokens, answer.prompt_tokens = req.max_tokens, len(req.prompt_ids)
        # compile (or load) what this request needs that `warm` did not (nothing, normally); not the request's time
        t0 = time.perf_counter()
        llm.engine.runner.warmup(llm.engine.request_program_keys(len(req.prompt_ids), req.max_tokens),
                                 complete=False)
        req.metrics.arrival_time += time.perf_counter() - t0
        if stop.seen:
            return
        stream = self._stream = llm.submit(req)
        if stop.seen:  # stopped while it was being submitted (`cancel` may have found no stream yet)
            stream.abort()
        try:
            for d in stream:
                if d.output is not None:
                    comp = d.output.outputs[0]
                    answer.finish_reason = comp.finish_reason
                    answer.logprobs = comp.logprobs
                if d.text:
                    yield d.text
        finally:
            if stream.output is None:
                stream.abort()  # an unfinished request is aborted: its KV pages come back at the next step
        tok = llm.tokenizer
        answer.token_text = lambda i: tok.decode([i], skip_special_tokens=False) if tok is not None else None

    cancel_wait_s = 10.0  # an aborted answer's stream ends at the engine's next step: wait for it

    def cancel(self) -> None:
        """Abort the answer being made (any thread): the engine drops it at its next step."""
        stream = self._stream
        if stream is not None:
            stream.abort()

    def close(self) -> None:
        self.llm.close()


class ServerBackend:
    """The conversation on a running ``jaxinfer serve`` (gRPC), with the defaults of local chat."""

    def __init__(self, args: argparse.Namespace, overrides: dict, token: Optional[str]):
        from jaxinfer.server.client import Client  # lazy: grpc (see the module docstring)

        self.address = args.server
        self.timeout = getattr(args, "timeout", None)
        self.chat_template_kwargs = getattr(args, "chat_template_kwargs", None)
        self.client = Client(args.server, token=token, tls_ca=getattr(args, "tls_ca", None))
        try:
            info = self.client.model_info(timeout=self.timeout or 30.0)
        except BaseException:
            self.client.close()
            raise
        self.name = info["name"]
        self.max_model_len = info["max_model_len"]
        # the model's defaults (the server applies them) under the CLI's under the flags, as locally
        model_defaults = info.get("generation_defaults") or {}
        self.sampling = generate_sampling(overrides, model_defaults.get("temperature"))
        self.max_tokens = self.sampling.pop("max_tokens")
        self.logprobs = self.sampling.get("logprobs") is not None
        if not info["has_chat_template"] or not info["has_tokenizer"]:
            self.client.close()
            raise UsageError(f"the server's model {self.name!r} has no chat template, which 'jaxinfer chat' needs; "
                             "use 'jaxinfer generate --no-chat'.")

    def count(self, messages: list) -> int:
        return self.client.tokenize(messages, chat_template_kwargs=self.chat_template_kwargs,
                                    timeout=self.timeout or 30.0)["count"]

    def answer(self, messages: list, max_tokens: int, answer: Answer, stop: StopOnInterrupt) -> Iterator[str]:
        answer.max_tokens = max_tokens
        pieces = self.client.generate(messages, max_tokens=max_tokens, timeout=self.timeout,
                                      chat_template_kwargs=self.chat_template_kwargs, **self.sampling)
        names: dict = {}
        try:
            for piece in pieces:
                if piece.logprobs is not None:
                    answer.logprobs = (answer.logprobs or []) + piece.logprobs
                    names.update(piece.token_text or {})
                if piece.finished:
                    answer.finish_reason = piece.finish_reason
                    answer.prompt_tokens = (piece.usage or {}).get("prompt_tokens", 0)
                if piece.text:
                    yield piece.text
        finally:
            pieces.close()  # an unfinished call is cancelled: the server aborts the request
        answer.token_text = lambda i: names.get(i) or None

    cancel_wait_s = 1.0  # a server busy with a long prompt may send the next piece late: go on without it

    def cancel(self) -> None:
        """Nothing at once: the call is cancelled when the reader closes it (at the next piece, or when the
        call ends), in the background if the chat has gone on."""

    def close(self) -> None:
        self.client.close()


# --------------------------------------------------------------------------- #
# The conversation
# --------------------------------------------------------------------------- #


class Chat:
    """The read-answer loop over a backend (`LocalBackend` or `ServerBackend`)."""

    def __init__(self, backend, *, stdin: TextIO, stdout: TextIO, stderr: TextIO, system: Optional[str] = None,
                 interactive: Optional[bool] = None):
        self.backend = backend
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.system = system or None
        self.history: list = []  # user and assistant messages, alternating
        self.interactive = _isatty(stdin) if interactive is None else interactive
        self.answers: list = []  # every turn's Answer (for tests and callers)

    # -- output --------------------------------------------------------------------

    def _out(self, text: str) -> None:
        self.stdout.write(text)
        self.stdout.flush()

    def note(self, text: str) -> None:
        """A line about the conversation (not part of an answer): on stderr."""
        self.stderr.write(text + "\n")
        self.stderr.flush()

    # -- the loop ------------------------------------------------------------------

    def messages(self, user: Optional[str] = None) -> list:
        out = [{"role": "system", "content": self.system}] if self.system else []
        out += self.history
        if user is not None:
            out.append({"role": "user", "content": user})
        return out

    def _read(self) -> str:
        """The next line, without its newline; EOFError at the end of input."""
        if self.interactive and self.stdin is sys.stdin:
            return input(PROMPT)  # readline's editing and history
        if self.interactive:
            self._out(PROMPT)
        line = self.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\r\n")

    def run(self) -> int:
        """Read and answer until /exit, end of input or a second Ctrl-C at the prompt; returns the exit status."""
        if self.interactive:
            self.note(f"chatting with {self.backend.name} ({self.backend.max_model_len}-token context); "
                      "/help for commands, /exit or Ctrl-D to leave")
        interrupted = False  # the last thing at the prompt was a Ctrl-C
        while True:
            try:
                try:
                    line = self._read()
                except EOFError:
                    if self.interactive:
                        self._out("\n")
                    return 0
                interrupted = False
                code = self.handle(line)
                if code is not None:
                    return code
            except KeyboardInterrupt:  # at the prompt (or between turns): clear the line, twice leaves
                try:
                    if self.interactive:
                        self._out("\n")
                    if interrupted:
                        return 0
                    interrupted = True
                    self.note("(Ctrl-C again, Ctrl-D or /exit to leave)")
                except KeyboardInterrupt:  # the second came while the first was being answered
                    return 0

    def handle(self, line: str) -> Optional[int]:
        """One line: a command or a message. Returns an exit status to leave, None to go on."""
        text = line.strip()
        if not text:
            return None
        if text.startswith("//"):
            return self.turn(line.lstrip()[1:])
        if text.startswith("/"):
            return self.command(text)
        return self.turn(line)

    def command(self, text: str) -> Optional[int]:
        name, _, rest = text.partition(" ")
        name = name.lower()
        if name in ("/exit", "/quit", "/bye"):
            return 0
        if name == "/clear":
            self.history.clear()
            self.note("(conversation cleared" + ("; the system prompt stays)" if self.system else ")"))
        elif name == "/system":
            self.system = rest.strip() or None
            self.note("(system prompt set)" if self.system else "(system prompt removed)")
        elif name in ("/help", "/?"):
            self.note(HELP)
        else:
            self.note(f"unknown command {name}; /help lists them (//TEXT sends /TEXT as a message)")
        return None

    def turn(self, user: str) -> Optional[int]:
        """Send the conversation with ``user`` appended; stream the answer; keep both in the history."""
        backend = self.backend
        messages = self.messages(user)
        answer = Answer()
        printed = False
        try:
            with StopOnInterrupt() as stop:
                n = backend.count(messages)
                room = backend.max_model_len - n
                if room < 1:
                    self.note(f"the conversation is {n} tokens with this message and the context holds "
                              f"{backend.max_model_len} (max_model_len): /clear to start over")
                    return None
                if stop.requested:
                    return None
                pump = PiecePump(backend.answer(messages, min(backend.max_tokens, room), answer, stop))
                try:
                    for piece in pump.pieces(stop):  # none after a Ctrl-C: the stream is cut at the interrupt
                        answer.text += piece
                        self._out(piece)
                        printed = True
                finally:
                    if not pump.finished:  # stopped (or a second Ctrl-C): abort the request now
                        backend.cancel()
                    pump.close(backend.cancel_wait_s)
                stopped = not pump.finished
        except Exception as e:  # noqa: BLE001 - sorted below; anything else is raised again
            self._end_line(printed)
            server_error = _server_error_class()
            code = getattr(e, "code", None) if server_error and isinstance(e, server_error) else None
            if isinstance(e, ValueError):  # the processor's checks; the server's INVALID_ARGUMENT
                self.note(f"jaxinfer: error: {one_line(e.details if code is not None else str(e))}")
                return None
            if code is None:
                raise
            if code.name == "RESOURCE_EXHAUSTED":
                self.note(f"jaxinfer: the server is busy ({one_line(e.details)}); send the message again")
                return None
            self.note(f"jaxinfer: error: {_server_failure(getattr(backend, 'address', '?'), e)}")
            return EXIT_SERVER_ERROR
        except KeyboardInterrupt:  # a second Ctrl-C while the answer stopped: the answer is dropped
            self._end_line(printed)
            raise
        self.answers.append(answer)
        self._end_line(printed)
        if stopped:
            answer.finish_reason = None
            if answer.text:
                self.history += [{"role": "user", "content": user}, {"role": "assistant", "content": answer.text}]
                self.note("(stopped; what was said stays in the conversation)")
            else:
                self.note("(stopped before the answer began; the message was dropped)")
            return None
        self.history += [{"role": "user", "content": user}, {"role": "assistant", "content": answer.text}]
        if answer.finish_reason == "length":
            if answer.max_tokens < backend.max_tokens:
                self.note(f"(the answer filled the context ({backend.max_model_len} tokens): /clear to start over)")
            else:
                self.note(f"(the answer stopped at the {answer.max_tokens}-token limit: --max-tokens)")
        if backend.logprobs and answer.logprobs is not None:
            print_logprobs(answer.token_text, answer.logprobs, file=self.stderr)
        return None

    def _end_line(self, printed: bool) -> None:
        if printed:
            self._out("\n\n" if self.interactive else "\n")


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def _server_error_class():
    """`jaxinfer.server.client.ServerError` when the gRPC client is in use (a local chat never imports it)."""
    client = sys.modules.get("jaxinfer.server.client")
    return getattr(client, "ServerError", None)


def _server_failure(address: str, e) -> str:
    """One line for a failed call, worded as ``generate --server`` words it (nothing answered, too slow, or
    what the server answered)."""
    return one_line(server_error_message(address, e))


# --------------------------------------------------------------------------- #
# The command
# --------------------------------------------------------------------------- #


def check_chat_args(args: argparse.Namespace) -> dict:
    """What ``chat`` checks before a model or a server: returns the sampling overrides."""
    overrides = sampling_overrides(args)
    SamplingParams(**overrides)  # raises ValueError with vLLM's wording
    return overrides


def run(args: argparse.Namespace, *, stdin: Optional[TextIO] = None, stdout: Optional[TextIO] = None,
        stderr: Optional[TextIO] = None, t_start: Optional[float] = None) -> int:
    """``jaxinfer chat``: load the model (or reach the server), then converse on stdin/stdout."""
    stdin = stdin if stdin is not None else sys.stdin
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    t_start = time.perf_counter() if t_start is None else t_start
    backend: Any
    if getattr(args, "server", None):
        from jaxinfer.server.client import ServerError  # lazy: grpc
        from jaxinfer.server.config import read_auth_token

        refuse_local_flags(args)
        overrides = check_chat_args(args)
        token = read_auth_token(getattr(args, "auth_token_file", None))
        try:
            backend = ServerBackend(args, overrides, token)
        except ServerError as e:
            stderr.write(f"jaxinfer: error: {_server_failure(args.server, e)}\n")
            stderr.flush()
            return EXIT_SERVER_ERROR
    else:
        overrides = check_chat_args(args)
        check_engine_flags(args)
        llm = load_llm(args)
        from jaxinfer.engine import distributed  # lazy: JAX (imported by load_llm's stage)

        if distributed.run_as_follower(llm):  # a multi-process run: process 0 holds the conversation
            return 0
        try:
            backend = LocalBackend(llm, args, overrides)
            backend.warm()  # every program a turn can run, now: no compile between a question and its answer
        except BaseException:
            llm.close()
            raise
    progress.ready(t_start)
    interactive = _isatty(stdin)
    if interactive and stdin is sys.stdin:
        try:
            import readline  # noqa: F401 - line editing and history for input(); lazy: optional
        except ImportError:  # a Python built without it: plain input()
            pass
    quiet = _QuietEngine(enabled=not getattr(args, "verbose", False))
    try:
        with quiet:
            code = Chat(backend, stdin=stdin, stdout=stdout, stderr=stderr, system=getattr(args, "system", None),
                        interactive=interactive).run()
    except (KeyboardInterrupt, BrokenPipeError):
        raise  # the process leaves without teardown (jaxinfer.cli.main._stop_early)
    except BaseException:
        backend.close()
        raise
    backend.close()
    return code


class _QuietEngine:
    """While the conversation runs, the engine's start-up lines (progress stages: a program loaded or
    compiled, a model restored) and its INFO logging stay out of it: the terminal shows prompts, answers
    and the chat's own notes. Warnings and errors still come through; ``--verbose`` keeps everything."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._showing = False
        self._level = logging.NOTSET

    def __enter__(self) -> "_QuietEngine":
        if self.enabled:
            self._showing = progress.showing()
            progress.configure(show=False)
            log = logging.getLogger("jaxinfer")
            self._level = log.level
            if log.getEffectiveLevel() < logging.WARNING:
                log.setLevel(logging.WARNING)
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            logging.getLogger("jaxinfer").setLevel(self._level)
            progress.configure(show=self._showing)
