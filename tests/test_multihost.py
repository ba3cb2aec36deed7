"""Two processes x four CPU devices, one tensor-parallel engine: JAX's distributed runtime over
loopback (gloo collectives), process 0 leading and publishing each step's plan, process 1
following (`jaxinfer.engine.distributed`). Greedy tokens must equal one process's, before and after
the leader updates the weights (`LLM.update_params`: broadcast, the follower takes them; the
two-process update check of tests/test_update_params.py, run here to start the pair once)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

import jaxinfer
from conftest import TINY, TINY_ENGINE

WORKER = os.path.join(os.path.dirname(__file__), "multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_draw_the_tokens_of_one(tmp_path):
    sys.path.insert(0, os.path.dirname(WORKER))
    from multihost_worker import PROMPTS, inits, save_inits

    weights = tmp_path / "inits.npz"
    save_inits(weights)  # drawn once here (this process has the ops compiled), not in each worker

    env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}", JAX_NUM_PROCESSES="2",
               XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    out = tmp_path / "tokens.json"
    procs = [
        subprocess.Popen([sys.executable, WORKER, str(out), str(weights)], env=dict(env, JAX_PROCESS_ID=str(i)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in (0, 1)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=400)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{log[-3000:]}"
    got = json.loads(out.read_text())
    assert got["devices"] == 8 and got["processes"] == 2
    assert "followed" in logs[1] and "and 1 warm-up and 2 updates" in logs[1], logs[1][-2000:]

    params, params_b = inits()
    llm = jaxinfer.LLM.from_params(TINY, params, engine_config=TINY_ENGINE)
    try:
        sp = jaxinfer.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
        llm.update_params(params_b)
        want_b = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
    finally:
        llm.close()
    assert got["tokens"] == want and got["tokens_again"] == want
    # the follower took the new weights too: a step's tokens are the leader's only if both shards are B's
    assert got["tokens_b"] == want_b != want
