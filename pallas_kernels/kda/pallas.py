"""Dispatch of the Pallas KDA kernels to their backend module (``gpu.py`` or ``tpu.py``).

Each backend module exposes ``kda(q, k, v, g, beta, *, scale, initial_state, segment_ids,
use_qk_l2norm, A_log, dt_bias, gate, lower_bound, beta_is_logit, chunk_size)`` with a
``jax.custom_vjp`` and returns ``(o, final_state)``; on CPU it runs in interpret mode.
``save_residuals``, ``config`` (a :class:`~pallas_kernels.kda.config.KdaGpuConfig`) and
``states_every`` (the states every M chunks, a third result) go to the GPU backend only (the TPU kernels recompute in the backward and take no tuning).
"""

from __future__ import annotations

import importlib


def kda(q, k, v, g, beta, *, backend: str, save_residuals: bool = True, config=None,
        states_every=None, **kwargs):
  if backend not in ("gpu", "tpu"):
    raise ValueError(f"kda: unknown Pallas backend {backend!r}")
  if states_every and backend == "tpu":
    raise ValueError("kda(pallas_tpu): output_states_every is not supported; use "
                     "implementation='pallas_gpu' or 'chunked'")
  mod = importlib.import_module(f"pallas_kernels.kda.{backend}")
  if backend == "gpu":
    kwargs.update(save_residuals=save_residuals, config=config, states_every=states_every)
  return mod.kda(q, k, v, g, beta, **kwargs)
