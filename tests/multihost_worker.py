"""One process of the two-process test (tests/test_multihost.py): a tiny random Llama on a
tensor-parallel mesh over every process's CPU devices. Process 0 generates, updates the weights to a
second init and generates again, then back, and writes the tokens as JSON to argv[1]; the other
process follows its steps and its weight updates. The two inits come from the test in argv[2] (an .npz of
their leaves), so neither process draws them again (jax.random compiles an op for each leaf's shape).

Run by the test with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID and
XLA_FLAGS=--xla_force_host_platform_device_count=N set.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine import distributed

distributed.initialize()  # before anything touches the backend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import TINY, TINY_ENGINE  # noqa: E402

import jaxinfer  # noqa: E402
from jaxinfer.models import llama  # noqa: E402
from jaxinfer.ops.spec import init_random, is_spec  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7], list(range(20, 45))]


def inits() -> list:
    """The test's two random inits of TINY (A and B), as it draws them: `init_random` at keys 0 and 1."""
    return [init_random(llama.param_specs(TINY), jax.random.PRNGKey(seed)) for seed in (0, 1)]


def save_inits(path) -> None:
    np.savez(path, *[np.asarray(x) for tree in inits() for x in jax.tree.leaves(tree)])


def load_inits(path) -> list:
    treedef = jax.tree.structure(llama.param_specs(TINY), is_leaf=is_spec)
    with np.load(path) as z:
        leaves = [jnp.asarray(z[f"arr_{i}"]) for i in range(2 * treedef.num_leaves)]
    return [jax.tree.unflatten(treedef, leaves[:treedef.num_leaves]),
            jax.tree.unflatten(treedef, leaves[treedef.num_leaves:])]


def main() -> None:
    params, params_b = load_inits(sys.argv[2])
    engine = TINY_ENGINE.replace(tensor_parallel_size=jax.device_count())
    llm = jaxinfer.LLM.from_params(TINY, params, engine_config=engine)
    if distributed.is_leader():
        # the follower compiles these when the leader does (a warm-up plan), not one by one later
        llm.engine.runner.warmup(llm.engine.request_program_keys(len(PROMPTS[0]), 8), complete=False)
        sp = jaxinfer.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        draw = lambda: [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]  # noqa: E731
        got = {"tokens": draw(), "devices": jax.device_count(), "processes": jax.process_count()}
        # new weights mid-run (`LLM.update_params`): the leader broadcasts them, the follower takes them
        llm.update_params(params_b)
        got["tokens_b"] = draw()
        llm.update_params(params)
        got["tokens_again"] = draw()
        llm.close()
        with open(sys.argv[1], "w") as f:
            json.dump(got, f)
    else:
        steps = llm.follow()
        print(f"process {jax.process_index()} followed {steps} steps and "
              f"{llm.runner.warmups_followed} warm-up and {llm.runner.params_updates} updates", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
