"""The sampling defaults in force (``--generation-config auto|vllm|PATH``, as vLLM's flag) on every path, and the
CLI's default ``--max-tokens`` (the rest of the context, capped).

A request that leaves a sampling field unset draws the same tokens from the library, ``jaxinfer generate``, the
gRPC client's ``chat`` and an OpenAI HTTP request, all on a tiny random model saved as a directory that ships no
temperature (so ``auto`` means temperature 0.2 / top-p 0.9) — and not those of the neutral (``vllm``) defaults.
"""

from __future__ import annotations

import json

import pytest

from conftest import save_char_model
from jaxinfer.config import GenerationDefaults
from jaxinfer.loading.generation_config import (
    FALLBACK,
    NEUTRAL,
    describe_generation,
    read_generation_config,
    resolve_generation_config,
)
from jaxinfer.sampling_params import SamplingParams

SEED, N = 7, 12
MESSAGES = [{"role": "user", "content": "hello world"}]


# --------------------------------------------------------------------------- #
# Resolving auto / vllm / PATH (no model)
# --------------------------------------------------------------------------- #


def _sampling(g: GenerationDefaults) -> dict:
    return {k: getattr(g, k) for k in NEUTRAL}


def test_auto_is_the_models_own_with_the_small_model_fallback_only_without_a_temperature():
    own = GenerationDefaults(temperature=0.6, top_k=40, eos_token_ids=(3,))
    assert _sampling(resolve_generation_config("auto", own)) == {**NEUTRAL, "temperature": 0.6, "top_k": 40}
    bare = GenerationDefaults(top_k=5, eos_token_ids=(2,))  # no temperature: jaxinfer's 0.2 / 0.9, top-k kept
    got = resolve_generation_config("auto", bare)
    assert _sampling(got) == {**NEUTRAL, **FALLBACK, "top_k": 5} and got.eos_token_ids == (2,)
    assert resolve_generation_config(None, bare) == got  # None is auto
    greedy = GenerationDefaults.from_dict({"do_sample": False, "top_p": 0.5})  # do_sample false: temperature 0
    assert _sampling(resolve_generation_config("auto", greedy)) == {**NEUTRAL, "temperature": 0.0, "top_p": 0.5}


def test_vllm_is_neutral_whatever_the_model_says_and_keeps_its_stop_tokens():
    own = GenerationDefaults(temperature=0.6, top_p=0.7, top_k=40, min_p=0.1, repetition_penalty=1.3,
                             eos_token_ids=(3, 4))
    got = resolve_generation_config("vllm", own)
    assert _sampling(got) == NEUTRAL and got.eos_token_ids == (3, 4)
    # exactly SamplingParams' own defaults (vLLM's): nothing reshapes the distribution
    neutral = SamplingParams()
    assert all(getattr(neutral, k) == v for k, v in NEUTRAL.items())


def test_a_path_gives_its_files_sampling_fields(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.45, "top_p": 0.75,
                                                                 "eos_token_id": 9}))
    model = GenerationDefaults(temperature=0.9, top_k=3, eos_token_ids=(2,))
    for spec in (str(tmp_path), str(tmp_path / "generation_config.json")):  # the directory or the file
        got = resolve_generation_config(spec, model)
        # the file's fields, the rest neutral (not the model's top-k); the model's stop tokens
        assert _sampling(got) == {**NEUTRAL, "temperature": 0.45, "top_p": 0.75} and got.eos_token_ids == (2,)
        assert f"from {spec}" in describe_generation(spec, model)
    assert "temperature 0.2, top-p 0.9" in describe_generation("auto", GenerationDefaults())
    assert "no temperature" in describe_generation("auto", GenerationDefaults())
    assert "the model's" in describe_generation("auto", model) and "top-k 3" in describe_generation("auto", model)
    assert "neutral" in describe_generation("vllm", model)


