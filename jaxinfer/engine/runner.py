"""The model runner: turns host request state into padded device inputs and calls the steps.

It owns the device state (parameters, KV cache, sampler state) and the
compiled step programs (`jaxinfer.engine.programs`), and nothing else; which
requests run, and where their pages are, is decided by the scheduler. All
padding to buckets happens here, through `jaxinfer.engine.buckets` and the program
table's page width.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.ops import backend
from jaxinfer.engine import distributed
from jaxinfer.ops.attention import RaggedMetadata
from jaxinfer.engine.buckets import pages_needed
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.distributed import to_host
from jaxinfer.ops.kv_cache import init_cache, slots_for
from jaxinfer.ops.mesh import TPLayout, cache_sharding, make_mesh, place_params, replicated, sharding_for
from jaxinfer.ops.mesh import leaf_name, family_relayouts
from jaxinfer.models import get_family
from jaxinfer.outputs import Logprob
from jaxinfer.engine.programs import ProgramKey, ProgramTable
from jaxinfer.ops.quant import is_quantized
from jaxinfer.engine.request import Request, TokenRef
from jaxinfer.engine.scheduler import PrefillChunk
from jaxinfer.ops.sampler import SamplerOutput, init_sampler_state
from jaxinfer.engine.sampling import RowSampling, build_metadata
from jaxinfer.engine.step import LogitsRows
from jaxinfer.sampling_params import MAX_LOGIT_BIAS
from jaxinfer.ops.spec import is_spec, zeros
from jaxinfer.engine.structured import bitmask_width, segment_masks
from jaxinfer.loading.weights import canonical_specs, check_param_tree, stored_tree


WARMUP = "warmup"  # a plan that lists programs to compile, not a step
UPDATE_PARAMS = "update_params"  # a plan: new weights, broadcast from the leader right after it


class ModelRunner:
    """``model_cfg`` is the model as loaded; ``params`` its tree (host or device arrays, or restored
    into `jaxinfer.ops.mesh.load_shardings`). On the engine's mesh the runner works with the
    tensor-parallel layout of both: `cfg` is `TPLayout.config(model_cfg)` (the plain model at
    ``tensor_parallel_size`` 1), `params` are laid out and placed, the KV cache is split by KV heads.
    """

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, params: Any):
        self.model_cfg = model_cfg
        self.ecfg = engine_cfg
        self.mesh = make_mesh(engine_cfg)
        self.layout = TPLayout.of(model_cfg, engine_cfg.tensor_parallel_size)
        self.cfg = self.layout.config(model_cfg)
        self.params = place_params(params, model_cfg, self.layout, self.mesh)
        self.max_model_len = engine_cfg.context_limit(model_cfg.max_position_embeddings, model_cfg.kv_window)
        self.kv_cache = init_cache(self.cfg, engine_cfg, sharding=cache_sharding(self.mesh, self.cfg))
        # zeros on every device of the mesh (each process its own), no program compiled for them
        self.sampler_state = jax.tree.map(
            lambda a: zeros(a.shape, a.dtype, replicated(self.mesh)),
            jax.eval_shape(functools.partial(init_sampler_state, engine_cfg.max_num_seqs, model_cfg.vocab_size)))
        # Several processes: the leader (process 0) publishes each step's plan, the others follow it.
        self.plans = distributed.PlanChannel() if distributed.is_multiprocess() else None
        # XLA:CPU's collectives block a pool thread per device until every device arrives, so two
        # steps in flight can starve each other: on a CPU mesh each step completes before the next.
        self.one_step_in_flight = self.mesh.devices.size > 1 and self.mesh.devices.flat[0].platform == "cpu"
        self.warmups_followed = 0  # a follower: warm-up plans of the leader it ran
        # the native kernels load here (progress lines, never inside a trace); every program is traced with this
        # choice, which carries this engine's product precision and batch-invariant mode (not the process's)
        self.kernels = backend.prepare(matmul_precision=engine_cfg.matmul_precision,
                                       batch_invariant=engine_cfg.batch_invariant)
        self.programs = ProgramTable(self)
        self._neutral_bias: dict = {}  # batch rows -> (bias_ids, bias_values) of no logit_bias, on device
        self._neutral_mask: dict = {}  # batch rows -> an all-ones allowed-token bitmask, on device
        self.mask_s = 0.0  # host time building the metadata of steps with constrained rows (the masks)
        self.mask_rows = 0  # constrained rows masked
        self.params_updates = 0  # weights swapped in since loading (`swap_params`)
        self.dispatched_at = 0.0  # perf_counter just before the last step program was called (its timing starts here)

    # -- padded inputs ---------------------------------------------------

    def _sampling(self, rows: list, batch: int):
        local = self.plans is None
        t0 = time.perf_counter()
        md = build_metadata(rows, batch, num_slots=self.ecfg.max_num_seqs, max_logprobs=self.ecfg.max_logprobs,
                            neutral_bias=self._neutral_bias_arrays if local else None,
                            vocab_size=self.model_cfg.vocab_size,
                            neutral_mask=self._neutral_mask_array if local else None,
                            prior_width=self.ecfg.num_speculative_tokens)
        constrained = sum(1 for r in rows if r is not None and r.constraint is not None)
        if constrained:
            self.mask_s += time.perf_counter() - t0
            self.mask_rows += constrained
        return md

    def _neutral_bias_arrays(self, batch: int) -> tuple:
        """The logit-bias arrays of a batch where no row has one, placed once per batch bucket:
        steps without a bias (nearly all) ship no [batch, MAX_LOGIT_BIAS] arrays to the device.
        (Several processes send host arrays in each step's plan, so they build them instead.)"""
        got = self._neutral_bias.get(batch)
        if got is None:
            host = (np.full((batch, MAX_LOGIT_BIAS), -1, np.int32), np.zeros((batch, MAX_LOGIT_BIAS), np.float32))
            got = self._neutral_bias[batch] = jax.device_put(host, replicated(self.mesh))
        return got

    def _neutral_mask_array(self, batch: int):
        """An all-ones allowed-token bitmask (no row constrained), placed once per batch bucket."""
        got = self._neutral_mask.get(batch)
        if got is None:
            host = np.full((batch, bitmask_width(self.model_cfg.vocab_size)), -1, np.int32)
            got = self._neutral_mask[batch] = jax.device_put(host, replicated(self.mesh))
        return got

    # -- steps -------------------------------------------------------------

    def step(self, decodes: Sequence[Request], chunks: Sequence[PrefillChunk]) -> SamplerOutput:
        """Dispatch one engine step (asynchronously): the decode rows, then the prefill chunks, as one
        ragged batch (`jaxinfer.engine.step.ragged_step`). Output row i is the i-th of that order;
        prompt logprobs are per token, the chunks' tokens following the decode rows' one each."""
        return self._run(*self.step_inputs(decodes, chunks))

    def step_inputs(self, decodes: Sequence[Request], chunks: Sequence[PrefillChunk]) -> tuple[ProgramKey, tuple]:
        """The step of ``decodes`` and ``chunks`` undispatched: its program's key and its host inputs
        (tokens, from_state, ragged attention metadata, logits rows, prompt rows, sampling metadata),
        which follow the runner's params, KV cache and sampler state. Benchmarks time the program on
        them directly.

        A decode row's input token still on device (`TokenRef`: drawn by a step not yet read back)
        is taken from the sampler state's per-slot last token, inside the step: no host round trip.
        A decode row with draft tokens (``Request.drafts``, speculative decoding) feeds its input and
        its drafts, and asks for logits at each: its verify segment (`jaxinfer.ops.sampler.Drafts`)."""
        ps = self.ecfg.page_size
        work = [(r, r.num_computed, 1 + len(r.drafts), False) for r in decodes]
        work += [(c.request, c.start, c.length, True) for c in chunks]
        real = sum(n for _, _, n, _ in work)
        num_rows = sum(n for _, _, n, prefill in work if not prefill) + len(chunks)
        key = self.programs.step_key(real, len(work), max(pages_needed(s + n, ps) for _, s, n, _ in work), num_rows)
        r_pad, n_pad, l_pad = key.batch, key.tokens, key.logits
        spec = self.ecfg.num_speculative_tokens
        tokens = np.zeros(n_pad, np.int32)
        from_state = np.zeros(n_pad, np.bool_)
        positions = np.full(n_pad, -1, np.int32)
        slots = np.zeros(n_pad, np.int32)
        query_start = np.full(r_pad + 1, real, np.int32)
        table = np.zeros((r_pad, key.pages), np.int32)
        kv_lens = np.zeros(r_pad, np.int32)
        prompt_rows = np.zeros(r_pad, np.bool_)
        index = np.zeros(l_pad, np.int32)
        request = np.full(l_pad, r_pad, np.int32)
        draft = np.full(l_pad, -1, np.int32)
        rows: list[Optional[RowSampling]] = [None] * l_pad
        at = row = 0
        for i, (r, s, n, prefill) in enumerate(work):
            k = pages_needed(s + n, ps)
            if len(r.pages) < k:
                raise RuntimeError(f"{r.request_id} has {len(r.pages)} pages, needs {k}")
            table[i, :k] = r.pages[:k]
            pos = np.arange(s, s + n, dtype=np.int32)
            if prefill:
                tokens[at:at + n] = r.all_token_ids(s, n)
            elif isinstance(r.last_token, TokenRef):
                if r.drafts:
                    raise RuntimeError(f"{r.request_id}: drafts need the input token on the host")
                from_state[at] = True
            else:
                tokens[at:at + n] = [r.last_token, *r.drafts]
            positions[at:at + n] = pos
            slots[at:at + n] = slots_for(table[i], pos, ps)
            query_start[i] = at
            kv_lens[i] = s + n
            prompt_rows[i] = prefill
            ends = not prefill or s + n == r.prefill_target
            # a constrained verify segment: each row masked by the grammar after the drafts before it
            masks = None
            if r.constraint is not None and not prefill and r.drafts:
                t0 = time.perf_counter()
                masks = segment_masks(r.constraint, r.drafts, self.model_cfg.vocab_size)
                self.mask_s += time.perf_counter() - t0
                self.mask_rows += n
            for j in range(1 if prefill else n):  # a chunk's last token; each token of a verify segment
                tok = at + n - 1 if prefill else at + j
                index[row], request[row] = tok, i
                if not prefill and j < n - 1:
                    draft[row] = r.drafts[j]
                rows[row] = RowSampling(r.params, r.seed, s + (n if prefill else j + 1), r.slot, is_output=ends,
                                        banned=r.banned_ids(j), prompt_len=r.prompt_len,
                                        constraint=r.constraint if ends and masks is None else None,
                                        prior=tuple(r.drafts[:j]) if not prefill else (),
                                        mask=None if masks is None else masks[j])
                row += 1
            at += n
        attn = RaggedMetadata(positions, slots, query_start, table, kv_lens)
        logits_rows = LogitsRows(index, request, draft if spec else None)
        md = self._sampling(rows, l_pad)
        return key, (tokens, from_state, attn, logits_rows, prompt_rows, md)

    def _run(self, key: ProgramKey, host_args: tuple) -> SamplerOutput:
        """Dispatch the program ``key`` on the host inputs; the leader of several processes
        first publishes them, so every process runs the same step."""
        prog = self.programs.get(key)
        self.dispatched_at = time.perf_counter()
        if self.plans is None:
            out, self.kv_cache, self.sampler_state = prog(self.params, self.kv_cache, self.sampler_state, *host_args)
        else:  # everything that can fail comes before the plan goes out
            args = distributed.global_inputs(host_args, replicated(self.mesh))
            step = self.plans.publish(key, host_args)
            try:
                out, self.kv_cache, self.sampler_state = prog(self.params, self.kv_cache, self.sampler_state, *args)
            except BaseException as e:
                distributed.lost_step(step, e)
            self.plans.dispatched(step, out)
        if self.one_step_in_flight:
            jax.block_until_ready(out)
        return out

    def warmup(self, keys: list, complete: bool = True) -> int:
        """Compile (or load) the programs ``keys`` (`ProgramTable.warmup`); the leader of several
        processes first tells the followers, so they compile them at the same time instead of
        one by one when the steps arrive."""
        if self.plans is not None and distributed.is_leader():
            self.plans.publish(WARMUP, (list(keys), complete))  # compiles only: no step to wait for
        return self.programs.warmup(keys, complete)

    # -- the weights (`jaxinfer.LLM.params`, `jaxinfer.LLM.update_params`) ------

    def canonical_params(self) -> Any:
        """The model's canonical tree (`jaxinfer.loading.weights.canonical_specs`) from the weights the runner
        holds: a leaf the layout leaves as loaded, float, is the runner's own array (no copy); a leaf
        re-laid out for tensor parallelism is gathered back into the model's order, and a quantized
        one dequantized to float32, each by a small jitted program (compiled on first use) into a
        new array on the mesh, split as the rules split the canonical leaf."""
        if self.plans is not None:
            raise ValueError(
                "LLM.params is not available on several processes: every process would have to "
                "run the gathers; read the weights in the training code that made them"
            )
        specs = jax.tree.leaves(canonical_specs(self.model_cfg), is_leaf=is_spec)
        flat, treedef = jax.tree_util.tree_flatten_with_path(self.params, is_leaf=is_quantized)
        maps = family_relayouts(self.model_cfg, self.layout)
        out = []
        for (path, x), spec in zip(flat, specs, strict=True):
            name = leaf_name(path)
            m = maps.get((name, 2 if is_quantized(x) else np.ndim(x)))
            if m is None and not is_quantized(x):
                out.append(x)
                continue
            axis, inv = (0, None) if m is None else (m[0], _inverse_map(m[1], spec.shape[m[0]]))
            fn = _canonical_fn(axis, is_quantized(x) and name == "lm_head", sharding_for(spec, self.mesh))
            out.append(fn(x, inv))
        return jax.tree_util.tree_unflatten(treedef, out)

    def prepare_params(self, params: Any) -> Any:
        """A canonical tree from the caller, checked (`jaxinfer.loading.weights.check_param_tree`: ValueError
        naming the first leaf that differs) and stored as loading stores it
        (`jaxinfer.loading.weights.stored_tree`: float leaves in the dtypes the runner holds, quantized ones
        quantized on the host by the model's scheme). Touches no runner state: any thread."""
        tree = check_param_tree(params, canonical_specs(self.model_cfg))
        return stored_tree(tree, self._stored_targets())

    def swap_params(self, stored: Any) -> None:
        """Lay out and place ``stored`` (`prepare_params`) as loading does and make it the weights of
        every later step; the old arrays are dropped (freed once the steps that use them are done).
        Same shapes, dtypes and shardings: no program recompiles. The caller runs it between
        steps, on the thread that dispatches them. The leader of several processes publishes an
        update plan and broadcasts the stored tree to the followers (`jaxinfer.engine.distributed
        .broadcast_arrays`), which place it in the same order."""
        if self.plans is None:
            self.params = self._place(stored)
            self.params_updates += 1
            return
        leaves, treedef = jax.tree.flatten(stored)
        leaves = [np.asarray(x) for x in leaves]  # a single process's arrays: `stored_tree` checked them
        step = self.plans.publish(UPDATE_PARAMS, sum(x.nbytes for x in leaves))
        try:
            stored = jax.tree.unflatten(treedef, distributed.broadcast_arrays(leaves))
            self.params = self._place(stored)
        except BaseException as e:
            distributed.lost_step(step, e)
        self.params_updates += 1

    def _place(self, stored: Any) -> Any:
        """``stored`` laid out and placed like the weights held now, in arrays of the runner's own."""
        new = place_params(stored, self.model_cfg, self.layout, self.mesh)
        # place_params keeps a device array that is already where it belongs: copy it, so the
        # runner never shares a buffer with the caller (a training step may donate its arrays)
        given = {id(x) for x in jax.tree.leaves(stored)}
        new = jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False) if id(x) in given else x, new)
        held = jax.tree_util.tree_flatten_with_path(self.params)[0]
        for (path, a), b in zip(held, jax.tree.leaves(new), strict=True):
            if (a.shape, a.dtype, a.sharding) != (b.shape, b.dtype, b.sharding):
                raise RuntimeError(f"params{jax.tree_util.keystr(path)}: placed as {b.shape} {b.dtype} "
                                   f"{b.sharding}, the programs take {a.shape} {a.dtype} {a.sharding}")
        return new

    def _stored_targets(self) -> list:
        """Per canonical leaf, how the runner stores it: its dtype, or a `QuantizedWeight` of specs."""
        specs = get_family(self.model_cfg.architecture).param_specs(self.model_cfg)
        stored = jax.tree.leaves(specs, is_leaf=lambda s: is_spec(s) or is_quantized(s))
        held = jax.tree.leaves(self.params, is_leaf=is_quantized)
        return [s if is_quantized(s) else np.dtype(h.dtype) for s, h in zip(stored, held, strict=True)]

    def _stored_zeros(self) -> Any:
        """Zeros in the structure, shapes and dtypes of a stored tree (a follower's receive buffers)."""
        specs = get_family(self.model_cfg.architecture).param_specs(self.model_cfg)
        is_leaf = lambda s: is_spec(s) or is_quantized(s)  # noqa: E731
        leaves, treedef = jax.tree.flatten(specs, is_leaf=is_leaf)
        zeros = lambda s, dtype=None: np.zeros(s.shape, dtype or s.dtype)  # noqa: E731
        return jax.tree.unflatten(treedef, [
            jax.tree.map(zeros, s) if is_quantized(s) else zeros(s, t)
            for s, t in zip(leaves, self._stored_targets(), strict=True)
        ])

    # -- several processes ---------------------------------------------------

    def follow(self) -> int:
        """A follower process: run the leader's steps, in order, until it stops; returns how many."""
        if self.plans is None or distributed.is_leader():
            raise RuntimeError("follow() is for processes other than 0 of a multi-process run")
        n = 0
        while (plan := self.plans.receive()) is not None:
            key, host_args = plan
            if key == WARMUP:
                self.programs.warmup(*host_args)
                self.warmups_followed += 1
                continue
            if key == UPDATE_PARAMS:
                self._receive_params(host_args)
                continue
            prog = self.programs.get(key)
            args = distributed.global_inputs(host_args, replicated(self.mesh))
            out, self.kv_cache, self.sampler_state = prog(self.params, self.kv_cache, self.sampler_state, *args)
            if self.one_step_in_flight:
                jax.block_until_ready(out)
            n += 1
        return n

    def _receive_params(self, nbytes: int) -> None:
        """A follower: the leader's new weights (`swap_params`), broadcast to every process."""
        zeros = self._stored_zeros()
        leaves, treedef = jax.tree.flatten(zeros)
        if sum(x.nbytes for x in leaves) != nbytes:
            raise RuntimeError(f"the leader sends {nbytes} bytes of weights, this process expects "
                               f"{sum(x.nbytes for x in leaves)}: the processes hold different models")
        stored = jax.tree.unflatten(treedef, distributed.broadcast_arrays(leaves))
        self.params = self._place(stored)
        self.params_updates += 1

    def stop_followers(self) -> None:
        """The leader: tell the followers there are no more steps."""
        if self.plans is not None and distributed.is_leader():
            self.plans.stop()


