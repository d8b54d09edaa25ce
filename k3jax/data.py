"""Training data: documents -> token ids -> packed rows, as a checkpointable grain pipeline.

Sources (``data.source``): ``"stdlib"`` (the ``.py`` files of this Python's standard library, the
embedded default), or a file, directory or glob of ``.txt``/``.py``/``.md`` text (one document per
file), ``.jsonl`` (one document per line, ``data.text_field``), ``.parquet`` (one document per row,
``data.text_field``) or ``.array_record`` (pre-tokenised: each record is one document's token ids
as little-endian int32 bytes; ``python -m k3jax.pretokenize`` writes them). Paths may be local or
object-store URLs (``gs://bucket/corpus/*.jsonl``, :mod:`k3jax.storage`).

Tokenizers (``data.tokenizer``, :mod:`k3jax.tokenizer`): ``"byte"`` (UTF-8 bytes 0-255), a HF
``tokenizer.json`` path, or a tiktoken-format BPE file (Kimi's ``tiktoken.model``).

Every document becomes ``x = [bos] + ids + [eos]``; its training pairs are ``x[:-1]`` (inputs) and
``x[1:]`` (targets), so no target ever belongs to another document. Pairs are concatenated and cut
into rows of ``seq_len`` (grain's concat-then-split packing): a document longer than the room left
in a row continues in the next row as a new segment. Batches are dicts of ``[B, T]`` arrays:
``input_ids``, ``targets`` (int32), ``segment_ids`` (1, 2, ... per document piece in the row, 0 on
padding), ``positions`` (position inside the piece) and ``weights`` (float32, 1 on real tokens, 0 on
padding).

A model with a vision tower (``model.vision``) reads image-text documents (the synthetic set,
JSONL with images or chats, tar shards) or text ones through :mod:`k3jax.vision_data`: packing
keeps each image's placeholders in one row, placeholder targets get weight 0, and the rows carry
their images' vision arrays as ``vision_<name>``.

The held-out split is decided per document by a hash of its key (relative file path, or
``file:line`` / ``file:row`` / ``file:record``), so it never changes with the shuffle seed.

Several processes (one per host of a pod): text, JSONL and Parquet sources are indexed whole on
every host, which then reads its own slice of the documents (``process_index::process_count``).
ArrayRecord shards are split by file instead: host ``p`` of ``P`` opens only the files
``p, p + P, ...`` of the sorted list (at least ``P`` files are needed), so start-up reads
nothing of the others' shards; remote shards are copied to a local cache first
(:func:`k3jax.storage.local_copy`: ArrayRecord reads local files).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sysconfig
from pathlib import Path
from typing import Any

import grain
import numpy as np

from k3jax import storage
from k3jax.config import Config, ConfigError
from k3jax.tokenizer import HFTokenizer, Tokenizer, make_tokenizer

TEXT_SUFFIXES = (".txt", ".py", ".md", ".text")
RECORD_SUFFIXES = (".jsonl", ".parquet", ".array_record")
# what k3jax.pretokenize writes beside its shards: counts, source, tokenizer and its vocab_size
PRETOKENIZED_MANIFEST = "pretokenize.json"


class DataError(ValueError):
  """A data path, format or tokenizer cannot be used."""


# ---------------------------------------------------------------------------------------------
# Tokenizers (k3jax.tokenizer) against the config's special ids.


def check_special_ids(cfg: Config, tokenizer: Tokenizer) -> None:
  """Refuses a ``model.{bos,eos,pad}_token_id`` (or ``model.vision.image_token_id``) that the
  tokenizer also gives to text: its ordinary ids are ``0 .. vocab_size - 1``, less the special
  added tokens of a ``tokenizer.json`` (which ordinary text never becomes)."""
  special: set[int] = set()
  if isinstance(tokenizer, HFTokenizer):
    with open(tokenizer.path) as f:
      special = {t["id"] for t in json.load(f).get("added_tokens", []) if t.get("special")}
  ids = {f"model.{name}": getattr(cfg.model, name)
         for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
  if cfg.model.vision is not None:
    ids["model.vision.image_token_id"] = cfg.model.vision.image_token_id
  for name, i in ids.items():
    if i < tokenizer.vocab_size and i not in special:
      raise ConfigError(f"{name}={i}: the tokenizer {cfg.data.tokenizer!r} gives id {i} to "
                        f"text (its ids are 0-{tokenizer.vocab_size - 1}); use an id it leaves "
                        "free (at least its vocab_size) or one of its special tokens")


def check_pretokenized_vocab(cfg: Config) -> None:
  """Refuses a directory of shards whose manifest (:data:`PRETOKENIZED_MANIFEST`) names a
  tokenizer with more ids than ``model.vocab_size``."""
  manifest = storage.path(cfg.data.source) / PRETOKENIZED_MANIFEST
  if not manifest.is_file():
    return
  written = json.loads(manifest.read_text())
  if written["vocab_size"] > cfg.model.vocab_size:
    raise DataError(f"data.source: {cfg.data.source!r} was tokenised by {written['tokenizer']!r}, "
                    f"{written['vocab_size']} ids, more than model.vocab_size="
                    f"{cfg.model.vocab_size}")


# ---------------------------------------------------------------------------------------------
# Document sources: random access (len, getitem) plus one stable key per document.


def _read(path: Path) -> bytes:
  try:
    return path.read_bytes()
  except OSError as e:
    raise DataError(f"{path}: cannot read ({e.strerror or e})") from e


def _utf8(raw: bytes) -> str | None:
  """``raw`` as text; None for bytes that are not text (a NUL byte, or not UTF-8)."""
  if b"\0" in raw:
    return None
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError:
    return None


class TextFiles:
  """One document per UTF-8 text file; keys are paths relative to ``root``. Every file is read
  once up front: an unreadable one is an error naming it, binary (or non-UTF-8) ones are left out
  and listed in ``skipped``; ``sizes`` are the documents' lengths in characters."""

  def __init__(self, paths: list[Path], root: Path):
    self.paths, self.sizes, self.skipped = [], [], []
    for p in paths:
      text = _utf8(_read(p))
      if text is None:
        self.skipped.append(p)
      else:
        self.paths.append(p)
        self.sizes.append(len(text))
    self.keys = [str(p.relative_to(root)) if p.is_relative_to(root) else str(p)
                 for p in self.paths]

  def __len__(self) -> int:
    return len(self.paths)

  def __getitem__(self, i: int) -> str:
    text = _utf8(_read(self.paths[i]))
    if text is None:
      raise DataError(f"{self.paths[i]}: no longer UTF-8 text (it changed after the start)")
    return text


