"""Memory and communication plan of a training layout, without devices and without allocating.

``python -m k3jax.plan CONFIG --mesh data=A,fsdp=B,expert=C,context=D [--seq-len L] [--batch B]
[--lower-layers N] [--platform P] [--memory GB] [key=value ...]`` prints a JSON report:

- ``params`` / ``grads`` / ``optimizer``: per-device bytes, exact: every leaf of the abstract
  parameter tree (``nnx.eval_shape``) and of the optimizer state (``jax.eval_shape`` of
  ``tx.init``) divided by the mesh axes its logical names shard it over (:mod:`sharding.rules`);
  ``unsplit_params`` lists the leaves a rule asks to split over an axis that divides none of
  their dimensions (whole on every device of it), and ``warning`` names them when they hold
  more than 1% of the model;
- ``activations``: per-device peak for ``model.remat`` and ``model.remat_skip``, of one
  micro-batch (``--batch / train.grad_accum`` sequences: the step runs them one at a time, and
  ``collectives`` counts each one's gathers and gradient reductions). With no expert,
  context or tensor split (``method: traced``) it is measured on the program itself: the residuals
  ``jax.vjp`` keeps from the forward to the backward of the loss (every layer under its remat
  policy, the kernels of ``--platform``, at the per-device batch), plus the larger of the two
  transients: the loss chunk's logits and their gradient (formed in the forward), and the
  recompute of one remat layer (its residuals without the policy less those kept). It is counted
  before XLA's fusion and buffer reuse (against the compiled step: benchmarks/RESULTS.md,
  Training, "The memory plan against the compiled step"). Traced, it also
  gives the peak for every ``model.remat_skip`` (``by_remat_skip_GB``: a layer leaving the remat
  adds what its backward would form again); ``--memory GB`` says whether the total fits (``fit``)
  and, traced, the largest ``model.remat_skip`` that does. With expert, context or tensor splits
  (``method: analytical``) the formulas in ``activations.terms`` apply: they assume flash-style
  attention kernels and count a remat layer as keeping only its input, as under ``full``
  (``dots`` and ``dots_kernels`` keep more);
- ``collectives``: bytes each device sends per step for every collective (analytical): FSDP
  all-gathers and reduce-scatters, data-parallel gradient all-reduces, the expert all-to-alls
  (and MoonEP's weight fetch), the KDA ``(M, N)`` and MLA latent all-gathers of context
  parallelism, the Quantile Balancing histogram all-reduce;
- ``lowering`` (``--lower-layers N``, N > 0: that many layers, -1: all): the full training step
  (forward, backward, optimizer, bias update) of the model cut to N layers is lowered with
  ``jax.jit(...).trace(...).lower()`` on a ``jax.sharding.AbstractMesh`` of the requested shape,
  with the kernels of ``--platform`` (Triton and Mosaic GPU for an H200, Mosaic TPU; nothing is
  compiled or run); reports the time taken, the kernel calls and the collectives found in the
  lowered program (only the ``shard_map`` ones: GSPMD adds the others when compiling);
- ``compiled`` (``--compile TARGET [--compile-layers N] [--hlo PATH] [--xla-dump DIR]``): the
  same step compiled
  for compile-only devices of an H200, an H100 or a TPU topology (:mod:`k3jax.aot`) on the
  requested mesh: XLA's memory analysis per device (temporaries, arguments, outputs, the peak)
  against the device's usable memory (``fits``), the compile time, the kernels and the bytes each
  collective leaves on a device per step (``collectives_GB_received``, loops counted). This is the
  program the device would run, so it settles what the traced and analytical estimates above
  approximate; on a GPU target without autotuning it can be a few GiB off
  (benchmarks/RESULTS.md, Training).
"""

from __future__ import annotations

import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
import sharding
from k3jax import aot, cli, config as config_lib
from k3jax.config import Config, MeshConfig
from k3jax.train_state import abstract_model, abstract_train_state, state_names
from sharding import context_parallel, mesh as mesh_lib
from sharding.expert_parallel import capacity
from sharding.rules import logical_spec

