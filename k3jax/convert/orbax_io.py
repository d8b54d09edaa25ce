"""Orbax side of the converter: a leaf type that is written block by block while it is saved,
slice reads through tensorstore, and restoring a converted directory."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from k3jax import config as config_lib
from k3jax import run_dir, storage
from k3jax.config import ModelConfig
from k3jax.convert.errors import ConversionError
from k3jax.convert.hf_config import config_from_hf, read_hf_config


_IN_FLIGHT_BYTES = 192 << 20  # written blocks not yet committed, per array


@dataclasses.dataclass
class LazyArray:
  """An Orbax leaf whose data is produced block by block while it is saved."""

  shape: tuple[int, ...]
  dtype: np.dtype
  write_shape: tuple[int, ...]
  blocks: Callable[[], Iterator[tuple[tuple[slice, ...], np.ndarray]]]


def register_lazy_handler():
  """Makes Orbax save :class:`LazyArray` leaves through a streaming type handler."""
  import orbax.checkpoint as ocp
  import tensorstore as ts
  from orbax.checkpoint import future
  from orbax.checkpoint._src.serialization import ocdbt_utils
  from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
  from orbax.checkpoint._src.serialization import type_handlers

  class LazyArrayHandler(type_handlers.NumpyHandler):
    """Writes a :class:`LazyArray` like a NumPy array, one block (one tensorstore write) at a
    time; restores as ``np.ndarray`` (or ``jax.Array`` with a sharding)."""

    def __init__(self):
      super().__init__(deepcopy_host_arrays=False)

    async def _background_serialize(self, values, infos, args=None):
      for value, info, arg in zip(values, infos, args):
        await info.await_path_creation()
        spec = ts_utils.build_array_write_spec(
            info=info, arg=arg, global_shape=value.shape, local_shape=value.write_shape,
            dtype=value.dtype, use_ocdbt=info.is_ocdbt_checkpoint,
            process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint))
        t = await ts.open(ts.Spec(spec.json), create=True, open=True, context=info.ts_context)
        pending, in_flight = [], 0
        try:
          for idx, block in value.blocks():  # overlap producing the next block with writing
            pending.append((t[idx].write(block), block.nbytes))
            in_flight += block.nbytes
            while pending and (in_flight > _IN_FLIGHT_BYTES or len(pending) > 8):
              fut, n = pending.pop(0)
              await fut
              in_flight -= n
            await asyncio.sleep(0)
        except BaseException:  # the issued writes finish first, so the directory can be removed
          for fut, _ in pending:
            with contextlib.suppress(Exception):
              await fut
          raise
        for fut, _ in pending:
          await fut

    async def serialize(self, values, infos, args=None):
      args = args or [ocp.SaveArgs()] * len(values)
      return [future.CommitFutureAwaitingContractedSignals(
          self._background_serialize(values, infos, args), name="lazy_array")]

  ocp.type_handlers.register_type_handler(LazyArray, LazyArrayHandler(), override=True)


def nest_paths(flat: dict[str, object]) -> dict:
  """``{"a.b": x}`` -> ``{"a": {"b": x}}``: our dotted parameter paths as an Orbax tree."""
  tree: dict = {}
  for path, v in flat.items():
    node = tree
    *head, leaf = path.split(".")
    for k in head:
      node = node.setdefault(k, {})
    node[leaf] = v
  return tree


def flatten_paths(tree: dict, prefix: str = "") -> dict[str, object]:
  """The inverse of :func:`nest_paths`."""
  out = {}
  for k, v in tree.items():
    key = f"{prefix}{k}"
    if isinstance(v, dict):
      out.update(flatten_paths(v, key + "."))
    else:
      out[key] = v
  return out


class OrbaxReader:
  """Reads slices of the arrays of an Orbax PyTree checkpoint through tensorstore. With
  ``subtrees`` (a training checkpoint's ``("params", "biases")``) only the arrays under those
  top-level keys are seen, by their paths inside them (the model's paths)."""

  def __init__(self, directory: str | Path, *, subtrees: tuple[str, ...] = ()):
    import orbax.checkpoint as ocp
    self.dir = storage.checkpoint_path(directory)
    meta = ocp.PyTreeCheckpointer().metadata(self.dir)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    tree = dict(tree)
    parts = {s: flatten_paths(dict(tree[s])) for s in subtrees} if subtrees else {"": flatten_paths(tree)}
    self.meta = {k: v for part in parts.values() for k, v in part.items()}
    # our path -> the array's name in the checkpoint
    self.stored = {k: f"{s}.{k}" if s else k for s, part in parts.items() for k in part}
    self._open: dict[str, object] = {}

  def shape(self, path: str) -> tuple[int, ...]:
    return tuple(self.meta[path].shape)

  def dtype(self, path: str) -> np.dtype:
    return np.dtype(self.meta[path].dtype)

  def _array(self, path: str):
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
    t = self._open.get(path)
    if t is None:
      kv = ts_utils.build_kvstore_tspec(str(self.dir), name=self.stored[path],
                                        use_ocdbt=(self.dir / "manifest.ocdbt").exists())
      ctx = ts_utils.get_ts_context(use_ocdbt=True)
      try:
        t = ts.open({"driver": "zarr", "kvstore": kv}, open=True, read=True, context=ctx).result()
      except ValueError:
        t = ts.open({"driver": "zarr3", "kvstore": kv}, open=True, read=True, context=ctx).result()
      self._open[path] = t
    return t

  def read(self, path: str, idx: tuple = ()) -> np.ndarray:
    return np.asarray(self._array(path)[idx].read().result())


def orbax_tree(src: Path, run: run_dir.RunCheckpoint | None) -> tuple[Path, tuple[str, ...]]:
  """(the Orbax tree holding the weights of ``src``, the subtrees of it that are weights): a
  converted directory's ``params/`` (all of it), or the ``state`` of a training run's newest
  checkpoint or of one ``RUN_DIR/checkpoints/<step>`` (its ``params`` and ``biases``).
  run: ``run_dir.find(src)`` (it opens the run's checkpoints: callers look it up once)."""
  if run is not None:
    return run.state_dir, run_dir.WEIGHT_FIELDS
  return (src / "params" if (src / "params").is_dir() else src), ()


def load_orbax_config(src: Path, config: str | Path | None,
                      run: run_dir.RunCheckpoint | None) -> ModelConfig:
  """The model config of a converted directory or a training run: ``config`` (a k3jax YAML) if
  given, else its ``k3jax.yaml``, the run's ``config.yaml``, or its HF ``config.json``.
  run: ``run_dir.find(src)``."""
  if config is not None:
    return config_lib.load(config).model
  if (src / "k3jax.yaml").is_file():
    return config_lib.load(src / "k3jax.yaml").model
  if run is not None:
    return config_lib.load(run.config_path).model
  if (src / "config.json").is_file():
    return config_from_hf(read_hf_config(src))
  raise ConversionError(f"{src}: neither k3jax.yaml, a training run's config.yaml nor config.json "
                        "found (pass --config)")


def load_orbax_params(src: str | Path, *, config: str | Path | None = None,
                      shardings: dict | None = None) -> tuple[ModelConfig, dict[str, object]]:
  """Restores an Orbax directory or a training run's checkpoint (its weights only): (config,
  {our path: np.ndarray}); with ``shardings`` (our path -> ``jax.sharding.Sharding`` for every
  parameter) each device reads only its shard and the values are ``jax.Array``."""
  import orbax.checkpoint as ocp
  src = storage.checkpoint_path(src)
  run = run_dir.find(src)  # once for config, tree and verify
  cfg = load_orbax_config(src, config, run)
  ckpt, subtrees = orbax_tree(src, run)
  if not subtrees and not shardings:
    return cfg, flatten_paths(ocp.PyTreeCheckpointer().restore(ckpt))
  reader = OrbaxReader(ckpt, subtrees=subtrees)
  args = {reader.stored[k]: ocp.ArrayRestoreArgs(sharding=shardings[k]) if shardings
          and k in shardings else ocp.RestoreArgs(restore_type=np.ndarray) for k in reader.meta}
  item = nest_paths({reader.stored[k]: m for k, m in reader.meta.items()})
  tree = ocp.PyTreeCheckpointer().restore(ckpt, args=ocp.args.PyTreeRestore(
      item=item, restore_args=nest_paths(args), partial_restore=bool(subtrees)))
  if subtrees:  # a training run's checkpoint: its weights against the checksums saved with them
    run_dir.verify(run, tree)
  flat = flatten_paths(tree)
  return cfg, {k: flat[stored] for k, stored in reader.stored.items()}
