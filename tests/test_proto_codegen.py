"""The committed gRPC code is what `python -m jaxinfer.server.codegen` makes from server/jaxinfer.proto."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools is not installed (pip install -e .[test])")

from jaxinfer.server import codegen  # noqa: E402


def test_committed_generated_code_is_not_stale(tmp_path):
    written = codegen.generate(str(tmp_path))
    assert sorted(os.path.basename(p) for p in written) == sorted(codegen.GENERATED)
    for name in codegen.GENERATED:
        with open(os.path.join(codegen.HERE, name), encoding="utf-8") as f:
            committed = f.read()
        with open(tmp_path / name, encoding="utf-8") as f:
            fresh = f.read()
        assert codegen.normalized(committed) == codegen.normalized(fresh), (
            f"server/{name} is stale: run `python -m jaxinfer.server.codegen` and commit the result"
        )


def test_generated_code_imports_inside_the_package():
    with open(os.path.join(codegen.HERE, "jaxinfer_pb2_grpc.py"), encoding="utf-8") as f:
        text = f.read()
    assert "from jaxinfer.server import jaxinfer_pb2 as jaxinfer__pb2" in text
    assert "\nimport jaxinfer_pb2" not in text
    from jaxinfer.server import jaxinfer_pb2

    assert jaxinfer_pb2.DESCRIPTOR.package == "jaxinfer.v1"
    assert {m.name for m in jaxinfer_pb2.DESCRIPTOR.services_by_name["Generation"].methods} == {
        "Generate", "Tokenize", "GetModelInfo",
    }
