"""Image-text training data: interleaved documents -> packed rows with their vision arrays.

Used by :class:`k3jax.data.Data` when ``model.vision`` is set. Documents:

- ``data.source: synthetic_images``: shapes and digits with captions rendered on the fly
  (:mod:`k3jax.synthetic_images`), nothing on disk.
- JSONL, one document per line: ``{"text": "a <image> b", "images": ["a.png", ...]}`` (paths
  relative to the JSONL file; an entry that is a list of paths is one video of those frames; an
  animated GIF/WebP is a video of its frames), or a chat ``{"messages": [{"role": "user",
  "content": [{"type": "text", "text": ...}, {"type": "image_url", "image_url": {"url":
  "a.png"}}]}, {"role": "assistant", "content": "..."}]}`` (``url`` a path or a data URL),
  rendered with the tokenizer's chat template; lines without images are text documents.
- WebDataset-style tar shards (``*.tar``): the files of one sample share a key (the name up to
  its first dot); its text is ``key.txt`` or the ``text`` field of ``key.json``, its images the
  ``key.*.png|jpg|jpeg|gif|webp|bmp`` files in name order (placed where the text's markers are,
  or before the text when it has none).
- Any text source of :mod:`k3jax.data` (text documents only: a vision model trains on text too).

``data.image_marker`` (``"<image>"``) marks where each image goes: a document needs one marker
per image, in order. Every line and sample is checked up front (JSON, fields, marker counts,
image files present), and a record that fails later (an image that does not decode or has too
many patches) raises :class:`~k3jax.data.DataError` naming the file and record: nothing corrupt
is trained on silently.

In the data workers (grain's read threads), a document becomes ``x = [bos] + ids + [eos]`` where
each image stands as ``num_tokens`` copies of ``model.vision.image_token_id`` (its visual tokens
after the pixel shuffle), its pixels decoded and cut into patches
(:func:`k3jax.vision.preprocess`). :class:`PackImages` packs documents into rows of ``seq_len``
tokens and at most ``data.max_patches`` patches: a document continues in the next row as a new
segment when the row is full, but an image's run of placeholders (and its patches) never splits
across rows. Targets that are placeholders get weight 0 (nothing to predict there); the text
after an image is trained normally. Rows carry the text batch's arrays ``[T]`` plus the vision
arrays of :func:`k3jax.vision.batch` padded to ``data.max_patches`` patches.
"""

from __future__ import annotations

import dataclasses
import json
import tarfile
from pathlib import Path
from typing import Any

import grain
import numpy as np

from k3jax import images as images_lib
from k3jax import storage, vision
from k3jax.config import Config
from k3jax.data import DataError, JsonlLines
from k3jax.tokenizer import Tokenizer, apply_chat_template
from k3jax.vision_prompt import VISION_PREFIX, interleave, preprocess

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp")
SYNTHETIC = "synthetic_images"


# ---------------------------------------------------------------------------------------------
# Documents and their images.


@dataclasses.dataclass(frozen=True)
class ImageRef:
  """One image file, or a member of a tar shard (``offset``/``size`` of its bytes), or the
  bytes of a data URL."""
  path: str
  offset: int = 0
  size: int = -1
  inline: bytes | None = None

  def read(self) -> bytes:
    if self.inline is not None:
      return self.inline
    p = storage.path(self.path)
    try:
      with p.open("rb") as f:
        if self.size < 0:
          return f.read()
        f.seek(self.offset)
        return f.read(self.size)
    except OSError as e:
      raise DataError(f"{self.path}: cannot read ({e.strerror or e})") from e


@dataclasses.dataclass(frozen=True)
class Document:
  """Text with one ``marker`` per image; ``images``: per image an :class:`ImageRef`, a tuple of
  them (a video's frames) or decoded pixels (``[H, W, 3]`` or ``[F, H, W, 3]`` uint8);
  ``where`` names the record in errors."""
  text: str
  images: tuple = ()
  where: str = ""

  def __len__(self) -> int:  # the sources' ``sizes``: 0 only for an empty document
    return len(self.text) + len(self.images)


def load_pixels(image, max_pixels: int) -> np.ndarray:
  """``[H, W, 3]`` (an image) or ``[F, H, W, 3]`` (a video) uint8 of one document image."""
  if isinstance(image, np.ndarray):
    return image
  if isinstance(image, tuple):
    return images_lib.stack_frames([images_lib.decode(f.read(), max_pixels=max_pixels)
                                    for f in image])
  return images_lib.decode_media(image.read(), max_pixels=max_pixels)


