"""Text with image markers -> token ids with runs of placeholders, and the images' vision items.

Shared by the data workers (:mod:`k3jax.vision_data`), the server (:mod:`k3jax.serve.api`) and
the engine's prefix cache (:func:`prefix_keys`); NumPy only (no grain, no JAX). An image is one
:class:`k3jax.vision.VisionItem`; a video (``[F, H, W, 3]`` frames) one item per chunk of
``cfg.pos_emb_frames`` frames. Each item stands in the token sequence as ``item.num_tokens``
copies of ``cfg.image_token_id``, in order.
"""

from __future__ import annotations

import hashlib

import numpy as np

from k3jax import vision
from k3jax.config import VisionConfig

# training batches carry k3jax.vision.batch's arrays under these keys: vision_<name>
VISION_PREFIX = "vision_"


def batch_vision(batch: dict) -> dict | None:
  """The vision arrays of a training batch (keys without :data:`VISION_PREFIX`), or None."""
  out = {k[len(VISION_PREFIX):]: v for k, v in batch.items() if k.startswith(VISION_PREFIX)}
  return out or None


def preprocess(pixels: np.ndarray, cfg: VisionConfig) -> list[vision.VisionItem]:
  """The items of an image (one) or a video (one per chunk of ``cfg.pos_emb_frames`` frames,
  each with its own run of placeholders)."""
  if isinstance(pixels, np.ndarray) and pixels.ndim == 4:
    return [vision.preprocess(chunk, cfg) for chunk in vision.video_chunks(pixels, cfg)]
  return [vision.preprocess(pixels, cfg)]


def interleave(pieces: list[list[int] | np.ndarray], per_image: list[list[vision.VisionItem]],
               image_token_id: int) -> tuple[np.ndarray, list[tuple[int, int]],
                                             list[vision.VisionItem]]:
  """Token ids of the text pieces between images (``len(per_image) + 1`` of them) with each
  image's placeholder runs between them -> (ids ``[n]`` int32, (start, length) of each item's
  run, the items in order)."""
  if len(pieces) != len(per_image) + 1:
    raise ValueError(f"{len(pieces)} text pieces for {len(per_image)} images")
  out, spans, items, at = [], [], [], 0
  for k, piece in enumerate(pieces):
    for item in per_image[k - 1] if k else ():
      spans.append((at, item.num_tokens))
      items.append(item)
      out.append(np.full(item.num_tokens, image_token_id, np.int32))
      at += item.num_tokens
    out.append(np.asarray(piece, np.int32).reshape(-1))
    at += len(out[-1])
  return np.concatenate(out) if out else np.zeros(0, np.int32), spans, items


def digest(item: vision.VisionItem) -> str:
  """A hash of an item's patches and grid: equal for the same pixels, different otherwise."""
  h = hashlib.sha256(np.ascontiguousarray(item.patches).tobytes())
  h.update(repr(item.grid).encode())
  return h.hexdigest()


def prefix_keys(prompt, items: list[vision.VisionItem], image_token_id: int) -> list:
  """Per prompt position, what the prefix cache keys it by: the token id, or for a placeholder
  ``(digest of its item, index within the item)`` (the placeholder ids are all the same: two
  prompts share a cached prefix only where their images are equal too). ``items`` fill the
  placeholders in order."""
  keys = [int(t) for t in prompt]
  tags = [(digest(item), j) for item in items for j in range(item.num_tokens)]
  at = iter(tags)
  for p, t in enumerate(keys):
    if t == image_token_id:
      keys[p] = next(at)
  return keys
