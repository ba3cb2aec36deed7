"""Prefill/decode disaggregation: a prompt's KV pages move from a prefill engine to a decode engine.

Roles (`KVTransferConfig`, vLLM's ``kv_transfer_config``; ``serve --disaggregation-mode``, SGLang's flag):

* **prefill** computes a request's prompt (chunked, prefix cache on, as always) and its first token,
  then holds its KV pages for a decode engine to take. The request's pages are gathered by a jitted
  program into one buffer per layer (``[pages, page_size, rows, width]``, the cache layer's own
  sharding) and registered with `jax.experimental.transfer`'s transfer server under a fresh 62-bit
  uuid (`TransferServer.await_pull`). The pages stay referenced (an extra reference on each, so
  the prefix cache keeps them too) until the decode side acknowledges or ``timeout_s`` passes: the
  held pages are the memory the buffers stand for, so a prefill engine never holds more transfers
  than its cache has pages.
* **decode** receives a request with its prompt and the transfer's coordinates (`KVTransferParams`:
  SGLang's bootstrap host, port and room, or vLLM's ``kv_transfer_params``). The engine thread
  takes a slot and pages for the prompt, and a worker thread does the network: it asks the prefill
  side's bootstrap channel for the transfer (waiting while the prompt is still computed), pulls the
  buffers (`TransferConnection.pull`), then acknowledges so the prefill side frees its pages. Back
  on the engine thread a jitted program that donates the cache scatters the buffers into the
  request's pages, the full pages are named in the prefix cache, and the request joins the batch
  as a decode row whose first token is the prefill's (its logprob too). The engine loop never waits
  on the network. A decode row preempted later recomputes locally, as any other.

The bootstrap channel is plain HTTP/JSON on the prefill side's ``bootstrap_port``
(SGLang's ``--disaggregation-bootstrap-port``, default 8998):

* ``GET /v1/kv/info`` -> ``{"role", "page_size", "tp", "dtype", "layers", "entry"}`` (``entry``: one
  layer's ``[page_size, rows, width]``); the decode side checks it once per prefill server and
  refuses a different page size, TP size, dtype or layout in one line.
* ``GET /v1/kv/<room>/<choice>?wait=<s>`` -> 200 with the transfer's layout when ready
  (``uuid``, transfer ``address``, ``num_tokens``, ``num_pages``, ``padded_pages``, ``first_token``,
  ``first_logprob``); 202 while the prompt is still being computed (or not yet arrived: the router
  sends the request to both sides at once) after ``wait`` seconds; 404 for a room the prefill side
  has never seen, 410 for one it released (acknowledged or expired), 409 for one whose prefill
  failed or was aborted, or that another request already took (a transfer has one taker: the
  primitive's pull of a uuid already pulled never returns). A 200 renews the entry's deadline (the
  pull follows).
* ``POST /v1/kv/<room>/<choice>/ack`` -> 200: the decode side has the data (or gave up); the
  prefill side frees the pages now.

``<room>`` is SGLang's ``bootstrap_room`` (any integer or string; the router draws a random one per
request); ``<choice>`` the choice index (``n`` > 1: each choice draws its own first token on the
prefill side, each moves its own pages).

Faults: a room the decode side cannot get (unknown after ``timeout_s``, expired, failed, the prefill
server unreachable or killed mid-pull) fails that request with ``finish_reason`` "error" and a
message ``"KV transfer <status>: ..."`` (`error_status` reads the HTTP status back), its pages freed;
a transfer never taken is freed at its deadline; the decode side acknowledges whatever it stopped
waiting for (its client went away included), so the prefill side frees at once.

Scope and what would come next: both sides need the same page size and the same tensor-parallel
size (the transfer primitive moves each shard as it is laid out; a 2-way buffer pulled into a 4-way
sharding is refused by it). Resharding would pull the prefill's shards as they are (specs with the
prefill's sharding, placed on a matching sub-mesh of the decode side, or staged through host
memory), then reshard on the decode side with one jitted ``device_put``/``reshard`` into the cache
layer's sharding before the scatter: the KV-head axis is split contiguously both ways, so it is a
split or a concatenation of whole heads. Multi-host engines (a leader publishing plans) are not
supported yet: the scatter is not a published step. The decode side pulls the whole prompt even
where its own prefix cache holds the start (a later step: ask for the missing pages only).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import functools
import http.client
import json
import logging
import random
import re
import socket
import threading
import time
import urllib.parse
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.buckets import pages_needed
from jaxinfer.outputs import Logprob

log = logging.getLogger("jaxinfer")

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's
DEFAULT_TIMEOUT_S = 30.0
ROLES = ("prefill", "decode")
_VLLM_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}


class KVTransferError(RuntimeError):
    """A transfer that cannot be done; ``status`` is its HTTP status (404, 409, 410, 502, ...)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status

    def line(self) -> str:
        return f"KV transfer {self.status}: {self}"


