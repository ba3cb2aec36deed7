"""Beyond one host: JAX's distributed runtime, with process 0 leading and the others following.

Every process runs the same compiled step programs over one global mesh (the
devices of all processes, `jax.devices()`), so XLA's collectives (NCCL on GPUs,
ICI on TPUs, gloo over TCP on CPUs) join them into one engine. Only process 0,
the *leader*, runs the engine: requests, the scheduler, the tokenizer, the page
allocator. Before each step it publishes the step's *plan* -- the program key and
the host inputs (token ids, attention and sampling metadata: a few KB of numpy)
-- in the distributed runtime's key-value store; every other process, a
*follower* (`ModelRunner.follow`, `LLM.follow`), takes the plan, feeds the same
inputs and runs the same program. A step's outputs are replicated, and the
leader reads its own copy. When the leader closes, it publishes a stop plan.

The key-value store (the coordination service JAX starts with
`jax.distributed.initialize`) costs a millisecond or two a plan on loopback, and needs no
compiled program (`multihost_utils.broadcast_one_to_all` compiles one per shape).
A plan is deleted once its step has completed (which needs every process). The leader
builds a step's inputs and program before publishing its plan; a failure after the
plan is out would leave the processes a step apart, so it ends the leader's process
(and the runtime's heartbeat then ends the others).

Start (every process, before anything touches a JAX backend): `initialize()`,
which calls `jax.distributed.initialize` with JAX's own environment
(``JAX_COORDINATOR_ADDRESS``, plus ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``
where no cluster manager -- SLURM, Open MPI, Kubernetes, Cloud TPU -- provides
them). ``jaxinfer`` commands call it when ``JAX_COORDINATOR_ADDRESS`` is set; a
program that relies on a cluster manager to supply the coordinator's address calls
``jax.distributed.initialize()`` itself, first.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
from typing import Any, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxinfer import progress

PLAN_PREFIX = "jaxinfer/plan/"
_STOP = "stop"


def initialize() -> bool:
    """Join the distributed runtime when the environment describes one; returns whether it did.

    Must run before any JAX backend is used. On CPU the cross-process collectives are gloo's.
    """
    if jax.distributed.is_initialized():
        return True
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not address:
        return False
    kw: dict[str, Any] = {"coordinator_address": address}
    if os.environ.get("JAX_NUM_PROCESSES"):
        kw["num_processes"] = int(os.environ["JAX_NUM_PROCESSES"])
    if os.environ.get("JAX_PROCESS_ID"):
        kw["process_id"] = int(os.environ["JAX_PROCESS_ID"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kw)
    return True


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    return jax.process_index() == 0


def _client():
    # Lazy: a private JAX module, so a JAX release that moves it breaks multi-process runs only.
    from jax._src.distributed import global_state

    if global_state.client is None:
        raise RuntimeError("the JAX distributed runtime is not initialized (jaxinfer.engine.distributed.initialize)")
    return global_state.client


_SESSIONS = [0]  # runners made in this process so far: every process makes them in the same order


class PlanChannel:
    """The leader's step plans, in order, through the distributed runtime's key-value store.

    Keys are ``jaxinfer/plan/<session>/<step>``: each runner (the same on every process)
    has its own session, so a second `LLM` in one run never meets the first one's keys.
    The leader deletes a plan once the step it planned has completed: a step completes only
    when every process has run it, so every follower has read its plan by then. (A warm-up
    plan, which lists programs to compile, plans no step and stays: a few keys a run.)
    """

    def __init__(self, wait_s: float = 60.0):
        self.client = _client()
        _SESSIONS[0] += 1
        self.prefix = f"{PLAN_PREFIX}{_SESSIONS[0]}/"
        self.step = 0
        self.wait_ms = int(wait_s * 1000)
        self.stopped = False
        self._in_flight: list = []  # (step, its output) not yet seen complete, oldest first
        self._lock = threading.Lock()

    def publish(self, key: Any, host_args: Any) -> int:
        """Leader: the plan of the next step (``key``: its program, ``host_args``: numpy inputs);
        returns its step number, for `dispatched`."""
        with self._lock:
            if self.stopped:
                raise RuntimeError("the followers were stopped: no more steps can run")
            self.client.key_value_set_bytes(f"{self.prefix}{self.step}", pickle.dumps((key, host_args), protocol=5))
            self.step += 1
            while self._in_flight and _complete(self._in_flight[0][1]):
                self.client.key_value_delete(f"{self.prefix}{self._in_flight.pop(0)[0]}")
            return self.step - 1

    def dispatched(self, step: int, out: Any) -> None:
        """Leader: step ``step`` was dispatched with output ``out`` (its plan goes when it completes)."""
        with self._lock:
            self._in_flight.append((step, out))

    def stop(self) -> None:
        """Leader: no more steps; the followers return."""
        with self._lock:
            if self.stopped:
                return
            self.client.key_value_set_bytes(f"{self.prefix}{self.step}", pickle.dumps((_STOP, None), protocol=5))
            self.stopped = True

    def receive(self) -> Optional[tuple[Any, Any]]:
        """Follower: the next plan, waiting as long as the leader is idle; None once it stopped."""
        name = f"{self.prefix}{self.step}"
        while True:
            try:
                blob = self.client.blocking_key_value_get_bytes(name, self.wait_ms)
                break
            except Exception as e:  # an idle leader: wait again (a dead one ends the process by heartbeat)
                if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e):
                    raise
        self.step += 1
        key, host_args = pickle.loads(blob)
        return None if key == _STOP else (key, host_args)


BROADCAST_WORDS = 1 << 24  # int32 words per collective of `broadcast_arrays` (64 MiB)


def broadcast_arrays(arrays: list) -> list:
    """The leader's host arrays on every process, bit for bit (`jaxinfer.LLM.update_params`).

    Every process calls it at the same point with arrays of the same shapes and dtypes (a
    follower's contents are ignored). The bytes go as int32 words through
    `jax.experimental.multihost_utils.broadcast_one_to_all` (a sum with the followers' zeros,
    exact in integers, so no float's bits change), in chunks of `BROADCAST_WORDS`: one
    compiled program per chunk size, reused by every later update of the same model; a host
    holds the whole tree once more while it arrives.
    """
    sizes = [int(np.asarray(a).nbytes) for a in arrays]
    words = max(1, -(-sum(sizes) // 4))
    chunk = min(BROADCAST_WORDS, words)
    n = -(-words // chunk)
    buf = np.zeros(n * chunk * 4, np.uint8)
    if is_leader():
        off = 0
        for a, size in zip(arrays, sizes):
            buf[off : off + size] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            off += size
    got = buf.view(np.int32).reshape(n, chunk)
    for i in range(n):
        got[i] = multihost_utils.broadcast_one_to_all(got[i])
    out, off = [], 0
    for a, size in zip(arrays, sizes):
        out.append(buf[off : off + size].view(np.asarray(a).dtype).reshape(np.shape(a)))
        off += size
    return out


def _complete(out: Any) -> bool:
    return all(x.is_ready() for x in jax.tree.leaves(out) if isinstance(x, jax.Array))


def lost_step(step: int, error: BaseException) -> None:
    """The leader failed to run a step whose plan is out: the followers are running it and would
    pair their next collectives with the wrong program. End this process (the runtime's
    heartbeat ends the others) rather than run on out of step."""
    message = f"jaxinfer: process 0 failed step {step} after publishing its plan ({type(error).__name__}: {error}); " \
              "the processes are out of step, exiting"
    logging.getLogger("jaxinfer").critical(message)
    print(message, file=sys.stderr, flush=True)
    os._exit(70)


def global_inputs(host_args: Any, sharding: Any) -> Any:
    """Host numpy inputs (the same on every process) as global arrays replicated on ``sharding``."""

    def put(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(put, host_args)


def to_host(x: jax.Array):
    """A replicated device array as numpy, on any process (each holds a whole copy)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))


def run_as_follower(llm) -> bool:
    """For commands: on a follower process, run the leader's steps until it closes and return
    True (the command has nothing else to do there); on the leader, or alone, return False."""
    if not is_multiprocess() or is_leader():
        return False
    steps = llm.follow()
    progress.say(f"process {jax.process_index()}: followed {steps} steps of process 0")
    return True
