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
`jax.distributed.initialize`) costs about 1.5 ms a plan on loopback, and needs no
compiled program (`multihost_utils.broadcast_one_to_all` compiles one per shape).
Plans are deleted two steps later: a follower cannot fall further behind than one
step, because the leader's step waits for every process in its collectives.

Start (every process, before anything touches a JAX backend): `initialize()`,
which calls `jax.distributed.initialize` with JAX's own environment
(``JAX_COORDINATOR_ADDRESS``, plus ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``
where no cluster manager -- SLURM, Open MPI, Kubernetes, Cloud TPU -- provides
them). ``jaxinfer`` commands call it when ``JAX_COORDINATOR_ADDRESS`` is set.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Optional

import jax
import numpy as np

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
    from jax._src.distributed import global_state

    if global_state.client is None:
        raise RuntimeError("the JAX distributed runtime is not initialized (jaxinfer.distributed.initialize)")
    return global_state.client


class PlanChannel:
    """The leader's step plans, in order, through the distributed runtime's key-value store."""

    def __init__(self, wait_s: float = 60.0):
        self.client = _client()
        self.step = 0
        self.wait_ms = int(wait_s * 1000)

    def publish(self, key: Any, host_args: Any) -> None:
        """Leader: the plan of the next step (``key``: its program, ``host_args``: numpy inputs)."""
        self.client.key_value_set_bytes(f"{PLAN_PREFIX}{self.step}", pickle.dumps((key, host_args), protocol=5))
        if self.step >= 2:  # every follower has taken it: it is running the step after it
            self.client.key_value_delete(f"{PLAN_PREFIX}{self.step - 2}")
        self.step += 1

    def stop(self) -> None:
        """Leader: no more steps; the followers return."""
        self.publish(_STOP, None)

    def receive(self) -> Optional[tuple[Any, Any]]:
        """Follower: the next plan, waiting as long as the leader is idle; None once it stopped."""
        name = f"{PLAN_PREFIX}{self.step}"
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
    from jaxinfer import progress

    progress.say(f"process {jax.process_index()}: followed {steps} steps of process 0")
    return True