def _check_markers(text: str, n_images: int, marker: str, where: str) -> None:
  n = text.count(marker)
  if n != n_images:
    raise DataError(f"{where}: the text holds {n} image markers {marker!r} for {n_images} images")


def _image_ref(entry, base: storage.AnyPath, where: str) -> ImageRef:
  if not isinstance(entry, str) or not entry:
    raise DataError(f"{where}: an image must be a path or data URL string, got {entry!r:.60}")
  if entry.startswith("data:"):
    try:
      return ImageRef(where, inline=images_lib.url_bytes(entry))
    except images_lib.ImageError as e:
      raise DataError(f"{where}: {e}") from None
  if entry.startswith(("http://", "https://")):
    raise DataError(f"{where}: image {entry!r:.80} is a web URL; training reads local or "
                    "object-store paths (download it first)")
  path = storage.path(entry) if storage.is_remote(entry) or Path(entry).is_absolute() \
      else base / entry
  if not storage.is_remote(path) and not Path(path).is_file():
    raise DataError(f"{where}: image file {path} does not exist")
  return ImageRef(str(path))


def _chat_document(messages, marker: str, base, where: str, tokenizer: Tokenizer) -> Document:
  """A chat with image parts -> its text through the chat template (turn after turn, each
  assistant reply appended after the prompt that leads to it), markers where the images were."""
  if not isinstance(messages, list) or not messages:
    raise DataError(f"{where}: 'messages' must be a non-empty list")
  flat, refs = [], []
  for m in messages:
    content = m.get("content") if isinstance(m, dict) else None
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
      raise DataError(f"{where}: every message needs a string 'role', got {m!r:.80}")
    if isinstance(content, str):
      flat.append({"role": m["role"], "content": content})
      continue
    if not isinstance(content, list):
      raise DataError(f"{where}: a message's 'content' must be text or a list of parts")
    text = ""
    for part in content:
      kind = part.get("type") if isinstance(part, dict) else None
      if kind == "text" and isinstance(part.get("text"), str):
        text += part["text"]
      elif kind == "image_url" and isinstance(part.get("image_url"), dict):
        refs.append(_image_ref(part["image_url"].get("url"), base, where))
        text += marker
      else:
        raise DataError(f"{where}: unsupported content part {part!r:.80} (text or image_url)")
    flat.append({"role": m["role"], "content": text})
  text, done = "", 0
  for i, m in enumerate(flat):
    if m["role"] == "assistant":
      text = apply_chat_template(tokenizer, flat[:i]) + m["content"]
      done = i + 1
  if done < len(flat):  # trailing turns without a reply: their prompt text
    text = apply_chat_template(tokenizer, flat)
  _check_markers(text, len(refs), marker, where)
  return Document(text, tuple(refs), where)


class ImageTextLines(JsonlLines):
  """One :class:`Document` per non-empty line of JSONL files (see the module docstring), every
  line checked up front as :class:`k3jax.data.JsonlLines` does."""

  def __init__(self, paths, *, text_field: str, marker: str, tokenizer: Tokenizer):
    self.marker, self.tokenizer = marker, tokenizer
    super().__init__(paths, text_field)

  def _parse(self, line: bytes, path, where: str) -> Document:
    try:
      record = json.loads(line)
    except ValueError as e:
      raise DataError(f"{where}: not a JSON line ({e})") from e
    if not isinstance(record, dict):
      raise DataError(f"{where}: not a JSON object")
    if "messages" in record:
      return _chat_document(record["messages"], self.marker, path.parent, where, self.tokenizer)
    text = record.get(self.field)
    if not isinstance(text, str):
      raise DataError(f"{where}: no string field {self.field!r} (data.text_field) or "
                      f"'messages'; fields: {sorted(record)}")
    entries = record.get("images") or []
    if not isinstance(entries, list):
      raise DataError(f"{where}: 'images' must be a list")
    refs = tuple(tuple(_image_ref(f, path.parent, where) for f in e) if isinstance(e, list)
                 else _image_ref(e, path.parent, where) for e in entries)
    _check_markers(text, len(refs), self.marker, where)
    return Document(text, refs, where)