AXES = mesh_lib.AXES
TOKEN_AXES = mesh_lib.TOKEN_AXES
GB = 1e9


def parse_mesh(text: str) -> dict[str, int]:
  """``"data=2,expert=4"`` -> ``{"data": 2, "expert": 4, ...}`` (missing axes: 1)."""
  sizes = {a: 1 for a in AXES}
  for item in filter(None, text.split(",")):
    if "=" not in item:
      raise config_lib.ConfigError(f"--mesh: expected axis=size, got {item!r}")
    k, v = item.split("=", 1)
    if k.strip() not in AXES:
      raise config_lib.ConfigError(f"--mesh: unknown axis {k!r} (axes: {', '.join(AXES)})")
    sizes[k.strip()] = int(v)
    if sizes[k.strip()] < 1:
      raise config_lib.ConfigError(f"--mesh: axis {k!r} must be >= 1")
  return sizes


def _spec_axes(names, shape, sizes):
  """Mesh axes (size > 1) that split a leaf with logical ``names`` and ``shape``."""
  if not names:
    return ()
  return mesh_lib.spec_axes(mesh_lib.fit_spec(
      logical_spec(names, None, [a for a in AXES if sizes[a] > 1]), shape, sizes))


def _nbytes(x) -> int:
  return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


def _leaves(tree):
  return jax.tree_util.tree_flatten_with_path(tree)[0]


def abstract_state(cfg: Config):
  """(abstract :class:`~k3jax.train_state.TrainState` without shardings, the parameters' logical
  axis names) of ``cfg``: nothing is allocated."""
  model = abstract_model(cfg)
  return abstract_train_state(cfg, model=model), state_names(model)[0]


def state_bytes(cfg: Config, sizes: dict[str, int], abstract=None) -> dict:
  """Exact per-device bytes of parameters, gradients and optimizer state, and the per-leaf
  layout the collective accounting needs; ``abstract``: :func:`abstract_state` of ``cfg`` when
  the caller has it."""
  state, names = abstract or abstract_state(cfg)
  arrays = state.arrays("params", "opt_state")  # one entry per layer, as the names are
  params = arrays["params"]
  flat_names = {mesh_lib.path_key(p): n for p, n in _leaves(mesh_lib._wrap(names))}
  per_leaf = []
  for path, x in _leaves(params):
    n = flat_names[mesh_lib.path_key(path)].names
    axes = _spec_axes(n, x.shape, sizes)
    split = math.prod(sizes[a] for a in axes)
    per_leaf.append({"path": mesh_lib.path_key(path), "bytes": _nbytes(x),
                     "local": _nbytes(x) / split, "axes": axes,
                     "expert": bool(n and n[0] == "expert")})
  opt = arrays["opt_state"]
  by_path = {leaf["path"]: leaf for leaf in per_leaf}
  opt_local = 0.0
  for path, x in _leaves(opt):
    key = mesh_lib.path_key(path)
    match = next((by_path[key[i:]] for i in range(len(key)) if key[i:] in by_path), None)
    split = 1 if match is None or not x.shape else math.prod(sizes[a] for a in match["axes"])
    opt_local += _nbytes(x) / split
  local = sum(leaf["local"] for leaf in per_leaf)
  return {"per_leaf": per_leaf, "params": local, "grads": local, "optimizer": opt_local,
          "total_params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)),
          "total_bytes": sum(_nbytes(x) for x in jax.tree.leaves(params)),
          "unsplit": mesh_lib.unsplit_params(params, names, sizes)}


def _ring(bytes_full: float, n: int) -> float:
  """Bytes one device sends in a ring all-gather / reduce-scatter of ``bytes_full`` over n."""
  return bytes_full * (n - 1) / n if n > 1 else 0.0


