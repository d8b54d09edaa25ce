"""Where k3jax reads and writes: local paths and object-store URLs.

Every path a user gives (``--run-dir``, ``data.source``, ``train.init_from``, ``from_pretrained``,
``convert.py --src/--dst``) goes through :func:`path`. A local one becomes an absolute
``pathlib.Path`` (relative to the working directory at the time it is given: Orbax and tensorstore
take absolute paths only); ``file://`` is local too. A URL of :data:`SCHEMES` becomes an
``etils.epath.Path`` read and written through fsspec (``gcsfs`` for ``gs://``: the ``[gcs]``
extra). Both kinds offer the ``pathlib`` methods the callers use (``/``, ``name``, ``is_dir``,
``open``, ``read_text``, ``iterdir``, ...); what differs is here: sizes (:func:`size`), recursive
listings (:func:`glob`), local copies for readers that only open local files
(:func:`local_copy`) and whole-file writes (:func:`write`).

Orbax writes its arrays with tensorstore, whose remote driver is GCS's: run directories,
checkpoints and Orbax conversions live on a local (or mounted) path or ``gs://``; data, tokenizers
and HF checkpoints may be read from any scheme of :data:`SCHEMES`.
"""

from __future__ import annotations

import glob as glob_lib
import os
import shutil
import uuid
from pathlib import Path
from typing import Union

from etils import epath

# URL scheme -> (fsspec protocol, the package that provides it)
SCHEMES = {"gs": ("gcs", "gcsfs"), "s3": ("s3", "s3fs"), "az": ("az", "adlfs"),
           "hf": ("hf", "huggingface_hub")}
# the schemes Orbax (tensorstore) can write checkpoints to
CHECKPOINT_SCHEMES = ("gs",)

AnyPath = Union[Path, epath.Path]


class StorageError(ValueError):
  """A path k3jax cannot use (an unknown scheme, a missing filesystem package)."""


def scheme(p) -> str | None:
  """The URL scheme of ``p`` (``"gs"``), None for a local path."""
  head, sep, _ = os.fspath(p).partition("://")
  return head if sep and head != "file" else None


def is_remote(p) -> bool:
  return scheme(p) is not None


def path(p) -> AnyPath:
  """``p`` (a str or path) as an absolute local ``Path`` or an ``epath.Path`` URL."""
  s = os.fspath(p)
  if s.startswith("file://"):
    s = s[len("file://"):]
  name = scheme(s)
  if name is None:
    return Path(os.path.abspath(os.path.expanduser(s)))
  if name not in SCHEMES:
    raise StorageError(f"{s}: unknown scheme {name}://; k3jax reads local paths and "
                       + ", ".join(f"{k}://" for k in SCHEMES))
  protocol, package = SCHEMES[name]
  import fsspec
  try:
    fsspec.get_filesystem_class(protocol)
  except (ImportError, ValueError) as e:
    raise StorageError(f"{s}: {name}:// needs the package {package} (pip install {package}"
                       + ("; or pip install 'k3jax[gcs]'" if name == "gs" else "") + f"): {e}"
                       ) from e
  return epath.Path(s)


def checkpoint_path(p) -> AnyPath:
  """:func:`path` for an Orbax directory (a run directory, a conversion's output): local or one of
  :data:`CHECKPOINT_SCHEMES`."""
  out = path(p)
  if is_remote(out) and scheme(out) not in CHECKPOINT_SCHEMES:
    raise StorageError(f"{out}: Orbax checkpoints are written through tensorstore, which reaches "
                       f"{', '.join(f'{s}://' for s in CHECKPOINT_SCHEMES)} and local paths only; "
                       "use one of those (or mount the bucket and give its local path)")
  return out


def makedirs(p: AnyPath) -> None:
  """Creates the local directory ``p`` and its parents. An object store has no directories (an
  object's name holds its prefix): nothing to do there, and nothing is asked of it (gcsfs would
  create a bucket that does not exist)."""
  if not is_remote(p):
    p.mkdir(parents=True, exist_ok=True)


def size(p: AnyPath) -> int:
  """The length of the file ``p`` in bytes."""
  st = p.stat()
  return st.st_size if hasattr(st, "st_size") else st.length


def _fs(p):
  import fsspec
  return fsspec.core.url_to_fs(os.fspath(p))[0]