_ERROR_RE = re.compile(r"^KV transfer (\d{3}): ")


def error_status(message: Optional[str]) -> Optional[int]:
    """The HTTP status of a request that failed in its KV transfer (its ``error`` message), else None."""
    m = _ERROR_RE.match(message or "")
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class KVTransferConfig:
    """An engine's disaggregation role. ``role``: "prefill" or "decode" (vLLM's ``kv_role`` values
    ``kv_producer``/``kv_consumer`` are accepted too). ``bootstrap_port`` (prefill): where the
    bootstrap channel listens (0: any free port), ``bootstrap_host`` the address it binds and
    advertises. ``timeout_s``: how long a prefill engine holds a transfer no decode engine takes,
    and how long a decode engine waits for a transfer to be ready."""

    role: str
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    timeout_s: float = DEFAULT_TIMEOUT_S
    transfer_host: str = "127.0.0.1"  # the transfer server's interface

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"kv_transfer_config role must be 'prefill' or 'decode', got {self.role!r}.")
        if not 0 <= int(self.bootstrap_port) <= 65535:
            raise ValueError(f"bootstrap_port must be in [0, 65535], got {self.bootstrap_port}.")
        if not self.timeout_s > 0:
            raise ValueError(f"the KV transfer timeout must be positive, got {self.timeout_s}.")

    @classmethod
    def of(cls, value: Any) -> Optional["KVTransferConfig"]:
        """A config from None, a KVTransferConfig, or a dict (our keys, or vLLM's ``kv_role``, ``kv_ip``, ``kv_port``)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be a dict, got {type(value).__name__}.")
        d = dict(value)
        role = d.pop("role", None) or _VLLM_ROLES.get(d.get("kv_role"), d.get("kv_role"))
        d.pop("kv_role", None)
        d.pop("kv_connector", None)  # vLLM names its connector; ours is jax.experimental.transfer
        if "kv_ip" in d:
            d["bootstrap_host"] = d.pop("kv_ip")
        if "kv_port" in d:
            d["bootstrap_port"] = d.pop("kv_port")
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown kv_transfer_config keys {unknown}; known: role, {sorted(names - {'role'})}.")
        return cls(role=role, **d)


@dataclass
class KVTransferParams:
    """One request's transfer: the ``room`` (SGLang's bootstrap_room; the transfer id both sides share) and,
    on the decode side, the prefill server's bootstrap ``host`` and ``port``."""

    room: str
    host: Optional[str] = None
    port: Optional[int] = None

    @classmethod
    def of(cls, value: Any = None, *, bootstrap_host=None, bootstrap_port=None,
           bootstrap_room=None) -> Optional["KVTransferParams"]:
        """From SGLang's three body fields, or a dict (vLLM's ``kv_transfer_params``: ``bootstrap_*``,
        or ``remote_host``/``remote_port`` with ``transfer_id``/``remote_request_id``), or None.
        ``{"do_remote_decode": true}`` without a room (vLLM's proxy asking a prefill server) draws a new
        room, which the prefill server's response carries (`KVSender.response_params`)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict) and value:
            v = value
            bootstrap_host = v.get("bootstrap_host", v.get("remote_host", bootstrap_host))
            bootstrap_port = v.get("bootstrap_port", v.get("remote_port", bootstrap_port))
            bootstrap_room = v.get("bootstrap_room", v.get("transfer_id", v.get("remote_request_id", bootstrap_room)))
            if bootstrap_room is None and v.get("do_remote_decode") and bootstrap_host is None:
                bootstrap_room = uuid.uuid4().hex
        elif value not in (None, {}):
            raise ValueError(f"kv_transfer_params must be a dict, got {type(value).__name__}.")
        if bootstrap_room is None:
            if bootstrap_host is not None or bootstrap_port is not None:
                raise ValueError("bootstrap_host/bootstrap_port need a bootstrap_room (the transfer id).")
            return None
        if isinstance(bootstrap_room, (list, tuple)):
            raise ValueError("one bootstrap_room per request (a list is a batch: send one request per prompt).")
        room = str(bootstrap_room)
        if not room or len(room) > 128 or "/" in room:
            raise ValueError(f"bootstrap_room must be a short id without '/', got {bootstrap_room!r}.")
        port = None
        if bootstrap_port is not None:
            port = int(bootstrap_port)
            if not 0 < port <= 65535:
                raise ValueError(f"bootstrap_port must be in [1, 65535], got {bootstrap_port}.")
        if (bootstrap_host is None) != (port is None):
            raise ValueError("bootstrap_host and bootstrap_port come together.")
        return cls(room=room, host=bootstrap_host, port=port)


def make_side(engine, value: Any):
    """The engine's KV-transfer side for its role (`KVSender`, `KVReceiver`), or None without a role."""
    cfg = KVTransferConfig.of(value)
    if cfg is None:
        return None
    if jax.process_count() > 1:
        raise ValueError("prefill/decode disaggregation is not supported on a multi-host engine yet.")
    return (KVSender if cfg.role == "prefill" else KVReceiver)(engine, cfg)