class JsonlLines:
  """One document per non-empty line of JSONL files, read by byte offset. Every line is checked
  up front: one that is not a JSON object with a string ``field`` is an error naming
  ``file:line``; ``sizes`` are the documents' lengths in characters."""

  def __init__(self, paths: list[Path], field: str):
    self.field = field
    self.index: list[tuple[Path, int]] = []
    self.keys, self.sizes, self.skipped = [], [], []
    for p in paths:
      offset = 0
      try:
        with p.open("rb") as f:
          for n, line in enumerate(f):
            if line.strip():
              self.sizes.append(len(self._parse(line, p, f"{p}:{n + 1}")))
              self.index.append((p, offset))
              self.keys.append(f"{p.name}:{n}")
            offset += len(line)
      except OSError as e:
        raise DataError(f"{p}: cannot read ({e.strerror or e})") from e

  def _parse(self, line: bytes, path, where: str):
    """The document of one line of ``path`` (``where`` names it in errors)."""
    return self._text(line, where)

  def _text(self, line: bytes, where: str) -> str:
    try:
      record = json.loads(line)
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
      raise DataError(f"{where}: not a JSON line ({e})") from e
    if not isinstance(record, dict) or self.field not in record:
      fields = sorted(record) if isinstance(record, dict) else type(record).__name__
      raise DataError(f"{where}: no field {self.field!r} (data.text_field); fields: {fields}")
    if not isinstance(record[self.field], str):
      raise DataError(f"{where}: field {self.field!r} is {type(record[self.field]).__name__}, "
                      "not text")
    return record[self.field]

  def __len__(self) -> int:
    return len(self.index)

  def __getitem__(self, i: int) -> str:
    path, offset = self.index[i]
    with path.open("rb") as f:
      f.seek(offset)
      line = f.readline()
    return self._parse(line, path, f"{path} at byte {offset}")


