"""`LLM.params` and `LLM.update_params`: weights read and swapped in place, as a training loop does.

Two random inits of the tiny Llama (A and B): an engine updated to B draws the tokens of an engine
built from B, updated back to A the tokens it drew first, and nothing compiles across the updates;
`params` round-trips (float and int8: the stored integers are those a fresh quantized engine holds);
a bad tree is refused by name and the engine goes on; the prefix cache forgets pages computed by
the old weights; requests in flight are aborted. Tensor parallelism (one process, 4 devices) runs
this file as a worker in a subprocess. Two processes (the follower updated by the leader's
broadcast) are checked in tests/test_multihost.py, whose process pair does it after its own draw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import TINY, TINY_ENGINE, tiny_params  # noqa: E402

import jaxinfer  # noqa: E402
from jaxinfer.engine.compile_cache import compile_count  # noqa: E402
from jaxinfer.models import llama  # noqa: E402
from jaxinfer.ops.spec import is_spec  # noqa: E402

PROMPTS = [list(range(1, 14)), [5, 6, 7], [400, 3, 77, 12, 9]]
WORKER_PROMPTS = PROMPTS[:2]  # fewer programs to compile on the meshes
GREEDY = jaxinfer.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def tokens(llm, prompts=PROMPTS, sp=GREEDY) -> list:
    """One prompt at a time: a lone request always runs the same programs."""
    return [llm.generate(p, sp)[0].outputs[0].token_ids for p in prompts]


def in_layer(params, li: int, block: str, **leaves):
    """``params`` with leaves of block ``block`` of layer ``li`` replaced."""
    layers = list(params.layers)
    layers[li] = replace(layers[li], **{block: replace(getattr(layers[li], block), **leaves)})
    return replace(params, layers=layers)


def host_leaves(tree) -> list:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def same_arrays(a, b) -> bool:
    la, lb = host_leaves(a), host_leaves(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def weights():
    return tiny_params(seed=0), tiny_params(seed=1)


@pytest.fixture(scope="module")
def fresh_b(weights):
    """The tokens of an engine built from B."""
    llm = jaxinfer.LLM.from_params(TINY, weights[1], engine_config=TINY_ENGINE)
    try:
        yield tokens(llm), llm.params
    finally:
        llm.close()


@pytest.fixture(scope="module")
def llm(weights):
    llm = jaxinfer.LLM.from_params(TINY, weights[0], engine_config=TINY_ENGINE)
    yield llm
    llm.close()


def test_update_to_b_and_back_draws_each_models_tokens_and_compiles_nothing(llm, weights, fresh_b):
    a, b = weights
    want_a = tokens(llm)
    tokens(llm)  # the programs of a prefix hit, too
    before = compile_count()
    assert llm.update_params(b) == 0
    assert tokens(llm) == fresh_b[0] != want_a
    assert llm.update_params(a) == 0
    assert tokens(llm) == want_a
    assert compile_count() == before, "an update (or a step after it) compiled a program"
    assert llm.runner.params_updates == 2
    llm.engine.allocator.check_all_free()


def test_params_is_the_canonical_tree_and_round_trips(llm, weights, fresh_b):
    a, b = weights
    llm.update_params(a)
    p = llm.params
    assert jax.tree.structure(p) == jax.tree.structure(a)
    assert same_arrays(p, a)
    # one device, float: a view of the engine's own arrays
    assert all(x is y for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(llm.runner.params)))
    want = tokens(llm)
    llm.update_params(p)  # its own tree: new buffers (the engine never keeps the caller's), same values
    assert not any(x is y for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(llm.runner.params)))
    assert same_arrays(llm.params, a)
    assert tokens(llm) == want
    assert same_arrays(fresh_b[1], b)  # a fresh engine's params are what it was given


def test_old_weights_are_dropped(llm, weights):
    import weakref

    a, b = weights
    llm.update_params(a)
    held = [weakref.ref(x) for x in jax.tree.leaves(llm.runner.params)]
    llm.update_params(b)
    tokens(llm, PROMPTS[:1])  # a step after the swap
    assert all(r() is None for r in held), "the engine still holds the old weights"
    llm.update_params(a)


def test_numpy_and_other_dtypes_are_cast_to_the_engines(llm, weights, fresh_b):
    a, b = weights
    as_bf16 = jax.tree.map(lambda x: np.asarray(x).astype(jax.numpy.bfloat16), b)
    llm.update_params(as_bf16)
    got = llm.params
    assert all(x.dtype == np.float32 for x in host_leaves(got))
    assert same_arrays(got, jax.tree.map(lambda x: x.astype(np.float32), as_bf16))
    llm.update_params(jax.tree.map(np.asarray, b))  # numpy float32
    assert same_arrays(llm.params, b)
    assert tokens(llm) == fresh_b[0]
    llm.update_params(a)


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda t: in_layer(t, 1, "attention", wo=t.layers[1].attention.wo[:, :-1]),
         ["params.layers[1].attention.wo", "(64, 63) float32", "(64, 64)"]),
        (lambda t: in_layer(t, 0, "mlp", w_down=None), ["params.layers[0].mlp.w_down is missing"]),
        (lambda t: in_layer(t, 0, "attention", bqkv=np.zeros(3, np.float32)),
         ["params.layers[0].attention.bqkv", "not a parameter"]),
        (lambda t: replace(t, final_norm=np.ones(64, np.int32)), ["params.final_norm", "int32", "floating"]),
        (lambda t: replace(t, layers=t.layers[:1]), ["params.layers[1]", "missing"]),
        (lambda t: {"embed": t.embed, "final_norm": t.final_norm, "lm_head": t.lm_head, "layers": t.layers},
         ["params: a dict", "jaxinfer.models.weights_table.Params"]),
    ],
    ids=["shape", "missing", "extra", "dtype", "layers", "a-dict"],
)
def test_a_bad_tree_is_refused_by_name_and_the_engine_goes_on(llm, weights, change, words):
    a, b = weights
    llm.update_params(a)
    want = tokens(llm, PROMPTS[:1])
    bad = change(b)
    with pytest.raises(ValueError) as e:
        llm.update_params(bad)
    for w in words:
        assert w in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    assert tokens(llm, PROMPTS[:1]) == want
    assert llm.runner.params_updates > 0 and same_arrays(llm.params, a)


def test_the_prefix_cache_forgets_pages_of_the_old_weights(llm, weights, fresh_b):
    a, b = weights
    llm.update_params(a)
    prompt = PROMPTS[0]  # 13 tokens: 3 full pages of 4
    tokens(llm, [prompt])
    alloc = llm.engine.allocator
    hits = alloc.hits
    tokens(llm, [prompt])
    assert alloc.hits > hits  # the prompt's pages are cached
    llm.update_params(b)
    hits = alloc.hits
    assert tokens(llm, [prompt]) == fresh_b[0][:1]
    assert alloc.hits == hits, "a page computed by the old weights was reused"
    # the check can fail: the same swap without emptying the cache reuses A's pages and drifts
    llm.update_params(a)
    tokens(llm, [prompt])
    llm.engine.call_between_steps(lambda: llm.runner.swap_params(llm.runner.prepare_params(b)))
    assert tokens(llm, [prompt]) != fresh_b[0][:1]
    llm.update_params(a)


def test_requests_in_flight_are_aborted(llm, weights, fresh_b):
    import threading
    import time

    a, b = weights
    llm.update_params(a)
    long = jaxinfer.SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    for _ in range(5):  # a loaded machine may finish the request before the hold lands: try again
        request = llm.make_request(PROMPTS[1], long)
        stream = llm.submit(request)
        assert next(iter(stream)).token_ids
        # hold the engine between two steps, so the request is surely still running when the swap comes
        reached, go, running = threading.Event(), threading.Event(), []

        def hold_here():
            running.append(not request.finished)
            reached.set()
            go.wait()

        hold = threading.Thread(target=llm.engine.call_between_steps, args=(hold_here,))
        hold.start()
        assert reached.wait(10)
        if running[0]:
            break
        go.set()
        hold.join(10)
        stream.result()
    if not running[0]:
        pytest.skip("the request finished before the engine could be held, five times (a fast machine)")
    aborted: list = []
    update = threading.Thread(target=lambda: aborted.append(llm.update_params(b)))
    update.start()
    while update.is_alive() and llm.engine._calls.qsize() == 0:  # the swap waits behind the hold
        time.sleep(0.001)
    go.set()
    hold.join(10)
    update.join(30)
    assert aborted == [1]
    out = stream.result()
    assert out.outputs[0].finish_reason == "abort"
    assert 0 < len(out.outputs[0].token_ids) < 120
    assert tokens(llm, PROMPTS[1:2]) == fresh_b[0][1:2]
    assert llm.wait_idle()
    llm.engine.allocator.check_all_free()
    llm.update_params(a)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_update_stores_what_a_fresh_quantized_engine_holds(weights, mode):
    """int8 draws tokens too; int4 compares the stored trees only (no programs to compile)."""
    a, b = weights
    engine = TINY_ENGINE.replace(quantization=mode)
    q = jaxinfer.LLM.from_params(TINY, a, engine_config=engine)
    fresh = jaxinfer.LLM.from_params(TINY, b, engine_config=engine)
    try:
        if mode == "int8":
            want_a = tokens(q)
            want_b = tokens(fresh)
        before = compile_count()
        q.update_params(b)
        assert same_arrays(q.runner.params, fresh.runner.params)  # the same integers, scales, layout
        if mode == "int8":
            assert tokens(q) == want_b
        assert compile_count() == before
        pb = q.params  # dequantized, float32, the canonical tree
        assert jax.tree.structure(pb) == jax.tree.structure(b)
        assert all(x.dtype == np.float32 for x in host_leaves(pb))
        assert same_arrays(pb, fresh.params)
        err = max(float(np.max(np.abs(x - y))) for x, y in zip(host_leaves(pb), host_leaves(b)))
        assert 0 < err < (0.01 if mode == "int8" else 0.1)  # rounded, not garbled (the weights: std 0.3)
        q.update_params(pb)  # its own dequantized values quantize back to the same integers
        assert same_arrays(q.runner.params, fresh.runner.params)
        q.update_params(a)
        if mode == "int8":
            assert tokens(q) == want_a
    finally:
        q.close()
        fresh.close()


# -- tensor parallelism: this file as a worker ------------------------------------------------


def _save_weights(path, trees) -> None:
    """The trees' leaves in one .npz: the worker takes this process's draws instead of drawing them again
    (`tiny_params` compiles a jax.random op for each leaf's shape: seconds in a fresh process)."""
    np.savez(path, *[np.asarray(x) for tree in trees for x in jax.tree.leaves(tree)])


def _load_weights(path) -> list:
    treedef = jax.tree.structure(llama.param_specs(TINY), is_leaf=is_spec)
    n = treedef.num_leaves
    with np.load(path) as z:
        leaves = [jax.numpy.asarray(z[f"arr_{i}"]) for i in range(len(z.files))]
    return [jax.tree.unflatten(treedef, leaves[i:i + n]) for i in range(0, len(leaves), n)]


def _run_worker(tmp_path, devices: int, weights) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    out, npz = tmp_path / "tp.json", tmp_path / "weights.npz"
    _save_weights(npz, weights)
    p = subprocess.run([sys.executable, os.path.abspath(__file__), str(out), str(npz)], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=500)
    assert p.returncode == 0, f"the worker exited with {p.returncode}:\n{p.stdout[-3000:]}"
    return json.loads(out.read_text())


def test_tensor_parallel_update_and_params(tmp_path, llm, weights, fresh_b):
    """One process, 4 devices: KV heads replicated over shards, the MLP split; updates and
    `params` go through the layout and back."""
    llm.update_params(weights[0])
    got = _run_worker(tmp_path, 4, weights)
    assert got["tp"] == 4
    assert got["a"] == tokens(llm, WORKER_PROMPTS) and got["b"] == fresh_b[0][:2] and got["a_again"] == got["a"]
    assert got["compiles"] == 0
    assert got["params_a"] and got["params_b"] and got["int8"], got


def _worker(out_path: str, weights_path: str) -> None:
    a, b = _load_weights(weights_path)  # the test's `weights`: tiny_params at seeds 0 and 1
    engine = TINY_ENGINE.replace(tensor_parallel_size=jax.device_count())
    llm = jaxinfer.LLM.from_params(TINY, a, engine_config=engine)
    res: dict = {"tp": engine.tensor_parallel_size}
    res["a"] = tokens(llm, WORKER_PROMPTS)
    tokens(llm, WORKER_PROMPTS)  # the programs of a prefix hit, too
    before = compile_count()
    llm.update_params(b)
    res["b"] = tokens(llm, WORKER_PROMPTS)
    llm.update_params(a)
    res["a_again"] = tokens(llm, WORKER_PROMPTS)
    res["compiles"] = compile_count() - before
    res["params_a"] = same_arrays(llm.params, a)  # gathered back from the layout
    llm.update_params(b)
    res["params_b"] = same_arrays(llm.params, b)
    # int8 on the mesh: the stored tree and its dequantized values are those of one device's
    q = jaxinfer.LLM.from_params(TINY, a, engine_config=engine.replace(quantization="int8"))
    one = jaxinfer.LLM.from_params(TINY, b, engine_config=TINY_ENGINE.replace(quantization="int8"))
    q.update_params(b)
    res["int8"] = same_arrays(q.params, one.params)
    q.update_params(q.params)
    res["int8"] = res["int8"] and same_arrays(q.params, one.params)
    llm.close()
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
