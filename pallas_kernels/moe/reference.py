"""XLA reference for grouped matmuls and token permutation."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gmm(lhs, rhs, group_sizes, *, preferred_element_type=None):
  """``lhs [M, K]`` (rows sorted by group) x ``rhs [E, K, N]`` -> ``[M, N]``."""
  out = jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                           preferred_element_type=preferred_element_type or lhs.dtype)
  return out


def permute(x, expert_ids, num_experts):
  """Sorts token-expert pairs by expert (stable) and gathers the tokens into that order.

  x: ``[N, D]``; expert_ids: ``[N, k]``. Returns (``xs [N*k, D]``, ``group_sizes [E]`` int32,
  ``order [N*k]``: the flat pair index of each sorted row).
  """
  n, k = expert_ids.shape
  flat = expert_ids.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  xs = jnp.take(x, order // k, axis=0)
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  return xs, group_sizes, order


def unpermute(y, order, weights):
  """Inverse of :func:`permute`: ``y [N*k, D]`` in sorted order, weighted sum over each token's k
  experts with ``weights [N, k]``. Returns ``[N, D]`` in y's dtype."""
  n, k = weights.shape
  unsorted = jnp.zeros_like(y).at[order].set(y)  # pair order
  out = jnp.einsum("nkd,nk->nd", unsorted.reshape(n, k, -1).astype(jnp.float32),
                   weights.astype(jnp.float32))
  return out.astype(y.dtype)
