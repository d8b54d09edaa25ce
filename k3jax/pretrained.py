"""``from_pretrained``: a K3Model from an HF checkpoint directory or a converted Orbax directory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import convert
from k3jax.model import K3Model
from k3jax.train_state import abstract_model


def _is_orbax(path: Path) -> bool:
  return (path / "params" / "_METADATA").is_file() or (path / "_METADATA").is_file()


def from_pretrained(path: str | Path, *, dtype: str | None = None,
                    mesh: jax.sharding.Mesh | None = None, config: str | Path | None = None) -> K3Model:
  """Loads ``path`` (an HF directory with ``config.json`` and safetensors, or an Orbax directory
  written by ``convert.py hf-to-orbax``) into a :class:`K3Model`.

  dtype: "float32" or "bfloat16" for parameters and compute (default: the checkpoint's config).
  mesh: shard the parameters over this mesh with the default sharding rules (Orbax directories
  are then read shard by shard). config: a k3jax YAML overriding the stored config (Orbax only).
  The model called on int32 ``input_ids [B, T]`` returns float32 logits ``[B, T, vocab]``.
  """
  path = Path(path)
  if not path.is_dir():
    raise convert.ConversionError(f"from_pretrained: {path} is not a directory")
  orbax = _is_orbax(path)
  if orbax:
    cfg = convert.load_orbax_config(path, config)
  elif (path / "config.json").is_file():
    cfg = convert.config_from_hf(convert.read_hf_config(path), name=path.name)
  else:
    raise convert.ConversionError(
        f"from_pretrained: {path} holds neither an Orbax checkpoint nor an HF config.json")
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
  if orbax:
    _, values = convert.load_orbax_params(path, config=config, shardings=shardings)
  else:
    _, values = convert.load_hf_params(path, cfg)
  missing = []
  for p, var in flat_state:
    key = ".".join(map(str, p))
    if key not in values:
      missing.append(key)
      continue
    want = var.get_value()
    x = values[key]
    if tuple(x.shape) != tuple(want.shape):
      raise convert.ConversionError(f"{key}: checkpoint shape {list(x.shape)}, model {list(want.shape)}")
    if isinstance(x, np.ndarray):
      x = jnp.asarray(x, dtype=want.dtype)
      if shardings is not None:
        x = jax.device_put(x, shardings[key])
    else:
      x = x.astype(want.dtype)
    var.set_value(x)
  if missing:
    raise convert.ConversionError("from_pretrained: parameters missing from the checkpoint: "
                                     + ", ".join(missing))
  nnx.update(model, nnx.from_flat_state(flat_state))
  return model
