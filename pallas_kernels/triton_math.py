"""Elementwise maths for the bodies of the Pallas Triton kernels.

Pallas lowers ``jnp.exp`` on the GPU to libdevice's ``__nv_expf``: about ten instructions of range
reduction (FMAs, a rounding, integer shifts) around one ``ex2.approx``; ``jax.nn.sigmoid`` becomes
``1 / (1 + __nv_expf(-x))``. ``jnp.exp2`` lowers to ``__nv_exp2f``, the ``ex2.approx.f32``
instruction alone (2 ulp). ``e^x = 2^(x log2 e)`` adds a relative error of at most ``|x| 2^-24 log2 e`` (the
rounding of ``x log2 e``; 7e-6 at |x| = 85), far below the bf16 roundings around these values.

The streaming elementwise kernels use these; the KDA chunk kernels keep ``jnp.exp``, with which
they were faster, and so do the XLA references (benchmarks/RESULTS.md, "Step glue kernels").
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
