"""Checkpoints of a training run: an Orbax ``CheckpointManager`` over ``RUN_DIR/checkpoints``.

Each step directory holds three items: ``state`` (a pytree of arrays: parameters, optimizer state,
router biases, rng key data, ...; saved asynchronously), ``data`` (the grain iterator state of
every process) and ``meta`` (JSON: step, stage, counters). On a local path Orbax writes each
checkpoint under a temporary name and renames it when complete; on ``gs://`` (no renames) it writes
the step's objects in place and a ``commit_success.txt`` marker last, and only steps with the marker
count. Either way a crash mid-save leaves an incomplete directory, never a half-written step.

Every save records a fingerprint of each array of ``state`` in ``meta`` (``checksums``: two sums of
the array's bits, computed on device, see :func:`fingerprints`) and refuses a state holding a
non-finite value (:class:`NonFiniteError`), so no checkpoint ever holds one.

``restore_latest`` walks the complete checkpoints from the newest down: one that fails to load, whose
arrays do not match their checksums (a flipped bit), or that holds a non-finite value is
reported by name and renamed to ``<step>.corrupt`` (kept for inspection, and so that a later save of
the same step never lands on top of it), and the previous one is tried. A checkpoint that reads
but holds a state of another layout than the one asked for (another optimizer, or a state saved
by code whose optimizer state was laid out differently) is not corrupt: the restore stops with
:class:`LayoutError` and moves nothing, since every older checkpoint of the run has the same
layout. Temporary directories of interrupted saves are reported and left alone. A save never
replaces an existing step.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from k3jax import storage

ITEMS = ("state", "data", "meta")


class LayoutError(RuntimeError):
  """A checkpoint holds a training state of another tree layout than the one being restored."""


class NonFiniteError(RuntimeError):
  """A training state to be saved holds a non-finite value."""


def _leaf_checks(x: jax.Array) -> jax.Array:
  """uint32[3] of one array: the sum of its bits as words, the sum of the words times odd
  multipliers that differ by position (both modulo 2^32), and 1 when every value is finite. A
  flipped bit moves a word by 2^k (k < 32), and so both sums, by a nonzero amount modulo 2^32: a
  single flip is always caught, several that cancel in both sums only by chance."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
  if x.dtype == jnp.bool_:
    words = x.astype(jnp.uint32)
  else:
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  # The flat index modulo 2^32, built dim by dim: a leaf may hold more than 2^32 words.
  position = jnp.zeros(words.shape, jnp.uint32)
  for d in range(words.ndim):
    stride = math.prod(words.shape[d + 1:]) % 2**32
    position = position + jax.lax.broadcasted_iota(jnp.uint32, words.shape, d) * jnp.uint32(stride)
  odd = position * jnp.uint32(0x9E3779B1) | 1
  return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * odd, dtype=jnp.uint32),
                    finite.astype(jnp.uint32)])


_tree_checks = jax.jit(lambda tree: jax.tree.map(_leaf_checks, tree))


def fingerprints(tree: Any) -> tuple[dict[str, list[int]], list[str]]:
  """({leaf path: [sum, weighted sum]} of every array of ``tree``, the paths of the arrays holding a
  non-finite value), computed on the arrays' devices; paths as ``opt_state.0.mu.embed``."""
  checks = jax.device_get(_tree_checks(tree))
  sums, nonfinite = {}, []
  for path, c in jax.tree_util.tree_flatten_with_path(checks)[0]:
    name = jax.tree_util.keystr(path, simple=True, separator=".")
    sums[name] = [int(c[0]), int(c[1])]
    if not c[2]:
      nonfinite.append(name)
  return sums, nonfinite


def _named(names: list[str], limit: int = 5) -> str:
  more = f" and {len(names) - limit} more" if len(names) > limit else ""
  return ", ".join(names[:limit]) + more


class _Unreadable(Exception):
  """A checkpoint item failed to read (the message says how)."""


def _layout_mismatch(e: Exception) -> bool:
  """Orbax's error for a readable checkpoint whose tree differs from the requested one."""
  return isinstance(e, ValueError) and "tree structures do not match" in str(e)


def _say(msg: str) -> None:
  if jax.process_index() == 0:
    print(f"[checkpoint] {msg}", file=sys.stderr, flush=True)


