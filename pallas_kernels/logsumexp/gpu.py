"""Row log-sum-exp of a large float32 or bf16 matrix as a Triton kernel through Pallas
(interpret mode off GPU): the LM head's ``[tokens, vocab]`` logits, read once.

Grid (row block, vocab split): each program streams its rows' share of the vocabulary in
``[rows, cols]`` tiles (a loop the compiler software-pipelines), keeping an online (max, sum of
exponentials) per row, one exponential per element; the ``splits`` partial results per row are
merged by XLA (``[splits, N]``, negligible). The splits give the GPU enough programs at a chunk
of 1024 tokens. Columns past V and rows past N are masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import default_backend, triton_math as tm

# The fastest of benchmarks/logsumexp.py's sweep on an H200 at [4096, 163840] (2026-12-01:
# 0.777 ms, 3.45 TB/s, against 0.910 at 1024 columns; XLA's one-pass reduction 1.030 ms,
# jax.nn.logsumexp 1.444 ms).
ROWS = 8
# bf16 input (train.bf16_logits), same sweep and shape (2026-12-04): 4 rows 0.441 ms (3.04 TB/s)
# against 8 rows 0.521, 16 rows 0.707; 1024 or 4096 columns, 4 or 16 splits, 2 or 4 stages no
# better at 8 rows.
ROWS_BF16 = 4
COLS = 2048
SPLITS = 8
WARPS = 4
STAGES = 3


def _interpret() -> bool:
  return default_backend() != "gpu"


def _kernel(x_ref, m_ref, s_ref, *, n, v, rows, cols, steps):
  i, j = pl.program_id(0), pl.program_id(1)
  r = i * rows + jnp.arange(rows, dtype=jnp.int32)
  row_ok = (r < n)[:, None]
  first = j * steps  # this split's first column tile

  def body(k, carry):
    m, s = carry
    c0 = (first + k) * cols
    c = c0 + jnp.arange(cols, dtype=jnp.int32)
    x = plgpu.load(x_ref.at[pl.ds(i * rows, rows), pl.ds(c0, cols)],
                   mask=row_ok & (c < v)[None, :], other=-jnp.inf).astype(jnp.float32)
    m_new = jnp.maximum(m, jnp.max(x, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    s = s * tm.exp(m - m_safe) + jnp.sum(tm.exp(x - m_safe[:, None]), axis=1)
    return m_new, s

  init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
  m, s = jax.lax.fori_loop(0, steps, body, init)
  plgpu.store(m_ref.at[j, pl.ds(i * rows, rows)], m, mask=r < n)
  plgpu.store(s_ref.at[j, pl.ds(i * rows, rows)], s, mask=r < n)


def logsumexp(x: jax.Array) -> jax.Array:
  """``log(sum(exp(x), -1))`` of float32 or bf16 ``x [..., V]``; ``[...]`` float32."""
  lead, v = x.shape[:-1], x.shape[-1]
  x = x.reshape(-1, v)
  n = x.shape[0]
  rows = ROWS_BF16 if x.dtype == jnp.bfloat16 else ROWS
  tiles = pl.cdiv(v, COLS)
  splits = min(SPLITS, tiles)
  steps = pl.cdiv(tiles, splits)
  kern = functools.partial(_kernel, n=n, v=v, rows=rows, cols=COLS, steps=steps)
  part = jax.ShapeDtypeStruct((splits, n), jnp.float32)
  m, s = pl.pallas_call(
      kern, out_shape=(part, part), grid=(pl.cdiv(n, rows), splits),
      compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=STAGES),
      interpret=_interpret(), name="logsumexp",
  )(x)
  top = jnp.max(m, axis=0)
  top_safe = jnp.where(top == -jnp.inf, 0.0, top)
  total = jnp.sum(s * jnp.exp(m - top_safe), axis=0)
  return (top_safe + jnp.log(total)).reshape(lead)
