"""HF safetensors -> Orbax, streaming.

:func:`hf_to_orbax` reads one tensor (or one expert) at a time with ``pread`` from the safetensors
shards and writes it straight into the Orbax/tensorstore array, so host memory stays near one
block, never a whole ``[E, ...]`` expert stack. :func:`load_hf_params` reads a small checkpoint
into memory instead.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np
import yaml

from k3jax import config as config_lib
from k3jax import storage
from k3jax.config import ModelConfig
from k3jax.convert.errors import ConversionError
from k3jax.convert.hf_config import checkpoint_floats, config_from_hf, read_hf_config
from k3jax.convert.links import refuse_outside_links
from k3jax.convert.mxfp4 import mxfp4_dequantize
from k3jax.convert.names import Param, detect_prefix, hf_weight_name, plan, validate
from k3jax.convert.orbax_io import LazyArray, nest_paths, register_lazy_handler
from k3jax.convert.output import Progress, check_interrupt, conversion_stats, staged_dir
from k3jax.convert.safetensors_io import ST_DTYPES, SafetensorsReader


def _a_log(x: np.ndarray, heads: int, name: str) -> np.ndarray:
  """The first ``heads`` entries of an ``A_log`` tensor, whose padding must be zero."""
  flat = x.reshape(-1)
  if np.any(flat[heads:] != 0):
    raise ConversionError(f"{name}: padding after the first {heads} heads is not zero")
  return flat[:heads]


class _Source:
  """Builds any block of a parameter from the HF tensors (pread per block, no full copies)."""

  def __init__(self, reader: SafetensorsReader, p: Param):
    self.r, self.p = reader, p

  def _expert(self, base: str) -> np.ndarray:
    t = self.r.tensors
    if base + ".weight_packed" in t:
      return mxfp4_dequantize(self.r.read(base + ".weight_packed"), self.r.read(base + ".weight_scale"),
                              _DTYPES["bf16"])
    return self.r.read(base + ".weight")

  def block(self, idx: tuple[slice, ...]) -> np.ndarray:
    p = self.p
    if p.kind == "gate_up":
      rows = []
      for e in range(idx[0].start, idx[0].stop):
        w1 = self._expert(p.sources[2 * e]).T[idx[1]]
        w3 = self._expert(p.sources[2 * e + 1]).T[idx[1]]
        rows.append(np.concatenate([w1, w3.astype(w1.dtype)], axis=1)[:, idx[2]])
      return np.stack(rows)
    if p.kind == "down":
      return np.stack([self._expert(p.sources[e]).T[idx[1:]]
                       for e in range(idx[0].start, idx[0].stop)])
    name = hf_weight_name(p, p.sources[0])
    if p.kind == "copy":
      return self.r.read(name, (idx[0].start, idx[0].stop))[(slice(None),) + idx[1:]]
    if p.kind == "linear":  # our [in, out] block = HF rows out-range, cols in-range, transposed
      return self.r.read(name, (idx[1].start, idx[1].stop))[:, idx[0]].T
    x = self.r.read(name)
    if p.kind == "conv":
      return x[:, 0, :].T[idx]
    if p.kind == "patch":
      return x.reshape(x.shape[0], -1).T[idx]
    if p.kind == "row":
      return x.reshape(-1)[idx]
    if p.kind == "a_log":
      return _a_log(x, p.shape[0], name)[idx]
    raise ConversionError(f"unknown kind {p.kind}")


def _split_axis(p: Param) -> int:
  """The axis blocks are cut along: one HF row range (linear: HF rows are our last axis)."""
  return {"linear": len(p.shape) - 1, "gate_up": 0, "down": 0}.get(p.kind, 0)


def block_shape(p: Param, itemsize: int, shard: tuple[int, ...] | None = None,
                max_bytes: int = 256 << 20) -> tuple[int, ...]:
  """The write block (and zarr write shape) of ``p``: the mesh shard (or the whole array), cut
  along the streaming axis until it holds at most ``max_bytes`` (one expert for expert stacks)."""
  shape = list(shard or p.shape)
  if not shape:
    return ()
  ax = _split_axis(p)
  if p.kind in ("gate_up", "down"):
    shape[0] = 1
  row = math.prod(shape) // max(shape[ax], 1) * itemsize
  if row * shape[ax] > max_bytes:
    n = max(1, max_bytes // max(row, 1))
    while shape[ax] % n:  # keep blocks equal so they tile the shard
      n -= 1
    shape[ax] = n
  return tuple(shape)


def _blocks(shape: tuple[int, ...], block: tuple[int, ...]) -> Iterator[tuple[slice, ...]]:
  """The index of every block of ``block`` shape tiling ``shape`` (the last ones may be smaller)."""
  if not shape:
    yield ()
    return
  grid = [range(0, s, b) for s, b in zip(shape, block)]
  for starts in np.ndindex(*[len(g) for g in grid]):
    yield tuple(slice(g[k], min(g[k] + b, s))
                for g, k, b, s in zip(grid, starts, block, shape))


def mesh_shard_shape(p: Param, mesh: dict[str, int] | None) -> tuple[int, ...] | None:
  """Per-device shard of ``p`` under ``mesh`` (axis -> size) with the default sharding rules.

  A dimension whose size the mesh axes do not divide stays whole."""
  if not mesh:
    return None
  from sharding.rules import logical_spec
  spec = logical_spec(p.names, mesh_axes=[a for a, n in mesh.items() if n > 1])
  out = []
  for dim, axes in zip(p.shape, tuple(spec) + (None,) * len(p.shape)):
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    n = math.prod(mesh[a] for a in axes)
    out.append(dim // n if dim % n == 0 else dim)
  return tuple(out)


_DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp32": np.dtype(np.float32)}


def _target_dtype(p: Param, reader: SafetensorsReader, dtype: str | None) -> np.dtype:
  """Storage dtype of ``p``: ``dtype`` if given, else the source's (bfloat16 for MXFP4)."""
  if p.kind == "a_log" or p.path.endswith((".dt_bias", ".gate.bias")):
    return np.dtype(np.float32)  # kept float32 by the model
  if dtype:
    return _DTYPES[dtype]
  first = p.sources[0]
  if p.kind in ("gate_up", "down") and first + ".weight_packed" in reader.tensors:
    return _DTYPES["bf16"]
  return ST_DTYPES[reader.tensors[hf_weight_name(p, first)].dtype]


