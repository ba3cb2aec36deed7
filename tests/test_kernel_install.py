"""The CPU kernels built at install time: a first run loads them without a compiler, a process picks only a
build that fits (this source, this jaxlib, this CPU), and without one the runtime build is the fallback, with
the load line saying what actually runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import save_char_model

from jaxinfer.ops import kernels
from jaxinfer.ops.kernels import install


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_char_model(tmp_path_factory)


def _recording_compiler(tmp_path, then_run: str = "") -> tuple[str, str]:
    """A `$CXX` that writes its arguments to a log, then runs ``then_run`` with them (or fails)."""
    log = tmp_path / "cxx.log"
    script = tmp_path / "cxx"
    tail = f'exec {then_run} "$@"' if then_run else "exit 1"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\n{tail}\n')
    script.chmod(0o755)
    return str(script), str(log)


def _fresh_env(tmp_path, **extra) -> dict:
    """A new user's environment: an empty HOME (so empty kernel, program and model caches)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "JAXINFER_MODEL_CACHE")}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env.update(HOME=str(home), JAX_PLATFORMS="cpu", **extra)
    return env


def _generate(model_dir, env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxinfer", "generate", "hello", "--model", str(model_dir), "--max-tokens", "2",
         "--max-model-len", "48", "--num-pages", "8", "--verbose"],
        capture_output=True, text=True, timeout=240, env=env)


def test_a_first_run_loads_the_installed_kernels_and_never_calls_a_compiler(tiny_model_dir, tmp_path):
    if kernels.installed(kernels.MATMUL) is None or kernels.installed(kernels.PAGED_ATTENTION) is None:
        pytest.skip("no install-time kernel build for this source, jaxlib and CPU (pip install -e . makes it)")
    cxx, log = _recording_compiler(tmp_path)
    p = _generate(tiny_model_dir, _fresh_env(tmp_path, CXX=cxx))
    assert p.returncode == 0, p.stderr
    assert not os.path.exists(log), f"a compiler ran: {open(log).read()}"
    assert "loading the CPU matmul kernel" in p.stderr and "building" not in p.stderr
    assert "CPU kernels: matmul native" in p.stderr and "attention native" in p.stderr, p.stderr


def test_a_failed_build_falls_back_and_the_load_line_says_what_runs(tiny_model_dir, tmp_path):
    """No installed kernels and a compiler that fails: the engine runs XLA's product, and dtype "auto" is chosen
    after the kernels load, so it is float32 (XLA's bfloat16 product is not batch-invariant) and says why."""
    cxx, log = _recording_compiler(tmp_path)
    p = _generate(tiny_model_dir, _fresh_env(tmp_path, CXX=cxx, JAXINFER_INSTALLED_KERNELS="0"))
    assert p.returncode == 0, p.stderr
    assert os.path.exists(log)  # the runtime build was tried
    line = next(ln for ln in p.stderr.splitlines() if "weights:" in ln)
    assert "weights: float32; dtype auto: the native CPU matmul kernel could not be loaded" in line, line
    assert "matmul XLA" in line and "attention pure-JAX" in line, line


def test_without_an_installed_build_the_first_use_compiles_the_kernel(tmp_path):
    """The runtime build still works: the attention kernel (the quicker of the two) built into a fresh cache."""
    gxx = kernels.compiler()
    if gxx is None:
        pytest.skip("no C++ compiler")
    cxx, log = _recording_compiler(tmp_path, then_run=gxx)
    code = ("from jaxinfer.ops import kernels; import sys; "
            "sys.exit(0 if kernels.prepare(kernels.PAGED_ATTENTION) else 1)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=_fresh_env(tmp_path, CXX=cxx, JAXINFER_INSTALLED_KERNELS="0"))
    assert p.returncode == 0, p.stderr
    assert "paged_attention_cpu.cc" in open(log).read()
    assert any(f.startswith("paged_attention_cpu-") for f in os.listdir(tmp_path / "home/.cache/jaxinfer/kernels"))


# -- which installed build a process takes (`install.find`) ----------------------------------------------

V3 = set(install.LEVELS["x86-64-v3"])
V4 = set(install.LEVELS["x86-64-v4"])


def _install_dir(tmp_path, entries) -> str:
    """An installed/ folder with a manifest of ``entries`` (each file present, contents irrelevant to `find`)."""
    d = tmp_path / "installed"
    d.mkdir()
    for e in entries:
        (d / e["file"]).write_bytes(b"")
    (d / install.MANIFEST).write_text(json.dumps({"libraries": entries}))
    return str(d)


def _entry(source_path, target, jaxlib="1.0", flags=(), digest=None):
    return {"source": os.path.basename(source_path), "target": target, "file": f"k-{target}.so",
            "source_sha256": digest or install.source_digest(source_path), "jaxlib": jaxlib,
            "cpu_signature": install.cpu_signature(flags) if target == "native" else None,
            "requires": list(install.LEVELS.get(target, ()))}


@pytest.fixture()
def source(tmp_path):
    p = tmp_path / "k.cc"
    p.write_text("// a kernel\n")
    return str(p)


def test_find_takes_the_native_build_on_its_own_cpu_and_the_highest_level_elsewhere(tmp_path, source):
    here = V4 | {"avx512_bf16"}
    d = _install_dir(tmp_path, [_entry(source, t, flags=here) for t in ("native", "x86-64-v3", "x86-64-v4")])
    assert install.find(d, source, "1.0", here).endswith("k-native.so")
    assert install.find(d, source, "1.0", V4).endswith("k-x86-64-v4.so")  # another CPU: not native
    assert install.find(d, source, "1.0", V3 | {"sse4_2"}).endswith("k-x86-64-v3.so")
    assert install.find(d, source, "1.0", {"sse4_2"}) is None  # no level fits: the runtime build


def test_find_refuses_a_build_of_another_source_or_jaxlib(tmp_path, source):
    d = _install_dir(tmp_path, [_entry(source, "x86-64-v3")])
    assert install.find(d, source, "1.0", V3) is not None
    assert install.find(d, source, "2.0", V3) is None  # built against other FFI headers
    with open(source, "a") as f:
        f.write("// edited in an editable install\n")
    assert install.find(d, source, "1.0", V3) is None
    assert install.find(str(tmp_path / "nowhere"), source, "1.0", V3) is None


def test_install_targets_are_checked_by_name():
    assert install.requested_targets("none") == [] and install.requested_targets("") == []
    assert install.requested_targets("native") == ["native"]
    with pytest.raises(ValueError, match="unknown kernel target 'x86-64-v9': native, x86-64-v3, x86-64-v4"):
        install.requested_targets("native,x86-64-v9")
    assert "-march=x86-64-v4" in install.machine_flags("x86-64-v4")