def test_a_bad_path_is_one_line_naming_it(tmp_path):
    with pytest.raises(ValueError, match="holds no generation_config.json"):
        read_generation_config(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        read_generation_config(tmp_path / "nope.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="not a JSON object"):
        read_generation_config(tmp_path / "list.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        read_generation_config(tmp_path / "bad.json")


def test_the_flag_is_checked_before_any_model_and_refused_with_server(tmp_path, capsys):
    import inspect

    import jaxinfer
    import jaxinfer.cli.main as cli
    from jaxinfer.cli.flags import llm_kwargs

    assert cli.main(["generate", "hi", "--generation-config", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--generation-config" in err and "does not exist" in err and len(err.splitlines()) == 1
    assert cli.main(["generate", "hi", "--server", "localhost:1", "--generation-config", "vllm"]) == 2
    assert "--generation-config" in capsys.readouterr().err
    parse = cli.build_parser().parse_args
    assert "generation_config" not in llm_kwargs(parse(["serve"]))  # LLM's default: auto
    assert inspect.signature(jaxinfer.LLM).parameters["generation_config"].default == "auto"
    assert llm_kwargs(parse(["serve", "--generation-config", "vllm"]))["generation_config"] == "vllm"
    for command in (["generate", "hi"], ["chat"]):
        assert parse([*command, "--generation-config", "vllm"]).generation_config == "vllm"


# --------------------------------------------------------------------------- #
# The CLI's default --max-tokens: the rest of the context, at most DEFAULT_MAX_TOKENS
# --------------------------------------------------------------------------- #


def test_cli_default_max_tokens_is_the_rest_of_the_context_capped():
    from jaxinfer.cli.flags import DEFAULT_MAX_TOKENS, sampling_overrides
    from jaxinfer.cli.main import build_parser
    from jaxinfer.engine.processor import InputProcessor

    assert DEFAULT_MAX_TOKENS == 4096
    parse = build_parser().parse_args
    assert sampling_overrides(parse(["generate", "hi"]))["max_tokens"] == DEFAULT_MAX_TOKENS
    assert sampling_overrides(parse(["generate", "hi", "--max-tokens", "9"]))["max_tokens"] == 9
    assert f"at most {DEFAULT_MAX_TOKENS}" in " ".join(build_parser()._subparsers._group_actions[0]
                                                        .choices["generate"].format_help().split())
    prompt = list(range(1, 31))
    params = SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)
    for max_model_len, want in ((100, 70), (DEFAULT_MAX_TOKENS, DEFAULT_MAX_TOKENS - 30),
                                (32768, DEFAULT_MAX_TOKENS)):  # the rest of the context, capped
        proc = InputProcessor(vocab_size=64, max_model_len=max_model_len)
        assert proc.make_request(prompt, params, fit_max_tokens=True).max_tokens == want
        if want < DEFAULT_MAX_TOKENS:  # the library and the server refuse it rather than shrink it
            with pytest.raises(ValueError, match="max_tokens"):
                proc.make_request(prompt, params)


# --------------------------------------------------------------------------- #
# Every path, one model
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random-weight model with a character tokenizer and a chat template that ships no sampling
    defaults (as SmolLM2's GGUF), saved as a directory."""
    return save_char_model(tmp_path_factory, seed=1)

def _flags(model_dir) -> list:
    return ["--model", str(model_dir), "--engine-config", "cpu", "--max-model-len", "64", "--num-pages", "16"]


def _generate(capsys, *argv) -> list:
    import jaxinfer.cli.main as cli

    assert cli.main(["generate", "hello world", "--seed", str(SEED), "--max-tokens", str(N), "--json", *argv]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chat"] is True and len(out["token_ids"]) == N
    return out["token_ids"]


def test_unset_sampling_fields_draw_the_same_tokens_on_every_path(model_dir, capsys):
    import asyncio

    import httpx

    import jaxinfer
    import jaxinfer.cli.main as cli
    from jaxinfer.cli.flags import llm_kwargs
    from jaxinfer.server import ServerConfig, ServerThread
    from jaxinfer.server.client import AsyncClient, Client
    from jaxinfer.server.openai_api.serving import OpenAIServing

    cli_auto = _generate(capsys, *_flags(model_dir))
    cli_vllm = _generate(capsys, *_flags(model_dir), "--generation-config", "vllm")

    llm = jaxinfer.LLM(**llm_kwargs(cli.build_parser().parse_args(["serve", *_flags(model_dir)])))
    try:
        assert llm.generation_config == "auto"
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p) == (FALLBACK["temperature"], FALLBACK["top_p"])

        def library(params: SamplingParams):
            return llm.chat(MESSAGES, params.clone(seed=SEED, max_tokens=N))[0].outputs[0]

        lib_auto = library(defaults)
        assert lib_auto.token_ids == library(SamplingParams(temperature=0.2, top_p=0.9)).token_ids
        lib_vllm = library(SamplingParams())  # what --generation-config vllm fills in: 1.0 / 1.0
        assert lib_vllm.token_ids != lib_auto.token_ids  # not vacuous: the two defaults draw differently
        assert cli_auto == lib_auto.token_ids and cli_vllm == lib_vllm.token_ids

        with ServerThread(llm, ServerConfig(port=0, http_port=0)) as srv:
            body = {"model": llm.model_name, "messages": MESSAGES, "seed": SEED, "max_tokens": N}
            r = httpx.post(srv.http_url + "/v1/chat/completions", json=body, timeout=60).json()
            assert r["choices"][0]["message"]["content"] == lib_auto.text and r["usage"]["completion_tokens"] == N
            # a body that sets the neutral values draws the vllm tokens: the defaults were what differed
            r = httpx.post(srv.http_url + "/v1/chat/completions", json={**body, "temperature": 1.0, "top_p": 1.0},
                           timeout=60).json()
            assert r["choices"][0]["message"]["content"] == lib_vllm.text
            assert OpenAIServing(llm, srv.servicer).sampling_defaults() == {
                "generation_config": "auto", **NEUTRAL, **FALLBACK}
            card = httpx.get(srv.http_url + "/v1/models", timeout=30).json()["data"][0]
            assert card["sampling_defaults"] == {"generation_config": "auto", **NEUTRAL, **FALLBACK}
            with Client(srv.address, timeout=60) as c:
                assert c.chat(MESSAGES, seed=SEED, max_tokens=N).token_ids == lib_auto.token_ids
                assert c.chat("hello world", seed=SEED, max_tokens=N).token_ids == lib_auto.token_ids
                assert c.complete(MESSAGES, seed=SEED, max_tokens=N, temperature=1.0,
                                  top_p=1.0).token_ids == lib_vllm.token_ids
                info = c.model_info()
                with pytest.raises(TypeError, match="list of messages"):
                    c.chat({"role": "user", "content": "hi"})

            async def async_chat():
                async with AsyncClient(srv.address, timeout=60) as ac:
                    return (await ac.chat(MESSAGES, seed=SEED, max_tokens=N)).token_ids

            assert asyncio.run(async_chat()) == lib_auto.token_ids
            assert info["generation_config"] == "auto"
            got = info["generation_defaults"]
            assert (got["temperature"], got["top_p"]) == pytest.approx((0.2, 0.9))
            # generate --server: the server's defaults, the same tokens as local generate
            assert _generate(capsys, "--server", srv.address, "--timeout", "60") == cli_auto
    finally:
        llm.close()
