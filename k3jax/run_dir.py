"""A training run directory as a source of weights (for ``from_pretrained``, ``generate``,
``orbax-to-hf`` and ``train.init_from``).

``train.py`` writes ``RUN_DIR/config.yaml`` and, through :class:`k3jax.checkpoint.Checkpointer`,
``RUN_DIR/checkpoints/<step>/state``: an Orbax tree ``{"params", "opt_state", "biases", "rng"}``
(:data:`k3jax.train_state.ARRAY_FIELDS`). Only ``params`` and ``biases`` are model weights.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from k3jax import storage

# The subtrees of a checkpoint's state that are the model's variables, by their model paths.
WEIGHT_FIELDS = ("params", "biases")


class RunDirError(ValueError):
  """A run directory has no usable checkpoint."""


@dataclasses.dataclass(frozen=True)
class RunCheckpoint:
  run_dir: storage.AnyPath
  step: int
  state_dir: storage.AnyPath  # the Orbax tree of the checkpoint's ``state`` item

  @property
  def config_path(self) -> storage.AnyPath:
    return self.run_dir / "config.yaml"


def find(path: str | Path) -> RunCheckpoint | None:
  """The checkpoint ``path`` names: a run directory (its newest complete checkpoint) or one of
  its ``checkpoints/<step>`` directories; None when ``path`` is neither."""
  from k3jax.checkpoint import Checkpointer
  path = storage.path(path)  # absolute: Orbax reads absolute paths only
  if (path / "state").is_dir() and path.parent.name == "checkpoints" and path.name.isdigit():
    run = path.parent.parent
    if not (run / "config.yaml").is_file():
      raise RunDirError(f"{path}: a checkpoint step directory without {run / 'config.yaml'}")
    return RunCheckpoint(run, int(path.name), path / "state")
  if not ((path / "config.yaml").is_file() and (path / "checkpoints").is_dir()):
    return None
  ckpt = Checkpointer(path / "checkpoints", async_save=False)
  try:
    steps = ckpt.steps()
  finally:
    ckpt.close()
  if not steps:
    raise RunDirError(f"{path}: the run has no complete checkpoint in {path / 'checkpoints'}")
  return RunCheckpoint(path, steps[-1], path / "checkpoints" / str(steps[-1]) / "state")


def verify(run: RunCheckpoint, weights) -> None:
  """Checks the weights read from ``run`` (``{"params": ..., "biases": ...}`` as restored) against
  the fingerprints ``train.py`` saved with the checkpoint (:func:`k3jax.checkpoint.fingerprints`);
  :class:`RunDirError` names every array that differs (corrupted on disk) or holds a non-finite
  value. A checkpoint saved before fingerprints were recorded is only checked for finiteness."""
  import orbax.checkpoint as ocp
  from k3jax.checkpoint import fingerprints
  meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(run.state_dir.parent / "meta")
  saved = meta.get("checksums")
  sums, nonfinite = fingerprints(weights)
  changed = [] if saved is None else sorted(k for k, v in sums.items() if saved.get(k) != v)
  problems = ([f"{k}: does not match its checksum (corrupted on disk)" for k in changed]
              + [f"{k}: holds non-finite values" for k in nonfinite])
  if problems:
    raise RunDirError(f"{run.run_dir} checkpoint {run.step} cannot be loaded "
                      f"({len(problems)} arrays):\n  " + "\n  ".join(problems))