def _parquet(path: storage.AnyPath):
  """``pyarrow.parquet.ParquetFile`` of a local path or a URL (through an fsspec file)."""
  import pyarrow.parquet as pq
  return pq.ParquetFile(path.open("rb") if storage.is_remote(path) else path)


class ParquetRows:
  """One document per row of the ``field`` column; reads one row group at a time (document sizes
are not known up front: ``sizes`` is None)."""
  sizes, skipped = None, []

  def __init__(self, paths: list[Path], field: str):
    self.field = field
    self.index: list[tuple[Path, int, int]] = []
    self.keys = []
    for p in paths:
      try:
        meta = _parquet(p)
      except Exception as e:  # OSError, or pyarrow's own errors for a file that is not Parquet
        raise DataError(f"{p}: cannot read as Parquet ({e})") from e
      if field not in meta.schema_arrow.names:
        raise DataError(f"{p}: no column {field!r} (data.text_field); columns: {meta.schema_arrow.names}")
      row = 0
      for g in range(meta.num_row_groups):
        for r in range(meta.metadata.row_group(g).num_rows):
          self.index.append((p, g, r))
          self.keys.append(f"{p.name}:{row}")
          row += 1
    self._cache: tuple[Any, list[str]] | None = None

  def __len__(self) -> int:
    return len(self.index)

  def __getitem__(self, i: int) -> str:
    path, group, row = self.index[i]
    if self._cache is None or self._cache[0] != (path, group):
      # a file opened per row group: grain's prefetch threads read at once, and a ParquetFile
      # shared between threads is not safe
      table = _parquet(path).read_row_group(group, columns=[self.field])
      self._cache = ((path, group), table.column(self.field).to_pylist())
    return self._cache[1][row]


class TokenRecords:
  """Pre-tokenised ArrayRecord files: each record is one document's int32 ids (document sizes are
not known up front: ``sizes`` is None); keys are ``file:record``. Only the files given are
opened (a host's own shards, see :func:`open_source`)."""
  sizes, skipped = None, []

  def __init__(self, paths: list[storage.AnyPath]):
    self._files, self.keys = [], []
    for p in paths:
      try:
        src = grain.sources.ArrayRecordDataSource([str(storage.local_copy(p))])
      except Exception as e:  # the library's errors name no file
        raise DataError(f"data.source: cannot read the ArrayRecord file {p} ({e})") from e
      self._files.append(src)
      self.keys += [f"{p.name}:{r}" for r in range(len(src))]
    self._ends = np.cumsum([len(f) for f in self._files])

  def __len__(self) -> int:
    return len(self.keys)

  def __getitem__(self, i: int) -> np.ndarray:
    f = int(np.searchsorted(self._ends, i, side="right"))
    record = self._files[f][i - (int(self._ends[f - 1]) if f else 0)]
    return np.frombuffer(record, dtype="<i4").astype(np.int32)


class Subset:
  """The documents of ``source`` at ``indices``."""

  def __init__(self, source, indices: list[int]):
    self.source, self.indices = source, indices

  def __len__(self) -> int:
    return len(self.indices)

  def __getitem__(self, i: int):
    return self.source[self.indices[i]]