# -- device programs --------------------------------------------------------------------------


def _bucket(n: int) -> int:
    """Pages padded to a power of two: a handful of gather/scatter programs, not one per length."""
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _gather_fn(shardings: tuple):
    return jax.jit(lambda cache, idx: [layer[idx] for layer in cache], out_shardings=list(shardings))


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(cache, pulled, idx):
    return [layer.at[idx].set(x.astype(layer.dtype)) for layer, x in zip(cache, pulled)]


def _page_counts(engine) -> list:
    """Every padded page count a transfer can have on this engine (a prompt of up to max_model_len tokens)."""
    most = _bucket(pages_needed(engine.runner.max_model_len, engine.ecfg.page_size))
    return [1 << i for i in range(most.bit_length())]


def _layout(cache: list, ecfg) -> dict:
    first = cache[0]
    return {"page_size": ecfg.page_size, "tp": ecfg.tensor_parallel_size, "dtype": str(first.dtype),
            "layers": len(cache), "entry": [int(d) for d in first.shape[1:]]}


def _logprob_dict(lp: Optional[Logprob]) -> Optional[dict]:
    if lp is None:
        return None
    return {"token_id": lp.token_id, "logprob": lp.logprob, "top": [[int(t), float(v)] for t, v in lp.top.items()],
            "rank": lp.rank}


def _logprob_of(d: Optional[dict]) -> Optional[Logprob]:
    if d is None:
        return None
    return Logprob(int(d["token_id"]), float(d["logprob"]), {int(t): float(v) for t, v in d["top"]}, d.get("rank"))


def _start_transfer_server(host: str):
    from jax.experimental import transfer  # the experimental module loads only with a role

    client = jax.devices()[0].client
    return transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])


# -- the prefill side -----------------------------------------------------------------------


class _Held:
    """One transfer on the prefill side: computing, then ready (its pages held) until released."""

    __slots__ = ("key", "state", "pages", "meta", "deadline", "error")

    def __init__(self, key: tuple, deadline: float):
        self.key = key
        self.state = "computing"  # -> "ready" -> "claimed" (a decode side has its layout) -> gone; or "failed"
        self.pages: list = []
        self.meta: Optional[dict] = None
        self.deadline = deadline
        self.error = ""


