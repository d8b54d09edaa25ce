"""Checkpoints of a training run: an Orbax ``CheckpointManager`` over ``RUN_DIR/checkpoints``.

Each step directory holds three items: ``state`` (a pytree of arrays: parameters, optimizer state,
router biases, rng key data, ...; saved asynchronously), ``data`` (the grain iterator state of
every process) and ``meta`` (JSON: step, stage, counters). Orbax writes each checkpoint under a
temporary name and renames it when complete, so a crash mid-save leaves a temporary directory,
never a half-written step.

``restore_latest`` walks the complete checkpoints from the newest down: one that fails to load is
reported by name and renamed to ``<step>.corrupt`` (kept for inspection, and so that a later save of
the same step never lands on top of it), and the previous one is tried. A checkpoint that reads
but holds a state of another layout than the one asked for (another optimizer, or a state saved
by code whose optimizer state was laid out differently) is not corrupt: the restore stops with
:class:`LayoutError` and moves nothing, since every older checkpoint of the run has the same
layout. Temporary directories of interrupted saves are reported and left alone. A save never
replaces an existing step.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import grain
import jax
import orbax.checkpoint as ocp

ITEMS = ("state", "data", "meta")


class LayoutError(RuntimeError):
  """A checkpoint holds a training state of another tree layout than the one being restored."""


def _layout_mismatch(e: Exception) -> bool:
  """Orbax's error for a readable checkpoint whose tree differs from the requested one."""
  return isinstance(e, ValueError) and "tree structures do not match" in str(e)


def _say(msg: str) -> None:
  if jax.process_index() == 0:
    print(f"[checkpoint] {msg}", file=sys.stderr, flush=True)


class Checkpointer:
  """Saves and restores (state pytree, grain iterator, meta dict) by step."""

  def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
    self.directory = Path(directory).absolute()
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
    """Starts saving ``step`` (returns at once when async); False when that step already exists."""
    if step in self.manager.all_steps():
      return False
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(data_iter),
        meta=ocp.args.JsonSave(meta)), force=True)
    if wait:
      self.manager.wait_until_finished()
    return True

  def _report_incomplete(self) -> None:
    if not self.directory.is_dir():
      return
    complete = {str(s) for s in self.manager.all_steps()}
    for p in sorted(self.directory.iterdir()):
      if p.is_dir() and p.name not in complete and ".orbax-checkpoint-tmp" in p.name:
        _say(f"skipping incomplete checkpoint {p} (an interrupted save)")

  def restore_latest(self, abstract_state: Any, make_iter: Callable[[int], Any]
                     ) -> tuple[int, Any, dict, Any] | None:
    """(step, state, meta, data iterator) of the newest checkpoint that loads; None when there is
    none. ``abstract_state`` gives the tree, shapes and shardings; ``make_iter(step)`` builds the
    grain iterator that the checkpoint of ``step`` saved, which is then set to its position."""
    self._report_incomplete()
    for step in sorted(self.manager.all_steps(), reverse=True):
      path = self.directory / str(step)
      data_iter = make_iter(step)
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=grain.checkpoint.CheckpointRestore(data_iter),
            meta=ocp.args.JsonRestore()))
      except Exception as e:  # any failure to read means this checkpoint cannot be trusted
        if _layout_mismatch(e):
          raise LayoutError(
              f"checkpoint {path} holds a training state laid out differently from the one this "
              "config builds (another optimizer, or one saved before a change of the optimizer "
              "state's layout); nothing was moved. Resume with the settings the run was started "
              "with, or start a new --run-dir. Orbax: " + str(e).splitlines()[0][:200]) from e
        target = path.with_name(f"{path.name}.corrupt")
        n = 1
        while target.exists():
          n += 1
          target = path.with_name(f"{path.name}.corrupt{n}")
        _say(f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}: "
             f"{str(e).splitlines()[0][:200] if str(e) else ''}); moved to {target.name}, "
             "trying the previous one")
        if jax.process_index() == 0:
          path.rename(target)
        self.manager.reload()
        continue
      return step, restored["state"], dict(restored["meta"]), data_iter
    return None

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
