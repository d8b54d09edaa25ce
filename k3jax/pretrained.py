"""``from_pretrained``: a K3Model from an HF checkpoint directory, a converted Orbax directory, or
a ``train.py`` run directory (its newest complete checkpoint, or ``RUN_DIR/checkpoints/<step>``),
each a local path (relative ones from the working directory) or a URL (``gs://``, :mod:`k3jax.storage`).

:func:`read_weights` is the part ``train.init_from`` shares: the weights of any of these
directories, checked name by name and shape by shape against a config's model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import config as config_lib
from k3jax import convert, run_dir, storage
from k3jax.config import ModelConfig
from k3jax.model import K3Model
from k3jax.train_state import abstract_model


def _is_orbax(path: Path) -> bool:
  return ((path / "params" / "_METADATA").is_file() or (path / "_METADATA").is_file()
          or run_dir.find(path) is not None)


def checkpoint_config(path: str | Path, config: str | Path | None = None) -> ModelConfig:
  """The model config stored with the weights in ``path`` (``config``: a k3jax YAML overriding
  it, for Orbax directories)."""
  path = storage.path(path)  # absolute: Orbax reads absolute paths only
  if not path.is_dir():
    raise convert.ConversionError(f"{path} is not a directory")
  if _is_orbax(path):
    return convert.load_orbax_config(path, config, run_dir.find(path))
  if (path / "config.json").is_file():
    return convert.config_from_hf(convert.read_hf_config(path), name=path.name)
  raise convert.ConversionError(
      f"{path} holds neither a training run (config.yaml and checkpoints/), an Orbax checkpoint "
      "nor an HF config.json")


def key_of(path) -> str:
  """The model path (``"layers.0.mlp.down_proj.kernel"``) of a ``jax.tree_util`` key path into a
  pure dict of the model's state."""
  return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def read_weights(path: str | Path, cfg: ModelConfig, *, shardings: dict | None = None,
                 config: str | Path | None = None) -> dict[str, object]:
  """{model path: array} of every variable of ``K3Model(cfg)`` read from ``path``; one
  ``ConversionError`` lists every missing parameter and every shape that differs from ``cfg``'s.
  ``shardings`` (model path -> sharding): Orbax directories are read shard by shard."""
  path = storage.path(path)
  want = {key_of(p): v for p, v in jax.tree_util.tree_flatten_with_path(
      nnx.to_pure_dict(nnx.state(abstract_model(cfg))))[0]}
  if _is_orbax(path):
    _, values = convert.load_orbax_params(path, config=config, shardings=shardings)
  else:
    _, values = convert.load_hf_params(path, cfg)
  problems = [f"{k}: missing from the checkpoint" for k in want if k not in values]
  problems += [f"{k}: checkpoint shape {list(values[k].shape)}, config {list(v.shape)}"
               for k, v in want.items() if k in values and tuple(values[k].shape) != tuple(v.shape)]
  if problems:
    raise convert.ConversionError(f"{path} does not match the config's model "
                                  f"({len(problems)} problems):\n  " + "\n  ".join(problems))
  return {k: values[k] for k in want}


def from_pretrained(path: str | Path, *, dtype: str | None = None,
                    mesh: jax.sharding.Mesh | None = None, config: str | Path | None = None,
                    overrides: list[str] | tuple[str, ...] = ()) -> K3Model:
  """Loads ``path`` (an HF directory with ``config.json`` and safetensors, an Orbax directory
  written by ``convert.py hf-to-orbax``, a ``train.py`` run directory or one of its
  ``checkpoints/<step>``) into a :class:`K3Model`. Only the weights (parameters and router
  biases) are read, never a run's optimizer state.

  dtype: "float32" or "bfloat16" for parameters and compute (default: the checkpoint's config).
  mesh: shard the parameters over this mesh with the default sharding rules (Orbax directories
  are then read shard by shard). config: a k3jax YAML overriding the stored config (Orbax only).
  overrides: ``model.*=value`` items applied to the config (e.g. ``model.kda.implementation=naive``).
  The model called on int32 ``input_ids [B, T]`` returns float32 logits ``[B, T, vocab]``.
  """
  path = storage.path(path)
  cfg = checkpoint_config(path, config)
  if overrides:
    cfg = config_lib.from_dict({"model": config_lib.to_dict(cfg)}, overrides).model
  if dtype is not None:
    if dtype not in ("float32", "bfloat16"):
      raise convert.ConversionError(f"from_pretrained: dtype must be float32 or bfloat16, got {dtype!r}")
    cfg = dataclasses.replace(cfg, param_dtype=dtype, compute_dtype=dtype)
  model = abstract_model(cfg)
  flat_state = nnx.to_flat_state(nnx.state(model))
  shardings = None
  if mesh is not None:
    from sharding.rules import named_sharding
    shardings = {}
    for p, var in flat_state:
      names = getattr(var, "sharding_names", None) or var.get_metadata().get("out_sharding")
      shardings[".".join(map(str, p))] = named_sharding(mesh, names or (None,) * var.get_value().ndim)
  values = read_weights(path, cfg, shardings=shardings, config=config)
  for p, var in flat_state:
    key = ".".join(map(str, p))
    want, x = var.get_value(), values[key]
    if isinstance(x, np.ndarray):
      x = jnp.asarray(x, dtype=want.dtype)
      if shardings is not None:
        x = jax.device_put(x, shardings[key])
    else:
      x = x.astype(want.dtype)
    var.set_value(x)
  nnx.update(model, nnx.from_flat_state(flat_state))
  return model
