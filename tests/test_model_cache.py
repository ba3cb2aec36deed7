"""The converted-model format and cache: convert once, restore after, never serve a different token.

Tiny random-weight models written as GGUF files (a SentencePiece 'llama' vocabulary or a
byte-level 'gpt2' one) and Hugging Face directories; the real SmolLM2 only where realism
matters (bit-identical parameters and tokenizer through the cache).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from conftest import TINY as TINY_512, TINY_ENGINE, requires_smollm2, tiny_params
from jaxinfer import gguf_file
from jaxinfer.loading import checkpoint, model_cache
from jaxinfer.cli.main import main as cli_main
from jaxinfer import models
from jaxinfer.config import GenerationDefaults, ModelConfig
from jaxinfer.text.tokenizer import Tokenizer, load_tokenizer
from jaxinfer.loading.weights import resolve_model
from test_tokenizer import train_tiny_sentencepiece
from test_weights import random_hf_tensors, to_file_tensor, to_gguf_name, write_hf_dir

T = gguf.GGMLQuantizationType
GREEDY = jaxinfer.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
TEXTS = ["hello world", "naïve café 日本語", "<|im_start|>user\njax page cache<|im_end|>", "  two  spaces", ""]


def tiny_cfg(vocab: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, name="tiny")


@pytest.fixture(scope="module")
def sp_model() -> bytes:
    return train_tiny_sentencepiece()


def write_tiny_gguf(path: Path, sp_model: bytes, matrix_type=T.Q8_0, seed: int = 0) -> Path:
    """A llama.cpp-style GGUF: quantized random weights and a SentencePiece 'llama' vocabulary."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    n = sp.get_piece_size()
    cfg = tiny_cfg(n)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
                       for i in range(n)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_eot_token_id(sp.piece_to_id("<|im_end|>"))
    w.add_chat_template(CHAT_TEMPLATE)
    for hf, x in random_hf_tensors(cfg, seed).items():
        x = to_file_tensor(hf, x, cfg)
        if x.ndim == 1:
            w.add_tensor(to_gguf_name(hf), x.astype(np.float32))
        else:
            w.add_tensor(to_gguf_name(hf), gguf.quants.quantize(x, matrix_type), raw_dtype=matrix_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def sp_vocab(sp_model: bytes) -> int:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_proto=sp_model).get_piece_size()


def research_params(cfg: ModelConfig, seed: int = 1):
    """A parameter tree as research code holds it: jax arrays of the family's tree."""
    from jaxinfer.models import llama
    from jaxinfer.ops.spec import init_random

    return init_random(llama.param_specs(cfg), jax.random.key(seed), scale=0.3)


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(model_cache.ENV, str(root))
    model_cache.stats.clear()
    return root


@pytest.fixture
def tiny_gguf(tmp_path, sp_model) -> Path:
    (tmp_path / "src").mkdir()
    return write_tiny_gguf(tmp_path / "src" / "tiny.gguf", sp_model)


def leaves_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb)
    )


def assert_same_tokenizer(a: Tokenizer, b: Tokenizer) -> None:
    assert a.facts() == b.facts()
    assert a.all_special_ids == b.all_special_ids and a.stop_token_ids == b.stop_token_ids
    assert a.chat_template == b.chat_template and type(a.backend) is type(b.backend)
    ids = list(range(a.vocab_size))
    assert a.convert_ids_to_tokens(ids) == b.convert_ids_to_tokens(ids)
    for text in TEXTS:
        assert a.encode(text) == b.encode(text), text
        assert a.decode(a.encode(text), skip_special_tokens=False) == b.decode(b.encode(text), skip_special_tokens=False)
    if a.chat_template:
        msgs = [{"role": "user", "content": "hello jax"}]
        assert a.apply_chat_template(msgs, tokenize=True) == b.apply_chat_template(msgs, tokenize=True)