def collectives(cfg: Config, sizes: dict[str, int], seq_len: int, batch: int, state: dict) -> dict:
  """Bytes sent per device per training step, by collective (analytical)."""
  m = cfg.model
  cb = jnp.dtype(m.cdtype).itemsize
  # forward, backward and the recomputed forward of the remat layers (their share of the layers)
  passes = 2 + m.remat_layers / m.num_layers
  tok_split = math.prod(sizes[a] for a in TOKEN_AXES)
  n = batch * seq_len / tok_split  # tokens per device
  out: dict[str, float] = {}
  fsdp_ag = fsdp_rs = dp_ar = 0.0
  for leaf in state["per_leaf"]:
    gather_axes = [a for a in leaf["axes"] if a != "expert"]
    g = math.prod(sizes[a] for a in gather_axes)
    full_on_device = leaf["local"] * g  # what the compute sees after the gathers
    if g > 1:
      fsdp_ag += (passes - 1) * _ring(full_on_device, g)  # forward + recomputed forward
      fsdp_rs += _ring(full_on_device, g)
    # gradients are summed over the token axes the leaf is not split over
    rep = math.prod(sizes[a] for a in TOKEN_AXES if a not in leaf["axes"])
    dp_ar += 2 * _ring(leaf["local"], rep)
  out["fsdp_all_gather_params"] = fsdp_ag
  out["fsdp_reduce_scatter_grads"] = fsdp_rs
  out["grad_all_reduce"] = dp_ar
  moe_layers = [i for i in range(m.num_layers) if m.is_moe(i)]
  r = sizes["expert"]
  if r > 1:
    e, k = m.moe.num_experts, m.moe.top_k
    er = e // r
    width = m.moe.latent_dim or m.hidden_size
    moonep = cfg.mesh.moonep
    cap = capacity(int(n), k, r, er, m.moe.capacity_factor, moonep)
    buf = r * cap * width * cb
    out["expert_all_to_all_tokens"] = len(moe_layers) * 2 * passes * _ring(buf, r)
    out["expert_counts_all_gather"] = len(moe_layers) * passes * _ring(r * e * 4, r)
    if moonep:
      f = m.moe.expert_intermediate
      wbuf = r * er * (3 * width * f) * jnp.dtype(m.pdtype).itemsize
      out["moonep_weight_fetch_all_to_all"] = len(moe_layers) * passes * _ring(wbuf, r)
  c = sizes["context"]
  bl = batch / math.prod(sizes[a] for a in ("data", "fsdp", "expert"))
  if c > 1:
    kd = m.kda
    kda_layers = sum(m.layer_kind(i) == "kda" for i in range(m.num_layers))
    mn = bl * kd.value_heads * kd.head_dim * (kd.head_dim + kd.v_head_dim) * 4
    out["kda_context_all_gather_MN"] = kda_layers * passes * _ring(c * mn, c)
    a = m.mla
    mla_layers = m.num_layers - kda_layers
    lat = bl * seq_len * (a.kv_lora_rank + a.qk_rope_head_dim) * cb
    out["mla_context_all_gather_latent"] = mla_layers * passes * _ring(lat, c)
    q_out = bl * (seq_len / c) * a.num_heads * (a.qk_head_dim + a.v_head_dim) * cb
    out["mla_context_zigzag_ppermute"] = mla_layers * passes * q_out
  if m.moe.balancing == "quantile_hist" and tok_split > 1:
    out["qb_histogram_all_reduce"] = len(moe_layers) * 2 * _ring(m.moe.num_experts * m.moe.balancing_bins * 4,
                                                                 tok_split)
  out["total"] = sum(out.values())
  return out


