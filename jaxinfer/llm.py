"""`LLM`: the library entry point (load a model, generate, stream, chat).

    llm = jaxinfer.LLM("smollm2-135m-instruct")
    outs = llm.generate(["The KV cache is"], jaxinfer.SamplingParams(max_tokens=32, temperature=0))
    for piece in llm.stream("Hello", jaxinfer.SamplingParams(max_tokens=16)):
        print(piece.text, end="")
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import time
from typing import Any, Iterator, Optional, Sequence, Union

import jax

from jaxinfer import models
from jaxinfer import progress
from jaxinfer.loading import model_cache as cache
from jaxinfer.loading.generation_config import describe_generation, resolve_generation_config
from jaxinfer.loading.weights import resolve_model
from jaxinfer.ops import backend, kv_cache
from jaxinfer.ops.quant import quantize_params
from jaxinfer.engine.compile_cache import enable_compilation_cache
from jaxinfer.config import DEFAULT_MODEL, EngineConfig, GenerationDefaults, ModelConfig
from jaxinfer.engine.core import Engine, RequestStream
from jaxinfer.engine.kv_transfer import KVTransferParams
from jaxinfer.ops.mesh import fit_pages, mesh_placement, placement_report
from jaxinfer.metrics import RequestMetrics
from jaxinfer.outputs import StreamDelta, merge_choices
from jaxinfer.engine.processor import InputProcessor, Prompt
from jaxinfer.engine.request import Request, new_request_id
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.sampling_params import SamplingParams



class LLM:
    """A model loaded for generation.

    `model` is a name, a GGUF path, a Hugging Face directory (or Hub repo id), or a directory
    written by ``jaxinfer convert`` / `jaxinfer.save_model`. A GGUF file or a Hugging Face
    directory is converted once into the engine's own checkpoint and restored from the model
    cache afterwards (``model_cache=False`` or ``JAXINFER_MODEL_CACHE=0`` turns that off).

    Start-up stages (resolving, converting or restoring, building kernels, compiling) are shown on a
    terminal's (or a notebook's) stderr, as the CLI shows them, unless logging shows the
    ``"jaxinfer"`` logger's INFO records (then they are log lines instead) or a level above INFO is
    set on it (the rule is `jaxinfer.progress.library_shows`). ``progress=False`` turns the lines
    off, ``progress=True`` on, on any stderr (for the process).
    """

    model_source = None  # the resolved ModelSource (None for from_params)
    model_cache_path = None  # the model cache entry restored or written, if any

    # progress=None|True|False, keyword-only: the start-up stage lines on stderr (jaxinfer.progress.keyword)
    @progress.keyword
    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        engine_config: Union[None, str, EngineConfig] = None,
        dtype: Optional[str] = None,
        quantization: Optional[str] = None,
        max_model_len: Optional[int] = None,
        enable_prefix_caching: bool = True,
        scheduling_policy: str = "fcfs",
        log_stats_interval: Optional[float] = None,
        max_num_batched_tokens: Optional[int] = None,
        warmup: bool = False,
        model_cache: bool = True,
        generation_config: Optional[str] = "auto",
        kv_transfer_config: Optional[dict] = None,
        **engine_overrides,
    ):

        t0 = time.perf_counter()
        if quantization is not None:
            engine_overrides["quantization"] = quantization
        backend.start_build()  # the native CPU kernels, when not installed: a background compile
        # dtype "auto" is chosen after the kernels load (`backend.dtype_choice`): by what actually runs
        engine = _engine_config(engine_config, dtype, max_model_len, engine_overrides)
        with progress.stage(f"resolving model {model}") as s:
            source = resolve_model(model)
            s.note(f"{source.format}: {source.path}")
        # The converted-model cache (jaxinfer.loading.model_cache): the first load of a GGUF file or an HF
        # directory converts it and saves the engine's tree; later loads restore it.
        loaded = cache.load(source, engine.dtype, use_cache=model_cache, placement=mesh_placement(engine),
                            quantization=engine.quantization)
        progress.say(f"model {source.name}: {models.describe(loaded.config)}; weights: {_weights_note(engine)}; "
                     f"{_kv_note(loaded.config, engine)}{_kernels_note()}")
        self.model_source = source
        self.model_cache_path = loaded.cache_path
        self._setup(
            loaded.config, engine, loaded.take_params(), loaded.tokenizer, loaded.generation, source.name,
            enable_prefix_caching=enable_prefix_caching, scheduling_policy=scheduling_policy,
            log_stats_interval=log_stats_interval,
            max_num_batched_tokens=max_num_batched_tokens, generation_config=generation_config,
            kv_transfer_config=kv_transfer_config,
        )
        self.load_time_s = time.perf_counter() - t0
        if warmup:
            self.engine.warmup()

    @classmethod
    def from_params(
        cls,
        model_config: ModelConfig,
        params: Any,
        *,
        tokenizer=None,
        engine_config: Union[None, str, EngineConfig] = None,
        generation: Optional[GenerationDefaults] = None,
        name: str = "custom",
        **engine_options,
    ) -> "LLM":
        """Wrap an in-memory parameter tree (research code, tests with random weights)."""
        self = cls.__new__(cls)
        engine = _engine_config(engine_config, None, None, {})
        if engine.quantization and not model_config.quant:  # a float tree, quantized here
            model_config, params = quantize_params(params, model_config, engine.quantization)
        self._setup(model_config, engine, params, tokenizer, generation or GenerationDefaults(), name, **engine_options)
        self.load_time_s = 0.0
        return self

    def _setup(
        self,
        cfg,
        engine,
        params,
        tokenizer,
        generation,
        name,
        *,
        enable_prefix_caching: bool = True,
        scheduling_policy: str = "fcfs",
        log_stats_interval: Optional[float] = None,
        max_num_batched_tokens: Optional[int] = None,
        generation_config: Optional[str] = None,
        kv_transfer_config: Optional[dict] = None,
    ) -> None:
        enable_compilation_cache()
        if generation_config is not None:  # "auto", "vllm" or a path; None (from_params): `generation` as given
            progress.say(describe_generation(generation_config, generation))  # the load line says which
            generation = resolve_generation_config(generation_config, generation)
        self.generation_config = generation_config
        self.model_config: ModelConfig = cfg
        engine = fit_pages(cfg, engine)  # kv_cache_memory_bytes -> num_pages, by the model's cache layout
        self.tokenizer = tokenizer
        self.generation_defaults: GenerationDefaults = generation
        self.model_name = name
        self.engine_config = engine
        self.runner = ModelRunner(cfg, engine, params)
        del params  # the runner holds the placed tree; what was loaded (host copies) is freed here
        if engine.tensor_parallel_size > 1:
            progress.say(placement_report(self.runner))
        self.max_model_len = self.runner.max_model_len
        self.engine = _Engine(
            self.runner,
            enable_prefix_caching=enable_prefix_caching,
            policy=scheduling_policy,
            log_stats_interval=log_stats_interval,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_transfer_config=kv_transfer_config,
        )
        self.processor = InputProcessor(
            tokenizer, vocab_size=cfg.vocab_size, max_model_len=self.max_model_len,
            max_logprobs=engine.max_logprobs, generation=generation,
        )
        self.eos_token_ids = self.processor.eos_token_ids

    # -- requests ------------------------------------------------------------

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation defaults (generation_config.json)."""
        return self.processor.default_sampling_params()

    def make_request(self, prompt: Prompt, params: Optional[SamplingParams] = None, **options) -> Request:
        """A validated `Request` for a prompt (text or token ids), or for ``messages=[...]`` with prompt None.

        The one front door (`jaxinfer.engine.processor.InputProcessor.process`): the options are its
        keywords (messages, chat_template_kwargs, add_generation_prompt, request_id, priority,
        metrics, fit_max_tokens), and ``kv_transfer_params`` (`make_requests`). Hand the result to `submit` or `stream_request`. For
        ``params.n`` > 1 use `make_requests`.
        """
        _one_choice(params)
        return self.make_requests(prompt, params, **options)[0]

    def make_requests(self, prompt: Prompt, params: Optional[SamplingParams] = None, **options) -> list:
        """One validated `Request` per choice of ``params.n`` (the prompt tokenized once); the
        options are `make_request`'s. Hand the list to `submit_group`, which prefills the
        prompt once and forks the other choices from it.

        Choice i has ``choice_index`` i and, when ``params.seed`` is set, samples with
        ``(seed + i) % 2**32`` (as vLLM does: the choices differ, and each is what a single
        request with that seed draws); without a seed each draws its own random seed.
        Request ids: with n == 1 the one request has the given (or a new) id; with n > 1
        choice i has the id ``f"{id}-{i}"``, and every choice has ``group_id`` == id.

        ``kv_transfer_params`` (prefill/decode disaggregation, `jaxinfer.engine.kv_transfer`): a dict with
        ``bootstrap_room`` (the transfer id) and, for a decode engine, the prefill engine's
        ``bootstrap_host`` and ``bootstrap_port`` (vLLM's ``kv_transfer_params`` keys are read too).
        """
        transfer = KVTransferParams.of(options.pop("kv_transfer_params", None))
        params = self.processor.default_sampling_params() if params is None else params
        n = params.n if isinstance(params, SamplingParams) else 1
        if n == 1:
            r = self.processor.process(prompt, params, **options)
            r.kv_transfer = transfer
            return [r]
        base = options.pop("request_id", None)
        if base is not None and (not isinstance(base, str) or not base):
            raise ValueError(f"request_id must be a non-empty string, got {base!r}.")
        base = base or new_request_id()
        first = self.processor.process(prompt, params, request_id=f"{base}-0", **options)
        reqs = [first]
        m0 = first.metrics
        for i in range(1, n):
            sp = params if params.seed is None else params.clone(seed=(params.seed + i) % 2**32)
            metrics = RequestMetrics(arrival_time=m0.arrival_time, tokenize_s=m0.tokenize_s,
                                     template_tokens=m0.template_tokens, user_tokens=m0.user_tokens)
            reqs.append(self.processor.make_request(
                first.prompt_ids, sp, prompt=first.prompt, metrics=metrics, request_id=f"{base}-{i}",
                priority=first.priority, fit_max_tokens=options.get("fit_max_tokens", False),
            ))
        for i, r in enumerate(reqs):
            r.choice_index, r.group_id, r.kv_transfer = i, base, transfer
        return reqs

    def _chat_requests(self, messages, params, chat_template_kwargs, add_generation_prompt) -> list:
        return self.make_requests(
            None, params, messages=messages, chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
        )

    # -- public API ------------------------------------------------------------

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        *,
        priority: Union[None, int, Sequence[int]] = None,
        kv_transfer_params: Union[None, dict, Sequence[dict]] = None,
    ) -> list:
        """Generate for one or many prompts (strings or token-id lists); returns RequestOutputs in order.

        All prompts go to the engine at once; it keeps the batch full as requests finish.
        ``priority`` (lower runs first) matters with ``scheduling_policy="priority"``. With
        ``n`` > 1 a prompt's RequestOutput holds n CompletionOutputs (``index`` 0..n-1), its
        usage counts the prompt once and the completion tokens of every choice.
        ``kv_transfer_params``: one dict (one prompt) or one per prompt (`make_requests`; a prefill or
        decode engine, ``kv_transfer_config``).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts; pass one or one each."
                )
            plist = list(sampling_params)
        else:
            plist = [sampling_params] * len(prompts)
        prios = list(priority) if isinstance(priority, (list, tuple)) else [priority or 0] * len(prompts)
        kvs = list(kv_transfer_params) if isinstance(kv_transfer_params, (list, tuple)) else [kv_transfer_params] * len(prompts)
        if len(kvs) != len(prompts):
            raise ValueError(f"got {len(kvs)} kv_transfer_params for {len(prompts)} prompts; pass one each.")
        groups = [self.make_requests(p, sp, priority=pr, kv_transfer_params=kv)
                  for p, sp, pr, kv in zip(prompts, plist, prios, kvs)]
        return self._run(groups)

    def chat(
        self,
        messages,
        sampling_params: Optional[SamplingParams] = None,
        *,
        chat_template_kwargs: Optional[dict] = None,
        add_generation_prompt: bool = True,
    ) -> list:
        """Chat with the model's own template: one conversation (a list of messages) or a list of them.

        One RequestOutput per conversation; with ``n`` > 1 it holds n choices, as `generate`'s."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        groups = [self._chat_requests(c, sampling_params, chat_template_kwargs, add_generation_prompt) for c in convs]
        return self._run(groups)

    def stream(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None) -> Iterator[StreamDelta]:
        """Yield `StreamDelta`s (``.text``, ``.token_ids``) as tokens are made; the last has ``.output``.

        One choice: for ``n`` > 1 use `make_requests` and `submit_group` (a stream per choice)."""
        return self.stream_request(self.make_request(prompt, sampling_params))

    def stream_chat(
        self,
        messages,
        sampling_params: Optional[SamplingParams] = None,
        *,
        chat_template_kwargs: Optional[dict] = None,
        add_generation_prompt: bool = True,
    ) -> Iterator[StreamDelta]:
        _one_choice(sampling_params)
        return self.stream_request(
            self._chat_requests(messages, sampling_params, chat_template_kwargs, add_generation_prompt)[0]
        )

    def stream_request(self, request: Request) -> Iterator[StreamDelta]:
        stream = self.engine.submit(request)
        try:
            yield from stream
        finally:
            if stream.output is None:
                stream.abort()

    def submit(self, request: Request) -> RequestStream:
        """Hand a prepared request to the engine; iterate the returned stream (sync or async)."""
        return self.engine.submit(request)

    def submit_group(self, requests: Sequence[Request]) -> list:
        """Hand the choices of one prompt (`make_requests`) to the engine: one stream per request,
        in order. The prompt is prefilled once; the other choices fork from it, sharing its KV
        pages (`jaxinfer.engine.core.Engine.submit_group`)."""
        return self.engine.submit_group(requests)

    def _run(self, groups: list) -> list:
        """Run groups of requests (the choices of one prompt each); one RequestOutput per group."""
        streams: list = []
        try:
            for g in groups:
                streams.append(self.engine.submit_group(g))
            return [merge_choices(g[0].group_id, [s.result() for s in ss]) for g, ss in zip(groups, streams)]
        finally:
            for ss in streams:
                for s in ss:
                    if s.output is None:
                        s.abort()

    # -- the weights (research loops) -----------------------------------------------

    @property
    def params(self) -> Any:
        """The model's canonical parameter tree: the structure `jaxinfer.models` defines for
        `model_config` (float, the LM head ``[hidden, vocab]``), the one `from_params` and
        `update_params` take.

        On one device, float weights: a view, no copy and no cost: the leaves are the very
        arrays the engine runs (immutable; a later `update_params` does not change them, but
        while you hold them they stay alive beside the new weights). Do not donate them to a
        jitted training step (``donate_argnums``): that deletes the engine's weights; copy
        them first (``jax.tree.map(jnp.copy, llm.params)``). Where the runner holds another
        form, each such leaf is a gathered copy, made on the devices by a small jitted program
        (compiled on first use): a leaf re-laid out for tensor parallelism (``wqkv``, ``wo``,
        ``w_gate_up``, ``w_down``) back in the model's order, and a quantized leaf dequantized
        to float32 (the exact values the engine multiplies by; `update_params` of them gives
        the same integers back). Each copy costs its float size in device memory. The other
        leaves are still the engine's own arrays. Not available on several processes.
        """
        return self.runner.canonical_params()

    def update_params(self, params: Any) -> int:
        """Swap new weights into the running engine, in place: no recompilation, no reload.

        ``params`` is a canonical tree (`params`' structure and shapes; numpy or JAX arrays of
        any floating dtype, anywhere this process can read them). It is checked first: a tree
        that differs raises ValueError naming the first leaf that differs (its path, shape and
        dtype, and the model's), and the engine keeps serving the weights it had. Then it is
        stored as loading stores it -- float leaves cast to the dtypes the engine holds (on the
        host, where a dtype differs), weights quantized on the host by the model's scheme when
        the engine runs quantized -- on the calling thread, while the engine keeps serving.

        The swap itself runs on the engine thread between two steps: the tree is laid out and
        placed as loading places it (the same shapes, dtypes and shardings, so every compiled
        program runs as it is), every request in flight (running or waiting) is aborted
        (finish_reason "abort", with the tokens it had: no request ever mixes two models'
        tokens), the prefix cache is emptied (its KV pages were computed by the old weights),
        and the old weights are dropped: their buffers are freed once the last step that
        reads them is done. A request submitted after this returns runs on the new weights.
        The engine never keeps the caller's buffers: a device array already where the engine
        needs it is copied, so a training step may donate the arrays it passed.

        Costs: peak device memory is the old weights, the new ones and whatever ``params``
        holds; a leaf cast or quantized goes through host memory (a device-to-host copy and a
        pass of numpy); tensor-parallel leaves are re-laid out on the devices by the programs
        loading compiled. On several processes (`jaxinfer.engine.distributed`), call it on process 0:
        it publishes an update plan and broadcasts the stored tree to the followers, which
        place it too before the next step.

        Returns the number of requests aborted.
        """
        stored = self.runner.prepare_params(params)
        engine = self.engine

        def swap() -> int:
            self.runner.swap_params(stored)
            aborted = engine.abort_in_flight()
            engine.forget_cached_pages()
            return aborted

        return engine.call_between_steps(swap)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until the engine has no requests and nothing in flight (tests, shutdown)."""
        return self.engine.wait_idle(timeout)

    def close(self) -> None:
        self.engine.shutdown()
        self.runner.stop_followers()

    def follow(self) -> int:
        """On a process other than 0 of a multi-process run (`jaxinfer.engine.distributed`): run the
        steps process 0's engine plans, until it closes. Returns the number of steps run."""
        return self.runner.follow()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- facts -------------------------------------------------------------------

    def info(self) -> dict:
        c, e = self.model_config, self.engine_config
        return {
            "model": self.model_name,
            "architecture": c.architecture,
            "max_model_len": self.max_model_len,
            "vocab_size": c.vocab_size,
            "dtype": e.dtype,
            "quantization": c.quant or None,
            "page_size": e.page_size,
            "num_pages": e.num_pages,
            "kv_capacity_tokens": (e.num_pages - 1) * e.page_size,
            "kv_bytes_per_token": kv_cache.kv_bytes_per_token(c, e.cache_dtype),
            "backend": jax.default_backend(),
            "tensor_parallel_size": e.tensor_parallel_size,
            "processes": jax.process_count(),
        }