def scramble_keeping_identity(path: Path) -> None:
    """Overwrite everything after the magic with garbage; keep size and mtime (the cache key)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(4)
        f.write(b"\xff" * (st.st_size - 4))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def entries(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if not p.name.startswith("."))


# --------------------------------------------------------------------------- #
# The GGUF header, parsed once
# --------------------------------------------------------------------------- #


def test_gguf_file_reads_what_gguf_reader_reads(tiny_gguf):
    ours, ref = gguf_file.GGUFFile(tiny_gguf), gguf.GGUFReader(tiny_gguf)
    fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.keys()) == set(fields)
    for k, v in fields.items():
        assert ours.get(k) == v and type(ours.get(k)) is type(v), k
    assert ours.array_len("tokenizer.ggml.tokens") == len(fields["tokenizer.ggml.tokens"])
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors):
        assert mine.shape == tuple(int(d) for d in theirs.shape) and mine.tensor_type == theirs.tensor_type
        data = ours.tensor_data(mine)
        assert data.dtype == theirs.data.dtype and data.shape == theirs.data.shape
        assert np.array_equal(data.view(np.uint8), theirs.data.view(np.uint8)), mine.name


def test_a_conversion_parses_the_gguf_once_for_weights_and_tokenizer(tiny_gguf, cache_root):
    before = gguf_file.parse_count
    model_cache.load(resolve_model(str(tiny_gguf)), "float32", use_cache=False)
    assert gguf_file.parse_count == before + 1


def test_truncated_gguf_is_a_clear_error(tmp_path, tiny_gguf):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:2000])
    with pytest.raises(ValueError, match="cut.gguf"):
        gguf_file.GGUFFile(cut)


# --------------------------------------------------------------------------- #
# The cache
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_second_load_restores_identical_params_and_tokenizer(tiny_gguf, cache_root, dtype):
    src = resolve_model(str(tiny_gguf))
    direct = model_cache.load(src, dtype, use_cache=False)
    first = model_cache.load(src, dtype)
    assert model_cache.stats["converted"] == 2 and model_cache.stats["saved"] == 1
    assert first.cache_path is not None and first.cache_path.parent == cache_root and not first.from_cache
    second = model_cache.load(src, dtype)
    assert second.from_cache and second.cache_path == first.cache_path and model_cache.stats["restored"] == 1
    assert leaves_equal(second.params, direct.params)
    assert jax.tree.leaves(second.params)[0].dtype == jnp.dtype(dtype)
    assert second.config == direct.config and second.generation == direct.generation
    assert_same_tokenizer(second.tokenizer, direct.tokenizer)
    assert second.tokenizer.source == str(src.path)
    assert [p.name for p in cache_root.iterdir()] == [first.cache_path.name]  # no temporaries left


def test_cached_load_reads_nothing_from_the_source(tiny_gguf, cache_root):
    src = resolve_model(str(tiny_gguf))
    first = model_cache.load(src, "float32")
    scramble_keeping_identity(tiny_gguf)  # any parse or dequantization would now fail
    parses = gguf_file.parse_count
    again = model_cache.load(src, "float32")
    assert again.from_cache and gguf_file.parse_count == parses
    assert leaves_equal(again.params, first.params)
    llm = jaxinfer.LLM(str(tiny_gguf), engine_config=TINY_ENGINE)
    assert llm.model_cache_path == first.cache_path and gguf_file.parse_count == parses
    llm.close()


def test_touching_the_source_rebuilds_and_removes_the_stale_entry(tiny_gguf, cache_root):
    src = resolve_model(str(tiny_gguf))
    old = model_cache.load(src, "float32").cache_path
    st = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    new = model_cache.load(src, "float32")
    assert model_cache.stats["converted"] == 2 and not new.from_cache
    assert new.cache_path != old and not old.exists() and entries(cache_root) == [new.cache_path]
    assert model_cache.load(src, "float32").from_cache


def test_each_dtype_has_its_own_entry(tiny_gguf, cache_root):
    src = resolve_model(str(tiny_gguf))
    a, b = model_cache.load(src, "float32"), model_cache.load(src, "bfloat16")
    assert a.cache_path != b.cache_path and len(entries(cache_root)) == 2
    assert model_cache.load(src, "bfloat16").from_cache and model_cache.load(src, "float32").from_cache


def _truncate_param_data(entry: Path) -> None:
    files = [f for f in (entry / "params").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert files
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _delete_param_data(entry: Path) -> None:
    for f in (entry / "params").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.unlink()


def _other_version(entry: Path) -> None:
    m = json.loads((entry / checkpoint.MANIFEST).read_text())
    m["format_version"] = checkpoint.FORMAT_VERSION + 1
    (entry / checkpoint.MANIFEST).write_text(json.dumps(m))


def _specs_changed(entry: Path) -> None:
    """As if the family's parameter tree changed since the entry was written (without a version bump)."""
    m = json.loads((entry / checkpoint.MANIFEST).read_text())
    m["params"]["leaf_shapes"]["['layers'][0]['w_down']"] = [96, 65]
    (entry / checkpoint.MANIFEST).write_text(json.dumps(m))