class KVSender:
    """The prefill engine's side: holds finished prompts' pages, serves the bootstrap channel."""

    role = "prefill"

    def __init__(self, engine, cfg: KVTransferConfig):
        self.engine = engine
        self.cfg = cfg
        self.server = _start_transfer_server(cfg.transfer_host)
        self.address = self.server.address()
        self._cond = threading.Condition()
        self._entries: dict = {}  # (room, choice) -> _Held
        self._gone: OrderedDict = OrderedDict()  # released keys -> why (410 with the reason)
        self._releases: deque = deque()  # keys the decode side acknowledged (HTTP threads -> engine thread)
        self._early: OrderedDict = OrderedDict()  # acknowledged before the request came here -> until when
        self.transfers = 0  # registered for pulling
        self.acked = 0
        self.expired = 0
        self.bytes = 0
        self.layout = _layout(engine.runner.kv_cache, engine.ecfg)
        from http.server import ThreadingHTTPServer  # here: an engine without a prefill role never imports it

        try:
            self.http = ThreadingHTTPServer((cfg.bootstrap_host, cfg.bootstrap_port), _handler(self))
        except OSError as e:
            raise ValueError(f"cannot serve the KV bootstrap channel on {cfg.bootstrap_host}:{cfg.bootstrap_port}: "
                             f"{e.strerror or e} (--disaggregation-bootstrap-port; 0 picks a free one)") from None
        self.http.daemon_threads = True
        self.bootstrap_port = self.http.server_address[1]
        self._thread = threading.Thread(target=self.http.serve_forever, name="jaxinfer-kv-bootstrap", daemon=True)
        self._thread.start()
        log.info("prefill role: KV bootstrap on http://%s:%d, transfer server %s, hold timeout %.0f s",
                 cfg.bootstrap_host, self.bootstrap_port, self.address, cfg.timeout_s)

    # engine thread ------------------------------------------------------------------------

    def on_add(self, r) -> bool:
        """A new request: one with a room is computed here as usual, then held (its first token only)."""
        p = r.kv_transfer
        if p is None:
            return False
        r.max_tokens = 1
        key = (p.room, r.choice_index)
        with self._cond:
            old = self._entries.get(key)
            if old is not None and old.state in ("ready", "claimed"):
                self._release(old, "replaced")
            self._gone.pop(key, None)
            e = self._entries[key] = _Held(key, time.monotonic() + self.cfg.timeout_s)
            if self._early.pop(key, 0) > time.monotonic():  # the decode side will not take it: computed, not held
                e.state, e.error = "failed", "released by the decode side before it was ready"
            self._cond.notify_all()
        return False  # scheduled as any request

    def on_finish(self, r) -> None:
        """Before the scheduler frees a finished request's pages: take a reference on them and register the buffers."""
        p = r.kv_transfer
        if p is None:
            return
        key = (p.room, r.choice_index)
        with self._cond:
            e = self._entries.get(key)
        if e is None or e.state != "computing":
            return
        if r.finish_reason in ("abort", "error") or not r.output_ids or r.num_computed < r.prompt_len:
            self._fail(e, f"the prefill side ended the request ({r.finish_reason}{': ' + r.error if r.error else ''})")
            return
        try:
            meta = self._register(r)
        except Exception as err:  # the request is answered; the decode side learns why
            log.exception("KV transfer registration failed")
            self._fail(e, f"registration failed: {err}")
            return
        with self._cond:
            e.meta, e.state = meta, "ready"
            e.pages = [pg for pg in r.pages[: meta["num_pages"]] if pg]
            self.engine.allocator.share(e.pages)
            e.deadline = time.monotonic() + self.cfg.timeout_s
            self._cond.notify_all()

    def warmup(self) -> int:
        """Compile the gather program for every padded page count (engine thread, before serving); how many."""
        cache = self.engine.runner.kv_cache
        fn = _gather_fn(tuple(layer.sharding for layer in cache))
        counts = _page_counts(self.engine)
        for n in counts:
            jax.block_until_ready(fn(cache, jnp.zeros(n, jnp.int32)))  # reads the dummy page only
        return len(counts)

    def _register(self, r) -> dict:
        runner = self.engine.runner
        ps = self.engine.ecfg.page_size
        n = pages_needed(r.prompt_len, ps)
        padded = _bucket(n)
        idx = np.zeros(padded, np.int32)
        idx[:n] = r.pages[:n]
        cache = runner.kv_cache
        bufs = _gather_fn(tuple(layer.sharding for layer in cache))(cache, jnp.asarray(idx))
        uid = random.getrandbits(62)  # the transfer server's id of these buffers (the room is the caller's)
        # the buffers stay registered past the pages' deadline (a claim renews that once): no cancel exists
        until = datetime.datetime.now() + datetime.timedelta(seconds=2 * self.cfg.timeout_s + 5)
        self.server.await_pull(uid, bufs, timeout=until)
        self.transfers += 1
        nbytes = sum(b.size * b.dtype.itemsize for b in bufs) * n // padded
        self.bytes += nbytes
        lp = r.logprobs[0] if r.logprobs else None
        return {"uuid": uid, "address": self.address, "num_tokens": r.prompt_len, "num_pages": n,
                "padded_pages": padded, "first_token": int(r.output_ids[0]), "first_logprob": _logprob_dict(lp),
                "bytes": nbytes, **self.layout}

    def tick(self) -> None:
        """Each engine iteration: free what was acknowledged or expired."""
        now = time.monotonic()
        with self._cond:
            while self._releases:
                key = self._releases.popleft()
                e = self._entries.get(key)
                if e is None and key not in self._gone:  # its request has not come yet (the router sends both)
                    self._early[key] = now + self.cfg.timeout_s
                    while len(self._early) > 4096:
                        self._early.popitem(last=False)
                elif e is not None and e.state in ("ready", "claimed"):
                    self.acked += 1
                    self._release(e, "acknowledged")
                elif e is not None and e.state == "computing":  # the decode side gave up first
                    e.state, e.error = "failed", "released by the decode side before it was ready"
                    e.deadline = now + self.cfg.timeout_s
            while self._early and next(iter(self._early.values())) < now:
                self._early.popitem(last=False)
            for e in list(self._entries.values()):
                if e.deadline < now and e.state != "computing":
                    held = e.state in ("ready", "claimed")
                    if held:
                        self.expired += 1
                        log.warning("KV transfer %s/%d expired after %.0f s: its %d pages freed", e.key[0], e.key[1],
                                    self.cfg.timeout_s, len(e.pages))
                    self._release(e, "expired" if held else e.error)

    def _release(self, e: _Held, why: str) -> None:  # under the lock, engine thread
        if e.pages:
            self.engine.allocator.release(reversed(e.pages))
            e.pages = []
        self._entries.pop(e.key, None)
        self._gone[e.key] = why
        while len(self._gone) > 4096:
            self._gone.popitem(last=False)

    def _fail(self, e: _Held, why: str) -> None:
        with self._cond:
            e.state, e.error = "failed", why
            e.deadline = time.monotonic() + self.cfg.timeout_s  # answered as failed for a while, then gone
            self._cond.notify_all()

    def release_all(self) -> None:
        with self._cond:
            for e in list(self._entries.values()):
                self._release(e, "shut down")

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()

    def response_params(self, p: KVTransferParams) -> dict:
        """What a prefill server's response carries for a proxy to hand the decode server (vLLM's
        ``kv_transfer_params`` contract; the same fields as SGLang's body)."""
        host = self.cfg.bootstrap_host
        if host in ("0.0.0.0", "::", ""):
            host = socket.getfqdn()
        return {"do_remote_prefill": True, "do_remote_decode": False, "bootstrap_host": host,
                "bootstrap_port": self.bootstrap_port, "bootstrap_room": p.room}

    def held(self) -> tuple:
        """(transfers held ready, their pages)."""
        with self._cond:
            ready = [e for e in self._entries.values() if e.state in ("ready", "claimed")]
            return len(ready), sum(len(e.pages) for e in ready)

    def stats_suffix(self) -> str:
        n, pages = self.held()
        return f", KV held {n} ({pages} pages)" if n or self.transfers else ""

    def metrics(self) -> dict:
        n, pages = self.held()
        return {"kv_transfers_held": n, "kv_transfer_pages_held": pages, "kv_transfers_in_flight": 0,
                "kv_transfers": self.transfers, "kv_transfers_expired": self.expired, "kv_transfers_failed": 0,
                "kv_transfer_bytes": self.bytes}

    # bootstrap HTTP threads -------------------------------------------------------------------

    def lookup(self, key: tuple, wait: float) -> tuple:
        """(status, body) for ``GET /v1/kv/<room>/<choice>``."""
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                e = self._entries.get(key)
                if e is not None and e.state == "ready":  # one taker: a uuid pulled twice would hang the second
                    e.state = "claimed"
                    e.deadline = max(e.deadline, time.monotonic() + self.cfg.timeout_s)  # the pull follows
                    return 200, e.meta
                if e is not None and e.state == "claimed":
                    return 409, {"error": f"transfer {key[0]}/{key[1]} is already being taken by another request"}
                if e is not None and e.state == "failed":
                    return 409, {"error": f"transfer {key[0]}/{key[1]}: {e.error}"}
                if e is None and key in self._gone:
                    return 410, {"error": f"transfer {key[0]}/{key[1]} is gone ({self._gone[key]})"}
                left = deadline - time.monotonic()
                if left <= 0:
                    if e is None:
                        return 404, {"error": f"unknown transfer id {key[0]}/{key[1]}"}
                    return 202, {"state": e.state}
                self._cond.wait(left)

    def acknowledge(self, key: tuple) -> None:
        with self._cond:
            self._releases.append(key)
        self.engine._wake.set()