def stdlib_files() -> tuple[list[Path], Path]:
  """The standard library's ``.py`` files, sorted by relative path (no site-packages)."""
  root = Path(sysconfig.get_paths()["stdlib"])
  files = [p for p in root.rglob("*.py")
           if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)]
  return sorted(files, key=lambda p: str(p.relative_to(root))), root


def _expand(source: str) -> tuple[list[storage.AnyPath], storage.AnyPath]:
  """(the data files of ``source``, a directory, file or glob; the directory their keys are
  relative to)."""
  p = storage.path(source)
  if p.is_dir():
    return [f for f in storage.files_under(p) if f.suffix in TEXT_SUFFIXES + RECORD_SUFFIXES], p
  files = storage.glob(source)
  if not files:
    return files, p
  root = files[0].parent
  while not all(f.is_relative_to(root) for f in files):
    root = root.parent
  return files, root


def open_source(source: str, text_field: str = "text", *, process_index: int = 0,
                process_count: int = 1):
  """The document source named by ``data.source`` (see the module docstring); of ArrayRecord
  files only those of process ``process_index`` of ``process_count``."""
  if source == "stdlib":
    files, root = stdlib_files()
    return TextFiles(files, root)
  files, root = _expand(source)
  if not files:
    raise DataError(f"data.source: no data files found at {source!r}")
  kinds = {f.suffix if f.suffix in RECORD_SUFFIXES else "text" for f in files}
  if len(kinds) > 1:
    raise DataError(f"data.source: {source!r} mixes file kinds {sorted(kinds)}; point it at one kind")
  kind = kinds.pop()
  if kind == ".jsonl":
    return JsonlLines(files, text_field)
  if kind == ".parquet":
    return ParquetRows(files, text_field)
  if kind == ".array_record":
    if len(files) < process_count:
      raise DataError(f"data.source: {source!r} holds {len(files)} ArrayRecord files for "
                      f"{process_count} processes, which read whole files each; write at least "
                      f"{process_count} shards (python -m k3jax.pretokenize SRC DST --shards N)")
    return TokenRecords(files[process_index::process_count])
  bad = [f for f in files if f.suffix not in TEXT_SUFFIXES]
  if bad:
    raise DataError(f"data.source: unsupported file type {bad[0].suffix!r} ({bad[0]}); "
                    f"expected {TEXT_SUFFIXES + RECORD_SUFFIXES}")
  return TextFiles(files, root)


def split_indices(keys: list[str], eval_fraction: float) -> tuple[list[int], list[int]]:
  """(train, eval) document indices: a document is held out when its key's hash falls below
  ``eval_fraction``; at least one document is held out when the fraction is positive."""
  h = [int.from_bytes(hashlib.sha1(k.encode()).digest()[:8], "big") / 2.0**64 for k in keys]
  held = {i for i, v in enumerate(h) if v < eval_fraction}
  if eval_fraction > 0 and not held and len(keys) > 1:
    held = {min(range(len(keys)), key=h.__getitem__)}
  train = [i for i in range(len(keys)) if i not in held]
  return train, sorted(held)


# ---------------------------------------------------------------------------------------------
# The pipeline.


class _Encode:
  """Document (text or ids) -> {"input_ids": x[:-1], "targets": x[1:]} with x = [bos] + ids + [eos]."""

  def __init__(self, tokenizer: Tokenizer, bos: int, eos: int):
    self.tokenizer, self.bos, self.eos = tokenizer, bos, eos

  def __call__(self, doc) -> dict[str, np.ndarray]:
    ids = doc if isinstance(doc, np.ndarray) else np.asarray(self.tokenizer.encode(doc), np.int32)
    x = np.concatenate([[self.bos], ids, [self.eos]]).astype(np.int32)
    return {"input_ids": x[:-1], "targets": x[1:]}


