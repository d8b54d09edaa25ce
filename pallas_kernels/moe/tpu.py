"""TPU grouped matmuls: the megablox kernels shipped with JAX
(``jax.experimental.pallas.ops.tpu.megablox``), used as they are.

megablox already is the TPU reference design for this product (Mosaic TPU, a group-metadata
driven grid over (N tiles, active M tiles, K tiles) with an f32 VMEM accumulator, and the
transposed ``tgmm`` for ``d_rhs``); what it lacks for us is handled in :mod:`pallas_kernels.moe.pallas`
(zeros past ``sum(group_sizes)``, M padding, the VJP). Under a CPU backend the kernels run in TPU
interpret mode (``pltpu.InterpretParams()``).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

# The module, not the function of the same name that the megablox package exports.
megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

from pallas_kernels import default_backend

TILE = 128  # rows, contraction and output columns of a megablox tile
ROW_MULTIPLE = TILE  # megablox needs M divisible by its row tile


def _interpret():
  return pltpu.InterpretParams() if default_backend() == "cpu" else False


def _int32_metadata():
  """The megablox calls traced with 64-bit types off: under ``jax_enable_x64`` its group
  metadata's tile count (``group_tiles.sum()``, the grid size behind ``tgmm``'s
  ``pl.num_programs``) becomes int64 and the kernel's int32 arithmetic on it fails. The operands
  are bf16 / float32 and the group sizes int32 either way."""
  return jax.enable_x64(False)


def _tiling(m: int, k: int, n: int):
  return (min(TILE, m), min(TILE, k), min(TILE, n))


def gmm(lhs, rhs, group_sizes, *, transpose_rhs: bool = False, out_dtype=None):
  """``lhs [M, K]`` x ``rhs [E, K, N]`` (``[E, N, K]`` with ``transpose_rhs``) -> ``[M, N]``;
  rows past ``sum(group_sizes)`` are left unwritten (the caller masks). ``M`` a multiple of 128."""
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  with _int32_metadata():
    return megablox.gmm(lhs, rhs, group_sizes.astype(jnp.int32), out_dtype or lhs.dtype,
                        _tiling(m, k, n), transpose_rhs=transpose_rhs, interpret=_interpret())


def tgmm(lhs, dout, group_sizes, *, out_dtype=None):
  """``lhs [R, K]``, ``dout [R, N]`` -> ``[E, K, N]`` with ``out[g] = lhs_g^T @ dout_g``."""
  r, k = lhs.shape
  n = dout.shape[1]
  with _int32_metadata():
    return megablox.tgmm(lhs.swapaxes(0, 1), dout, group_sizes.astype(jnp.int32),
                         out_dtype or lhs.dtype, _tiling(r, k, n), interpret=_interpret())
