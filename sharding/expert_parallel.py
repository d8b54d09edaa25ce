"""Expert parallelism: routed experts split over the expert-parallel mesh axes (``expert``, or
those of ``mesh.expert_axes``, e.g. ``expert, context``), tokens exchanged with fixed-size
``all_to_all``s inside ``jax.shard_map``.

Each device holds its tokens (the batch split over ``data, fsdp, expert, context``) and ``er =
E / R`` experts (R = the product of the expert-parallel axis sizes; expert weights are further
split over the rest of ``fsdp, context`` on the latent dim and ``tensor`` on the intermediate
dim, gathered inside). Per MoE layer:

1. every rank counts its token slots per expert; the counts ``[R, E]`` are all-gathered over the
   expert axis (the only data-dependent metadata, E integers per rank);
2. each slot gets a destination rank and expert group: its home rank (plain dispatch), or, with
   MoonEP (:mod:`sharding.moonep`), a plan that gives every rank exactly ``N*k/R`` slots, some of
   them on redundant copies of another rank's hot experts;
3. slots are packed into a ``[R, C, L]`` send buffer (C slots per destination: the worst case
   ``n * min(k, er)`` for dropless plain dispatch and ``n * k`` with MoonEP, or
   ``ceil(capacity_factor * n * k / R)`` when ``model.moe.capacity_factor > 0``, beyond which
   slots are dropped) and exchanged with ``all_to_all`` (works on every backend, CPU included);
4. the receiver sorts its rows by expert group and runs the GLU with two grouped matmuls over
   ``er`` home experts plus (MoonEP) ``er`` redundant slots whose weights were fetched from their
   home rank with another ``all_to_all``; with MoonEP the compute buffer is exactly the
   balanced ``n * k`` rows;
5. results return with the reverse ``all_to_all`` and are combined with the routing weights.

Everything is differentiable: the weight fetch is a collective whose transpose sends the copies'
gradients back to their home rank, where they add to the home expert's gradient.

MoonEP is on inside ``with sharding.layout(cfg.mesh)`` when ``mesh.moonep`` says so (the default
layout has it on).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

import pallas_kernels.moe as moe_ops
from pallas_kernels.moe.reference import inverse_map, move_rows
from sharding import moonep as moonep_lib
from sharding.context_parallel import axis_size
from sharding.rules import active_layout, logical_spec, per_device, token_spec


def axes() -> tuple[str, ...]:
  """The mesh axes (larger than 1) the routed experts are split over on the current mesh: those
  the ``expert`` rule of the active layout (:func:`sharding.rules.layout`) names, in rule
  order."""
  spec = logical_spec(("expert",))[0]
  return () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)


def active() -> bool:
  """True when the current mesh splits the routed experts over one or more axes."""
  return bool(axes())


def capacity(n: int, k: int, r: int, er: int, capacity_factor: float, moonep: bool) -> int:
  """Slots per (source, destination) pair in the send buffer."""
  if capacity_factor > 0:
    return max(1, math.ceil(capacity_factor * n * k / r))
  return n * k if moonep else n * min(k, er)


def _gather_weight(w, spec):
  """All-gathers the dims after the expert dim that ``spec`` splits (fsdp, context, tensor)."""
  for dim, entry in enumerate(tuple(spec)[1:], start=1):
    if entry is not None:
      w = jax.lax.all_gather(w, entry, axis=dim, tiled=True)
  return w


def _rank_within(keys, num_keys):
  """Position of each element among the equal keys before it (stable). keys: ``[M]`` int."""
  m = keys.shape[0]
  iota = jnp.arange(m, dtype=jnp.int32)
  sk, order = jax.lax.sort((keys.astype(jnp.int32), iota), num_keys=1, is_stable=True)
  counts = jnp.zeros((num_keys,), jnp.int32).at[sk].add(1, mode="drop")
  first = jnp.cumsum(counts) - counts
  rank_sorted = iota - first[jnp.clip(sk, 0, num_keys - 1)]
  return jnp.zeros((m,), jnp.int32).at[order].set(rank_sorted)


def moe_dispatch(x, expert_ids, weights, w_gate_up, w_down, activation, *, capacity_factor=0.0,
                 implementation=None, moonep: bool | None = None):
  """Routed experts over the expert axis: same contract as :func:`pallas_kernels.moe.expert_mlp`.

  x: ``[N, L]`` tokens; expert_ids, weights: ``[N, k]``; w_gate_up ``[E, L, 2F]``; w_down
  ``[E, F, L]``; activation ``gu [M, 2F] -> h [M, F]``. Returns ``[N, L]``.
  """
  moonep = active_layout().moonep if moonep is None else moonep
  ax = axes()
  r = math.prod(axis_size(a) for a in ax)
  e = w_gate_up.shape[0]
  if e % r:
    raise ValueError(f"expert parallelism: {e} experts do not split over the {r} ranks of mesh "
                     f"axes {ax}")
  er = e // r
  k = expert_ids.shape[1]
  tok = token_spec()
  w1_spec = logical_spec(("expert", "latent", "mlp"))
  w2_spec = logical_spec(("expert", "mlp", "latent"))
  slots = er if moonep else 0

  def body(x, ids, wts, w1, w2):
    # The weights' gathers wait for this layer's tokens: XLA otherwise starts every layer's at
    # the top of the step, all live at once (benchmarks/RESULTS.md, MLA, "What grew per layer").
    x, w1, w2 = jax.lax.optimization_barrier((x, w1, w2))
    w1 = _gather_weight(w1, w1_spec)  # [er, L, 2F]
    w2 = _gather_weight(w2, w2_spec)  # [er, F, L]
    n, width = x.shape
    me = jax.lax.axis_index(ax)
    flat = ids.reshape(-1).astype(jnp.int32)  # [n*k]
    counts = jnp.zeros((e,), jnp.int32).at[flat].add(1)
    all_counts = jax.lax.all_gather(counts, ax)  # [R, E]
    index = (jnp.cumsum(all_counts, 0) - all_counts)[me][flat] + _rank_within(flat, e)
    if moonep:
      p = moonep_lib.plan(all_counts, slots)
      dest, group = moonep_lib.assign(p, flat, index, r)
    else:
      dest, group = flat // er, flat % er
    cap = capacity(n, k, r, er, capacity_factor, moonep)
    pos = _rank_within(dest, r)
    keep = pos < cap
    pos = jnp.where(keep, pos, cap)  # out of bounds: dropped by the scatter below
    m = r * cap
    slot = jnp.where(keep, dest * cap + pos, m)  # [n*k]: each (token, choice)'s send slot
    slot_src = inverse_map(slot, m)  # [m]: the (token, choice) in each slot, n*k if none
    rows = jnp.broadcast_to(x[:, None], (n, k, width)).reshape(n * k, width)
    send = move_rows(rows, slot_src, slot).reshape(r, cap, width)
    groups = er + slots
    send_g = jnp.full((r, cap), groups, jnp.int32).at[dest, pos].set(group, mode="drop")
    recv = jax.lax.all_to_all(send, ax, 0, 0)  # [R, C, L]: row block s from source s
    recv_g = jax.lax.all_to_all(send_g, ax, 0, 0).reshape(-1)
    if moonep:  # fetch the redundant experts' weights from their home ranks
      se = p.slot_expert  # [R, S]
      mine = (se >= 0) & (se // er == me)
      local = jnp.clip(se - me * er, 0, er - 1)
      fetch = lambda w: jnp.sum(jax.lax.all_to_all(
          jnp.where(mine[..., None, None], w[local], 0).astype(w.dtype), ax, 0, 0), axis=0)
      w1 = jnp.concatenate([w1, fetch(w1)], axis=0)
      w2 = jnp.concatenate([w2, fetch(w2)], axis=0)
    budget = min(m, n * k) if moonep else m  # MoonEP: exactly the balanced share
    iota = jnp.arange(m, dtype=jnp.int32)
    sg, order = jax.lax.sort((recv_g, iota), num_keys=1, is_stable=True)
    order = order[:budget]
    unorder = inverse_map(order, m)
    xs = move_rows(recv.reshape(m, width), order, unorder)
    sizes = jnp.zeros((groups + 1,), jnp.int32).at[sg].add(1)[:groups]
    h = moe_ops.gmm(xs, w1.astype(x.dtype), sizes, implementation=implementation)
    h = activation(h).astype(x.dtype)
    y = moe_ops.gmm(h, w2.astype(x.dtype), sizes, implementation=implementation)
    back = move_rows(y, unorder, order).reshape(r, cap, width)
    back = jax.lax.all_to_all(back, ax, 0, 0)
    out = move_rows(back.reshape(m, width), slot, slot_src)  # [n*k, L], dropped slots 0
    acc = jnp.promote_types(x.dtype, jnp.float32)
    return jnp.einsum("nkd,nk->nd", out.reshape(n, k, width).astype(acc),
                      wts.astype(acc)).astype(x.dtype)

  fn = jax.shard_map(body, in_specs=(tok, tok, tok, w1_spec, w2_spec), out_specs=tok,
                     check_vma=False)
  return fn(x, expert_ids, weights, w_gate_up, w_down)


def local_experts(x, expert_ids, weights, w_gate_up, w_down, activation, *, implementation=None):
  """Routed experts when the mesh splits the tokens but not the experts: each device runs
  :func:`pallas_kernels.moe.expert_mlp` on its own tokens, as the activations lie, with the whole
  (gathered) expert weights. Left to the SPMD partitioner, the sort over all token-expert pairs
  would gather them, and every device would run every token's experts.

  x: ``[B, T, L]``; expert_ids, weights: ``[B, T, k]``; weights of the experts as in
  ``expert_mlp``. Returns ``[B, T, L]``.
  """
  tok = logical_spec(("batch", "length", None))
  w1_spec = logical_spec(("expert", "latent", "mlp"))
  w2_spec = logical_spec(("expert", "mlp", "latent"))

  def body(x, ids, wts, w1, w2):
    b, t, width = x.shape
    flat = lambda a: a.reshape(b * t, a.shape[-1])
    y = moe_ops.expert_mlp(flat(x), flat(ids), flat(wts), _gather_weight(w1, w1_spec),
                           _gather_weight(w2, w2_spec), activation, implementation=implementation)
    return y.reshape(b, t, width)

  return per_device(body, (tok, tok, tok, w1_spec, w2_spec), tok)(x, expert_ids, weights,
                                                                  w_gate_up, w_down)


def routed_experts(x, expert_ids, weights, w_gate_up, w_down, activation, *, capacity_factor=0.0,
                   implementation=None):
  """The routed experts laid out for the current mesh: x ``[B, T, L]``, expert_ids and weights
  ``[B, T, k]`` -> ``[B, T, L]``. Experts split: :func:`moe_dispatch` (all-to-all); only the
  tokens split: :func:`local_experts`; one device: :func:`pallas_kernels.moe.expert_mlp`."""
  if not active() and token_spec()[0] is not None:
    return local_experts(x, expert_ids, weights, w_gate_up, w_down, activation,
                         implementation=implementation)
  b, t, width = x.shape
  flat = lambda a: a.reshape(b * t, a.shape[-1])
  if active():
    y = moe_dispatch(flat(x), flat(expert_ids), flat(weights), w_gate_up, w_down, activation,
                     capacity_factor=capacity_factor, implementation=implementation)
  else:
    y = moe_ops.expert_mlp(flat(x), flat(expert_ids), flat(weights), w_gate_up, w_down,
                           activation, implementation=implementation)
  return y.reshape(b, t, width)


__all__ = ["axes", "active", "moe_dispatch", "local_experts", "routed_experts",
           "capacity"]