class _Engine(Engine):
    """The engine with what `LLM.update_params` needs of it: a call run on the engine thread
    between two steps, aborting every request in flight, emptying the prefix cache.
    (These belong in `jaxinfer.engine.core.Engine` and `jaxinfer.engine.page_allocator.PageAllocator`.)"""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._calls: queue.SimpleQueue = queue.SimpleQueue()

    def call_between_steps(self, fn) -> Any:
        """Run ``fn()`` on the engine thread before its next step; return its result (or raise
        its exception) here. Without a thread of its own (``autostart=False``: the caller
        drives `step`), it runs on the calling thread."""
        if not self.autostart:
            return fn()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, done))
        self._ensure_running()
        self._wake.set()
        return done.result()

    def step(self) -> None:
        while True:
            try:
                fn, done = self._calls.get_nowait()
            except queue.Empty:
                break
            try:
                done.set_result(fn())
            except BaseException as e:  # the caller gets it; the engine goes on
                done.set_exception(e)
        super().step()

    def abort_in_flight(self) -> int:
        """Engine thread: abort every request the engine holds (finish_reason "abort"); how many."""
        n = 0
        for r in list(self._requests.values()):
            if not r.finished:
                r.abort("abort")
                self._finish(r, "")
                n += 1
        return n

    def forget_cached_pages(self) -> None:
        """Engine thread: the prefix cache forgets every page it names (their contents were
        computed by other weights); pages in use stay allocated, unnamed."""
        self.allocator._hash_of.clear()
        self.allocator._page_of.clear()