def glob(pattern: str) -> list[AnyPath]:
  """The files (not directories) matching ``pattern`` (``**`` crosses directories), sorted."""
  if not is_remote(pattern):
    return sorted(Path(f) for f in glob_lib.glob(os.path.abspath(os.path.expanduser(pattern)),
                                                 recursive=True) if os.path.isfile(f))
  path(pattern)  # the scheme's checks
  fs, head = _fs(pattern), scheme(pattern) + "://"
  found = fs.glob(pattern, detail=True)
  return sorted(epath.Path(head + k.removeprefix(head)) for k, v in found.items()
                if v.get("type") == "file")


def files_under(directory: AnyPath) -> list[AnyPath]:
  """Every file below ``directory``, sorted."""
  if not is_remote(directory):
    return sorted(f for f in directory.rglob("*") if f.is_file())
  return glob(str(directory).rstrip("/") + "/**")


def write(p: AnyPath, data: str | bytes) -> None:
  """Writes the file ``p`` so that a reader sees the old or the new contents, never a part: a
  temporary file renamed over it locally; on an object store one object upload is already so."""
  def put(f):
    return f.write_bytes(data) if isinstance(data, bytes) else f.write_text(data)

  if is_remote(p):
    put(p)
    return
  tmp = p.with_name(f".{p.name}.tmp-{uuid.uuid4().hex[:8]}")
  try:
    put(tmp)
    tmp.replace(p)
  finally:
    tmp.unlink(missing_ok=True)


def cache_dir() -> Path:
  """Where :func:`local_copy` keeps remote files: ``$K3JAX_CACHE`` or ``~/.cache/k3jax``."""
  return Path(os.environ.get("K3JAX_CACHE") or Path.home() / ".cache" / "k3jax") / "remote"


def local_copy(p: AnyPath) -> Path:
  """A local file with the contents of ``p``: ``p`` itself when local, else a copy under
  :func:`cache_dir` (downloaded once, to a temporary name renamed when complete; a cached copy of
  another size is fetched again)."""
  if not is_remote(p):
    return p
  s = str(p)
  local = cache_dir() / scheme(s) / s.split("://", 1)[1]
  want = size(p)
  if local.is_file() and local.stat().st_size == want:
    return local
  local.parent.mkdir(parents=True, exist_ok=True)
  tmp = local.with_name(f".{local.name}.tmp-{uuid.uuid4().hex[:8]}")
  try:
    with p.open("rb") as src, open(tmp, "wb") as dst:
      shutil.copyfileobj(src, dst, 16 << 20)
    tmp.replace(local)
  finally:
    tmp.unlink(missing_ok=True)
  return local


def copy(src: AnyPath, dst: AnyPath) -> None:
  """Copies the file ``src`` to ``dst`` (either local or remote)."""
  if not (is_remote(src) or is_remote(dst)):
    shutil.copy2(src, dst)
    return
  with src.open("rb") as a, dst.open("wb") as b:
    shutil.copyfileobj(a, b, 16 << 20)


def rmtree(p: AnyPath) -> None:
  """Removes the directory ``p`` and everything in it, ignoring what is already gone."""
  if is_remote(p):
    try:
      p.rmtree(missing_ok=True)
    except OSError:
      pass
  else:
    shutil.rmtree(p, ignore_errors=True)


def publish(tmp: AnyPath, dst: AnyPath, last: tuple[str, ...] = ()) -> None:
  """Makes the complete directory ``tmp`` into ``dst`` (which must not exist). Locally one
  rename. An object store has no renames: every object is copied under ``dst`` (a copy inside the
  store) and ``tmp`` removed; the files named in ``last`` (paths inside ``tmp``, the ones that
  make the directory valid to its readers) are copied after all the others, so ``dst`` is never
  a valid but incomplete directory; a copy that fails removes what it put under ``dst``."""
  if not is_remote(dst):
    os.replace(tmp, dst)
    return
  fs, head = _fs(tmp), str(tmp).rstrip("/") + "/"
  files = [str(f)[len(head):] for f in files_under(tmp)]
  order = [f for f in files if f not in last] + [f for f in last if f in files]
  try:
    for rel in order:
      fs.copy(head + rel, str(dst).rstrip("/") + "/" + rel)
  except BaseException:
    rmtree(dst)
    raise
  rmtree(tmp)