class TarShards:
  """One :class:`Document` per sample of WebDataset-style tar files (see the module docstring);
  the members are indexed up front (remote shards copied to a local cache first)."""
  skipped: list = []

  def __init__(self, paths, *, text_field: str, marker: str):
    self.text_field, self.marker = text_field, marker
    self.samples: list[tuple[str, str, dict[str, tuple[int, int]]]] = []
    self.keys, self.sizes = [], []
    for p in paths:
      local = storage.local_copy(p)
      try:
        with tarfile.open(local, "r:") as tar:
          groups: dict[str, dict[str, tuple[int, int]]] = {}
          for m in tar:
            if m.isfile():
              head, _, tail = m.name.rpartition("/")
              key, dot, ext = tail.partition(".")
              if dot:
                groups.setdefault(f"{head}/{key}" if head else key, {})[ext.lower()] = (
                    m.offset_data, m.size)
      except (OSError, tarfile.TarError) as e:
        raise DataError(f"{p}: cannot read as a tar shard ({e})") from e
      for key, members in groups.items():
        where = f"{p}:{key}"
        if "txt" not in members and "json" not in members:
          raise DataError(f"{where}: the sample has no {key}.txt or {key}.json text")
        self.samples.append((str(local), where, members))
        self.keys.append(f"{Path(str(p)).name}:{key}")
        self.sizes.append(sum(s for _, s in members.values()))

  def __len__(self) -> int:
    return len(self.samples)

  def __getitem__(self, i: int) -> Document:
    path, where, members = self.samples[i]
    read = lambda ext: ImageRef(path, *members[ext]).read()
    if "json" in members:
      try:
        record = json.loads(read("json"))
      except ValueError as e:
        raise DataError(f"{where}.json: not JSON ({e})") from e
      text = record.get(self.text_field) if isinstance(record, dict) else None
      if not isinstance(text, str):
        raise DataError(f"{where}.json: no string field {self.text_field!r} (data.text_field)")
    else:
      try:
        text = read("txt").decode("utf-8")
      except UnicodeDecodeError as e:
        raise DataError(f"{where}.txt: not UTF-8 text ({e})") from e
    exts = sorted(e for e in members if f".{e}".endswith(IMAGE_SUFFIXES))
    refs = tuple(ImageRef(path, *members[e]) for e in exts)
    if refs and self.marker not in text:
      text = self.marker * len(refs) + text
    _check_markers(text, len(refs), self.marker, where)
    return Document(text, refs, where)


def open_source(cfg: Config, files, tokenizer: Tokenizer):
  """The image-text source of ``data.source`` (``files``: its data files), or None when it is a
  text source :func:`k3jax.data.open_source` reads."""
  d = cfg.data
  if d.source == SYNTHETIC:
    from k3jax.synthetic_images import SyntheticImages
    v = cfg.model.vision
    return SyntheticImages(seed=d.seed, marker=d.image_marker,
                           grid=v.patch_size * max(v.merge_kernel))
  if files and all(f.suffix == ".tar" for f in files):
    return TarShards(files, text_field=d.text_field, marker=d.image_marker)
  if files and all(f.suffix == ".jsonl" for f in files):
    return ImageTextLines(files, text_field=d.text_field, marker=d.image_marker,
                          tokenizer=tokenizer)
  return None


# ---------------------------------------------------------------------------------------------
# Workers: document -> ids with placeholder runs and the images' patches.


class EncodeImages:
  """Document -> ``{"input_ids", "targets", "weights": [n], "spans": [k, 2] (start, length of
  each image's placeholder run in input_ids), "items": [VisionItem]}``; text documents (str or
  pre-tokenised ids) have no images."""

  def __init__(self, tokenizer: Tokenizer, cfg: Config):
    self.tokenizer = tokenizer
    self.vision, self.marker = cfg.model.vision, cfg.data.image_marker
    self.bos, self.eos = cfg.model.bos_token_id, cfg.model.eos_token_id

  def __call__(self, doc) -> dict[str, Any]:
    if isinstance(doc, np.ndarray):
      pieces, pics, where = [doc.astype(np.int32)], [], "a pre-tokenised document"
    else:
      if isinstance(doc, str):
        doc = Document(doc)
      elif isinstance(doc, dict):  # the synthetic set
        doc = Document(doc["text"], tuple(doc["images"]), doc.get("where", "synthetic"))
      _check_markers(doc.text, len(doc.images), self.marker, doc.where)
      texts = doc.text.split(self.marker)
      pieces = [np.asarray(self.tokenizer.encode(t), np.int32) for t in texts]
      pics, where = doc.images, doc.where
    per_image = []  # the items of each image: one, or a video's chunks
    for k, image in enumerate(pics):
      try:
        per_image.append(preprocess(load_pixels(image, self.vision.max_pixels), self.vision))
      except (vision.VisionError, images_lib.ImageError) as e:
        raise DataError(f"{where}: image {k}: {e}") from None
    body, spans, items = interleave(pieces, per_image, self.vision.image_token_id)
    x = np.concatenate([[self.bos], body, [self.eos]]).astype(np.int32)
    targets = x[1:]
    return {"input_ids": x[:-1], "targets": targets,
            "weights": (targets != self.vision.image_token_id).astype(np.float32),
            "spans": np.asarray(spans, np.int32).reshape(-1, 2) + np.int32([1, 0]), "items": items,
            "where": where}


