"""What the MLA kernels (prefill and decode, Triton and TPU) share: base-2 online softmax in
float32, dims split into power-of-two parts, matmuls with float32 accumulation."""

from __future__ import annotations

import functools
import math
import operator

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton

LOG2E = math.log2(math.e)


def pow2_parts(d: int) -> tuple[tuple[int, int], ...]:
  """``(offset, size)`` power-of-two pieces of a dim (a multiple of 16), largest first."""
  parts, off = [], 0
  for bit in reversed(range(d.bit_length())):
    if d & (1 << bit):
      parts.append((off, 1 << bit))
      off += 1 << bit
  return tuple(parts)



def dot_nt(a, b):
  """``a [M, K] @ b [N, K].T`` with float32 accumulation."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot(a, b):
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def scores(q_parts, k_parts, scale2):
  return functools.reduce(operator.add, map(dot_nt, q_parts, k_parts)) * scale2


def softmax_step(s, m, l, accs, v_parts):
  """One online-softmax update (base 2). s ``[bq, bk]``, m/l ``[bq, 1]``, accs ``[bq, dv_i]``."""
  m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m - m_safe)
  p = jnp.exp2(s - m_safe)
  l = l * alpha + p.sum(axis=1, keepdims=True)
  pb = p.astype(v_parts[0].dtype)
  accs = tuple(acc * alpha + dot(pb, vc) for acc, vc in zip(accs, v_parts))
  return m_new, l, accs


def finish(m, l, accs):
  """Normalised outputs and the base-2 log-sum-exp (``+inf`` where no key was visible)."""
  seen = l > 0.0
  inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
  lse = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), jnp.inf)
  return tuple(acc * inv for acc in accs), lse


def grad_step(q_parts, k_parts, v_parts, do_parts, lse, delta, mask, scale2):
  """``(p, ds)`` for one block pair: ``p = softmax`` and ``ds = p * (dO V^T - delta)``.

  With the roles swapped (``k, q, do, v`` and lse/delta as rows) it returns ``p^T, ds^T``."""
  s = scores(q_parts, k_parts, scale2)
  if mask is not None:
    s = jnp.where(mask, s, -jnp.inf)
  p = jnp.exp2(s - lse)
  dp = functools.reduce(operator.add, map(dot_nt, do_parts, v_parts))
  return p, p * (dp - delta)



def gpu_params(warps, stages):
  """Triton's launch parameters."""
  return pltriton.CompilerParams(num_warps=warps, num_stages=stages)
