"""Builds the model and training state in one place for ``train.py``, ``k3jax.plan``,
``k3jax.aot``, the benchmarks and the converter."""

from __future__ import annotations

from flax import nnx

from k3jax.config import Config, ModelConfig


def abstract_model(cfg: Config | ModelConfig):
  """The :class:`~k3jax.model.K3Model` of ``cfg`` (a whole config or its ``model`` part) as
  shapes only (``nnx.eval_shape``): nothing is allocated."""
  from k3jax.model import K3Model
  model_cfg = cfg.model if isinstance(cfg, Config) else cfg
  return nnx.eval_shape(lambda: K3Model(model_cfg, rngs=nnx.Rngs(0)))