_EXTRA_SUFFIXES = (".json", ".model", ".txt", ".jinja", ".py", ".tiktoken", ".md")


def _copy_extras(src: storage.AnyPath, dst: storage.AnyPath, skip: set[str]):
  """Copies the source's small non-weight files (tokenizer, generation config) into ``dst``."""
  for f in sorted(src.iterdir()):
    if (f.is_file() and f.suffix in _EXTRA_SUFFIXES and f.name not in skip
        and storage.size(f) < 64 << 20):
      storage.makedirs(dst)
      storage.copy(f, dst / f.name)


def load_hf_params(src: str | Path, cfg: ModelConfig | None = None,
                   dtype: str | None = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
  """Reads an HF directory fully into memory: (config, {our path: array}). For small models
  (tests, from_pretrained); large ones go through :func:`hf_to_orbax`."""
  src = storage.path(src)
  refuse_outside_links(src)
  hf = read_hf_config(src)
  cfg = cfg or config_from_hf(hf, name=src.name)
  reader = SafetensorsReader(src)
  try:
    prefix = detect_prefix(reader.tensors)
    params = plan(cfg, prefix)
    validate(params, {n: (t.dtype, t.shape) for n, t in reader.tensors.items()}, prefix,
             checkpoint_floats(hf))
    return cfg, read_params(reader, params, dtype)
  finally:
    reader.close()


def read_params(reader: SafetensorsReader, params: list[Param], dtype: str | None = None
                ) -> dict[str, np.ndarray]:
  """``{our path: array}`` of ``params`` (a validated plan, or part of one) read in full."""
  out = {}
  for p in params:
    full = tuple(slice(0, s) for s in p.shape)
    out[p.path] = _Source(reader, p).block(full).astype(_target_dtype(p, reader, dtype))
  return out


def hf_to_orbax(src: str | Path, dst: str | Path, *, dtype: str | None = None,
                mesh: dict[str, int] | None = None, progress: bool = True,
                max_block_bytes: int = 256 << 20, overrides: tuple[str, ...] = ()) -> dict:
  """Converts the HF checkpoint in ``src`` into a new Orbax directory ``dst`` (local or URL paths,
  :mod:`k3jax.storage`; ``dst`` local or ``gs://``).

  dtype: "bf16" or "fp32" for every floating tensor (default: keep each source dtype; MXFP4
  experts become bfloat16, exactly). mesh: axis sizes (e.g. ``{"fsdp": 8, "expert": 4}``): the
  arrays are chunked along the per-device shards of the default sharding rules. Returns stats
  (bytes, seconds, MB/s, peak RSS).
  """
  import orbax.checkpoint as ocp
  src, dst = storage.path(src), storage.checkpoint_path(dst)
  if dtype not in (None, "bf16", "fp32"):
    raise ConversionError(f"--dtype must be bf16 or fp32, got {dtype!r}")
  refuse_outside_links(src)
  hf = read_hf_config(src)
  cfg = config_lib.replace_model(config_from_hf(hf, name=src.name), overrides)
  reader = SafetensorsReader(src)
  prefix = detect_prefix(reader.tensors)
  params = plan(cfg, prefix)
  tensors = {n: (t.dtype, t.shape) for n, t in reader.tensors.items()}
  used = validate(params, tensors, prefix, checkpoint_floats(hf))
  skipped = len(reader.tensors) - len(used)
  if dtype is None and cfg.param_dtype not in ("float32", "bfloat16"):
    dtype = "bf16"
  if dtype:
    cfg = dataclasses.replace(cfg, param_dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype],
                              compute_dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype])
  total_in = sum(reader.tensors[n].nbytes for n in used)
  bar = Progress(total_in, f"hf-to-orbax {src.name}", progress)
  t0 = time.perf_counter()
  written = [0]

  owner = {base: p.path for p in params for base in p.sources}
  in_bytes: dict[str, int] = {}
  for n in used:
    base = re.sub(r"\.(weight_packed|weight_scale|weight)$", "", n)
    path = owner.get(base, owner.get(n))
    in_bytes[path] = in_bytes.get(path, 0) + reader.tensors[n].nbytes

  def leaf(p: Param) -> LazyArray:
    dt = _target_dtype(p, reader, dtype)
    block = block_shape(p, dt.itemsize, mesh_shard_shape(p, mesh), max_block_bytes)
    source = _Source(reader, p)
    n_blocks = math.prod(-(-s // b) for s, b in zip(p.shape, block)) if p.shape else 1

    def blocks():
      for idx in _blocks(p.shape, block):
        check_interrupt()
        data = source.block(idx).astype(dt, copy=False)
        yield idx, data
        bar.update(in_bytes[p.path] // n_blocks)
        written[0] += data.nbytes
    return LazyArray(p.shape, dt, block, blocks)

  try:
    with staged_dir(dst, last=("params/_METADATA", "config.json")) as tmp:
      register_lazy_handler()
      tree = nest_paths({p.path: leaf(p) for p in params})
      ocp.PyTreeCheckpointer().save(tmp / "params", tree)
      (tmp / "config.json").write_text(json.dumps(hf, indent=2))
      (tmp / "k3jax.yaml").write_text(yaml.safe_dump({"model": config_lib.to_dict(cfg)}, sort_keys=False))
      manifest = {"format": 1, "prefix": prefix,
                  "tensors": {n: {"dtype": reader.tensors[n].dtype, "shape": list(reader.tensors[n].shape)}
                              for n in used},
                  "order": sorted(used, key=lambda n: (str(reader.tensors[n].file),
                                                       reader.tensors[n].offset))}
      (tmp / "hf_manifest.json").write_text(json.dumps(manifest))
      _copy_extras(src, tmp / "hf_extra", {"config.json", "model.safetensors.index.json"})
  finally:
    reader.close()
    bar.close()
  secs = time.perf_counter() - t0
  return conversion_stats(total_in, written[0], secs, skipped)