class _ToBatch:
  """grain's packed features -> the model's batch dict."""

  def __init__(self, pad: int):
    self.pad = pad

  def __call__(self, f: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    seg = f["input_ids_segment_ids"].astype(np.int32)
    real = seg > 0
    weights = real & (f["loss_mask"] > 0) if "loss_mask" in f else real  # SFT: assistant tokens
    return {
        "input_ids": np.where(real, f["input_ids"], self.pad).astype(np.int32),
        "targets": np.where(real, f["targets"], self.pad).astype(np.int32),
        "segment_ids": seg,
        "positions": f["input_ids_positions"].astype(np.int32),
        "weights": weights.astype(np.float32),
    }


class Data:
  """The documents, tokenizer and split of one config; builds per-stage grain pipelines."""

  def __init__(self, cfg: Config, *, process_index: int = 0, process_count: int = 1):
    m = cfg.model
    self.cfg = cfg
    self.tokenizer = make_tokenizer(cfg.data.tokenizer)
    if self.tokenizer.vocab_size > m.vocab_size:
      raise DataError(f"data.tokenizer: vocabulary of {self.tokenizer.vocab_size} ids does not fit "
                      f"model.vocab_size={m.vocab_size}")
    check_special_ids(cfg, self.tokenizer)
    from k3jax import vision_data  # image-text documents (it builds on this module's sources)
    self.sft = cfg.train.mode == "sft"
    self.vision = vision_data.row_patches(cfg) > 0
    if self.sft:  # conversations, trained on their assistant tokens (k3jax.posttrain.sft)
      from k3jax.posttrain import sft
      try:
        self.source = sft.Chats(cfg.data.source, [] if cfg.data.source == "builtin" else
                                _expand(cfg.data.source)[0], tasks=cfg.posttrain.tasks,
                                seed=cfg.data.seed)
      except sft.ChatError as e:
        raise DataError(str(e)) from e
    elif self.vision:  # image-text documents, or text ones (k3jax.vision_data)
      files = [] if cfg.data.source in ("stdlib", vision_data.SYNTHETIC) else \
          _expand(cfg.data.source)[0]
      self.source = vision_data.open_source(cfg, files, self.tokenizer) or open_source(
          cfg.data.source, cfg.data.text_field, process_index=process_index,
          process_count=process_count)
    elif cfg.data.source == vision_data.SYNTHETIC:
      raise DataError(f"data.source: {vision_data.SYNTHETIC} is image-text data; it needs a "
                      "model with a vision tower (model.vision)")
    else:
      self.source = open_source(cfg.data.source, cfg.data.text_field, process_index=process_index,
                                process_count=process_count)
    if isinstance(self.source, TokenRecords) and cfg.data.tokenizer != "byte":
      raise DataError("data.tokenizer: ArrayRecord sources are pre-tokenised; leave data.tokenizer as 'byte'")
    if isinstance(self.source, TokenRecords):
      check_pretokenized_vocab(cfg)
    if not len(self.source):
      raise DataError(f"data.source: {cfg.data.source!r} holds no documents"
                      + (f" ({len(self.source.skipped)} binary or non-UTF-8 files skipped)"
                         if self.source.skipped else ""))
    train, held = split_indices(self.source.keys, cfg.data.eval_fraction)
    if not self._text_in(train):
      raise DataError(f"data.source: {cfg.data.source!r} has no training text: "
                      + (f"its {len(train)} training documents are empty" if train else
                         f"no documents left after the held-out split (data.eval_fraction="
                         f"{cfg.data.eval_fraction})"))
    if cfg.train.eval_every and cfg.data.eval_fraction > 0 and not self._text_in(held):
      raise DataError(f"data.source: {cfg.data.source!r} leaves no held-out text for the eval "
                      f"every train.eval_every={cfg.train.eval_every} steps ({len(held)} held-out "
                      "documents, all empty); add documents, or set data.eval_fraction=0 or "
                      "train.eval_every=0")
    self.splits = {"train": train, "eval": held}
    self.process_index, self.process_count = process_index, process_count
    if cfg.train.batch_size % process_count:
      raise DataError(f"train.batch_size={cfg.train.batch_size} must be a multiple of the "
                      f"process count {process_count}")
    self.local_batch = cfg.train.batch_size // process_count
    if self.sft:
      from k3jax.posttrain.sft import ChatEncode
      self._encode = ChatEncode(self.tokenizer, m.bos_token_id, m.eos_token_id)
    elif self.vision:
      self._encode = vision_data.EncodeImages(self.tokenizer, cfg)
    else:
      self._encode = _Encode(self.tokenizer, m.bos_token_id, m.eos_token_id)
    self._to_batch = _ToBatch(m.pad_token_id)

  def _text_in(self, indices: list[int]) -> bool:
    """Whether the documents at ``indices`` hold any text (where sizes are known up front)."""
    sizes = self.source.sizes
    return bool(indices) and (sizes is None or any(sizes[i] for i in indices))

  def num_docs(self, split: str) -> int:
    return len(self.splits[split])

  def dataset(self, split: str, seq_len: int, *, seed: int = 0) -> grain.IterDataset:
    """Endless packed batches ``[local_batch, seq_len]``. Training reshuffles every epoch (seeded by
    ``seed``); eval cycles through the held-out documents in a fixed order. ``data.prefetch``
    batches are prepared ahead in a thread."""
    indices = self.splits[split]
    if not indices:
      raise DataError(f"no {split} documents (data.eval_fraction={self.cfg.data.eval_fraction})")
    ds = grain.MapDataset.source(Subset(self.source, indices))
    if not isinstance(self.source, TokenRecords):  # those hold this process's files only
      ds = ds[self.process_index::self.process_count]
    if len(ds) == 0:
      raise DataError(f"{split} split has {len(indices)} documents, fewer than the "
                      f"{self.process_count} processes")
    if split == "train" and self.cfg.data.shuffle:
      ds = ds.shuffle(seed=seed)
    ds = ds.repeat(None).map(self._encode).to_iter_dataset()
    if self.vision:  # images stay whole in a row; rows carry their vision arrays
      from k3jax import vision_data
      ds = vision_data.PackImages(ds, seq_len, vision_data.row_patches(self.cfg),
                                  self.cfg.model.pad_token_id)
      ds = ds.map(vision_data.RowArrays(self.cfg))
    else:
      ds = grain.experimental.ConcatThenSplitIterDataset(
          ds, length_struct={k: seq_len for k in ("input_ids", "targets")
                             + (("loss_mask",) if self.sft else ())})
      ds = ds.map(self._to_batch)
    ds = ds.batch(self.local_batch, drop_remainder=True)
    if self.cfg.data.prefetch:  # a background thread; the saved state stays that of the consumer
      ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=self.cfg.data.prefetch)
    return ds


# ---------------------------------------------------------------------------------------------
# Stages: [start, end) step ranges with their packing length.


@dataclasses.dataclass(frozen=True)
class Stage:
  index: int
  start: int
  end: int
  seq_len: int


def stages(cfg: Config) -> list[Stage]:
  """``train.stages`` as step ranges; the last stage runs to ``train.steps``. Without stages, one
  stage of ``data.seq_len``."""
  total = cfg.train.steps
  if not cfg.train.stages:
    return [Stage(0, 0, total, cfg.data.seq_len)]
  out, start = [], 0
  for i, s in enumerate(cfg.train.stages):
    last = i == len(cfg.train.stages) - 1
    end = max(total, start + s.steps) if last else start + s.steps
    out.append(Stage(i, start, end, s.seq_len))
    start = end
  return out


def stage_at(all_stages: list[Stage], step: int) -> Stage:
  """The stage that runs ``step`` (the last one past the end)."""
  return next((s for s in all_stages if s.start <= step < s.end), all_stages[-1])
