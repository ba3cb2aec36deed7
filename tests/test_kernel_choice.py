"""Kernels chosen once (`jaxinfer.ops.backend.KernelChoice`): a frozen value the step programs take as a static
argument, that device code reads instead of the process's kernel registry; the program cache key hashes it,
and hashes only device sources."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY, TINY_ENGINE, tiny_params
from jaxinfer.engine import programs, step
from jaxinfer.engine.programs import ProgramTable
from jaxinfer.engine.sampling import RowSampling, build_metadata
from jaxinfer.ops import attention, backend, cpu_matmul, invariant, kernels, kv_cache
from jaxinfer.ops.attention import AttentionMetadata
from jaxinfer.ops.backend import KernelChoice
from jaxinfer.ops.sampler import init_sampler_state
from jaxinfer.sampling_params import SamplingParams

HOST = backend.prepare()  # the host's choice, after loading its kernels (as the engine decides it)
needs_kernels = pytest.mark.skipif(not (HOST.cpu_matmul and HOST.cpu_attention), reason="native CPU kernels unavailable")


def test_a_choice_is_a_frozen_hashable_value():
    a, b = KernelChoice.for_platform("cpu"), KernelChoice.for_platform("cpu")
    assert a == b and hash(a) == hash(b) and len({a, b, KernelChoice.pure_jax("cpu")}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.cpu_matmul = False
    with pytest.raises(ValueError, match="platform"):
        KernelChoice("metal")
    with pytest.raises(ValueError, match="cpu platform only"):
        KernelChoice("tpu", cpu_matmul=True)
    with pytest.raises(ValueError, match="simd"):
        KernelChoice("cpu", simd="sse9")
    # the AVX-512 level with its dot instructions after it, and nothing else
    for simd in ("avx512+amx+vnni", "avx512+vnni", "avx512+amx", "avx2", "scalar"):
        assert KernelChoice("cpu", cpu_matmul=True, simd=simd).simd == simd
    for bad in ("avx2+vnni", "avx512+sve", "amx", "scalar+amx"):
        with pytest.raises(ValueError, match="simd must be one of"):
            KernelChoice("cpu", simd=bad)
    assert KernelChoice("cpu", simd="avx512+vnni") != KernelChoice("cpu", simd="avx512")  # other programs


def test_a_choice_for_another_platform_is_built_on_this_host():
    tpu = KernelChoice.for_platform("tpu")
    assert (tpu.platform, tpu.tpu_attention, tpu.cpu_matmul, tpu.cpu_attention) == ("tpu", True, False, False)
    assert KernelChoice.for_platform("gpu") == KernelChoice.for_platform("cuda") == KernelChoice("cuda", gpu_attention=True)
    # what it means for shapes: Llama 3's heads take the Pallas kernel, SmolLM2's do not
    assert tpu.attention_kernel(32, 8, 128, 32, jnp.bfloat16) == "tpu"
    assert tpu.attention_kernel(9, 3, 64, 32, jnp.bfloat16) is None
    assert KernelChoice("cuda").attention_kernel(32, 8, 128, 32, jnp.bfloat16) is None


def _prefill_hlo(choice):
    cfg, params = TINY, tiny_params()
    cache = kv_cache.init_cache(cfg, TINY_ENGINE)
    pos = np.arange(4, dtype=np.int32)[None]
    table = np.array([[1, 2]], np.int32)
    attn = AttentionMetadata(pos, kv_cache.slots_for(table, pos, TINY_ENGINE.page_size), table,
                             np.array([4], np.int32))
    md = build_metadata([RowSampling(SamplingParams(temperature=0), 0, 4, 0)], 1, num_slots=4, max_logprobs=2)
    state = init_sampler_state(4, cfg.vocab_size)
    kw = {} if choice is None else {"kernels": choice}
    return step.prefill.lower(params, cache, state, jnp.zeros((1, 4), jnp.int32), attn, np.array([3], np.int32),
                              md, cfg=cfg, **kw).as_text()


@needs_kernels
def test_the_step_traces_what_the_choice_says_not_what_is_loaded():
    """On this host both kernels are loaded; a choice that turns them off still traces XLA's path."""
    on = _prefill_hlo(KernelChoice.for_platform("cpu"))
    off = _prefill_hlo(KernelChoice.for_platform("cpu", native_cpu_kernels=False))
    for target in (cpu_matmul.TARGET_FLOAT, attention.CPU_TARGET):
        assert target in on and target not in off, target
    assert _prefill_hlo(None) == on  # research code without a choice gets the host's (decided before the trace)


@needs_kernels
def test_the_choice_does_not_leak_out_of_the_trace():
    with backend.using(KernelChoice.pure_jax("cpu")):
        assert backend.current() == KernelChoice.pure_jax("cpu")
    assert backend.current() == HOST


