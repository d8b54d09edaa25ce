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
  file: Path
  offset: int  # absolute byte offset of the data in the file

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * ST_DTYPES[self.dtype].itemsize


class SafetensorsReader:
  """Tensors of an HF directory (``model.safetensors`` or a sharded ``*.index.json`` set)."""

  def __init__(self, directory: str | Path):
    self.dir = Path(directory)
    index = self.dir / "model.safetensors.index.json"
    if index.is_file():
      weight_map = json.loads(index.read_text())["weight_map"]
      files = sorted(set(weight_map.values()))
    else:
      files = sorted(p.name for p in self.dir.glob("*.safetensors"))
    if not files:
      raise ConversionError(f"{self.dir}: no *.safetensors files")
    self.tensors: dict[str, TensorInfo] = {}
    for fname in files:
      path = self.dir / fname
      if not path.is_file():
        raise ConversionError(f"{index}: shard {fname} is missing")
      with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
      header.pop("__metadata__", None)
      for name, h in header.items():
        if h["dtype"] not in ST_DTYPES:
          raise ConversionError(f"{name}: unsupported safetensors dtype {h['dtype']}")
        self.tensors[name] = TensorInfo(name, h["dtype"], tuple(h["shape"]), path,
                                        8 + n + h["data_offsets"][0])
    self._fds: dict[Path, int] = {}

  def close(self):
    for fd in self._fds.values():
      os.close(fd)
    self._fds.clear()

  def _pread(self, info: TensorInfo, start: int, nbytes: int) -> bytearray:
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
      self._fh = open(self.dir / fname, "wb")
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
