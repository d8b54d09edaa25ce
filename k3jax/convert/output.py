"""What both directions share in writing their output: a staging directory published in place
only when complete (and removed on Ctrl-C or ``kill``), a progress bar over bytes, and the stats
they return.

Locally the staging directory is renamed to the destination. On an object store (``gs://``) it is a
temporary prefix next to the destination whose objects are copied under the destination when
complete, the files that make the directory valid last (``config.json`` of an HF directory;
``params/_METADATA`` then ``config.json`` of an Orbax one): a copy cut short leaves a destination
that no reader takes for a checkpoint (:func:`k3jax.storage.publish`)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import threading
import uuid
from typing import Iterator

from k3jax import storage
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


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_stop: list[int] = []  # the stop signal received while a staged directory is being written


def check_interrupt():
  """Raises :class:`ConversionError` once SIGINT or SIGTERM arrived during a conversion; called
  between blocks by whichever thread produces them (Orbax writes from its own threads)."""
  if _stop:
    raise ConversionError(f"interrupted by {signal.Signals(_stop[0]).name}")


@contextlib.contextmanager
def _deferred_stop_signals() -> Iterator[None]:
  """Turns SIGINT and SIGTERM into a stop request that the writers see at their next block, so
  the staged directory is removed before the signal takes its usual effect (KeyboardInterrupt,
  termination). A second signal acts at once. Only the main thread can handle signals."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  old = {}

  def request_stop(signum, frame):
    if _stop:  # the second one: restore the usual handler and deliver it
      signal.signal(signum, old[signum])
      os.kill(os.getpid(), signum)
    else:
      _stop.append(signum)

  for s in _STOP_SIGNALS:
    if signal.getsignal(s) not in (signal.SIG_IGN, None):  # an ignored signal stays ignored
      old[s] = signal.signal(s, request_stop)
  try:
    yield
  finally:
    received = _stop[:1]
    for s, h in old.items():
      signal.signal(s, h)
    _stop.clear()
    if received:
      os.kill(os.getpid(), received[0])  # now with its usual effect


_HOST = socket.gethostname()
_TMP = re.compile(r"\.(?P<name>.+)\.tmp-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}")


def _stale_temporaries(dst: storage.AnyPath):
  """Removes the staging directories of earlier conversions into ``dst`` killed on this host;
  raises :class:`ConversionError` naming one whose process still runs or ran elsewhere."""
  for tmp in sorted(dst.parent.glob(f".{dst.name}.tmp-*")):
    m = _TMP.fullmatch(tmp.name)
    if m and m["name"] == dst.name and m["host"] == _HOST and not _alive(int(m["pid"])):
      print(f"removing {tmp}, left by an interrupted conversion", file=sys.stderr)
      storage.rmtree(tmp)
    else:
      raise ConversionError(f"{tmp} is another conversion into {dst} (still running, or on another "
                            "host); remove it if none is")


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by someone else
    return True
  return True


@contextlib.contextmanager
def staged_dir(dst: storage.AnyPath, last: tuple[str, ...] = ()) -> Iterator[storage.AnyPath]:
  """A new temporary directory next to ``dst``, published as ``dst`` when the block completes
  (``last``: the files inside it that make it valid, see :func:`k3jax.storage.publish`) and
  removed when it raises or SIGINT / SIGTERM arrives (see :func:`check_interrupt`), so a failed
  or interrupted conversion leaves nothing behind. Temporaries of killed earlier runs are removed."""
  if dst.exists():
    raise ConversionError(f"destination {dst} already exists")
  storage.makedirs(dst.parent)
  _stale_temporaries(dst)
  tmp = dst.parent / f".{dst.name}.tmp-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  with _deferred_stop_signals():
    storage.makedirs(tmp)
    try:
      yield tmp
      check_interrupt()
      storage.publish(tmp, dst, last)
    except BaseException:
      storage.rmtree(tmp)
      raise


def conversion_stats(read_bytes: int, written: int, secs: float, skipped: int = 0) -> dict:
  """Bytes read and written, seconds, read rate, peak RSS and the source tensors left out."""
  import resource
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return {"read_bytes": read_bytes, "written_bytes": written, "seconds": secs,
          "read_MBps": read_bytes / 1e6 / max(secs, 1e-9), "peak_rss_bytes": peak,
          "skipped_tensors": skipped}