def _handler(sender: KVSender):
    from http.server import BaseHTTPRequestHandler

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet: errors reach the decode side in the bodies
            pass

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _key(self, parts: list) -> Optional[tuple]:
            try:
                return urllib.parse.unquote(parts[2]), int(parts[3])
            except (IndexError, ValueError):
                return None

        def do_GET(self):
            url = urllib.parse.urlsplit(self.path)
            parts = url.path.strip("/").split("/")
            if parts == ["v1", "kv", "info"]:
                return self._send(200, {"role": "prefill", **sender.layout})
            key = self._key(parts) if len(parts) == 4 and parts[:2] == ["v1", "kv"] else None
            if key is None:
                return self._send(404, {"error": f"no route {url.path}"})
            try:
                wait = min(max(float(urllib.parse.parse_qs(url.query).get("wait", ["0"])[0]), 0.0), 30.0)
            except ValueError:
                wait = 0.0
            self._send(*sender.lookup(key, wait))

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            parts = urllib.parse.urlsplit(self.path).path.strip("/").split("/")
            key = self._key(parts) if len(parts) == 5 and parts[:2] == ["v1", "kv"] and parts[4] == "ack" else None
            if key is None:
                return self._send(404, {"error": f"no route {self.path}"})
            sender.acknowledge(key)
            self._send(200, {"ok": True})

    return Handler


