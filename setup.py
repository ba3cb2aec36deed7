"""The install-time build of the CPU kernels (everything else about the package is in pyproject.toml).

``pip install`` (a wheel or an editable install) runs `build_py`, and after it the C++ kernels of
jaxinfer/ops/kernels are compiled for this CPU into that package's ``installed/`` folder, so a first
run only loads them (`jaxinfer.ops.kernels.install` says which builds and how a process picks one).
A failed build never fails the install: the kernels are then built on first use, as before.
``JAXINFER_KERNEL_TARGETS`` chooses the builds (default ``native``; ``x86-64-v3,x86-64-v4`` for a
wheel that other x86 machines install; ``none`` skips them).
"""

import importlib.util
import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
KERNELS = os.path.join("jaxinfer", "ops", "kernels")


def _by_path(name: str, relative: str):
    """A standard-library-only module of the package, loaded from its file (jaxinfer's dependencies may
    not be importable while it builds)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, relative))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        dest_root = HERE if getattr(self, "editable_mode", False) else self.build_lib
        dest = os.path.join(dest_root, KERNELS, "installed")

        def say(text):
            print(text, file=sys.stderr, flush=True)

        try:
            install = _by_path("_jaxinfer_kernels_install", os.path.join(KERNELS, "install.py"))
            env = _by_path("_jaxinfer_env", os.path.join("jaxinfer", "env.py"))
            targets = install.requested_targets()
            if not targets:
                return
            import jaxlib  # a build requirement: its FFI headers

            include = os.path.join(os.path.dirname(os.path.abspath(jaxlib.__file__)), "include")
            install.build_installed(os.path.join(HERE, KERNELS), dest, include, jaxlib.__version__,
                                    env.cpu_flags(), targets, say=say)
        except Exception as e:  # never fail the install: the runtime build is the fallback
            say(f"jaxinfer: the CPU kernels were not built at install time ({e}); they will be built on first use")


setup(cmdclass={"build_py": BuildPyWithKernels})