def _inverse_map(idx: np.ndarray, size: int) -> np.ndarray:
    """For a layout's index map (laid-out position -> original, -1 a pad): original -> a laid-out
    position that holds it (a KV head replicated over several shards: any of its copies)."""
    inv = np.full(size, -1, np.int32)
    real = np.nonzero(idx >= 0)[0]
    inv[idx[real]] = real
    if (inv < 0).any():
        raise RuntimeError(f"the layout drops positions {np.nonzero(inv < 0)[0][:5]} of a leaf")
    return inv


@functools.lru_cache(maxsize=None)
def _canonical_fn(axis: int, transpose: bool, out_sharding: Any):
    """A laid-out (and maybe quantized) leaf -> its canonical float value (`canonical_params`)."""

    def f(x, inv):
        w = x.dequantize(jnp.float32) if is_quantized(x) else x
        if inv is not None:
            w = jnp.take(w, inv, axis=axis)
        return w.T if transpose else w

    return jax.jit(f, out_shardings=out_sharding)


def read_output(out: SamplerOutput, rows: Sequence[tuple]) -> list:
    """Bring a step's results to the host: for each (request, first logits row, rows) in ``rows``, its
    tokens [(token, Logprob or None)]: one a row; a verify segment's (rows > 1, speculative decoding)
    are its emitted rows (``out.emitted``): the accepted drafts, then the token drawn after them."""
    tokens = to_host(out.tokens)
    emitted = to_host(out.emitted) if out.emitted is not None and any(n > 1 for _, _, n in rows) else None
    lps = None
    if out.logprob is not None and any(r.params.logprobs is not None for r, _, _ in rows):
        lps = (to_host(out.logprob), to_host(out.top_ids), to_host(out.top_logprobs))
    res = []
    for r, first, n in rows:
        m = int(emitted[first:first + n].sum()) if n > 1 else 1
        drawn = []
        for i in range(first, first + m):
            lp = None
            if lps is not None and r.params.logprobs is not None:
                k = r.params.logprobs
                top = {int(t): float(v) for t, v in zip(lps[1][i, :k], lps[2][i, :k])}
                lp = Logprob(int(tokens[i]), float(lps[0][i]), top)
            drawn.append((int(tokens[i]), lp))
        res.append(drawn)
    return res
