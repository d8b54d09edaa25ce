"""MoonEP planner (SPEC section 5): redundant expert copies that give every expert-parallel rank
exactly its share of the routed token slots.

R ranks, E experts, ``er = E / R`` experts at home on each rank (expert ``e`` lives on rank
``e // er``). From the per-rank routing counts ``[R, E]`` of the current micro-batch the total
``N*k`` slots are split into per-rank targets ``floor`` or ``ceil`` of ``N*k / R``. Rank ``p``'s
home load minus its target is its surplus ``a_p`` (a deficit when negative).

The plan is a forest over the ranks. Each rank receives slots from at most one *parent* and only
of the parent's home experts, so at most ``er`` redundant expert slots per rank ever suffice. A
rank exports its own experts only, hottest first (``export = a + inflow <= home load`` because
``inflow <= target``). Construction, with one stream of slots in flight: start at the most
overloaded rank; while a rank with a deficit fits in the stream (smallest deficit first), it
becomes a child taking exactly its deficit; otherwise the next overloaded rank (largest surplus
first) becomes a child taking the whole remaining stream (less than any deficit, so within its
target) and continues the stream with its own surplus added. The stream always equals the
remaining deficits minus the remaining surpluses, so the loop never gets stuck.

Slot assignment: the slots of expert ``e`` are ordered by source rank, then by position on the
source (``u`` = global index). On its home's export line expert ``e`` covers
``[exp_start_e, exp_start_e + load_e)``; position ``exp_start_e + u`` below the home's export
goes to the child whose range contains it, the rest stays home.

Everything is a pure, jittable function with static shapes (a ``fori_loop`` over R).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Plan(NamedTuple):
  target: jax.Array  # [R] int32: slots each rank computes
  parent: jax.Array  # [R] int32: the rank it receives from, -1 for none
  inflow: jax.Array  # [R] int32: slots received from the parent
  start: jax.Array  # [R] int32: where the received range starts on the parent's export line
  export: jax.Array  # [R] int32: slots each rank sends to its children
  exp_start: jax.Array  # [E] int32: expert's offset on its home's export line (hottest first)
  desc_rank: jax.Array  # [E] int32: expert's rank by load on its home (0 = hottest)
  slot_expert: jax.Array  # [R, S] int32: the foreign expert held in each redundant slot, -1 empty
  slot_first: jax.Array  # [R] int32: desc_rank of the expert in slot 0


def plan(counts: jax.Array, num_slots: int | None = None) -> Plan:
  """The MoonEP plan from ``counts [R, E]`` (slots routed from rank r to expert e).

  num_slots: redundant expert slots per rank (default and maximum needed: ``E / R``).
  """
  r, e = counts.shape
  if e % r:
    raise ValueError(f"MoonEP: {e} experts do not split over {r} expert-parallel ranks")
  er = e // r
  s = er if num_slots is None else num_slots
  counts = counts.astype(jnp.int32)
  load = counts.sum(0, dtype=jnp.int32)  # [E]
  home_load = load.reshape(r, er).sum(1, dtype=jnp.int32)
  total = home_load.sum(dtype=jnp.int32)
  ranks = jnp.arange(r, dtype=jnp.int32)
  target = total // r + (ranks < total % r).astype(jnp.int32)
  a = home_load - target
  heavy = a >= 0
  big = jnp.iinfo(jnp.int32).max
  heavy_order = jnp.argsort(jnp.where(heavy, -a, big), stable=True).astype(jnp.int32)
  light_order = jnp.argsort(jnp.where(heavy, big, -a), stable=True).astype(jnp.int32)
  n_heavy = heavy.sum(dtype=jnp.int32)
  n_light = r - n_heavy

  def step(_, st):
    cur, x, i, j, off, parent, inflow, start = st
    cand = light_order[jnp.minimum(i, r - 1)]
    d = -a[cand]
    take_light = (i < n_light) & (d <= x)
    h = heavy_order[jnp.minimum(j, r - 1)]
    node = jnp.where(take_light, cand, h)
    amount = jnp.where(take_light, d, x).astype(jnp.int32)
    parent = parent.at[node].set(cur)
    inflow = inflow.at[node].set(amount)
    start = start.at[node].set(off)
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    x = i32(jnp.where(take_light, x - d, x + a[h]))
    off = i32(jnp.where(take_light, off + d, 0))
    cur = i32(jnp.where(take_light, cur, h))
    return (cur, x, i32(i + take_light), i32(j + (~take_light)), off, parent, inflow, start)

  root = heavy_order[0]
  zeros = jnp.zeros((r,), jnp.int32)
  init = (root, a[root].astype(jnp.int32), jnp.int32(0), jnp.int32(1), jnp.int32(0),
          jnp.full((r,), -1, jnp.int32), zeros, zeros)
  _, _, _, _, _, parent, inflow, start = jax.lax.fori_loop(0, r - 1, step, init)
  export = a + inflow

  # Experts on their home's export line, hottest first (ties by index).
  loads = load.reshape(r, er)
  order = jnp.argsort(-loads, axis=1, stable=True)  # [R, er] local expert ids, hottest first
  desc_rank = jnp.zeros((r, er), jnp.int32).at[ranks[:, None], order].set(
      jnp.broadcast_to(jnp.arange(er, dtype=jnp.int32), (r, er)))
  sorted_loads = jnp.take_along_axis(loads, order, 1)
  starts_sorted = jnp.cumsum(sorted_loads, 1) - sorted_loads
  exp_start = jnp.take_along_axis(starts_sorted, desc_rank, 1).reshape(e)
  desc_rank = desc_rank.reshape(e)

  # Redundant slots: the parent's experts overlapping each rank's received range.
  home = jnp.arange(e, dtype=jnp.int32) // er
  lo, hi = start[:, None], (start + inflow)[:, None]
  overlap = ((home[None, :] == parent[:, None]) & (inflow[:, None] > 0) & (load[None, :] > 0)
             & (exp_start[None, :] < hi) & (exp_start[None, :] + load[None, :] > lo))  # [R, E]
  first = jnp.min(jnp.where(overlap, desc_rank[None, :], er), axis=1)
  slot = jnp.where(overlap, desc_rank[None, :] - first[:, None], -1)
  expert_ids = jnp.arange(e, dtype=jnp.int32)
  slot_expert = jnp.stack([jnp.max(jnp.where(slot == j, expert_ids[None, :], -1), axis=1)
                           for j in range(s)], axis=1) if s else jnp.zeros((r, 0), jnp.int32)
  return Plan(target, parent, inflow, start, export, exp_start, desc_rank, slot_expert, first)


def assign(p: Plan, expert: jax.Array, index: jax.Array, num_ranks: int):
  """Destination of token slots under plan ``p``.

  expert: ``[M]`` expert ids; index: ``[M]`` each slot's global index among the slots routed to
  its expert (source rank major). Returns (rank ``[M]``, group ``[M]``): group ``< er`` is a home
  expert (``expert - rank * er``), ``er + j`` redundant slot ``j`` of that rank.
  """
  e = p.exp_start.shape[0]
  er = e // num_ranks
  home = expert // er
  x = p.exp_start[expert] + index
  exported = x < p.export[home]
  child = ((p.parent[None, :] == home[:, None]) & (p.start[None, :] <= x[:, None])
           & (x[:, None] < (p.start + p.inflow)[None, :]))  # [M, R]
  dest = jnp.argmax(child, axis=1).astype(jnp.int32)
  rank = jnp.where(exported, dest, home)
  group = jnp.where(exported, er + p.desc_rank[expert] - p.slot_first[dest], expert - home * er)
  return rank.astype(jnp.int32), group.astype(jnp.int32)


__all__ = ["Plan", "plan", "assign"]
