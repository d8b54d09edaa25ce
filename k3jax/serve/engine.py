"""The serving engine: continuous batching over the hybrid paged cache with prefix caching.

Every :meth:`Engine.step` admits waiting requests (restoring a cached prefix: shared MLA pages
plus a KDA checkpoint copied into the request's own slot), then dispatches at most two compiled
programs: one decode step for every request with one token to feed, and one prefill step for up
to ``serve.prefill_rows`` requests' next prompt chunks (``serve.token_budget`` tokens in all).
Only then does it read the previous step's sampled tokens and hand them out, so the host's
bookkeeping runs while the device computes: a decode row whose input token the host has not read
yet takes it on device from the previous step's outputs. A request that stops on a sampled token
has run one more step by then; that step's writes go to its own pages and slot, before anything
that reuses them, and its output is dropped. A step that completes a prefix block is followed by
the block's KDA checkpoint copy, dispatched before the next step.
Chunks never cross a ``serve.block_size`` boundary, so the KDA state at the end of a chunk that
reaches one is the boundary state the prefix index checkpoints, taken in the same pass. Step
shapes come from a fixed set (batch rows and chunk lengths in powers of two) compiled by
:meth:`Engine.compile`, so load never triggers a compile. When pages run out the newest request is
preempted: its cache is released and it is recomputed (prompt plus the tokens generated so far)
when it is admitted again.

Requests come in through :meth:`Engine.submit` (any thread) and leave through their callback,
called on the engine thread (:meth:`Engine.start`) once per token. :meth:`Engine.generate` drives
the same steps synchronously, for tests and in-process use.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import logging
import math
import os
import secrets
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

import sharding
from k3jax import vision_prompt
from k3jax.config import ConfigError, MeshConfig, ServeConfig
from k3jax.generate import GenerateError, check_decoding
from k3jax.model import K3Model
from k3jax.serve import batch
from k3jax.serve import step as step_lib
from k3jax.serve.batch import Request
from k3jax.serve.cache import Allocator, Hit, PrefixIndex, chain_key
from k3jax.serve.images import ImageInputs, validate as validate_images
from k3jax.serve.types import TOP_LOGPROBS, EngineStats, RequestError, SamplingParams, TokenOutput
from sharding import mesh as mesh_lib
from sharding.rules import DEFAULT_RULES

log = logging.getLogger("k3jax.serve")
_MIN_CHUNK = 16
# logical axis names of the pools' arrays (k3jax.serve.step): slots and pages stay whole
_POOL_NAMES = {"pages": (None, None, None), "state": (None, "kv_heads", None, None),
               "conv": (None, None, None, "kv_heads")}


class Engine:
  """Continuous-batching engine of one model (see the module docstring).

  model: the model to serve (its parameters are split off once); serve: the ``serve.*`` config;
  mesh: a ``MeshConfig`` to serve on a mesh of the local devices with training's sharding rules
  less the ZeRO-3 split (``sharding.layout(..., serving=True)``: experts over ``expert``, heads
  and mlp columns over ``tensor``, every other weight whole on each device; the KDA slots' heads
  over ``tensor`` too, the MLA pages, shared by all heads, and the step's rows on every device;
  plain expert dispatch, MoonEP off), or None: one device.
  """

  def __init__(self, model: K3Model, serve: ServeConfig, *, mesh: MeshConfig | None = None):
    self.cfg, self.serve, self.mesh_cfg = model.cfg, serve, mesh
    if mesh is not None and mesh.context != 1:
      raise ConfigError(f"mesh.context: serving splits no sequence, got {mesh.context}")
    self.mesh = None if mesh is None else mesh_lib.make_mesh(mesh)
    self.max_model_len = min(serve.max_model_len, self.cfg.max_position)
    ps, bs = serve.page_size, serve.block_size
    num_pages = serve.num_pages or serve.max_batch * math.ceil(self.max_model_len / ps) + 1
    num_slots = serve.num_slots or 2 * serve.max_batch + 1
    self.pages = Allocator(num_pages, "MLA page")
    self.slots = Allocator(num_slots, "KDA slot")
    self.index = PrefixIndex(self.pages, self.slots, bs)
    self.table_width = math.ceil((self.max_model_len + bs) / ps)
    # rows split over the mesh's batch axes come in multiples of their product
    f = 1 if self.mesh is None else math.prod(
        dict(zip(self.mesh.axis_names, self.mesh.axis_sizes))[a] for a in DEFAULT_RULES["batch"])
    # padding rows take no cache: even max_batch=1 decodes in min_decode_rows rows
    fewest = -(-serve.min_decode_rows // f) * f
    self.decode_sizes = batch.buckets(max(-(-serve.max_batch // f) * f, fewest), fewest)
    self.prefill_sizes = batch.buckets(-(-serve.prefill_rows // f) * f, f)
    self.chunk_sizes = batch.buckets(bs, min(_MIN_CHUNK, bs))
    self._graphdef, params = nnx.split(model)
    # the steps' head shards: the serving layout's fused weights hold each shard's heads
    self._shards = 1 if self.mesh is None else self.mesh.shape.get("tensor", 1)
    self._rows = None  # sharding of the step's per-row inputs
    if self.mesh is not None:
      with self._scope():  # the serving layout's rules (sharding.layout(..., serving=True))
        params = mesh_lib.shard_params(params, self.mesh)
      self._rows = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    self._set_params(params)
    self._pools = step_lib.init_pools(nnx.merge(self._step_graphdef, self._step_params),
                                      num_pages=num_pages, page_size=ps, num_slots=num_slots)
    if self.mesh is not None:
      names = [{k: _POOL_NAMES[k][-a.ndim:] for k, a in p.items()} for p in self._pools]
      with self._scope():
        self._pools = jax.device_put(self._pools,
                                     mesh_lib.pure_shardings(self._pools, self.mesh, names))
    self._steps: dict[tuple[bool, int, int], Callable] = {}
    self._samplers: dict[tuple[bool, int, bool], Callable] = {}  # (decode, rows, draw)
    # the previous steps' sampled tokens, padded to the largest decode and prefill row counts
    self._feed_width = (self.decode_sizes[-1], self.prefill_sizes[-1])
    self._no_feed = tuple(jax.device_put(np.zeros(w, np.int32), self._rows)
                          for w in self._feed_width)
    self._feed = self._no_feed
    self._in_flight: list = []  # the dispatched step's rows and outputs, read by the next step
    # prefill steps of a model with a vision tower take, per row, the visual tokens of its
    # chunk's placeholders [T, d] (a row without images: zeros)
    self._images = None if self.cfg.vision is None else ImageInputs(
        self.cfg, self._graphdef, self._rows, self._scope)
    self._copy = jax.jit(step_lib.copy_slots, donate_argnums=0)
    self._copy_width = 2 * max(serve.max_batch, serve.prefill_rows)
    self.stats = EngineStats(pages_total=self.pages.total, slots_total=self.slots.total)
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []
    self._ids = itertools.count(1)
    self._wake = threading.Condition()
    self._inbox: list[Request] = []
    self._cancels: set[int] = set()
    self._thread: threading.Thread | None = None
    self._stop = False
    self._restores: list[tuple[int, int]] = []  # (checkpoint slot or 0 to zero, request slot)
    self._checkpoints: list[tuple[int, int]] = []  # (request slot, checkpoint slot)
    self.paused: dict[int, Request] = {}  # paused requests, holding their pages and slot
    self._resumed: collections.deque[Request] = collections.deque()  # admitted before waiting

  # ------------------------------------------------------------------------------ requests

  def validate(self, prompt, params: SamplingParams, images=()) -> None:
    """Raises :class:`RequestError` naming what makes the request impossible to run; ``images``:
    the vision items of the prompt's image placeholders, in order."""
    try:
      check_decoding(max_new_tokens=params.max_tokens, temperature=params.temperature,
                     top_p=params.top_p, top_k=params.top_k)
    except GenerateError as e:
      raise RequestError(str(e).removeprefix("generate: ")) from None
    if not 0 <= params.logprobs <= TOP_LOGPROBS:
      raise RequestError(f"logprobs must lie in [0, {TOP_LOGPROBS}], got {params.logprobs}")
    if params.seed is not None and not 0 <= params.seed < 2**32:
      raise RequestError(f"seed must lie in [0, 2**32), got {params.seed}")
    vocab = self.cfg.vocab_size
    if not prompt:
      raise RequestError("the prompt is empty")
    if any(not isinstance(t, (int, np.integer)) or not 0 <= t < vocab for t in prompt):
      raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
    if any(not 0 <= t < vocab for t in params.stop_token_ids):
      raise RequestError(f"stop token ids must lie in [0, {vocab})")
    validate_images(self.cfg, prompt, images)
    total = len(prompt) + params.max_tokens
    if total > self.max_model_len:
      raise RequestError(
          f"this model's context limit is {self.max_model_len} tokens, but the request needs "
          f"{total} ({len(prompt)} in the prompt, max_tokens={params.max_tokens})")
    need = math.ceil(total / self.serve.page_size)
    if need > self.pages.total:
      raise RequestError(f"the request needs {need} cache pages of {self.serve.page_size} tokens "
                         f"and the cache holds {self.pages.total} (serve.num_pages)")

  def submit(self, prompt, params: SamplingParams, callback: Callable[[TokenOutput], None],
             images=()) -> int:
    """Queues a request (any thread); returns its id. Its outputs reach ``callback``.
    ``images``: the vision items of the prompt's image placeholders, in order."""
    self.validate(prompt, params, images)
    stop = set(params.stop_token_ids)
    if not params.ignore_eos:
      stop.add(self.cfg.eos_token_id)
    r = Request(next(self._ids), tuple(int(t) for t in prompt), params, callback,
                 secrets.randbits(32) if params.seed is None else params.seed, frozenset(stop))
    r.tokens = list(r.prompt)
    r.keys = list(r.prompt)
    if images:
      v = self.cfg.vision
      r.images = tuple(images)
      r.keys = vision_prompt.prefix_keys(r.prompt, r.images, v.image_token_id)
      r.before = np.concatenate([[0], np.cumsum(np.asarray(r.prompt) == v.image_token_id)])
    with self._wake:
      self._inbox.append(r)
      self._wake.notify()
    return r.id

  def cancel(self, request_id: int) -> None:
    """Ends a request (any thread): it gets a last output with finish_reason ``"abort"``."""
    with self._wake:
      self._cancels.add(request_id)
      self._wake.notify()

  def generate(self, prompts, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    """Runs requests to completion on the calling thread (the engine thread must not run);
    returns each request's generated tokens."""
    if self._thread is not None:
      raise RuntimeError("Engine.generate: the engine thread is running; use submit")
    params = params if isinstance(params, list) else [params] * len(prompts)
    outs: dict[int, list[int]] = {}
    errors = []

    def collect(o: TokenOutput):
      if o.token is not None:
        outs[o.request_id].append(o.token)
      if o.error:
        errors.append(o.error)

    ids = [self.submit(p, sp, collect) for p, sp in zip(prompts, params)]
    for i in ids:
      outs[i] = []
    while self.has_work():
      self.step()
    if errors:
      raise RuntimeError("; ".join(errors))
    return [outs[i] for i in ids]

  def has_work(self) -> bool:
    with self._wake:
      return bool(self._inbox or self._cancels or self.running or self.waiting or self._resumed
                  or self._in_flight)

  # ------------------------------------------------------------------------------ post-training

  def update_weights(self, params, biases=None) -> None:
    """Serves new weights from the next step on (between steps; no recompile): ``params`` and
    ``biases`` are pure dicts (``nnx.to_pure_dict``, as training holds them) of the same shapes,
    cast and placed as the engine's. The prefix index is dropped (its states came from the old
    weights); running and paused requests keep their caches but register no more blocks, and
    those with image placeholders left to prefill encode their images again."""
    self.flush()  # tokens in flight came from the old weights: handed out before they change
    new = nnx.to_pure_dict(self._params)

    def put(tree):
      for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        node = new
        for k in path[:-1]:
          node = node[getattr(k, "key", getattr(k, "idx", k))]
        key = getattr(path[-1], "key", getattr(path[-1], "idx", path[-1]))
        if node[key].shape != x.shape:
          raise ValueError(f"Engine.update_weights: {jax.tree_util.keystr(path)} has shape "
                           f"{x.shape}, the engine's {node[key].shape}")
        node[key] = jax.device_put(jnp.asarray(x, node[key].dtype), node[key].sharding)

    put(params)
    if biases is not None:
      put(biases)
    state = jax.tree.map(lambda x: x, self._params)
    nnx.replace_by_pure_dict(state, new)
    self._set_params(state)
    self.index.clear()
    for r in self.running + list(self.paused.values()) + list(self._resumed):
      r.blocks = []
      if r.visual is not None:  # placeholders still to prefill: their tokens from the new tower
        r.visual = self._images.encode(self._params, r.images)

  def _set_params(self, params) -> None:
    """Takes ``params`` (the model's state as laid out) and builds the steps' serving layout
    from them (:func:`step_lib.serving_model`)."""
    self._params = params
    serving = step_lib.serving_model(nnx.merge(self._graphdef, params), self._shards)
    self._step_graphdef, state = nnx.split(serving)
    if self.mesh is not None:
      with self._scope():
        state = mesh_lib.shard_params(state, self.mesh)
    self._step_params = state
    self._leaves = jax.tree.leaves(state)  # what the steps take (step_lib.step)

  def pause(self, request_id: int) -> None:
    """Takes a running or waiting request out of scheduling (between steps; the tokens in flight
    are handed out first, :meth:`flush`); a running one keeps its MLA pages and KDA slot, so
    :meth:`resume` continues it exactly where it stopped."""
    self.flush()
    queues = (self.running, self.waiting, self._resumed)
    q = next((q for q in queues if any(r.id == request_id for r in q)), None)
    if q is None:
      raise KeyError(f"request {request_id} is neither running nor waiting")
    r = next(r for r in q if r.id == request_id)
    q.remove(r)
    self.paused[request_id] = r

  def resume(self, request_id: int) -> None:
    """Schedules a paused request again, ahead of the waiting ones."""
    r = self.paused.pop(request_id)
    (self._resumed if r.slot is not None else self.waiting).appendleft(r)

  # ------------------------------------------------------------------------------ thread

  def start(self) -> None:
    """Compiles every step shape, then runs :meth:`step` on a background thread."""
    self.compile()
    self._thread = threading.Thread(target=self._loop, name="k3jax-engine", daemon=True)
    self._thread.start()

  def shutdown(self) -> None:
    with self._wake:
      self._stop = True
      self._wake.notify()
    if self._thread is not None:
      self._thread.join()
      self._thread = None

  def _loop(self) -> None:
    while True:
      with self._wake:
        while not self._stop and not (self._inbox or self._cancels or self.running or self.waiting
                                      or self._in_flight):
          self._wake.wait()
        if self._stop:
          break
      try:
        self.step()
      except Exception as e:  # a failed step ends what it ran; the engine keeps serving
        log.exception("engine step failed")
        self._in_flight = []
        for r in list(self.running):
          self._finish(r, "error", error=f"engine step failed: {e}")
    for r in list(self.running) + list(self.waiting):
      self._finish(r, "abort")

  # ------------------------------------------------------------------------------ compiling

  @contextlib.contextmanager
  def _scope(self):
    """The mesh and its layout, while tracing and running steps (nothing without a mesh)."""
    if self.mesh is None:
      yield
      return
    with jax.set_mesh(self.mesh), sharding.layout(self.mesh_cfg, serving=True):
      yield

  def _lower(self, decode: bool, n: int, t: int):
    with self._scope():
      return step_lib.lower(self._step_graphdef, self._step_params, self._pools, decode=decode,
                            rows=n, tokens=t, table_width=self.table_width,
                            feed=self._feed_width, row_sharding=self._rows,
                            visual=None if decode or self._images is None else self._images.shape)

  def _compiled(self, decode: bool, n: int, t: int):
    return self._program(self._steps, (decode, n, t), self._lower,
                         f"the {'decode' if decode else 'prefill'} step of {n} rows x {t} tokens")

  def _lower_sampler(self, decode: bool, n: int, draw: bool):
    with self._scope():
      return step_lib.lower_sample(n, self.cfg.vocab_size, self._feed_width[0 if decode else 1],
                                   draw, self._rows)

  def _sampler(self, decode: bool, n: int, draw: bool):
    return self._program(self._samplers, (decode, n, draw), self._lower_sampler,
                         f"the sampling of {n} {'decode' if decode else 'prefill'} rows"
                         f"{' (drawing)' if draw else ''}")

  @staticmethod
  def _program(cache: dict, key: tuple, lower: Callable, what: str):
    """``cache[key]``, compiled from ``lower(*key)`` at first use (logged: :meth:`compile`
    compiles every shape up front, so a first use under load is worth a warning)."""
    if key not in cache:
      t0 = time.perf_counter()
      cache[key] = lower(*key).compile()
      log.warning("compiled %s at first use (%.1f s): Engine.compile compiles every shape up "
                  "front", what, time.perf_counter() - t0)
    return cache[key]

  def step_shapes(self) -> list[tuple[bool, int, int]]:
    """Every (decode, rows, tokens per row) shape a step may take."""
    return ([(True, n, 1) for n in self.decode_sizes]
            + [(False, n, t) for n in self.prefill_sizes for t in self.chunk_sizes])

  def sampler_shapes(self) -> list[tuple[bool, int, bool]]:
    """Every (decode, rows, draw) the sampling program after a step may take."""
    return [(d, n, draw) for d, sizes in ((True, self.decode_sizes), (False, self.prefill_sizes))
            for n in sizes for draw in (False, True)]

  def compile(self, workers: int | None = None) -> float:
    """Compiles every step shape and its sampling programs, ``workers`` at a time (default: half
    the host's cores, XLA's compiles run side by side); returns (and logs) the seconds it took.
    Each shape compiles as soon as it is lowered (lowering is Python, one at a time), the most
    tokens first, so the longest compiles do not end the run alone."""
    t0 = time.perf_counter()
    todo = sorted((s for s in self.step_shapes() if s not in self._steps),
                  key=lambda s: s[1] * s[2], reverse=True)
    samplers = [s for s in self.sampler_shapes() if s not in self._samplers]
    jobs = [(self._lower, s) for s in todo] + [(self._lower_sampler, s) for s in samplers]
    workers = workers or max(1, min(len(jobs), (os.cpu_count() or 2) // 2))
    with (concurrent.futures.ThreadPoolExecutor(workers) as pool,
          tqdm(total=len(jobs), desc="compiling step shapes", unit="program",
               dynamic_ncols=True, mininterval=1.0) as bar):
      futures = []
      for lower, s in jobs:
        futures.append(pool.submit(lower(*s).compile))
        futures[-1].add_done_callback(lambda _: bar.update())
      compiled = [f.result() for f in futures]
    self._steps.update(zip(todo, compiled))
    self._samplers.update(zip(samplers, compiled[len(todo):]))
    if self._images is not None:
      self._images.compile(self._params)
    secs = time.perf_counter() - t0
    log.info("compiled %d step shapes in %.1f s (%d at a time)", len(todo), secs, workers)
    return secs

  # ------------------------------------------------------------------------------ the step

  def step(self) -> None:
    """Admits, dispatches one decode and one prefill program, then hands out the previous
    step's tokens while these run."""
    self._take_inbox()
    self._admit()
    decode, prefill = self._schedule()
    self._copy_pending(self._restores, zero_src=True)
    done, self._in_flight = self._in_flight, []
    feed = list(self._no_feed)
    if decode:
      out = self._run(True, [(r, r.computed, 1) for r in decode])
      self._in_flight.append(self._book(decode, [1] * len(decode), out, 0))
      feed[0] = out[0]
    if prefill:
      out = self._run(False, prefill)
      self._in_flight.append(self._book([r for r, *_ in prefill], [c for *_, c in prefill], out,
                                        self._feed_width[0]))
      feed[1] = out[0]
    self._feed = tuple(feed)
    ran = [(r, r.epoch) for r in decode + [r for r, *_ in prefill]]
    emitted = self._receive(done)
    for r, epoch in ran:  # blocks this step completes, their checkpoints before the next step
      if r.epoch == epoch:
        self._register(r)
    self._copy_pending(self._checkpoints, zero_src=False)
    self.stats.steps += 1
    self._update_stats()
    for r, o in emitted:
      r.callback(o)

  def flush(self) -> None:
    """Reads and hands out the tokens of the step in flight (between steps, on the engine's
    thread), so that every token dispatched so far has reached its request."""
    done, self._in_flight = self._in_flight, []
    for r, o in self._receive(done):
      r.callback(o)

  def _book(self, rows: list[Request], counts: list[int], out, offset: int):
    """Books a dispatched step: each row's ``counts`` tokens are computed, and a row whose last
    known or awaited token was among them awaits the token sampled after it (at ``offset`` plus
    its row in the feed). Returns (the sampling rows ``(request, epoch, row)``, the outputs)."""
    booked = []
    for i, (r, c) in enumerate(zip(rows, counts)):
      r.computed += c
      if r.computed == len(r.tokens) + r.inflight:
        r.inflight += 1
        r.feed = offset + i
        booked.append((r, r.epoch, i))
    return booked, out

  def _take_inbox(self) -> None:
    with self._wake:
      inbox, self._inbox = self._inbox, []
      cancels, self._cancels = self._cancels, set()
    self.waiting.extend(inbox)
    for r in [r for r in list(self.waiting) + self.running if r.id in cancels]:
      self._finish(r, "abort")

  def _alloc_slot(self) -> int | None:
    s = self.slots.alloc()
    while s is None and self.index.evict_checkpoint():
      s = self.slots.alloc()
    return s

  def _alloc_page(self) -> int | None:
    p = self.pages.alloc()
    if p is None:
      self.index.evict_pages(1)
      p = self.pages.alloc()
    return p

  def _admit(self) -> None:
    while self._resumed and len(self.running) < self.serve.max_batch:
      self.running.append(self._resumed.popleft())  # paused with their cache: nothing to restore
    while self.waiting and len(self.running) < self.serve.max_batch:
      r = self.waiting[0]
      slot = self._alloc_slot()
      if slot is None:
        return
      self.waiting.popleft()
      r.slot = slot
      chain, hit = (self.index.lookup(r.keys) if self.serve.prefix_cache else ([], Hit()))
      for p in hit.pages:
        self.pages.incref(p)
      r.pages, r.computed = list(hit.pages), hit.length
      r.blocks = chain[:hit.length // self.serve.block_size]
      if hit.checkpoint is not None:
        self.slots.incref(hit.checkpoint)  # held until the copy has run
        self._restores.append((hit.checkpoint, slot))
        self.stats.kda_checkpoint_hits += 1
        self.stats.prefix_hit_tokens += hit.length
      else:
        self._restores.append((0, slot))  # a fresh state: zeros
      if r.generated == 0:
        r.cached = hit.length
      if r.images and r.before[min(hit.length, len(r.prompt))] < r.before[-1]:  # left to prefill
        r.visual = self._images.encode(self._params, r.images)
      self.running.append(r)

  def _reserve(self, r: Request, end: int) -> bool:
    """Maps pages for positions ``< end`` of ``r``, preempting newer requests when the cache is
    full; False if ``r`` itself had to go."""
    need = -(-end // self.serve.page_size)
    while len(r.pages) < need:
      p = self._alloc_page()
      if p is None:
        victim = self.running[-1]
        self._preempt(victim)
        if victim is r:
          return False
        continue
      r.pages.append(p)
    return True

  def _decode_ready(self, r: Request) -> bool:
    """Whether ``r`` has exactly one token to feed: the host's, or one the previous step
    samples (then not when that token ends ``r`` by length)."""
    if not r.inflight:
      return r.pending == 1
    total = len(r.tokens) + r.inflight
    return (total == r.computed + 1 and total - len(r.prompt) < r.params.max_tokens
            and total < self.max_model_len)

  def _schedule(self):
    """The decode rows and the prefill rows ``(request, start, length)`` of this step. A request
    preempted meanwhile (by a later one's :meth:`_reserve`) has no slot any more."""
    decode = []
    for r in list(self.running):
      if r.slot is not None and self._decode_ready(r) and self._reserve(r, r.computed + 1):
        decode.append(r)
    prefill, budget = [], self.serve.token_budget
    bs = self.serve.block_size
    for r in list(self.running):
      if len(prefill) == self.serve.prefill_rows or budget == 0:
        break
      if r.slot is None or r.inflight or r.pending <= 1:
        continue
      n = min(r.pending, bs - r.computed % bs, budget)
      if self._reserve(r, r.computed + n):
        prefill.append((r, r.computed, n))
        budget -= n
    return [r for r in decode if r.slot is not None], [x for x in prefill if x[0].slot is not None]

  def _preempt(self, r: Request) -> None:
    self._release(r)
    r.computed, r.blocks = 0, []
    r.inflight, r.epoch = 0, r.epoch + 1  # tokens in flight are sampled again, the same ones
    self.running.remove(r)
    self.waiting.appendleft(r)
    self.stats.preemptions += 1

  def _release(self, r: Request) -> None:
    r.visual = None
    for p in r.pages:
      self.pages.decref(p)
    r.pages = []
    if r.slot is not None:
      for i, (src, dst) in enumerate(self._restores):
        if dst == r.slot:
          if src:
            self.slots.decref(src)
          del self._restores[i]
          break
      self.slots.decref(r.slot)
      r.slot = None

  def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
    self._drop(r)
    r.callback(TokenOutput(r.id, None, finish_reason=reason, error=error,
                           prompt_tokens=len(r.prompt), cached_tokens=r.cached))

  def _drop(self, r: Request) -> None:
    """Takes ``r`` out of the engine: its cache released, its outputs in flight dropped."""
    if r in self.running:
      self._release(r)
      self.running.remove(r)
    elif r in self.waiting:
      self.waiting.remove(r)
    elif self.paused.pop(r.id, None) is not None or r in self._resumed:
      if r in self._resumed:
        self._resumed.remove(r)
      self._release(r)
    r.inflight, r.epoch = 0, r.epoch + 1

  def _copy_pending(self, pairs: list[tuple[int, int]], *, zero_src: bool) -> None:
    """Runs the queued slot copies (``zero_src``: source 0 means zeros) and drops the
    references the restores held on their checkpoints."""
    while pairs:
      chunk, pairs[:] = pairs[:self._copy_width], pairs[self._copy_width:]
      src = np.zeros(self._copy_width, np.int32)
      dst = np.zeros(self._copy_width, np.int32)
      src[:len(chunk)], dst[:len(chunk)] = zip(*chunk)
      zero = (src == 0) & (dst != 0) if zero_src else np.zeros_like(src, bool)
      with self._scope():
        self._pools = self._copy(self._pools, src, dst, zero)
      if zero_src:
        for s, _ in chunk:
          if s:
            self.slots.decref(s)

  def _run(self, decode: bool, rows: list[tuple[Request, int, int]]):
    """Dispatches one compiled step over ``rows`` (request, start, tokens); returns its device
    outputs: the sampled tokens padded to the feed width, logprobs, top ids, top logprobs."""
    sizes = self.decode_sizes if decode else self.prefill_sizes
    n = batch.fit(sizes, len(rows))
    t = 1 if decode else batch.fit(self.chunk_sizes, max(c for _, _, c in rows))
    (tokens, starts, nvalid, table, slots, temp, top_p, top_k, seeds, counters,
     src) = batch.host_inputs(rows, n, t, self.table_width, decode=decode)
    fn = self._compiled(decode, n, t)
    # the sort and top-k of drawing only where a row draws or asks for alternatives
    draw = any(r.params.temperature > 0 or r.params.logprobs for r, _, _ in rows)
    sampler = self._sampler(decode, n, draw)
    args = (tokens, starts, nvalid, table, slots)
    sampling = (seeds, counters, temp, top_p, top_k)
    if self._rows is not None:
      args, sampling, src = jax.device_put((args, sampling, src), self._rows)
    if decode:
      args = (*args, (*self._feed, src))
    elif self._images is not None:
      args = (*args, None, self._images.step_inputs(rows, n, t))
    with self._scope():
      self._pools, logits = fn(self._leaves, self._pools, *args)
      return list(sampler(logits, *sampling))

  def _receive(self, steps) -> list[tuple[Request, TokenOutput]]:
    """Reads the sampled tokens of ``steps`` (:meth:`_book`'s) and books them: each request
    still in the epoch it was dispatched in takes its token, and ends on a stop token or its
    length. Returns the outputs to hand out."""
    emitted = []
    outs = jax.device_get([out for _, out in steps])
    for (booked, _), (tok, lp, top_ids, top_lp) in zip(steps, outs):
      tok, lp = tok.tolist(), lp.tolist()
      for r, epoch, i in booked:
        if r.epoch != epoch:
          continue
        r.inflight -= 1
        r.visual = None  # every placeholder is in the cache
        t = tok[i]
        r.tokens.append(t)
        r.keys.append(t)
        self.stats.generation_tokens += 1
        if r.generated == 1:
          self.stats.prompt_tokens += len(r.prompt)
        reason = None
        if t in r.stop_ids:
          reason = "stop"
        elif r.generated >= r.params.max_tokens or len(r.tokens) >= self.max_model_len:
          reason = "length"
        k = r.params.logprobs
        top = tuple(zip(top_ids[i, :k].tolist(), top_lp[i, :k].tolist())) if k else ()
        emitted.append((r, TokenOutput(r.id, t, lp[i], top,
                                       finish_reason=reason, prompt_tokens=len(r.prompt),
                                       cached_tokens=r.cached)))
        if reason is not None:
          self._drop(r)
    return emitted

  def _register(self, r: Request) -> None:
    """Puts the block ``r`` just completed into the prefix index, with a KDA checkpoint every
    ``serve.checkpoint_every`` blocks."""
    bs = self.serve.block_size
    i = r.computed // bs - 1
    if (not self.serve.prefix_cache or r.computed % bs or len(r.blocks) != i
        or len(r.keys) < r.computed):
      return
    tokens = r.keys[i * bs:(i + 1) * bs]
    parent = r.blocks[-1] if r.blocks else None
    per = bs // self.serve.page_size
    block = self.index.insert(chain_key(parent.key if parent else 0, tokens), parent, tokens,
                              r.pages[i * per:(i + 1) * per])
    if block is None:  # the parent was evicted: this request's later blocks stay uncached
      return
    r.blocks.append(block)
    if block.checkpoint is None and (i + 1) % self.serve.checkpoint_every == 0:
      slot = self._alloc_slot()
      if slot is not None:
        self.index.set_checkpoint(block, slot)
        self._checkpoints.append((r.slot, slot))

  def _update_stats(self) -> None:
    s = self.stats
    s.running, s.waiting = len(self.running), len(self.waiting) + len(self._inbox)
    s.pages_used, s.slots_used = self.pages.used, self.slots.used
