"""Building configs from YAML and plain dicts with ``key=value`` overrides, and back to dicts;
every error names the key."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from k3jax.config.checks import validate
from k3jax.config.model import ConfigError, ModelConfig
from k3jax.config.run import Config


# ---------------------------------------------------------------------------------------------
# Building dataclasses from plain dicts, with errors that name the key.


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(value: Any, tp: Any, key: str) -> Any:
  origin = typing.get_origin(tp)
  if origin in (types.UnionType, typing.Union):
    args = typing.get_args(tp)
    if value is None and type(None) in args:
      return None
    others = [a for a in args if a is not type(None)]
    if len(others) == 1:  # an optional field: the inner type's error names the inner key
      return _coerce(value, others[0], key)
    for a in args:
      if a is type(None):
        continue
      try:
        return _coerce(value, a, key)
      except ConfigError:
        pass
    raise ConfigError(f"{key}: expected {tp}, got {value!r}")
  if origin is tuple:
    (elem, *_rest) = typing.get_args(tp)
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{key}: expected a list, got {value!r}")
    return tuple(_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value))
  if dataclasses.is_dataclass(tp):
    if isinstance(value, tp):
      return value
    if not isinstance(value, dict):
      raise ConfigError(f"{key}: expected a mapping for {tp.__name__}, got {value!r}")
    return _build(tp, value, key)
  if tp is bool:
    if isinstance(value, bool):
      return value
    raise ConfigError(f"{key}: expected true/false, got {value!r}")
  if tp is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    raise ConfigError(f"{key}: expected an integer, got {value!r}")
  if tp is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
    if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
      return float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
    raise ConfigError(f"{key}: expected a number, got {value!r}")
  if tp is str:
    if isinstance(value, str):
      return value
    raise ConfigError(f"{key}: expected a string, got {value!r}")
  raise ConfigError(f"{key}: unsupported type {tp}")


def _build(cls: type, data: dict, prefix: str = "") -> Any:
  hints = typing.get_type_hints(cls)
  names = {f.name for f in dataclasses.fields(cls)}
  for k in data:
    if k not in names:
      full = f"{prefix}.{k}" if prefix else k
      raise ConfigError(f"unknown config key {full!r} (known: {', '.join(sorted(names))})")
  kwargs = {}
  for k, v in data.items():
    full = f"{prefix}.{k}" if prefix else k
    kwargs[k] = _coerce(v, hints[k], full)
  return cls(**kwargs)


def to_dict(cfg: Any) -> Any:
  """The config as plain YAML-able Python data (tuples become lists)."""
  if dataclasses.is_dataclass(cfg):
    return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
  if isinstance(cfg, tuple):
    return [to_dict(v) for v in cfg]
  return cfg


def _apply_override(tree: dict, item: str) -> None:
  if "=" not in item:
    raise ConfigError(f"override {item!r}: expected key=value")
  key, raw = item.split("=", 1)
  key = key.strip()
  value = yaml.safe_load(raw) if raw.strip() else ""
  parts = key.split(".")
  node = tree
  for p in parts[:-1]:
    node = node.setdefault(p, {})
    if not isinstance(node, dict):
      raise ConfigError(f"override {key!r}: {p!r} is not a section")
  node[parts[-1]] = value


def _merge(base: dict, over: dict) -> dict:
  out = dict(base)
  for k, v in over.items():
    if isinstance(v, dict) and isinstance(out.get(k), dict):
      out[k] = _merge(out[k], v)
    else:
      out[k] = v
  return out


def from_dict(data: dict, overrides: list[str] | tuple[str, ...] = ()) -> Config:
  tree = _merge({}, data or {})
  for item in overrides:
    _apply_override(tree, item)
  cfg = _build(Config, tree)
  validate(cfg)
  return cfg


def load(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
  """Loads a YAML config, applies ``key=value`` overrides and validates the result."""
  from k3jax import storage
  given, path = path, storage.path(path)
  if not path.is_file():
    raise ConfigError(f"config file {str(given)!r} does not exist")
  with path.open() as f:
    data = yaml.safe_load(f) or {}
  if not isinstance(data, dict):
    raise ConfigError(f"{path}: top level must be a mapping")
  return from_dict(data, overrides)


def replace(cfg: Config, overrides: list[str]) -> Config:
  """A copy of ``cfg`` with ``key=value`` overrides applied and validated."""
  return from_dict(to_dict(cfg), overrides)


def replace_model(model: ModelConfig, overrides: list[str] | tuple[str, ...]) -> ModelConfig:
  """``model`` with ``model.*`` overrides applied and validated (ConfigError for other keys)."""
  other = [o for o in overrides if not o.partition("=")[0].startswith("model.")]
  if other:
    raise ConfigError(f"{other[0]}: only model.* overrides apply here")
  return replace(Config(model=model), list(overrides)).model if overrides else model