# -- the decode side ------------------------------------------------------------------------


def _http(host: str, port: int, method: str, path: str, timeout: float) -> tuple:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(method, path, body=b"" if method == "POST" else None)
        resp = conn.getresponse()
        body = resp.read()
        try:
            return resp.status, json.loads(body or b"{}")
        except ValueError:
            return resp.status, {"error": body[:200].decode(errors="replace")}
    finally:
        conn.close()


class KVReceiver:
    """The decode engine's side: admits transferred requests, pulls their KV off the engine thread."""

    role = "decode"

    def __init__(self, engine, cfg: KVTransferConfig):
        self.engine = engine
        self.cfg = cfg
        self.server = _start_transfer_server(cfg.transfer_host)
        self.layout = _layout(engine.runner.kv_cache, engine.ecfg)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="jaxinfer-kv-pull")
        # the waits for a prefill side to have the KV (long polls) on threads of their own, so that a backlog of
        # them never holds up a pull that could start
        self._asks = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="jaxinfer-kv-ask")
        self._lock = threading.Lock()
        self._connections: dict = {}  # transfer address -> TransferConnection
        self._checked: dict = {}  # (host, port) -> None (fine) or the refusal
        # A request holds no slot and no pages until its KV is ready on the prefill side: the router sends a
        # request to both servers at once, and a backlogged prefill server must not make this one hold pages
        # (and preempt running streams) for prompts that are not computed yet.
        self.asking: dict = {}  # request id -> request, waiting for the prefill side to have its KV
        self.waiting: deque = deque()  # (request, transfer metadata): ready, waiting for a slot and pages
        self.pulling: dict = {}  # request id -> request, its pull under way
        self.pulled = 0
        self.failed = 0
        self.bytes = 0
        self.seconds = 0.0
        log.info("decode role: KV pulled through transfer server %s, wait timeout %.0f s", self.server.address(),
                 cfg.timeout_s)

    # engine thread ------------------------------------------------------------------------

    def on_add(self, r) -> bool:
        p = r.kv_transfer
        if p is None:
            return False
        if p.host is None:
            self._fail_now(r, KVTransferError(400, "a decode engine needs bootstrap_host and bootstrap_port with "
                                                   "the bootstrap_room"))
            return True
        if r.params.uses_penalties or r.params.wants_prompt_logprobs:
            # their token history (or every prompt position's logits) comes from a local prefill: compute
            # the prompt here and let the prefill side go
            self._pool.submit(self._ack, p, r.choice_index)
            return False
        self.asking[r.request_id] = r
        self._asks.submit(self._ask, r)
        return True

    def _ready(self, r, meta: dict) -> None:
        """Engine thread: the prefill side has the request's KV; it may take a slot and pages now."""
        if self.asking.pop(r.request_id, None) is None:
            return
        if r.finished:  # aborted while it waited: the prefill side may free at once
            self._pool.submit(self._ack, r.kv_transfer, r.choice_index)
            return
        self.waiting.append((r, meta))

    def tick(self) -> None:
        """Each engine iteration: start the pulls a slot and pages allow, oldest first."""
        sched, alloc = self.engine.scheduler, self.engine.allocator
        while self.waiting:
            r, meta = self.waiting[0]
            if r.finished:  # aborted before its pull began: the prefill side may free at once
                self.waiting.popleft()
                self._pool.submit(self._ack, r.kv_transfer, r.choice_index)
                continue
            need = pages_needed(r.prompt_len + 1, self.engine.ecfg.page_size)
            if not sched.can_adopt() or need > alloc.num_free:
                return
            self.waiting.popleft()
            r.pages = alloc.allocate(need)
            sched.reserve(r)
            self.pulling[r.request_id] = r
            r.metrics.scheduled_time = time.perf_counter()
            self._pool.submit(self._pull, r, meta)

    def on_finish(self, r) -> None:
        self.pulling.pop(r.request_id, None)
        if self.waiting:
            self.engine._wake.set()  # its slot and pages may let a waiting transfer start: no idle wait first

    def warmup(self) -> int:
        """Compile the scatter program for every padded page count (engine thread, before serving); how many."""
        runner = self.engine.runner
        counts = _page_counts(self.engine)
        for n in counts:
            zeros = [jnp.zeros((n, *layer.shape[1:]), layer.dtype, device=layer.sharding) for layer in runner.kv_cache]
            runner.kv_cache = _scatter(runner.kv_cache, zeros, jnp.zeros(n, jnp.int32))  # writes the dummy page only
        jax.block_until_ready(runner.kv_cache)
        return len(counts)

    def _done(self, r, pulled: list, meta: dict, seconds: float) -> None:
        """Engine thread: the buffers are here; scatter them into the request's pages, start decoding."""
        if self.pulling.pop(r.request_id, None) is None or r.finished:
            return  # aborted meanwhile: its pages were freed with it
        eng = self.engine
        padded = meta["padded_pages"]
        idx = np.zeros(padded, np.int32)
        n = meta["num_pages"]
        idx[:n] = r.pages[:n]
        eng.runner.kv_cache = _scatter(eng.runner.kv_cache, pulled, jnp.asarray(idx))
        self.pulled += 1
        self.bytes += meta.get("bytes", 0)
        self.seconds += seconds
        log.debug("KV transfer %s/%d: %d tokens, %d bytes in %.1f ms (%.2f GB/s)", r.kv_transfer.room,
                  r.choice_index, meta["num_tokens"], meta.get("bytes", 0), seconds * 1e3,
                  meta.get("bytes", 0) / seconds / 1e9 if seconds else 0.0)
        r.num_computed = r.prompt_len
        r.num_sampled = 1
        r.metrics.cached_tokens = 0
        token = int(meta["first_token"])
        r.last_token = token
        eng.scheduler.adopt(r)
        eng.adopt_first_token(r, token, _logprob_of(meta.get("first_logprob")))

    def _failed(self, r, err: KVTransferError) -> None:
        self.failed += 1
        self.asking.pop(r.request_id, None)
        if self.pulling.pop(r.request_id, None) is None and r.finished:
            return
        if not r.finished:
            self._fail_now(r, err)

    def _fail_now(self, r, err: KVTransferError) -> None:
        log.warning("request %s: %s", r.request_id, err.line())
        r.finish_reason, r.error = "error", err.line()
        self.engine._finish(r, "")

    def release_all(self) -> None:
        pass

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._asks.shutdown(wait=False, cancel_futures=True)

    def stats_suffix(self) -> str:
        n = len(self.asking) + len(self.pulling) + len(self.waiting)
        if not (n or self.pulled or self.failed):
            return ""
        rate = self.bytes / self.seconds / 1e9 if self.seconds else 0.0
        return f", KV in flight {n}, pulled {self.pulled} ({rate:.2f} GB/s), failed {self.failed}"

    def metrics(self) -> dict:
        return {"kv_transfers_held": 0, "kv_transfer_pages_held": 0,
                "kv_transfers_in_flight": len(self.asking) + len(self.pulling) + len(self.waiting),
                "kv_transfers": self.pulled,
                "kv_transfers_expired": 0, "kv_transfers_failed": self.failed, "kv_transfer_bytes": self.bytes}

    # worker threads -----------------------------------------------------------------------

    def _post(self, fn, *args) -> None:
        self.engine.call_soon(functools.partial(fn, *args))

    def _ack(self, p: KVTransferParams, choice: int) -> None:
        try:
            _http(p.host, p.port, "POST", f"/v1/kv/{urllib.parse.quote(p.room)}/{choice}/ack", 5.0)
        except OSError:
            pass  # gone: it frees at its own timeout (or has no pages left)

    def _check(self, host: str, port: int) -> None:
        """Once per prefill server: the same page size, TP size, dtype and layout, or a one-line refusal."""
        with self._lock:
            if (host, port) in self._checked:
                refusal = self._checked[(host, port)]
                if refusal is not None:
                    raise refusal
                return
        status, info = _http(host, port, "GET", "/v1/kv/info", 10.0)
        if status != 200:
            raise KVTransferError(502, f"{host}:{port} is not a prefill bootstrap server ({status})")
        here, there = self.layout, info
        refusal = None
        for name in ("page_size", "tp", "dtype", "layers", "entry"):
            if here.get(name) != there.get(name):
                what = {"tp": "tensor-parallel size", "page_size": "page size", "entry": "cache layout"}.get(name, name)
                refusal = KVTransferError(409, f"refusing KV from {host}:{port}: {what} {there.get(name)} there, "
                                               f"{here.get(name)} here")
                break
        with self._lock:
            self._checked[(host, port)] = refusal
        if refusal is not None:
            log.error("%s", refusal.line())
            raise refusal

    def _connection(self, address: str):
        with self._lock:
            conn = self._connections.get(address)
            if conn is None:
                conn = self._connections[address] = self.server.connect(address)
            return conn

    def _meta(self, r, p: KVTransferParams) -> dict:
        path = f"/v1/kv/{urllib.parse.quote(p.room)}/{r.choice_index}"
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            if r.finished:
                raise KVTransferError(499, "the request ended while its transfer was awaited")
            left = deadline - time.monotonic()
            status, body = _http(p.host, p.port, "GET", f"{path}?wait={max(0.0, min(2.0, left)):.2f}", 10.0 + left)
            if status == 200:
                return body
            if status != 202 and not (status == 404 and left > 2.0):  # 404: the prefill may not have it yet
                raise KVTransferError(status, body.get("error", f"bootstrap answered {status}"))
            if left <= 0:
                if status == 404:
                    raise KVTransferError(404, body.get("error", "unknown transfer id"))
                raise KVTransferError(504, f"transfer {p.room}/{r.choice_index} not ready after {self.cfg.timeout_s:.0f} s")

    def _ask(self, r) -> None:
        """Wait until the prefill side has the request's KV (its bootstrap's long poll), then hand it to the
        engine thread (`_ready`) to get a slot and pages."""
        p = r.kv_transfer
        try:
            try:
                self._check(p.host, p.port)
                meta = self._meta(r, p)
                if meta["num_tokens"] != r.prompt_len:
                    raise KVTransferError(409, f"transfer {p.room}: {meta['num_tokens']} prompt tokens there, "
                                               f"{r.prompt_len} here (not the same prompt)")
            except KVTransferError:
                raise
            except (OSError, http.client.HTTPException) as e:
                raise KVTransferError(502, f"prefill bootstrap {p.host}:{p.port} unreachable: {e}") from None
        except KVTransferError as e:
            self._ack(p, r.choice_index)  # whatever the prefill side holds (or will) for it is freed now
            self._post(self._failed, r, e)
            return
        self._post(self._ready, r, meta)

    def _pull(self, r, meta: dict) -> None:
        p = r.kv_transfer
        try:
            try:
                cache = self.engine.runner.kv_cache
                shape = (meta["padded_pages"], *cache[0].shape[1:])
                specs = [jax.ShapeDtypeStruct(shape, layer.dtype, sharding=layer.sharding) for layer in cache]
                address = meta["address"]
                host, _, port = address.rpartition(":")
                if host in ("0.0.0.0", "[::]", "::", ""):  # a wildcard bind: the host the bootstrap answered on
                    address = f"{p.host}:{port}"
                t0 = time.perf_counter()
                pulled = self._connection(address).pull(int(meta["uuid"]), specs)
                jax.block_until_ready(pulled)
                seconds = time.perf_counter() - t0
            except KVTransferError:
                raise
            except (OSError, http.client.HTTPException) as e:
                raise KVTransferError(502, f"prefill bootstrap {p.host}:{p.port} unreachable: {e}") from None
            except Exception as e:  # the transfer itself (the peer died mid-pull, ...)
                raise KVTransferError(502, f"pull from the prefill side failed: {e}") from None
        except KVTransferError as e:
            self._ack(p, r.choice_index)  # whatever the prefill side holds (or will) for it is freed now
            self._post(self._failed, r, e)
            return
        self._ack(p, r.choice_index)
        self._post(self._done, r, pulled, meta, seconds)


