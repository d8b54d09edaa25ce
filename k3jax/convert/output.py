"""What both directions share in writing their output: a staging directory renamed into place
only when complete, a progress bar over bytes, and the stats they return."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

from k3jax.convert.errors import ConversionError


class Progress:
  """tqdm over bytes written, showing the rate."""

  def __init__(self, total: int, desc: str, enabled: bool = True):
    self.bar = None
    if enabled:
      from tqdm import tqdm
      self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                      dynamic_ncols=True, mininterval=1.0)

  def update(self, n: int):
    if self.bar:
      self.bar.update(n)

  def close(self):
    if self.bar:
      self.bar.close()


@contextlib.contextmanager
def staged_dir(dst: Path) -> Iterator[Path]:
  """A new temporary directory next to ``dst``, renamed to ``dst`` when the block completes and
  removed when it raises, so a failed conversion leaves nothing behind."""
  if dst.exists():
    raise ConversionError(f"destination {dst} already exists")
  dst.parent.mkdir(parents=True, exist_ok=True)
  tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
  tmp.mkdir()
  try:
    yield tmp
    os.replace(tmp, dst)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def conversion_stats(read_bytes: int, written: int, secs: float, skipped: int = 0) -> dict:
  """Bytes read and written, seconds, read rate, peak RSS and the source tensors left out."""
  import resource
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return {"read_bytes": read_bytes, "written_bytes": written, "seconds": secs,
          "read_MBps": read_bytes / 1e6 / max(secs, 1e-9), "peak_rss_bytes": peak,
          "skipped_tensors": skipped}
