"""Row log-sum-exp of a large float32 or bf16 matrix as a Triton kernel through Pallas
(interpret mode off GPU): the LM head's ``[tokens, vocab]`` logits, read once.

Grid (row block, vocab split): each program streams its rows' share of the vocabulary in
``[rows, cols]`` tiles (a loop the compiler software-pipelines), keeping an online (max, sum of
exponentials) per row, one exponential per element; the ``splits`` partial results per row are
merged by XLA (``[splits, N]``, negligible). The splits give the GPU enough programs at a chunk
of 1024 tokens. Columns past V and rows past N are masked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import default_backend, triton_math as tm


@dataclasses.dataclass(frozen=True)
class Config:
  """``[rows, cols]`` tiles, ``splits`` vocabulary splits per row block, Triton's ``warps`` and
  software-pipelining ``stages``. :func:`default_config` holds the fastest tilings of
  ``benchmarks/logsumexp.py``'s sweep on an H200 (benchmarks/RESULTS.md, "Step glue
  kernels", LM-head log-sum-exp)."""
  rows: int = 8
  cols: int = 2048
  splits: int = 8
  warps: int = 4
  stages: int = 3


def default_config(dtype) -> Config:
  """The tiling for input of ``dtype``: 4-row tiles for bf16 (half the bytes per row), else 8."""
  return Config(rows=4) if jnp.dtype(dtype) == jnp.bfloat16 else Config()


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


def logsumexp(x: jax.Array, config: Config | None = None) -> jax.Array:
  """``log(sum(exp(x), -1))`` of float32 or bf16 ``x [..., V]``; ``[...]`` float32. ``config``:
  default :func:`default_config` of x's dtype."""
  config = config or default_config(x.dtype)
  lead, v = x.shape[:-1], x.shape[-1]
  x = x.reshape(-1, v)
  n = x.shape[0]
  rows = config.rows
  tiles = pl.cdiv(v, config.cols)
  splits = min(config.splits, tiles)
  steps = pl.cdiv(tiles, splits)
  kern = functools.partial(_kernel, n=n, v=v, rows=rows, cols=config.cols, steps=steps)
  part = jax.ShapeDtypeStruct((splits, n), jnp.float32)
  m, s = pl.pallas_call(
      kern, out_shape=(part, part), grid=(pl.cdiv(n, rows), splits),
      compiler_params=plgpu.CompilerParams(num_warps=config.warps, num_stages=config.stages),
      interpret=_interpret(), name="logsumexp",
  )(x)
  top = jnp.max(m, axis=0)
  top_safe = jnp.where(top == -jnp.inf, 0.0, top)
  total = jnp.sum(s * jnp.exp(m - top_safe), axis=0)
  return (top_safe + jnp.log(total)).reshape(lead)