def activations(cfg: Config, sizes: dict[str, int], seq_len: int, batch: int) -> dict:
  """Peak activation bytes per device (analytical estimate, see the module docstring): for
  layouts with expert, context or tensor splits, whose per-device program differs from the
  one-device one."""
  m = cfg.model
  cb = jnp.dtype(m.cdtype).itemsize
  tok_split = math.prod(sizes[a] for a in TOKEN_AXES)
  n = batch * seq_len / tok_split
  d = m.hidden_size
  tp = sizes["tensor"]
  blocks = -(-m.num_layers // m.attn_res.block_size) + 1 if m.attn_res.enabled else 0
  terms = {}
  live_layers = m.num_layers - m.remat_layers  # layers that keep their forward tensors
  if m.remat_layers:
    terms["saved_layer_inputs"] = m.remat_layers * n * d * cb
    terms["attn_res_blocks"] = blocks * n * d * cb
    live_layers += 1  # the one recomputed in the backward
  kd = m.kda
  kda_proj = n * (2 * kd.num_heads * kd.head_dim + 2 * kd.value_heads * kd.v_head_dim
                  + kd.value_heads * kd.head_dim) / tp
  # forward tensors of one KDA layer (projections, convs, gate: cdtype) plus the float32 chunk
  # intermediates of the op (two passes when the context axis splits the sequence)
  kda_op = n * kd.value_heads * (3 * kd.head_dim + kd.v_head_dim) * 4 / tp * (2 if sizes["context"] > 1 else 1)
  kda_layer = 2 * kda_proj * cb + kda_op
  a = m.mla
  rows = batch / math.prod(sizes[x] for x in ("data", "fsdp", "expert"))
  latent = a.kv_lora_rank + a.qk_rope_head_dim
  mla_layer = (n * a.num_heads * (2 * a.qk_head_dim + 2 * a.v_head_dim) * cb / tp
               + n * latent * cb)
  if sizes["context"] > 1:
    # the context-parallel MLA gathers all ranks' latents and up-projects them into every head's
    # keys and values one key block at a time (sharding/context_parallel.py: [rows, block, H,
    # 192 + 128]), merging the blocks into a float32 output and log-sum-exp; the backward gathers
    # the latents again (only the rank's own are kept)
    kb = context_parallel.key_block(seq_len)
    mla_layer += rows * seq_len * latent * cb
    mla_layer += rows * kb * a.num_heads * (a.qk_head_dim + a.v_head_dim) * cb / tp
    mla_layer += n * a.num_heads * (a.v_head_dim + 1) * 4 / tp
  mo = m.moe
  width = mo.latent_dim or d
  r = sizes["expert"]
  slots = n * mo.top_k
  if r > 1:
    cap = capacity(int(n), mo.top_k, r, mo.num_experts // r, mo.capacity_factor, cfg.mesh.moonep)
    rows = r * cap
  else:
    rows = slots
  moe_layer = ((2 * rows + slots) * width * cb  # send / receive buffers, per-slot outputs
               + rows * 3 * mo.expert_intermediate * cb / tp  # gate/up and the activation
               + n * mo.num_shared_experts * mo.expert_intermediate * 3 * cb / tp)
  if r > 1 and cfg.mesh.moonep:
    moe_layer += 2 * mo.num_experts * 3 * width * mo.expert_intermediate * jnp.dtype(m.pdtype).itemsize
  dense_layer = n * m.dense_intermediate * 3 * cb / tp
  layer = max(kda_layer, mla_layer) + max(moe_layer, dense_layer)
  terms["one_layer_forward"] = layer * live_layers
  terms["one_layer_backward"] = 2 * layer  # cotangents of the same tensors
  terms["head_and_loss"] = n * d * 4 * 2 + 1024 * m.vocab_size * 4 * 2
  return {"peak": sum(terms.values()), "terms": terms, "tokens_per_device": n,
          "method": "analytical"}


PLATFORMS = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu", "cpu": "cpu"}
# the GPU the kernels are built for when lowering for one without it (Hopper: wgmma, TMA)
GPU_TARGET = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


def _residual_bytes(f, *args) -> int:
  """Bytes of the residuals ``jax.vjp(f, *args)`` keeps for the backward, less the arguments."""
  # what jax.ad_checkpoint.print_saved_residuals prints, as (aval, source) pairs (jax 0.11.2)
  from jax._src.ad_checkpoint import saved_residuals
  return sum(_nbytes(aval) for aval, src in saved_residuals(f, *args)
             if not src.startswith("from the argument"))


def _abstract_batch(batch: int, seq_len: int) -> dict:
  tok = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  return {"input_ids": tok, "targets": tok, "segment_ids": tok, "positions": tok,
          "weights": jax.ShapeDtypeStruct((batch, seq_len), jnp.float32)}


def _blocks_before(m, i: int) -> int:
  """AttnRes block summaries layer ``i`` receives (``K3Model.hidden`` commits one at each layer
  whose index is a multiple of the block size)."""
  return sum(j % m.attn_res.block_size == 0 for j in range(i)) if m.attn_res.enabled else 0


def _layer_recompute_bytes(cfg: Config, layer, i: int, batch: int, seq_len: int) -> int:
  """Bytes the backward of ``layer`` (the abstract model's layer ``i``) under ``model.remat``'s
  policy forms again: the layer's residuals without the policy less those it keeps under it
  (``[batch, seq_len]`` tokens); what the layer adds to the saved residuals when it leaves the
  remat."""
  import dataclasses
  from k3jax.model import layer_call
  m = dataclasses.replace(cfg.model, remat_skip=0)
  graphdef, state = nnx.split(layer)
  x = jax.ShapeDtypeStruct((batch, seq_len, m.hidden_size), m.cdtype)
  n_blocks = _blocks_before(m, i)
  tok = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)

  def kept(model_cfg):
    def f(state, x, blocks, segment_ids):
      out, blocks, _, stats = layer_call(model_cfg, i)(nnx.merge(graphdef, state), x, blocks,
                                                       segment_ids, segment_ids > 0, None, False,
                                                       None)
      return out, blocks, stats
    return _residual_bytes(f, state, x, (x,) * n_blocks, tok)

  return kept(dataclasses.replace(m, remat="none")) - kept(m)


def traced_activations(cfg: Config, batch: int, seq_len: int, platform: str = "cuda",
                       abstract=None) -> dict:
  """Peak activation bytes of the one-device training step at ``[batch, seq_len]`` tokens, from
  the residuals of its traced loss (see the module docstring); nothing is lowered. ``abstract``:
  :func:`abstract_state` of ``cfg`` when the caller has it."""
  from k3jax import train_step as ts
  m = cfg.model
  state = (abstract or abstract_state(cfg))[0]
  graphdef = state.graphdef
  with pallas_kernels.target_platform(PLATFORMS[platform]):
    saved = _residual_bytes(lambda p, b, x: ts._loss(graphdef, p, b, x, cfg.train)[0],
                            state.params, state.biases, _abstract_batch(batch, seq_len))
    # layers of one mixer and MLP kind recompute alike but for their AttnRes sources: the last
    # of each kind has the most and stands for all
    kind = lambda i: (m.layer_kind(i), m.is_moe(i))
    last = {kind(i): i for i in range(m.num_layers)} if m.remat != "none" else {}
    layers = state.model().layers if last else []
    delta = {k: _layer_recompute_bytes(cfg, layers[i], i, batch, seq_len)
             for k, i in last.items()}
  chunk = min(cfg.train.loss_chunk, batch * seq_len)
  logits = jnp.dtype(jnp.bfloat16 if cfg.train.bf16_logits else jnp.float32).itemsize
  head = chunk * m.vocab_size * (logits + jnp.dtype(m.cdtype).itemsize)
  by_skip = {}  # model.remat_skip -> (saved residuals, one layer's recompute): a layer that
  for n in range(m.num_layers + 1 if delta else 0):  # leaves the remat keeps its delta
    out = range(m.num_layers - n, m.num_layers - m.remat_skip)
    back = range(m.num_layers - m.remat_skip, m.num_layers - n)
    by_skip[n] = (saved + sum(delta[kind(i)] for i in out) - sum(delta[kind(i)] for i in back),
                  max((delta[kind(i)] for i in range(m.num_layers - n)), default=0))
  recompute = by_skip[m.remat_skip][1] if by_skip else 0
  terms = {"saved_residuals": saved, "loss_chunk_logits_and_gradient": head,
           "one_layer_recompute": recompute}
  return {"peak": saved + max(head, recompute), "terms": terms,
          "tokens_per_device": batch * seq_len, "method": "traced",
          "by_remat_skip": {n: sv + max(head, rc) for n, (sv, rc) in by_skip.items()}}


def cut_layers(cfg: Config, layers: int) -> Config:
  """``cfg`` with the model cut to its first ``layers`` layers (all for 0, -1 or more than it
  has), keeping an MLA layer when it had one."""
  m = cfg.model
  if not 0 < layers < m.num_layers:
    return cfg
  keep = lambda idx: tuple(i for i in idx if i < layers)
  mla = keep(m.mla_layers) or ((layers - 1,) if m.mla_layers else ())
  return config_lib.replace(cfg, [f"model.num_layers={layers}", f"model.mla_layers={list(mla)}",
                                  f"model.dense_layers={list(keep(m.dense_layers))}",
                                  f"model.remat_skip={min(m.remat_skip, layers)}"])


def _traced_step(cfg: Config, mesh, seq_len: int, batch: int, target: str):
  """The training step (forward, backward, optimizer, bias update) traced on ``mesh`` (abstract
  or of compile-only devices) with the kernels of ``target`` ("gpu", "tpu", "cpu"), as
  ``train.py`` traces it (:func:`k3jax.train_step.trace_train_step` of the state
  :func:`k3jax.train_state.abstract_train_state` lays out), the state donated."""
  from k3jax import train_step as ts
  state = abstract_train_state(cfg, mesh)  # outside the mesh: the names are not axes
  in_mesh = (jax.sharding.use_abstract_mesh if isinstance(mesh, jax.sharding.AbstractMesh)
             else jax.set_mesh)
  with sharding.layout(cfg.mesh), in_mesh(mesh), pallas_kernels.target_platform(target):
    step_fn = ts.make_train_step(cfg, state.graphdef, state.tx, state.schedule)
    jitted = ts.jit_train_step(step_fn, donate=True, state=state)
    return ts.trace_train_step(jitted, state, ts.batch_spec(batch, seq_len,
                                                            mesh_lib.batch_sharding(mesh)))


def lower_step(cfg: Config, sizes: dict[str, int], seq_len: int, batch: int, layers: int,
               platform: str = "cuda") -> dict:
  """Lowers (never compiles or runs) the training step of the model cut to ``layers`` layers on
  an abstract mesh of ``sizes``."""
  cfg = cut_layers(cfg, layers)
  target = PLATFORMS[platform]
  device = GPU_TARGET if target == "gpu" else None
  amesh = mesh_lib.abstract_mesh(MeshConfig(**sizes), math.prod(sizes.values()), device)
  t0 = time.perf_counter()
  traced = _traced_step(cfg, amesh, seq_len, batch, target)
  t1 = time.perf_counter()
  with jax.sharding.use_abstract_mesh(amesh):
    lowered = traced.lower(lowering_platforms=(platform,))
  t2 = time.perf_counter()
  text = lowered.as_text()
  ops = {}
  for op in ("all_gather", "all_to_all", "all_reduce", "reduce_scatter", "collective_permute"):
    ops[op] = text.count(f"stablehlo.{op}")
  return {"layers": cfg.model.num_layers, "platform": platform, "trace_s": round(t1 - t0, 1),
          "lower_s": round(t2 - t1, 1), "stablehlo_chars": len(text),
          "shard_map_collectives": ops, "kernel_calls": aot.kernel_counts(text)}


def compile_step(cfg: Config, sizes: dict[str, int], seq_len: int, batch: int, layers: int,
                 target: str, hlo_path: str | None = None, dump_to: str | None = None) -> dict:
  """Compiles the training step of the model cut to ``layers`` layers for compile-only devices
  of ``target`` (:mod:`k3jax.aot`: ``h200``, ``v5p:2x2x1``, ...) on a mesh of ``sizes``; reports
  the compiled memory per device against the device's, the compile time and the kernels.
  ``hlo_path``: where to write the compiled HLO text; ``dump_to``: a directory for XLA's dump
  of the compile (:func:`k3jax.aot.dump_options`)."""
  cfg = cut_layers(cfg, layers)
  platform = aot.platform(target)
  devices = aot.devices(target, math.prod(sizes.values()))
  mesh = mesh_lib.make_mesh(MeshConfig(**sizes), devices)
  t0 = time.perf_counter()
  traced = _traced_step(cfg, mesh, seq_len, batch, PLATFORMS[platform])
  with jax.set_mesh(mesh):
    lowered = traced.lower()
  t1 = time.perf_counter()
  compiled = aot.compile_lowered(lowered, target, dump_to)
  t2 = time.perf_counter()
  text = compiled.as_text()
  if hlo_path:
    with open(hlo_path, "w") as f:
      f.write(text)
  mem = aot.memory_report(compiled, target)
  usable = aot.usable_memory_bytes(target)
  return {"target": target, "device_kind": devices[0].device_kind, "devices": len(devices),
          "layers": cfg.model.num_layers, "lower_s": round(t1 - t0, 1),
          "compile_s": round(t2 - t1, 1), "memory_per_device": mem,
          "usable_memory_GiB": round(usable / 2**30, 1), "fits": mem["peak_bytes"] <= usable,
          "kernel_calls": aot.kernel_counts(text),
          "collectives_GB_received": {k: v / GB for k, v in aot.collective_bytes(text).items()}}


def largest_fit(by_remat_skip: dict[int, float], state: float, memory: float) -> int | None:
  """The largest ``model.remat_skip`` whose activation peak fits in ``memory`` bytes beside
  ``state`` bytes (parameters, gradients, optimizer state); None when none does."""
  return max((n for n, v in by_remat_skip.items() if state + v <= memory), default=None)


def plan(cfg: Config, sizes: dict[str, int], seq_len: int, batch: int, lower_layers: int = 0,
         platform: str = "cuda", memory_gb: float | None = None, compile_target: str | None = None,
         compile_layers: int = -1, hlo_path: str | None = None,
         dump_to: str | None = None) -> dict:
  devices = math.prod(sizes.values())
  tok_axes = math.prod(sizes[a] for a in ("data", "fsdp", "expert"))
  accum = cfg.train.grad_accum
  if batch % accum:
    raise config_lib.ConfigError(f"--batch {batch} must be divisible by train.grad_accum = {accum}")
  micro = batch // accum  # the step runs its micro-batches one after another
  if micro % tok_axes:
    raise config_lib.ConfigError(f"the micro-batch of {micro} sequences (--batch {batch} / "
                                 f"train.grad_accum {accum}) must be divisible by "
                                 f"data*fsdp*expert = {tok_axes}")
  if seq_len % (2 * sizes["context"]):
    raise config_lib.ConfigError(f"--seq-len {seq_len} must be divisible by 2*context = {2 * sizes['context']}")
  t0 = time.perf_counter()
  abstract = abstract_state(cfg)
  st = state_bytes(cfg, sizes, abstract)
  if all(sizes[a] == 1 for a in ("expert", "context", "tensor")):
    act = traced_activations(cfg, micro // tok_axes, seq_len, platform, abstract)
  else:
    act = activations(cfg, sizes, seq_len, micro)
  # every micro-batch gathers the parameters again and reduces its own gradients
  coll = {k: v * accum for k, v in collectives(cfg, sizes, seq_len, micro, st).items()}
  total = st["params"] + st["grads"] + st["optimizer"] + act["peak"]
  report = {
      "config": cfg.model.name, "mesh": sizes, "devices": devices, "seq_len": seq_len,
      "batch": batch, "micro_batch": micro, "tokens_per_step": seq_len * batch,
      "moonep": cfg.mesh.moonep,
      "total_params": st["total_params"],
      "per_device_bytes": {"params": st["params"], "grads": st["grads"],
                           "optimizer": st["optimizer"], "activations_peak": act["peak"],
                           "total": total},
      "per_device_GB": {"params": st["params"] / GB, "grads": st["grads"] / GB,
                        "optimizer": st["optimizer"] / GB, "activations_peak": act["peak"] / GB,
                        "total": total / GB},
      "activations": {"method": act["method"],
                      "terms_GB": {k: v / GB for k, v in act["terms"].items()},
                      "tokens_per_device": act["tokens_per_device"]},
      "unsplit_params": [{**{k: g[k] for k in ("leaf", "shape", "axes", "count")},
                          "GB": g["bytes"] / GB} for g in st["unsplit"][:10]],
      "collectives_bytes_per_step": coll,
      "collectives_GB_per_step": {k: v / GB for k, v in coll.items()},
      "accounting_s": round(time.perf_counter() - t0, 1),
  }
  warning = mesh_lib.unsplit_warning(st["unsplit"], sizes, st["total_bytes"])
  if warning:
    report["warning"] = warning
  curve = act.get("by_remat_skip")
  if curve:
    report["activations"]["by_remat_skip_GB"] = {n: v / GB for n, v in curve.items()}
  if memory_gb is not None:
    report["fit"] = {"memory_GB": memory_gb, "fits": total <= memory_gb * GB}
    if curve:
      state = st["params"] + st["grads"] + st["optimizer"]
      report["fit"]["largest_remat_skip"] = largest_fit(curve, state, memory_gb * GB)
  if lower_layers:
    report["lowering"] = lower_step(cfg, sizes, seq_len, batch, lower_layers, platform)
  if compile_target:
    report["compiled"] = compile_step(cfg, sizes, seq_len, batch, compile_layers, compile_target,
                                      hlo_path, dump_to)
  return report


def main(argv=None) -> int:
  ap = cli.parser("python -m k3jax.plan", __doc__.split("\n\n")[0], config_positional=True)
  ap.add_argument("--mesh", required=True, help="axis=size,... over data, fsdp, expert, context, tensor")
  ap.add_argument("--seq-len", type=int, default=None, help="default: data.seq_len")
  ap.add_argument("--batch", type=int, default=None, help="sequences per step; default: train.batch_size")
  ap.add_argument("--lower-layers", type=int, default=0,
                  help="lower the step of the model cut to N layers (-1: all layers; 0: skip)")
  ap.add_argument("--platform", default=None, choices=sorted(PLATFORMS),
                  help="the target: its kernels are traced for the activations and it is the "
                       "lowering platform (default: the --compile target's, else cuda)")
  ap.add_argument("--compile", default=None, metavar="TARGET", dest="compile_target",
                  help="compile the step for compile-only devices of TARGET (h200, h100, or a TPU "
                       "topology such as v5p:2x2x1; `make aot` installs their plugins) and report "
                       "the compiled memory per device")
  ap.add_argument("--compile-layers", type=int, default=-1,
                  help="with --compile: the model cut to N layers (-1: all)")
  ap.add_argument("--hlo", default=None, metavar="PATH", help="with --compile: write the "
                  "compiled HLO text there")
  ap.add_argument("--xla-dump", default=None, metavar="DIR", help="with --compile: XLA's dump "
                  "of the compile there (HLO, buffer assignment, live ranges: "
                  "benchmarks/xla_live_buffers.py reads them)")
  ap.add_argument("--memory", type=float, default=None, metavar="GB",
                  help="memory a device may use (GB): report whether the layout fits and, "
                       "with traced activations and a remat policy, the largest "
                       "model.remat_skip that does")
  args = cli.parse(ap, argv)
  sizes = parse_mesh(args.mesh)
  over = list(args.overrides) + [f"mesh.{a}={s}" for a, s in sizes.items()]
  try:
    cfg = cli.load(args.config, over)
  except config_lib.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  seq_len = args.seq_len or cfg.data.seq_len
  batch = args.batch or cfg.train.batch_size
  platform = args.platform or (aot.platform(args.compile_target) if args.compile_target
                               else "cuda")
  print(json.dumps(plan(cfg, sizes, seq_len, batch, args.lower_layers, platform, args.memory,
                        args.compile_target, args.compile_layers, args.hlo, args.xla_dump),
                   indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
