"""Elementwise maths for the bodies of the Pallas Triton kernels.

Pallas lowers ``jnp.exp`` on the GPU to libdevice's ``__nv_expf``: about ten instructions of range
reduction (FMAs, a rounding, integer shifts) around one ``ex2.approx``; ``jax.nn.sigmoid`` becomes
``1 / (1 + __nv_expf(-x))``. ``jnp.exp2`` lowers to ``__nv_exp2f``, the ``ex2.approx.f32``
instruction alone (2 ulp). ``e^x = 2^(x log2 e)`` adds a relative error of at most ``|x| 2^-24 log2 e`` (the
rounding of ``x log2 e``; 7e-6 at |x| = 85), far below the bf16 roundings around these values.

The streaming elementwise kernels use these (H200, the k3_1b step, 2026-12-03: the GLU
activation 23.0 -> 21.5 ms per step, the log-sum-exp 12.1 -> 11.6, the short convolutions'
backward 7.1 -> 6.9). The KDA chunk kernels keep ``jnp.exp``: with these, ``kda_chunk_a`` took
1.16 instead of 1.01 ms and ``kda_chunk_dqkg`` 2.9 instead of 2.6 ms at B1 T16384 H32 (both hold
255 registers per thread; not understood beyond that). The XLA references keep ``jnp.exp``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

LOG2E = math.log2(math.e)


def exp(x):
  """``e^x`` as ``2^(x log2 e)`` (one ``ex2.approx`` on the GPU)."""
  return jnp.exp2(x * LOG2E)


def sigmoid(x):
  """``1 / (1 + e^-x)`` (0 and 1 at the ends, no overflow trouble: ``1 / inf = 0``)."""
  return 1.0 / (1.0 + exp(-x))


def silu(x):
  """``x sigmoid(x)``."""
  return x * sigmoid(x)