def _one_choice(params) -> None:
    if isinstance(params, SamplingParams) and params.n > 1:
        raise ValueError(
            f"n={params.n} asks for several choices: use LLM.make_requests and LLM.submit_group (a stream "
            f"per choice), or generate / chat."
        )


def _weights_note(engine: EngineConfig) -> str:
    """How the weights are held, and why when dtype "auto" chose it (the load line)."""
    held = engine.dtype if not engine.quantization else f"{engine.quantization} (activations {engine.dtype})"
    if engine.dtype_auto:
        return f"{held}; dtype auto: {backend.dtype_choice()[1]}"
    return held


def _kernels_note() -> str:
    """What runs the products and attention on a CPU (the load line), after the native kernels loaded."""
    note = backend.kernels_note()
    return f"; {note}" if note else ""


def _kv_note(cfg: ModelConfig, engine: EngineConfig) -> str:
    """What one token costs in the KV cache (the load line): bytes over every layer, and its entry per layer."""
    rows, width = kv_cache.token_entry(cfg)
    entry = (f"a latent of {cfg.kv_lora_rank} + rotary key of {cfg.qk_rope_head_dim}" if cfg.latent
             else f"{rows // 2} KV heads x 2 x {width}")
    n = kv_cache.kv_bytes_per_token(cfg, engine.cache_dtype)
    size = f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"
    return f"KV cache {size} a token ({entry} values a layer, {engine.cache_dtype})"


def _engine_config(engine_config, dtype, max_model_len, overrides) -> EngineConfig:
    if engine_config is None:
        engine = backend.engine_preset()
    elif isinstance(engine_config, str):
        engine = EngineConfig.preset(engine_config)
    else:
        engine = engine_config
    changes = dict(overrides)
    if dtype is not None:
        changes["dtype"] = dtype
    if max_model_len is not None:
        changes["max_model_len"] = max_model_len
    env_dtype = os.environ.get("JAXINFER_DTYPE")
    if env_dtype and "dtype" not in changes:
        changes["dtype"] = env_dtype
    return backend.resolve_engine_config(engine.replace(**changes) if changes else engine)
