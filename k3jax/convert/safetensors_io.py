"""Safetensors files: a header-only index plus ``pread`` (no mmap, so bytes read never linger in
RSS) for reading, and a streaming shard writer."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from pathlib import Path
from typing import Sequence

import ml_dtypes
import numpy as np

from k3jax import storage
from k3jax.convert.errors import ConversionError


ST_DTYPES = {  # safetensors dtype name -> NumPy dtype
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
}
_NP_TO_ST = {v: k for k, v in ST_DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """Where one tensor's bytes lie in a safetensors file."""

  name: str
  dtype: str  # safetensors dtype name, e.g. "BF16"
  shape: tuple[int, ...]
  file: Path  # or an ``epath.Path`` URL (k3jax.storage)
  offset: int  # absolute byte offset of the data in the file

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * ST_DTYPES[self.dtype].itemsize


def _is_count(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _header_problems(raw: dict, data_len: int) -> list[str]:
  """Every way the entries of a parsed header disagree with a data section of ``data_len``
  bytes: unknown dtypes, bad shapes, offsets out of range, of the wrong length or overlapping."""
  problems, spans = [], []
  for name, h in raw.items():
    if name == "__metadata__":
      if not isinstance(h, dict):
        problems.append("__metadata__ is not an object")
      continue
    if not isinstance(h, dict):
      problems.append(f"{name}: entry is not an object")
      continue
    dt, shape, offs = h.get("dtype"), h.get("shape"), h.get("data_offsets")
    bad = []
    if not (isinstance(dt, str) and dt in ST_DTYPES):
      bad.append(f"dtype {dt!r} is not one of {sorted(ST_DTYPES)}")
    if not (isinstance(shape, list) and all(map(_is_count, shape))):
      bad.append(f"shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offs, list) and len(offs) == 2 and all(map(_is_count, offs))
            and offs[0] <= offs[1] <= data_len):
      bad.append(f"data_offsets {offs!r} are not [begin, end] within the {data_len} data bytes")
    elif not bad and offs[1] - offs[0] != math.prod(shape) * ST_DTYPES[dt].itemsize:
      bad.append(f"data_offsets {offs} hold {offs[1] - offs[0]} bytes, {dt}{shape} needs "
                 f"{math.prod(shape) * ST_DTYPES[dt].itemsize}")
    if bad:
      problems.append(f"{name}: " + "; ".join(bad))
    elif offs[1] > offs[0]:
      spans.append((offs[0], offs[1], name))
  spans.sort()
  for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
    if begin < end:
      problems.append(f"{b}: data_offsets overlap those of {a}")
  return problems


def read_header(path: Path) -> tuple[int, dict]:
  """(header length, header dict) of one safetensors file, checked against the file's size
  before it is read: raises :class:`ConversionError` listing every problem of the header."""
  size = storage.size(path)
  with path.open("rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise ConversionError(f"{path}: {size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > size - 8:
      raise ConversionError(f"{path}: header length {n} is beyond the file's {size} bytes")
    blob = f.read(n)
  try:
    raw = json.loads(blob)
  except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
    raise ConversionError(f"{path}: header is not valid JSON ({str(e)[:100]})") from None
  if not isinstance(raw, dict):
    raise ConversionError(f"{path}: header is a JSON {type(raw).__name__}, not an object")
  problems = _header_problems(raw, size - 8 - n)
  if problems:
    raise ConversionError(f"{path}: {len(problems)} header problems:\n  " + "\n  ".join(problems))
  raw.pop("__metadata__", None)
  return n, raw


def _shard_files(directory: Path) -> tuple[list[str], dict[str, str] | None]:
  """The safetensors files of ``directory`` and, for a sharded set, the index's weight map."""
  index = directory / "model.safetensors.index.json"
  if not index.is_file():
    return sorted(p.name for p in directory.glob("*.safetensors")), None
  try:
    weight_map = json.loads(index.read_text())["weight_map"]
  except (ValueError, KeyError, TypeError, RecursionError) as e:
    raise ConversionError(f"{index}: not an index with a weight_map ({e!r})") from None
  if not (isinstance(weight_map, dict) and all(
      isinstance(f, str) and f == Path(f).name and f.endswith(".safetensors")
      for f in weight_map.values())):
    raise ConversionError(f"{index}: weight_map must map names to *.safetensors files of "
                          f"{directory}")
  return sorted(set(weight_map.values())), weight_map


class SafetensorsReader:
  """Tensors of an HF directory (``model.safetensors`` or a sharded ``*.index.json`` set).

  Every header is validated against its file (:func:`read_header`) and the index against the
  headers before any tensor data is read; :class:`ConversionError` lists every problem."""

  def __init__(self, directory):
    self.dir = storage.path(directory)
    files, weight_map = _shard_files(self.dir)
    if not files:
      raise ConversionError(f"{self.dir}: no *.safetensors files")
    self.tensors: dict[str, TensorInfo] = {}
    problems = []
    for fname in files:
      path = self.dir / fname
      if not path.is_file():
        problems.append(f"shard {fname} is missing")
        continue
      try:
        n, header = read_header(path)
      except ConversionError as e:
        problems.append(str(e))
        continue
      for name, h in header.items():
        if name in self.tensors:
          problems.append(f"{name} is in both {self.tensors[name].file.name} and {fname}")
        elif weight_map is not None and weight_map.get(name) != fname:
          problems.append(f"{name} is in {fname}, the index says {weight_map.get(name)}")
        self.tensors[name] = TensorInfo(name, h["dtype"], tuple(h["shape"]), path,
                                        8 + n + h["data_offsets"][0])
    if weight_map is not None:
      problems += [f"{name}: in the index, not in {f}" for name, f in weight_map.items()
                   if name not in self.tensors]
    if problems:
      raise ConversionError(f"{self.dir}: the safetensors files are not consistent:\n  "
                            + "\n  ".join(problems))
    self._fds: dict[Path, int] = {}
    self._remote: dict[object, object] = {}  # file objects of remote shards

  def close(self):
    for fd in self._fds.values():
      os.close(fd)
    self._fds.clear()
    for f in self._remote.values():
      f.close()
    self._remote.clear()

  def _pread(self, info: TensorInfo, start: int, nbytes: int) -> bytearray:
    if storage.is_remote(info.file):  # ranged reads of the object
      f = self._remote.get(info.file) or self._remote.setdefault(info.file, info.file.open("rb"))
      f.seek(info.offset + start)
      buf = bytearray(f.read(nbytes))
      if len(buf) < nbytes:
        raise ConversionError(f"{info.file}: truncated while reading {info.name}")
      return buf
    fd = self._fds.get(info.file)
    if fd is None:
      fd = self._fds[info.file] = os.open(info.file, os.O_RDONLY)
    buf = bytearray(nbytes)
    view, done = memoryview(buf), 0
    while done < nbytes:
      got = os.preadv(fd, [view[done:]], info.offset + start + done)
      if got <= 0:
        raise ConversionError(f"{info.file}: truncated while reading {info.name}")
      done += got
    return buf

  def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
    """The tensor (or rows ``[r0, r1)`` of its first axis) as a NumPy array."""
    info = self.tensors[name]
    dt = ST_DTYPES[info.dtype]
    shape = info.shape
    row = math.prod(shape[1:]) * dt.itemsize if shape else dt.itemsize
    r0, r1 = rows if rows is not None else (0, shape[0] if shape else 1)
    data = np.frombuffer(self._pread(info, r0 * row, (r1 - r0) * row), dtype=dt)
    return data.reshape(((r1 - r0),) + shape[1:] if shape else ())


class SafetensorsWriter:
  """Streams tensors into ``model-XXXXX-of-YYYYY.safetensors`` shards plus the index json.

  ``plan`` fixes names, dtypes and shapes up front (headers are written first); ``write`` must
  then be called once per tensor, in plan order.
  """

  def __init__(self, directory: Path, plan: Sequence[tuple[str, str, tuple[int, ...]]],
               max_shard_bytes: int = 5 << 30):
    self.dir = directory
    shards, cur, size = [], [], 0
    for item in plan:
      nbytes = math.prod(item[2]) * ST_DTYPES[item[1]].itemsize
      if cur and size + nbytes > max_shard_bytes:
        shards.append(cur)
        cur, size = [], 0
      cur.append(item)
      size += nbytes
    shards.append(cur)
    self.files, self.order, self.weight_map = [], [], {}
    for i, shard in enumerate(shards):
      fname = (f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
               else "model.safetensors")
      header, off = {"__metadata__": {"format": "pt"}}, 0
      for name, dt, shape in shard:
        nbytes = math.prod(shape) * ST_DTYPES[dt].itemsize
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
        self.order.append((name, dt, tuple(shape), fname))
        self.weight_map[name] = fname
      blob = json.dumps(header, separators=(",", ":")).encode()
      blob += b" " * (-len(blob) % 8)
      self.files.append((fname, blob, off))
    self.total_bytes = sum(f[2] for f in self.files)
    self._next, self._fh, self._fname = 0, None, None

  def write(self, name: str, array: np.ndarray):
    self.write_rows(name, [array], array.shape[0] if array.ndim else None)

  def write_rows(self, name: str, blocks, rows: int | None):
    """Writes tensor ``name`` from consecutive row blocks (``rows`` in all; None for a scalar)."""
    exp_name, dt, shape, fname = self.order[self._next]
    if name != exp_name or (shape[0] if shape else None) != rows:
      raise ConversionError(f"writer: got {name} with {rows} rows, expected {exp_name} {list(shape)}")
    if fname != self._fname:
      if self._fh:
        self._fh.close()
      blob = next(b for f, b, _ in self.files if f == fname)
      self._fh = (self.dir / fname).open("wb")
      self._fh.write(struct.pack("<Q", len(blob)) + blob)
      self._fname = fname
    done = 0
    for block in blocks:
      if tuple(block.shape[1:]) != tuple(shape[1:]) or _NP_TO_ST.get(block.dtype) != dt:
        raise ConversionError(f"writer: {name} block {block.dtype}{list(block.shape)} does not fit "
                              f"{dt}{list(shape)}")
      self._fh.write(np.ascontiguousarray(block).tobytes())
      done += block.shape[0] if block.ndim else 1
    if done != (shape[0] if shape else 1):
      raise ConversionError(f"writer: {name} got {done} rows, expected {list(shape)}")
    self._next += 1

  def close(self):
    if self._fh:
      self._fh.close()
    if self._next != len(self.order):
      raise ConversionError(f"writer: {len(self.order) - self._next} tensors were never written")
    if len(self.files) > 1:
      index = {"metadata": {"total_size": self.total_bytes}, "weight_map": self.weight_map}
      (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