def test_the_engine_decides_once_and_the_program_key_follows_the_choice(tiny_llm):
    runner = tiny_llm.engine.runner
    table = runner.programs
    assert table.kernels == KernelChoice.loaded()  # decided when the table was made, after the kernels loaded
    pure = ProgramTable(runner, kernels=KernelChoice.pure_jax("cpu"))
    native = ProgramTable(runner, kernels=KernelChoice.for_platform("cpu"))
    same = ProgramTable(runner, kernels=table.kernels)
    assert pure.fingerprint != native.fingerprint and same.fingerprint == table.fingerprint
    # both attention paths stop at each request's context: one full-width page table, pages no key
    assert pure.keys() == native.keys() and {k.pages for k in native.keys()} == {native.page_buckets[-1]}


def test_the_key_hashes_device_sources_only(tmp_path):
    """config.py, programs.py, the runner: not device code (their values reach the key as data); ops/ with its
    C++ kernels, models/ and the step are, and a change in any of them changes the digest."""
    names = [n for n, _ in programs.device_sources()]
    for host_file in ("jaxinfer/config.py", "jaxinfer/engine/programs.py", "jaxinfer/engine/runner.py",
                      "jaxinfer/env.py"):
        assert host_file not in names
    for device_file in ("jaxinfer/engine/step.py", "jaxinfer/ops/attention.py", "jaxinfer/ops/backend.py",
                        "jaxinfer/ops/kernels/matmul_cpu.cc", "jaxinfer/models/decoder.py"):
        assert device_file in names
    # the digest is of these files alone: copies give the same one, an edited copy another
    copies = []
    for name, path in programs.device_sources():
        dst = tmp_path / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dst)
        copies.append((name, str(dst)))
    assert programs.source_digest(copies) == programs._device_code_digest()
    edited = tmp_path / "jaxinfer/ops/kernels/matmul_cpu.cc"
    edited.write_text(edited.read_text() + "\n// an edit\n")
    assert programs.source_digest(copies) != programs._device_code_digest()


def test_the_traced_config_values_reach_the_key_as_data():
    """A config property read while tracing (attn_scale, the layer windows) is in the key by value."""
    base = programs.traced_config_values(TINY)
    assert programs.traced_config_values(dataclasses.replace(TINY, query_pre_attn_scalar=7.0)) != base
    assert programs.traced_config_values(dataclasses.replace(TINY, sliding_window=8)) != base
    assert programs.traced_config_values(dataclasses.replace(TINY)) == base


