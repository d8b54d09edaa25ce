"""Packing: several :class:`~k3jax.vision.preprocess.VisionItem` into the tower's static arrays.

``batch(rows, max_patches)`` lays each batch row's items (the images of that row's text, in the
order their placeholders appear) one after the other in ``max_patches`` patch slots; the rest
is padding (segment id 0), which attends to nothing and yields no visual token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from k3jax.config import VisionConfig
from k3jax.vision.preprocess import VisionItem
from k3jax.vision.resize import VisionError

# the arrays of :func:`batch`, the tower's input
ARRAY_NAMES = ("patches", "positions", "times", "pos_rows", "pos_row_weights", "pos_cols",
               "pos_col_weights", "segment_ids", "frame_ids", "temporal_ids", "temporal_order",
               "token_ids", "num_tokens")


def _row(items: Sequence[VisionItem], max_patches: int, width: int,
         merge: int) -> dict[str, np.ndarray]:
  n = sum(it.num_patches for it in items)
  if n > max_patches:
    raise VisionError(f"{len(items)} images of {n} patches in one row, over max_patches="
                      f"{max_patches}")
  out = {
      "patches": np.zeros((max_patches, width), np.float32),
      "positions": np.zeros((max_patches, 2), np.int32),
      "times": np.full((max_patches,), -1, np.int32),
      "pos_rows": np.zeros((max_patches, 4), np.int32),
      "pos_row_weights": np.zeros((max_patches, 4), np.float32),
      "pos_cols": np.zeros((max_patches, 4), np.int32),
      "pos_col_weights": np.zeros((max_patches, 4), np.float32),
      "segment_ids": np.zeros((max_patches,), np.int32),
      "frame_ids": np.zeros((max_patches,), np.int32),
      "temporal_ids": np.zeros((max_patches,), np.int32),
      "temporal_order": np.arange(max_patches, dtype=np.int32),
      "token_ids": np.full((max_patches // merge,), max_patches // merge, np.int32),
      "num_tokens": np.int32(sum(it.num_tokens for it in items)),
  }
  start, frame_id, position_id, token0 = 0, 0, 0, 0
  for i, it in enumerate(items):
    end = start + it.num_patches
    s = slice(start, end)
    frames = it.grid[0]
    for key in ("patches", "pos_rows", "pos_row_weights", "pos_cols", "pos_col_weights"):
      out[key][s] = getattr(it, key)
    t = it.positions[:, 0]
    out["positions"][s] = it.positions[:, 1:]
    out["times"][s] = t if frames > 1 else -1
    out["segment_ids"][s] = i + 1
    out["frame_ids"][s] = frame_id + 1 + t
    # temporal pass: the frames of one patch position next to each other
    per_frame = it.num_patches // frames
    order = np.arange(it.num_patches).reshape(frames, per_frame).T.ravel()
    out["temporal_order"][s] = start + order
    out["temporal_ids"][s] = position_id + 1 + np.repeat(np.arange(per_frame), frames)
    out["token_ids"][start // merge:end // merge] = token0 + it.tokens[::merge]
    start, frame_id, position_id = end, frame_id + frames, position_id + per_frame
    token0 += it.num_tokens
  return out


def batch(items: Sequence[VisionItem] | Sequence[Sequence[VisionItem]], max_patches: int, *,
          cfg: VisionConfig | None = None) -> dict[str, np.ndarray]:
  """The tower's input for ``B`` batch rows: ``items`` is one row's items, or a sequence of
  rows (one sequence of items per text row, possibly empty; ``cfg`` is needed when no row has an
  item, for the patch size). Every array has a leading ``[B]``
  (``P = max_patches``, ``M = P / merge``, ``merge = kh * kw``):

  - ``patches`` ``[B, P, C*p*p]`` float32; ``positions`` ``[B, P, 2]`` int32 (patch row,
    column: the 2D rotary embedding); ``times`` ``[B, P]`` int32 (frame of a video chunk, -1 for
    images: the temporal embedding);
  - ``pos_rows``/``pos_cols`` ``[B, P, 4]`` int32 and ``pos_row_weights``/``pos_col_weights``
    ``[B, P, 4]`` float32 (the learned grid's interpolation taps);
  - ``segment_ids`` ``[B, P]`` int32: the item (1-based, 0 padding), joint attention;
    ``frame_ids``: the frame, spatial attention; ``temporal_order`` (a permutation that puts a
    position's frames together) with ``temporal_ids`` (segments in that order), temporal
    attention;
  - ``token_ids`` ``[B, M]`` int32: the row's visual token each ``merge``-patch group feeds
    (groups of one position in several frames are averaged when ``temporal_pool``; ``M`` for
    padding); ``num_tokens`` ``[B]`` int32: the row's visual tokens.
  """
  if max_patches <= 0:
    raise VisionError(f"max_patches must be positive, got {max_patches}")
  rows = [items] if not items or isinstance(items[0], VisionItem) else items
  shapes = {(it.patches.shape[1], it.merge) for row in rows for it in row}
  if cfg is not None:
    shapes.add((cfg.channels * cfg.patch_size ** 2, cfg.merge))
  if len(shapes) != 1:
    raise VisionError("items preprocessed with different vision configs in one batch" if shapes
                      else "a batch without items needs cfg (the patch size and merge kernel)")
  width, merge = shapes.pop()
  if max_patches % merge:
    raise VisionError(f"max_patches={max_patches} must be a multiple of the merge kernel's "
                      f"{merge} patches")
  packed = [_row(row, max_patches, width, merge) for row in rows]
  return {k: np.stack([p[k] for p in packed]) for k in packed[0]}