class Checkpointer:
  """Saves and restores (state pytree, grain iterator, meta dict) by step."""

  def __init__(self, directory, *, keep: int = 3, async_save: bool = True):
    self.directory = storage.checkpoint_path(directory)
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True),
        item_handlers={
            "state": ocp.StandardCheckpointHandler(),
            "data": grain.checkpoint.CheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        })

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state: Any, data_iter, meta: dict, *, wait: bool = False) -> bool:
    """Starts saving ``step`` (returns at once when async); False when that step already exists.
    Raises :class:`NonFiniteError`, saving nothing, when ``state`` holds a non-finite value."""
    if step in self.manager.all_steps():
      return False
    sums, nonfinite = fingerprints(state)
    if nonfinite:
      raise NonFiniteError(f"the training state at step {step} holds non-finite values in "
                           f"{_named(nonfinite)}; not saved")
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(data_iter),
        meta=ocp.args.JsonSave({**meta, "checksums": sums})), force=True)
    if wait:
      self.manager.wait_until_finished()
    return True

  def _report_incomplete(self) -> None:
    if not self.directory.is_dir():
      return
    complete = {str(s) for s in self.manager.all_steps()}
    for p in sorted(self.directory.iterdir()):  # a temporary name, or a step without its marker
      if p.is_dir() and p.name not in complete and (".orbax-checkpoint-tmp" in p.name
                                                    or p.name.isdigit()):
        _say(f"skipping incomplete checkpoint {p} (an interrupted save)")

  def _restore(self, step: int, **items) -> Any:
    """``items`` of checkpoint ``step``; :class:`LayoutError` for a state of another layout,
    :class:`_Unreadable` for any other failure to read."""
    try:
      return self.manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # any failure to read means this checkpoint cannot be trusted
      if _layout_mismatch(e):
        raise LayoutError(
            f"checkpoint {self.directory / str(step)} holds a training state laid out differently "
            "from the one this config builds (another optimizer, or one saved before a change of "
            "the optimizer state's layout); nothing was moved. Resume with the settings the run "
            "was started with, or start a new --run-dir. Orbax: "
            + str(e).splitlines()[0][:200]) from e
      raise _Unreadable(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                        ) from e

  def _set_aside(self, path: storage.AnyPath, why: str) -> None:
    """Renames the checkpoint at ``path`` to ``<step>.corrupt`` (``.corrupt2``, ... when taken)."""
    target = path.with_name(f"{path.name}.corrupt")
    n = 1
    while target.exists():
      n += 1
      target = path.with_name(f"{path.name}.corrupt{n}")
    _say(f"checkpoint {path} {why}; moved to {target.name}, trying the previous one")
    if jax.process_index() == 0:
      path.rename(target)
    self.manager.reload()

  def restore_latest(self, abstract_state: Any, make_iter: Callable[[int], Any],
                     keep_position: Callable[[dict], bool] = lambda meta: True
                     ) -> tuple[int, Any, dict, Any] | None:
    """(step, state, meta, data iterator) of the newest checkpoint that loads, matches its
    checksums and holds only finite values; None when there is none. ``abstract_state`` gives the
    tree, shapes and shardings; ``make_iter(step)`` builds the grain iterator that the checkpoint
    of ``step`` saved, which is then set to its position unless ``keep_position(meta)`` is False
    (it may also raise to refuse the checkpoint's settings)."""
    self._report_incomplete()
    for step in sorted(self.manager.all_steps(), reverse=True):
      path = self.directory / str(step)
      data_iter = make_iter(step)
      try:
        meta = dict(self._restore(step, meta=ocp.args.JsonRestore())["meta"])
        items = {"state": ocp.args.StandardRestore(abstract_state)}
        if keep_position(meta):  # outside the reads: a refusal is no sign of corruption
          items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        state = self._restore(step, **items)["state"]
      except _Unreadable as e:
        self._set_aside(path, f"is corrupt or unreadable ({e})")
        continue
      sums, nonfinite = fingerprints(state)
      saved = meta.pop("checksums", None)  # None: saved before checksums were recorded
      changed = [] if saved is None else [k for k, v in sums.items() if saved.get(k) != v]
      if changed:
        self._set_aside(path, f"does not match its checksums in {_named(changed)} (corrupted on "
                              "disk)")
        continue
      if nonfinite:
        self._set_aside(path, f"holds non-finite values in {_named(nonfinite)}")
        continue
      return step, state, meta, data_iter
    return None

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