# ---------------------------------------------------------------------------------------------
# Packing that keeps images whole.


class PackImages(grain.IterDataset):
  """Encoded documents -> rows of ``seq_len`` tokens and at most ``max_patches`` patches (see
  the module docstring), each ``{"input_ids", "targets", "segment_ids", "positions", "weights":
  [seq_len], "items": [VisionItem]}``; ``pad`` fills the rest of a row."""

  def __init__(self, parent: grain.IterDataset, seq_len: int, max_patches: int, pad: int):
    super().__init__(parent)
    self.seq_len, self.max_patches, self.pad = seq_len, max_patches, pad

  def __iter__(self):
    return _PackIterator(self._parent.__iter__(), self.seq_len, self.max_patches, self.pad)


class _PackIterator(grain.DatasetIterator):
  """The state is where the next row starts: the parent's state before the document that opens
  it, and the token offset inside that document; restoring re-reads from there."""

  def __init__(self, parent, seq_len: int, max_patches: int, pad: int):
    super().__init__(parent)
    self.seq_len, self.max_patches, self.pad = seq_len, max_patches, pad
    self._doc, self._doc_state, self._cursor = None, None, 0

  def _next_doc(self):
    self._doc_state = self._parent.get_state()
    self._doc, self._cursor = next(self._parent), 0

  def get_state(self) -> dict:
    if self._doc is None or self._cursor >= len(self._doc["input_ids"]):
      return {"parent": self._parent.get_state(), "cursor": 0}
    return {"parent": self._doc_state, "cursor": self._cursor}

  def set_state(self, state: dict) -> None:
    self._parent.set_state(state["parent"])
    self._doc = None
    if state["cursor"]:
      self._next_doc()
      self._cursor = state["cursor"]

  def __next__(self) -> dict[str, Any]:
    t = self.seq_len
    row = {k: np.zeros(t, np.int32) for k in ("input_ids", "targets", "segment_ids", "positions")}
    row["input_ids"][:], row["targets"][:] = self.pad, self.pad
    row["weights"] = np.zeros(t, np.float32)
    items, fill, patches, segment = [], 0, 0, 0
    while fill < t:
      if self._doc is None or self._cursor >= len(self._doc["input_ids"]):
        self._next_doc()
      doc, c = self._doc, self._cursor
      n = len(doc["input_ids"])
      take = min(t - fill, n - c)
      ahead = [(k, s, m) for k, (s, m) in enumerate(doc["spans"]) if s + m > c and s < c + take]
      for k, s, m in ahead:  # images within reach: whole, and within the patch budget
        p = doc["items"][k].num_patches
        if s + m > c + take or patches + p > self.max_patches:
          take = s - c
          break
        patches += p
        items.append(doc["items"][k])
      if take == 0:
        if fill == 0:
          k, s, m = ahead[0]
          raise DataError(f"{doc['where']}: image {k} ({m} visual tokens, "
                          f"{doc['items'][k].num_patches} patches) cannot fit one row of "
                          f"{t} tokens and {self.max_patches} patches (data.seq_len, "
                          "data.max_patches)")
        break
      segment += 1
      sl = slice(fill, fill + take)
      for key in ("input_ids", "targets", "weights"):
        row[key][sl] = doc[key][c:c + take]
      row["segment_ids"][sl] = segment
      row["positions"][sl] = np.arange(take)
      fill += take
      self._cursor = int(c + take)
    row["items"] = items
    return row


def row_patches(cfg: Config) -> int:
  """Vision patches of one packed row: ``data.max_patches``, or ``model.vision.max_patches``;
  0 when the rows carry no images (a text model, or SFT's chat data)."""
  if cfg.model.vision is None or cfg.train.mode == "sft":
    return 0
  return cfg.data.max_patches or cfg.model.vision.max_patches


class RowArrays:
  """A packed row -> its text arrays and the vision arrays of its images
  (:func:`k3jax.vision.batch`, padded to ``max_patches`` patches)."""

  def __init__(self, cfg: Config):
    self.max_patches, self.vision = row_patches(cfg), cfg.model.vision

  def __call__(self, row: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {k: v for k, v in row.items() if k != "items"}
    arrays = vision.batch(row["items"], self.max_patches, cfg=self.vision)
    out.update({f"{VISION_PREFIX}{k}": v[0] for k, v in arrays.items()})
    return out