def _damage_param_data_in_place(entry: Path) -> None:
    """Same sizes, so only orbax's read can tell: the data file's header is garbage."""
    files = [f for f in (entry / "params").rglob("*") if f.is_file() and f.parent.name == "d"]
    for f in files:
        with open(f, "r+b") as fh:
            fh.write(b"\xff" * min(64, f.stat().st_size))


def _unlisted_manifest_file(entry: Path) -> None:
    m = json.loads((entry / checkpoint.MANIFEST).read_text())
    del m["params"]["files"]
    (entry / checkpoint.MANIFEST).write_text(json.dumps(m))


CORRUPTIONS = {
    "manifest deleted": lambda e: (e / checkpoint.MANIFEST).unlink(),
    "manifest truncated": lambda e: (e / checkpoint.MANIFEST).write_text('{"format": "jaxinfer-mo'),
    "param data truncated": _truncate_param_data,
    "param data deleted": _delete_param_data,
    "param data overwritten": _damage_param_data_in_place,
    "manifest lacks the file list": _unlisted_manifest_file,
    "params directory deleted": lambda e: __import__("shutil").rmtree(e / "params"),
    "tokenizer deleted": lambda e: (e / "tokenizer.model").unlink(),
    "another format version": _other_version,
    "shapes differ from the specs": _specs_changed,
}


# orbax's event loop may report a late tensorstore callback for a failed read; nothing leaks
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("corrupt", list(CORRUPTIONS), ids=list(CORRUPTIONS))
def test_corrupt_entry_is_rebuilt_with_one_warning(tiny_gguf, cache_root, corrupt):
    src = resolve_model(str(tiny_gguf))
    first = model_cache.load(src, "float32")
    CORRUPTIONS[corrupt](first.cache_path)
    with pytest.warns(RuntimeWarning, match="unusable, rebuilding") as record:
        rebuilt = model_cache.load(src, "float32")
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    assert model_cache.stats["rebuilt"] == 1 and not rebuilt.from_cache
    assert leaves_equal(rebuilt.params, first.params)
    assert entries(cache_root) == [first.cache_path]
    again = model_cache.load(src, "float32")
    assert again.from_cache and leaves_equal(again.params, first.params)
    _settle_failed_orbax_reads()


def _settle_failed_orbax_reads(timeout: float = 5.0) -> None:
    """A read orbax gave up on leaves tensorstore reads in flight, holding orbax coroutines that are
    never awaited; wait until they are gone so their complaints land in the test that caused them."""
    import gc
    import types

    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        pending = [o for o in gc.get_objects()
                   if isinstance(o, types.CoroutineType) and o.__name__ == "_read_array_index_and_device_put"]
        if not pending or time.monotonic() > deadline:
            return
        del pending
        time.sleep(0.05)


