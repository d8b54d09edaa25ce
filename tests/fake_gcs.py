"""A fake ``gs://`` for tests: ``gs://BUCKET/KEY`` is the local file ``ROOT/BUCKET/KEY`` for both
readers k3jax goes through, fsspec (``etils.epath``: configs, metrics, listings, Orbax's metadata)
and tensorstore (Orbax's arrays, whose GCS driver is swapped for its file driver). Orbax still
sees ``gs://`` paths, so it commits a checkpoint as on GCS (a ``commit_success.txt`` marker, no
renames)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Iterator

from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem


class FakeGCSFileSystem(DirFileSystem):
  """fsspec's ``gs``/``gcs`` protocol on a local directory (:attr:`root`, set by :func:`fake_gcs`)."""
  protocol = ("gs", "gcs")
  root: Path | None = None
  cachable = False

  def __init__(self, *args, **kwargs):
    super().__init__(path=str(self.root), fs=LocalFileSystem(auto_mkdir=True))


@contextlib.contextmanager
def fake_gcs(root: Path, monkeypatch) -> Iterator[Path]:
  """Within the block ``gs://`` URLs live under ``root``."""
  from etils.epath import backend
  from orbax.checkpoint._src.path import gcs_utils

  def file_kvstore(path: str) -> dict:
    bucket, key = gcs_utils.parse_gcs_path(path)
    return {"driver": "file", "path": str(root / bucket / key)}

  monkeypatch.setattr(FakeGCSFileSystem, "root", root)
  registry = sys.modules["fsspec.registry"]._registry  # fsspec.registry is a read-only view
  for name in ("gs", "gcs"):
    monkeypatch.setitem(registry, name, FakeGCSFileSystem)
  monkeypatch.setattr(gcs_utils, "get_kvstore_for_gcs", file_kvstore)
  # a flat bucket: Orbax asks GCS (google-cloud-storage) about hierarchical namespaces otherwise
  monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
  backend.fsspec_backend._get_filesystem.cache_clear()
  try:
    yield root
  finally:
    backend.fsspec_backend._get_filesystem.cache_clear()
