"""Symbolic links of a source directory: a conversion reads and copies only what lies inside it."""

from __future__ import annotations

from pathlib import Path

from k3jax import storage
from k3jax.convert.errors import ConversionError


def refuse_outside_links(directory: Path):
  """Raises :class:`ConversionError` naming every entry of ``directory`` that is a symbolic link
  resolving outside it. A Hugging Face cache snapshot (``<repo>/snapshots/<rev>``) may link into
  its repository's ``blobs/``, where the cache keeps the files. Object stores have no links."""
  if storage.is_remote(directory):
    return
  root = directory.resolve()
  allowed = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
  bad = [f"{f.name} -> {f.resolve()}" for f in sorted(directory.iterdir())
         if f.is_symlink() and not any(f.resolve().is_relative_to(a) for a in allowed)]
  if bad:
    raise ConversionError(f"{directory}: symbolic links pointing outside it (refused, not "
                          "followed):\n  " + "\n  ".join(bad))
