"""Run metrics: ``RUN_DIR/metrics.jsonl`` (one JSON object per line), TensorBoard event files in
``RUN_DIR/tensorboard`` with the ``[tensorboard]`` extra (tensorboardX), and a tqdm progress bar.

Non-finite numbers are written as ``null`` so that every line is strict JSON. A run that starts at
step ``s`` (a resume, or 0) first drops the records past ``s`` (those of steps it is about to run
again, and a line cut short by a kill), so every step appears once.

An object store cannot append: in a remote run directory (``gs://``) ``metrics.jsonl`` is
uploaded whole, at most every :data:`UPLOAD_EVERY_S` seconds and when the run ends.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any

import numpy as np

from k3jax import storage

UPLOAD_EVERY_S = 30.0


def _plain(v: Any) -> Any:
  if isinstance(v, dict):
    return {str(k): _plain(x) for k, x in v.items()}
  if isinstance(v, (list, tuple)):
    return [_plain(x) for x in v]
  if isinstance(v, np.ndarray) or hasattr(v, "__array__"):
    a = np.asarray(v)
    return _plain(a.item() if a.ndim == 0 else a.tolist())
  if isinstance(v, (np.integer, bool)):
    return int(v) if not isinstance(v, bool) else v
  if isinstance(v, (float, np.floating)):
    return float(v) if math.isfinite(v) else None
  return v


def _tb_writer(log_dir: storage.AnyPath):
  """tensorboardX's writer when the ``[tensorboard]`` extra is installed, else None."""
  try:
    from tensorboardX import SummaryWriter
  except ImportError:
    return None
  return SummaryWriter(str(log_dir))


def read_jsonl(path) -> list[dict]:
  with storage.path(path).open() as f:
    return [json.loads(line) for line in f if line.strip()]


def _kept(path: storage.AnyPath, step: int) -> list[str]:
  """The lines of ``path`` holding records up to ``step`` (not those that are not JSON objects)."""
  kept = []
  with path.open() as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(record, dict) and record.get("step", 0) <= step:
        kept.append(line if line.endswith("\n") else line + "\n")
  return kept


def truncate(path: storage.AnyPath, step: int) -> None:
  """Keeps the records of ``path`` up to ``step`` (and drops lines that are not JSON objects),
  replacing the file at once."""
  storage.write(path, "".join(_kept(path, step)))


class Metrics:
  """Writes metrics of a run (only on process 0 when ``enabled`` is False elsewhere)."""

  def __init__(self, run_dir, *, total_steps: int, start_step: int,
               enabled: bool = True, progress: bool = True):
    self.enabled = enabled
    run_dir = storage.path(run_dir)
    self.path = run_dir / "metrics.jsonl"
    self._file = self._lines = None
    self._uploaded = time.monotonic()
    if enabled and storage.is_remote(self.path):  # every line, uploaded whole
      self._lines = _kept(self.path, start_step) if self.path.exists() else []
    elif enabled:
      if self.path.exists():
        truncate(self.path, start_step)
      self._file = open(self.path, "a")
    self._tb = _tb_writer(run_dir / "tensorboard") if enabled else None
    self._bar = None
    if enabled and progress:
      from tqdm import tqdm
      self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                       file=sys.stderr, mininterval=1.0)

  def write(self, record: dict) -> None:
    """Appends one record (must hold ``step``); scalars also go to TensorBoard."""
    if not self.enabled:
      return
    record = _plain(record)
    if self._lines is not None:
      self._lines.append(json.dumps(record) + "\n")
      if time.monotonic() - self._uploaded >= UPLOAD_EVERY_S:
        self._upload()
    else:
      self._file.write(json.dumps(record) + "\n")
      self._file.flush()
    if self._tb is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
          self._tb.add_scalar(k, v, record["step"])
        elif isinstance(v, list) and all(isinstance(x, (int, float)) for x in v):
          for i, x in enumerate(v):
            self._tb.add_scalar(f"{k}/{i}", x, record["step"])
      self._tb.flush()

  def progress(self, step: int, **postfix) -> None:
    if self._bar is not None:
      self._bar.n = step
      self._bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v)
                             for k, v in postfix.items()}, refresh=True)

  def say(self, msg: str) -> None:
    """Prints a line (above the progress bar)."""
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.write(msg, file=sys.stdout)
    else:
      print(msg, flush=True)
    sys.stdout.flush()

  def _upload(self) -> None:
    storage.write(self.path, "".join(self._lines))
    self._uploaded = time.monotonic()

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
    if self._file is not None:
      self._file.close()
    if self._lines is not None:
      self._upload()
    if self._tb is not None:
      self._tb.close()