def test_unwritable_cache_warns_and_still_loads(tiny_gguf, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv(model_cache.ENV, str(blocker / "models"))
    with pytest.warns(RuntimeWarning, match="could not write the model cache entry"):
        m = model_cache.load(resolve_model(str(tiny_gguf)), "float32")
    assert m.params is not None and m.cache_path is None


@pytest.mark.parametrize("value", ["0", "off", "false", "no"])
def test_cache_turned_off_by_the_environment(tiny_gguf, tmp_path, monkeypatch, value):
    monkeypatch.setenv(model_cache.ENV, value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache.cache_dir() is None
    m = model_cache.load(resolve_model(str(tiny_gguf)), "float32")
    assert m.cache_path is None and not (tmp_path / "xdg").exists()


def test_cache_location_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv(model_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert model_cache.cache_dir() == tmp_path / "jaxinfer" / "models"


_RACER = textwrap.dedent("""
    import json, os, sys, time
    start = sys.argv[2]
    while not os.path.exists(start):
        time.sleep(0.005)
    from jaxinfer.loading import model_cache
    from jaxinfer.loading.weights import resolve_model
    model_cache.load(resolve_model(sys.argv[1]), "float32")
    print(json.dumps(dict(model_cache.stats)))
""")


def test_two_processes_converting_at_once_publish_one_valid_entry(tiny_gguf, cache_root, tmp_path):
    start = tmp_path / "go"
    env = {**os.environ, model_cache.ENV: str(cache_root), "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(tiny_gguf), str(start)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(0.5)
    start.touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r.get("saved", 0) for r in results) == 1, results
    assert all(r.get("converted", 0) + r.get("restored", 0) == 1 for r in results), results
    assert not any("rebuilt" in r or "save_failed" in r for r in results), results
    assert len(entries(cache_root)) == 1 and not [p for p in cache_root.iterdir() if p.name.startswith(".")]
    again = model_cache.load(resolve_model(str(tiny_gguf)), "float32")
    direct = model_cache.load(resolve_model(str(tiny_gguf)), "float32", use_cache=False)
    assert again.from_cache and leaves_equal(again.params, direct.params)


def test_hf_directory_is_cached_and_keyed_by_its_files(tmp_path, cache_root, sp_model):
    n = sp_vocab(sp_model)
    d = write_hf_dir(tmp_path / "tiny-hf", tiny_cfg(n), random_hf_tensors(tiny_cfg(n)),
                     generation={"eos_token_id": 2, "temperature": 0.7})
    (d / "tokenizer.model").write_bytes(sp_model)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))
    src = resolve_model(str(d))
    direct = model_cache.load(src, "float32", use_cache=False)
    first = model_cache.load(src, "float32")
    second = model_cache.load(src, "float32")
    assert second.from_cache and leaves_equal(second.params, direct.params)
    assert second.generation == direct.generation and second.generation.temperature == 0.7
    assert_same_tokenizer(second.tokenizer, direct.tokenizer)
    time.sleep(0.01)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": CHAT_TEMPLATE}))
    third = model_cache.load(src, "float32")
    assert not third.from_cache and third.cache_path != first.cache_path
    assert third.tokenizer.eos_token == "</s>"


# --------------------------------------------------------------------------- #
# The converted format: jaxinfer convert, LLM(dir), save_model
# --------------------------------------------------------------------------- #


def _ids(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_convert_command_then_llm_gives_the_tokens_of_the_source(tiny_gguf, tmp_path, cache_root, capsys):
    dst = tmp_path / "converted"
    assert cli_main(["convert", str(tiny_gguf), str(dst), "--dtype", "float32", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(dst)
    assert resolve_model(str(dst)).format == "jaxinfer" and not cache_root.exists()
    prompts = [[1, 5, 9, 33], list(range(3, 40))]
    with jaxinfer.LLM(str(tiny_gguf), engine_config=TINY_ENGINE, model_cache=False) as direct:
        want, want_text = _ids(direct, prompts), direct.generate("hello world", GREEDY)[0].outputs[0].text
    with jaxinfer.LLM(str(dst), engine_config=TINY_ENGINE) as converted:
        assert _ids(converted, prompts) == want
        assert converted.generate("hello world", GREEDY)[0].outputs[0].text == want_text
        assert converted.model_name == "tiny" and converted.tokenizer.chat_template == CHAT_TEMPLATE
    assert not cache_root.exists()  # a converted directory is loaded as it is, never cached again
    # the directory is also a plain Hugging Face tokenizer directory
    assert_same_tokenizer(load_tokenizer(dst), Tokenizer.from_gguf(tiny_gguf))
    assert cli_main(["convert", str(tiny_gguf), str(dst), "--quiet"]) == 2  # bad usage, not a failure
    err = capsys.readouterr().err
    assert err.startswith("jaxinfer: error: ") and "already exists; pass --force" in err and err.count("\n") == 1
    assert cli_main(["convert", str(tiny_gguf), str(dst), "--dtype", "bfloat16", "--force", "--quiet"]) == 0
    assert checkpoint.read_manifest(dst)["dtype"] == "bfloat16"


def test_relative_paths_work_for_convert_save_model_llm_and_generate(tiny_gguf, tmp_path, cache_root, capsys,
                                                                     monkeypatch, sp_model):
    """The README's own example, ``convert SRC ./dir`` then ``--model ./dir``, from another working directory."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    rel_src = os.path.relpath(tiny_gguf, work)  # ../src/tiny.gguf
    assert cli_main(["convert", rel_src, "./converted", "--dtype", "float32", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(work / "converted")
    cfg = tiny_cfg(sp_vocab(sp_model))
    saved = jaxinfer.save_model("saved", cfg, research_params(cfg))
    assert saved == work / "saved" and checkpoint.is_converted_dir(saved)
    assert leaves_equal(checkpoint.load_converted("saved").params, checkpoint.load_converted(saved).params)
    assert resolve_model("./converted").path == work / "converted"  # absolute, whatever the spelling
    prompts = [[1, 5, 9, 33]]
    with jaxinfer.LLM(str(tiny_gguf), engine_config=TINY_ENGINE, model_cache=False) as direct:
        want = _ids(direct, prompts)
    with jaxinfer.LLM("./converted", engine_config=TINY_ENGINE) as converted:
        assert _ids(converted, prompts) == want
    with jaxinfer.LLM("saved", engine_config=TINY_ENGINE) as research:
        assert len(_ids(research, prompts)[0]) == GREEDY.max_tokens
    # the model cache: a relative GGUF path is the same entry as its absolute one
    converted_before, restored_before = model_cache.stats["converted"], model_cache.stats["restored"]
    with jaxinfer.LLM(rel_src, engine_config=TINY_ENGINE) as cached:
        assert _ids(cached, prompts) == want
    assert model_cache.stats["converted"] == converted_before + 1 and len(entries(cache_root)) == 1
    with jaxinfer.LLM(str(tiny_gguf), engine_config=TINY_ENGINE) as again:
        assert _ids(again, prompts) == want
    assert model_cache.stats["converted"] == converted_before + 1 and model_cache.stats["restored"] == restored_before + 1
    # and the command line: generate --model ./converted
    assert cli_main(["generate", "--model", "./converted", "--engine-config", "cpu", "--max-model-len", "64",
                     "--max-tokens", "4", "--temperature", "0", "--no-chat", "--quiet", "hello"]) == 0
    out, err = capsys.readouterr()
    assert err == "jaxinfer: output stopped at the 4-token limit (--max-tokens); raise --max-tokens for a longer answer\n"
    assert out.endswith("\n") and out.strip()


def test_the_parameter_count_is_the_models_whatever_the_storage(tiny_gguf, cache_root):
    """int8 and int4 trees hold other leaves (packed nibbles, scales, offsets): the count is the float tree's."""
    source = resolve_model(str(tiny_gguf))
    float_model = model_cache.load(source, "float32", use_cache=False)
    want = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(float_model.params))
    assert models.num_params(float_model.config) == want
    for mode in ("int8", "int4"):
        m = model_cache.load(source, "float32", use_cache=False, quantization=mode)
        stored = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(m.params))
        assert m.config.quant and stored != want  # the storage differs...
        assert models.num_params(m.config) == want, mode  # ...the model does not
        assert models.describe(m.config) == models.describe(float_model.config)


def test_tokenize_command_uses_the_cached_tokenizer(tiny_gguf, cache_root, capsys):
    assert cli_main(["tokenize", "--model", str(tiny_gguf), "--json", "hello world"]) == 0
    want = json.loads(capsys.readouterr().out)
    model_cache.load(resolve_model(str(tiny_gguf)), "bfloat16")
    scramble_keeping_identity(tiny_gguf)
    parses = gguf_file.parse_count
    assert cli_main(["tokenize", "--model", str(tiny_gguf), "--json", "hello world"]) == 0
    assert json.loads(capsys.readouterr().out) == want and gguf_file.parse_count == parses
    assert model_cache.stats["tokenizer_restored"] == 1


def test_save_model_round_trip_serves_research_params(tmp_path, cache_root, sp_model):
    cfg = tiny_cfg(sp_vocab(sp_model))  # the shapes of the tests above: their compiled programs serve here too
    params = research_params(cfg)
    gen = GenerationDefaults(temperature=0.5, eos_token_ids=(3, 4))
    dst = jaxinfer.save_model(tmp_path / "mine", cfg, params, generation=gen)
    m = checkpoint.load_converted(dst)
    assert leaves_equal(m.params, params) and m.config == cfg and m.generation == gen and m.tokenizer is None
    prompts = [[1, 5, 9, 33], list(range(3, 40))]
    with jaxinfer.LLM.from_params(cfg, params, engine_config=TINY_ENGINE) as mem:
        want = _ids(mem, prompts)
    with jaxinfer.LLM(str(dst), engine_config=TINY_ENGINE) as served:
        assert _ids(served, prompts) == want and served.eos_token_ids == frozenset({3, 4})
    # bfloat16 saved, float32 served: widened exactly
    half = jaxinfer.save_model(tmp_path / "half", cfg, params, dtype="bfloat16")
    back = checkpoint.load_converted(half, dtype="float32")
    want16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
    assert leaves_equal(back.params, want16)
    with pytest.raises(FileExistsError):
        jaxinfer.save_model(dst, cfg, params)
    assert cli_main(["tokenize", "--model", str(dst), "hello"]) == 2  # saved without a tokenizer: says so


def test_save_model_with_a_tokenizer(tmp_path, cache_root, sp_model):
    spm_dir = tmp_path / "spm"
    spm_dir.mkdir()
    (spm_dir / "tokenizer.model").write_bytes(sp_model)
    (spm_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    tok = load_tokenizer(spm_dir)
    cfg = tiny_cfg(tok.vocab_size)
    params = research_params(cfg)
    dst = jaxinfer.save_model(tmp_path / "with-tok", cfg, params, tokenizer=tok)
    assert_same_tokenizer(checkpoint.load_converted(dst).tokenizer, tok)
    assert_same_tokenizer(Tokenizer.from_dir(dst), tok)  # plain from_dir rebuilds it too


def test_save_model_checks_the_tree_against_the_family_specs(tmp_path):
    params = tiny_params()
    layers = list(params.layers)
    layers[1] = dataclasses.replace(layers[1], mlp=dataclasses.replace(layers[1].mlp, w_down=layers[1].mlp.w_down[:, :10]))
    bad = dataclasses.replace(params, layers=layers)
    with pytest.raises(ValueError, match=r"\.layers\[1\]\.mlp\.w_down"):
        jaxinfer.save_model(tmp_path / "bad", TINY_512, bad)
    missing = dataclasses.replace(params, lm_head=None)
    with pytest.raises(ValueError, match="structure"):
        jaxinfer.save_model(tmp_path / "bad", TINY_512, missing)
    mixed = dataclasses.replace(params, final_norm=params.final_norm.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="mix dtypes"):
        jaxinfer.save_model(tmp_path / "bad", TINY_512, mixed)
    assert not (tmp_path / "bad").exists()
    assert jaxinfer.save_model(tmp_path / "ok", TINY_512, mixed, dtype="float32").is_dir()


# --------------------------------------------------------------------------- #
# The real model: bit-identical through the cache
# --------------------------------------------------------------------------- #


@pytest.mark.model
@requires_smollm2
def test_smollm2_through_the_cache_is_bit_identical_to_direct_loading(cache_root):
    from jaxinfer.ops.backend import resolve_dtype

    dtype = resolve_dtype("auto")
    src = resolve_model("smollm2-135m-instruct")
    direct = model_cache.load(src, dtype, use_cache=False)
    model_cache.load(src, dtype)
    t0 = time.perf_counter()
    cached = model_cache.load(src, dtype)
    restore_s = time.perf_counter() - t0
    assert cached.from_cache and leaves_equal(cached.params, direct.params)
    assert cached.config == direct.config and cached.generation == direct.generation
    assert_same_tokenizer(cached.tokenizer, direct.tokenizer)
    with open(os.path.join(os.path.dirname(__file__), "fixtures", "smollm2_reference.json")) as f:
        ref = json.load(f)
    for case in ref["generation"]:
        if case["kind"] == "text":
            assert cached.tokenizer.encode(case["prompt"]) == case["prompt_ids"]
    print(f"SmolLM2 {dtype} restore from the model cache: {restore_s:.2f}s")
