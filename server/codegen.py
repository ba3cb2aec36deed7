"""Regenerate the Python code of the gRPC API from ``server/jaxinfer.proto``.

    python -m jaxinfer.server.codegen            # rewrite server/jaxinfer_pb2{,_grpc}.py{,i}
    python -m jaxinfer.server.codegen --out DIR  # write them somewhere else (the staleness test)

Runs ``grpc_tools.protoc`` (``pip install grpcio-tools``, in the ``test`` extra)
and makes the generated import package-relative
(``from jaxinfer.server import jaxinfer_pb2``), so the code works inside the
installed ``jaxinfer.server`` package.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from typing import Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = "jaxinfer.proto"
GENERATED = ("jaxinfer_pb2.py", "jaxinfer_pb2.pyi", "jaxinfer_pb2_grpc.py")

# Lines that only record the versions of the tools that generated the code.
_VERSION_LINES = re.compile(
    r"^(# Protobuf Python Version: .*|GRPC_GENERATED_VERSION = .*|\s+\d+,)$", re.MULTILINE
)


def generate(out_dir: str, proto_dir: str = HERE) -> list:
    """Run protoc on ``proto_dir/jaxinfer.proto``; write the fixed-up files into ``out_dir``."""
    import grpc_tools  # lazy: grpcio-tools is optional (the test extra); only regenerating needs it
    from grpc_tools import protoc

    os.makedirs(out_dir, exist_ok=True)
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main([
            "grpc_tools.protoc",
            f"-I{proto_dir}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            os.path.join(proto_dir, PROTO),
        ])
        if rc != 0:
            raise RuntimeError(f"protoc failed with status {rc} on {os.path.join(proto_dir, PROTO)}")
        written = []
        for name in GENERATED:
            with open(os.path.join(tmp, name), encoding="utf-8") as f:
                text = f.read()
            text = text.replace(
                "import jaxinfer_pb2 as jaxinfer__pb2", "from jaxinfer.server import jaxinfer_pb2 as jaxinfer__pb2"
            )
            dest = os.path.join(out_dir, name)
            with open(dest, "w", encoding="utf-8") as f:
                f.write(text)
            written.append(dest)
    return written


def normalized(text: str) -> str:
    """Generated code without the tool-version lines (so another grpcio-tools release is not 'stale')."""
    return _VERSION_LINES.sub("", text)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.server.codegen", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=HERE, help="output folder (default: the server package itself)")
    args = p.parse_args(argv)
    for path in generate(args.out):
        print(f"wrote {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
