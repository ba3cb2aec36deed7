"""The house's rules: the import-linter contracts in pyproject.toml hold for the package as it installs.

`models/`, `server/` and `configs/` sit at the repository's top level and are mapped into `jaxinfer.*`
(pyproject's package-dir), so the check reads a copy of the package laid out as it installs. The
contracts: the layers (entry points > llm > engine > loading > text > models > ops > base), the
scheduler free of JAX, and no import circle between the modules of any folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _installed_layout(dst) -> str:
    pkg = os.path.join(dst, "jaxinfer")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(os.path.join(ROOT, "jaxinfer"), pkg, ignore=ignore)
    for mapped in ("models", "server", "configs"):
        shutil.copytree(os.path.join(ROOT, mapped), os.path.join(pkg, mapped), ignore=ignore)
    return str(dst)


def _lint_imports(where: str, *extra: str) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    env = dict(os.environ, PYTHONPATH=where)
    return subprocess.run([exe, "--config", os.path.join(ROOT, "pyproject.toml"), "--no-cache", *extra],
                          cwd=where, env=env, capture_output=True, text=True, timeout=300)


def test_every_import_contract_holds(tmp_path):
    out = _lint_imports(_installed_layout(tmp_path))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_an_upward_import_breaks_the_layers_contract(tmp_path):
    """The check can fail: one import from ops up into the engine is reported by name."""
    where = _installed_layout(tmp_path)
    with open(os.path.join(where, "jaxinfer", "ops", "kv_cache.py"), "a") as f:
        f.write("\nfrom jaxinfer.engine import scheduler  # noqa: E402,F401\n")
    out = _lint_imports(where)
    assert out.returncode != 0
    assert "jaxinfer.ops.kv_cache -> jaxinfer.engine.scheduler" in out.stdout