@pytest.mark.parametrize("source", [kernels.MATMUL, kernels.PAGED_ATTENTION])
@pytest.mark.parametrize("flags", [
    None,  # the default build (this CPU)
    ["-O3", "-march=native", "-mno-avx512f", "-fopenmp-simd"],  # the AVX2 path
    ["-O2", "-march=native", "-mno-avx512f", "-mno-avx2", "-mno-fma"],  # the scalar path
    ["-O3", "-march=skylake-avx512", "-fopenmp-simd"],  # the AVX-512 path (checked, not run: -fsyntax-only)
    ["-O3", "-march=icelake-server", "-fopenmp-simd"],  # AVX-512 with VNNI, no AMX
    ["-O3", "-march=sapphirerapids", "-fopenmp-simd"],  # AVX-512 with VNNI and AMX
])
def test_the_kernels_compile_without_warnings(source, flags):
    if kernels.compiler() is None:
        pytest.skip("no C++ compiler")
    cmd = kernels.compile_command(source, os.devnull, flags)
    assert not {"-w"} & set(cmd) and {"-Wall", "-Wextra"} <= set(cmd)
    out = subprocess.run([*cmd[:-2], "-fsyntax-only"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr[-3000:]


def test_matmul_precision_is_checked_and_carried_by_the_choice():
    from jaxinfer.config import EngineConfig

    with pytest.raises(ValueError, match="matmul_precision must be one of default, highest, got 'high'"):
        EngineConfig(matmul_precision="high")
    with pytest.raises(ValueError, match="matmul_precision"):
        KernelChoice("cuda", matmul_precision="fast")
    high = KernelChoice("cuda").with_precision("highest")
    assert high != KernelChoice("cuda") and hash(high) != hash(KernelChoice("cuda"))
    assert KernelChoice("cuda").with_precision("default") == KernelChoice("cuda")  # default: the choice as it was
    assert "highest" in str(high) and "precision" not in str(KernelChoice("cuda"))


def _dot_precisions(choice):
    import re

    return re.findall(r"dot_general.*?precision = \[(\w+), \w+\]", _prefill_hlo(choice))


def test_the_step_traces_its_products_at_the_choices_precision():
    """Pure JAX: every product of the prefill (projections, attention einsums, LM head) says HIGHEST under
    "highest"; under "default" none does, exactly the program of a choice made before the field."""
    pure = KernelChoice.pure_jax("cpu")
    default, high = _dot_precisions(pure), _dot_precisions(pure.with_precision("highest"))
    assert default and set(default) == {"DEFAULT"}
    assert len(high) == len(default) and set(high) == {"HIGHEST"}


def test_programs_of_another_precision_have_another_key(tiny_llm):
    runner = tiny_llm.engine.runner
    table = runner.programs
    assert table.kernels.matmul_precision == runner.ecfg.matmul_precision == "default"
    saved = runner.ecfg
    try:
        runner.ecfg = saved.replace(matmul_precision="highest")
        high = ProgramTable(runner, kernels=table.kernels)
    finally:
        runner.ecfg = saved
    assert high.kernels == table.kernels.with_precision("highest") and high.fingerprint != table.fingerprint


# -- batch-invariant mode: part of the choice, not of the process ------------------------------------------


def test_batch_invariant_mode_is_a_field_of_the_choice(monkeypatch):
    """Built once, read from the choice: the environment counts when a choice is built (`loaded`), not after."""
    monkeypatch.delenv(invariant.ENV, raising=False)
    before = KernelChoice.loaded()
    assert not before.batch_invariant
    on = before.with_batch_invariant(True)
    assert on.batch_invariant and on != before and hash(on) != hash(before)
    assert on.with_batch_invariant(None) is on and before.with_batch_invariant(False) is before
    assert "batch-invariant" in str(on) and "batch-invariant" not in str(before)
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        KernelChoice("cpu", batch_invariant="yes")
    monkeypatch.setenv(invariant.ENV, "1")
    assert KernelChoice.loaded().batch_invariant and not before.batch_invariant  # a choice made earlier keeps its mode
    assert not backend.prepare(batch_invariant=False).batch_invariant  # the engine's config wins over the environment
    assert backend.prepare().batch_invariant  # None: the environment's


def test_device_code_reads_the_mode_from_the_choice_it_is_traced_with(monkeypatch):
    monkeypatch.delenv(invariant.ENV, raising=False)
    pure = KernelChoice.pure_jax("cpu")
    with backend.using(pure.with_batch_invariant(True)):
        assert invariant.active()
        with backend.using(pure):
            assert not invariant.active()
    assert not invariant.active()  # outside a step: the host's choice, whose mode is the environment's (unset)
    monkeypatch.setenv(invariant.ENV, "1")
    assert invariant.active()
    with backend.using(pure):  # a step's choice wins over the environment
        assert not invariant.active()


@pytest.fixture(scope="module")
def two_engines():
    """Two engines of the tiny model in this process on XLA's path (native kernels off while they decide), the
    invariant one built first: in the old process-wide mode the second would have traced tiles too."""
    import jaxinfer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXINFER_CPU_KERNELS", "0")
        mp.delenv(invariant.ENV, raising=False)
        inv = jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=TINY_ENGINE.replace(batch_invariant=True))
        plain = jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=TINY_ENGINE.replace(batch_invariant=False))
    yield inv, plain
    inv.close()
    plain.close()


def _decode_product_rows(llm, batch: int = 2) -> set:
    """The row counts of the hidden-state products (lhs [rows, hidden]) in the engine's program for a step of
    ``batch`` decode rows."""
    import re

    import jax


    runner, table = llm.engine.runner, llm.engine.runner.programs
    key = table.step_key(batch, batch, 1)  # a decode step: one token a request
    fn, args = table._abstract_args(key)
    with jax.set_mesh(runner.mesh):
        text = fn.lower(*args, cfg=runner.cfg, kernels=table.kernels).as_text()
    return {int(m) for m in re.findall(rf"dot_general[^\n]*?: \(tensor<(\d+)x{TINY.hidden_size}x", text)}


def test_two_engines_in_one_process_keep_their_own_mode(two_engines):
    inv, plain = two_engines
    a, b = inv.engine.runner.programs, plain.engine.runner.programs
    assert (a.kernels.batch_invariant, b.kernels.batch_invariant) == (True, False)
    assert not a.kernels.cpu_matmul and a.kernels.with_batch_invariant(False) == b.kernels  # the mode alone differs
    assert a.fingerprint != b.fingerprint
    # the invariant engine's decode multiplies fixed tiles of TILE_ROWS rows; the other its 2 rows, as XLA likes
    assert _decode_product_rows(inv) == {invariant.TILE_ROWS}
    assert _decode_product_rows(plain) == {2}


def test_a_tpu_choice_names_its_generation_instead_of_the_trace_reading_the_device():
    v6 = KernelChoice.for_platform("tpu", tpu_kind="TPU v6 lite")
    assert v6.tpu_kind == "TPU v6 lite" and v6 != KernelChoice.for_platform("tpu") and "TPU v6 lite" in str(v6)
    assert KernelChoice.loaded().tpu_kind == ""  # this host has no TPU
    with pytest.raises(ValueError, match="tpu_kind must name a TPU device kind"):
        KernelChoice("cuda", tpu_kind="TPU v6 lite")
    with pytest.raises(ValueError, match="tpu_kind"):
        KernelChoice("tpu", tpu_attention=True, tpu_kind="NVIDIA H100")
