"""Orbax -> HF safetensors, streaming: :func:`orbax_to_hf` reads the Orbax arrays slice by slice
(one expert at a time for the routed experts) and streams safetensors shards out."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from k3jax import config as config_lib, run_dir, storage
from k3jax.convert.errors import ConversionError
from k3jax.convert.hf_config import config_to_hf, read_hf_config
from k3jax.convert.links import refuse_outside_links
from k3jax.convert.mxfp4 import mxfp4_quantize, mxfp4_shapes
from k3jax.convert.names import Param, hf_source_shape, hf_weight_name, plan
from k3jax.convert.orbax_io import OrbaxReader, load_orbax_config, orbax_tree
from k3jax.convert.output import Progress, check_interrupt, conversion_stats, staged_dir
from k3jax.convert.safetensors_io import ST_DTYPES, SafetensorsWriter


def _from_ours(p: Param, base: str, hf_shape: tuple[int, ...], reader: OrbaxReader,
               expert: int | None = None, half: int | None = None) -> np.ndarray:
  """The HF tensor ``base`` (float, before the HF dtype cast) from our parameter ``p``."""
  if p.kind == "gate_up":
    x = reader.read(p.path, (expert,))  # [L, 2F]
    f = x.shape[1] // 2
    return x[:, half * f:(half + 1) * f].T
  if p.kind == "down":
    return reader.read(p.path, (expert,)).T
  x = reader.read(p.path)
  if p.kind == "copy":
    return x.reshape(hf_shape)
  if p.kind == "linear":
    return x.T
  if p.kind == "conv":
    return x.T[:, None, :]
  if p.kind == "patch":
    return x.T.reshape(hf_shape)
  if p.kind == "row":
    return x.reshape(1, -1)
  if p.kind == "a_log":
    out = np.zeros(math.prod(hf_shape), x.dtype)
    out[: x.shape[0]] = x
    return out.reshape(hf_shape)
  raise ConversionError(f"unknown kind {p.kind}")


def _hf_row_blocks(p: Param, reader: OrbaxReader, hf_shape: tuple[int, ...], dtype: np.dtype,
                   max_bytes: int) -> Iterator[np.ndarray]:
  """The HF tensor of a "copy" / "linear" parameter in row blocks of at most ``max_bytes``."""
  rows = hf_shape[0]
  row_bytes = max(1, math.prod(hf_shape[1:]) * max(dtype.itemsize, reader.dtype(p.path).itemsize))
  step = max(1, max_bytes // row_bytes)
  for r in range(0, rows, step):
    sl = slice(r, min(r + step, rows))
    if p.kind == "linear":  # HF rows are our last axis
      yield reader.read(p.path, (Ellipsis, sl)).T.astype(dtype)
    else:
      yield reader.read(p.path, (sl,)).reshape((sl.stop - sl.start,) + hf_shape[1:]).astype(dtype)


def orbax_to_hf(src: str | Path, dst: str | Path, *, config: str | Path | None = None,
                experts: str = "auto", progress: bool = True, max_shard_bytes: int = 5 << 30,
                max_block_bytes: int = 256 << 20, overrides: tuple[str, ...] = ()) -> dict:
  """Writes the Orbax directory ``src`` (from :func:`hf_to_orbax`, or any ``params/`` tree of
  K3Model with a ``k3jax.yaml``) as an HF checkpoint in the new directory ``dst`` (local or URL
  paths, :mod:`k3jax.storage`).

  With the ``hf_manifest.json`` of a conversion, names, dtypes, shapes (padded ``A_log``) and the
  MXFP4 packing of the source come back exactly; otherwise the released layout is used, in the
  parameter dtype. experts: "auto" (as in the manifest), "mxfp4" or "bf16". max_block_bytes: the
  rows of a large tensor read and written at a time. overrides: ``model.*`` ``key=value`` items
  applied to the source's config.
  """
  src, dst = storage.checkpoint_path(src), storage.path(dst)
  refuse_outside_links(src)
  if (src / "hf_extra").is_dir():
    refuse_outside_links(src / "hf_extra")
  run = run_dir.find(src)  # once for config and tree
  cfg = config_lib.replace_model(load_orbax_config(src, config, run), overrides)
  mpath = src / "hf_manifest.json"
  manifest = json.loads(mpath.read_text()) if mpath.is_file() else None
  if manifest:
    prefix = manifest["prefix"]
  else:
    prefix = "language_model." if cfg.arch == "kimi_k3" else ""
  params = plan(cfg, prefix)
  ckpt, subtrees = orbax_tree(src, run)
  reader = OrbaxReader(ckpt, subtrees=subtrees)
  problems = []
  for p in params:
    if p.path not in reader.meta:
      problems.append(f"missing {p.path}")
    elif reader.shape(p.path) != p.shape:
      problems.append(f"{p.path}: shape {list(reader.shape(p.path))}, expected {list(p.shape)}")
  extra = sorted(set(reader.meta) - {p.path for p in params})
  problems += [f"unexpected {x}" for x in extra]
  if problems:
    raise ConversionError(f"{ckpt} does not match the config:\n  " + "\n  ".join(problems))

  # The HF tensor list: (name, dtype, shape, producer).
  default_dt = {"float32": "F32", "bfloat16": "BF16", "float64": "F32"}[cfg.param_dtype]
  items = []
  for p in params:
    hf_shape = hf_source_shape(p)
    if p.kind in ("gate_up", "down"):
      for k, base in enumerate(p.sources):
        e, half = (k // 2, k % 2) if p.kind == "gate_up" else (k, None)
        packed = (base + ".weight_packed" in manifest["tensors"]) if manifest and experts == "auto" \
            else experts == "mxfp4" or (experts == "auto" and cfg.arch == "kimi_k3")
        if packed:
          ps, ss = mxfp4_shapes(hf_shape)
          items.append((base + ".weight_packed", "U8", ps, (p, base, hf_shape, e, half, "packed")))
          items.append((base + ".weight_scale", "U8", ss, (p, base, hf_shape, e, half, "scale")))
        else:
          name = base + ".weight"
          dt = manifest["tensors"][name]["dtype"] if manifest and name in manifest["tensors"] else default_dt
          items.append((name, dt, hf_shape, (p, base, hf_shape, e, half, None)))
      continue
    name = hf_weight_name(p, p.sources[0])
    if manifest and name in manifest["tensors"]:
      dt, shape = manifest["tensors"][name]["dtype"], tuple(manifest["tensors"][name]["shape"])
    else:
      shape = (p.shape[0],) if p.kind == "a_log" else hf_shape
      dt = "F32" if (p.kind == "a_log" or name.endswith((".dt_bias", ".e_score_correction_bias"))) \
          else default_dt
    items.append((name, dt, shape, (p, name, shape, None, None, None)))
  if manifest:
    rank = {n: i for i, n in enumerate(manifest["order"])}
    items.sort(key=lambda it: rank.get(it[0], len(rank)))

  with staged_dir(dst, last=("config.json",)) as tmp:
    writer = SafetensorsWriter(tmp, [(n, dt, s) for n, dt, s, _ in items], max_shard_bytes)
    bar = Progress(writer.total_bytes, f"orbax-to-hf {src.name}", progress)
    t0 = time.perf_counter()
    try:
      pending: dict[str, tuple[np.ndarray, np.ndarray]] = {}
      for name, dt, shape, (p, base, hf_shape, e, half, part) in items:
        check_interrupt()
        if part is None and p.kind in ("copy", "linear") and len(shape) >= 1 and shape == hf_shape:
          writer.write_rows(name, _hf_row_blocks(p, reader, shape, ST_DTYPES[dt], max_block_bytes), shape[0])
          bar.update(math.prod(shape) * ST_DTYPES[dt].itemsize)
          continue
        if part is None:
          arr = np.asarray(_from_ours(p, base, hf_shape, reader, e, half)).astype(ST_DTYPES[dt])
        else:
          if base not in pending:
            pending[base] = mxfp4_quantize(_from_ours(p, base, hf_shape, reader, e, half))
          arr = pending[base][0] if part == "packed" else pending.pop(base)[1]
        writer.write(name, arr)
        bar.update(arr.nbytes)
      writer.close()
      hf = read_hf_config(src) if (src / "config.json").is_file() else config_to_hf(cfg)
      _set_quantization(hf, any(name.endswith(".weight_packed") for name, *_ in items))
      (tmp / "config.json").write_text(json.dumps(hf, indent=2))
      if (src / "hf_extra").is_dir():
        for f in (src / "hf_extra").iterdir():
          storage.copy(f, tmp / f.name)
    finally:
      bar.close()
  return conversion_stats(writer.total_bytes, writer.total_bytes, time.perf_counter() - t0)


MXFP4_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                    "symmetric": True, "dynamic": False}}},
}


def _set_quantization(hf: dict, packed: bool):
  """Keeps ``quantization_config`` consistent with how the routed experts were written."""
  holders = [d for d in (hf, hf.get("text_config")) if isinstance(d, dict)]
  has = any("quantization_config" in d for d in holders)
  if packed and not has:
    hf["quantization_config"] = MXFP4_QUANTIZATION_CONFIG
  elif not packed:
    for d in holders:
      d.pop("quantization_config", None)