_METRIC_DOCS = {  # name -> (kind, help)
    "kv_transfers_held": ("gauge", "Prefill role: finished prompts whose KV pages wait for a decode server."),
    "kv_transfer_pages_held": ("gauge", "Prefill role: KV pages held for decode servers."),
    "kv_transfers_in_flight": ("gauge", "Decode role: requests waiting for or pulling their prompt's KV."),
    "kv_transfers": ("counter", "KV transfers registered (prefill role) or pulled (decode role)."),
    "kv_transfers_expired": ("counter", "Prefill role: held transfers freed at the timeout, never taken."),
    "kv_transfers_failed": ("counter", "Decode role: requests failed because their KV could not be had."),
    "kv_transfer_bytes": ("counter", "Bytes of KV registered (prefill role) or pulled (decode role)."),
}


def transfer_metrics(engine) -> list:
    """An engine's KV-transfer metrics for Prometheus, as ``(kind, name, help, value)`` with kind "gauge" or
    "counter" (counter names without ``_total``, as prometheus_client's CounterMetricFamily takes them);
    empty without a role."""
    side = getattr(engine, "kv", None)
    if side is None:
        return []
    return [(_METRIC_DOCS[k][0], k, _METRIC_DOCS[k][1], v) for k, v in side.metrics().items()]
