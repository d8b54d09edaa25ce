"""Pixels to patches: ``preprocess(pixels, cfg) -> VisionItem`` (NumPy and Pillow, no JAX).

Runs where images are decoded (data workers, the server). The steps are the reference
processor's: bicubic resize (Pillow) to the size of :func:`k3jax.vision.resize.resize_plan`, zero
padding right and bottom, ``(x / 255 - mean) / std`` in float32, patches of
``channels x patch x patch`` values. The patches of each frame are stored in merge-block order
(block row, block column, then the ``kh x kw`` patches of the block), so that each run of
``kh * kw`` patches is one visual token's group; attention does not depend on the order, since
every patch carries its own position.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from k3jax.config import VisionConfig
from k3jax.vision.pos_taps import interpolation_taps
from k3jax.vision.resize import VisionError, resize_plan


@dataclasses.dataclass(frozen=True)
class VisionItem:
  """One image or video chunk, ready to pack (:func:`k3jax.vision.packing.batch`).

  ``N`` patches in merge-block order, frame after frame (see the module docstring)."""
  patches: np.ndarray  # [N, channels * patch * patch] float32, each patch as (channel, row, col)
  positions: np.ndarray  # [N, 3] int32: (frame, patch row, patch column)
  pos_rows: np.ndarray  # [N, 4] int32: learned-grid rows the patch's embedding interpolates
  pos_row_weights: np.ndarray  # [N, 4] float32
  pos_cols: np.ndarray  # [N, 4] int32
  pos_col_weights: np.ndarray  # [N, 4] float32
  tokens: np.ndarray  # [N] int32: the visual token (0-based, within the item) the patch feeds
  grid: tuple[int, int, int]  # (frames, patch rows, patch columns)
  num_tokens: int  # visual tokens the language model sees
  merge: int  # patches per visual token group (kh * kw)

  @property
  def num_patches(self) -> int:
    return self.patches.shape[0]


def video_chunks(frames: np.ndarray, cfg: VisionConfig) -> list[np.ndarray]:
  """``[F, H, W, C]`` frames cut into chunks of at most ``cfg.pos_emb_frames`` frames, each one
  :class:`VisionItem` (K2.5 samples a video into chunks of 4 frames, each with its own
  placeholder run)."""
  n = cfg.pos_emb_frames
  return [frames[i:i + n] for i in range(0, frames.shape[0], n)]


# K3's processor puts transparent images on a chessboard of 8-pixel squares, white (255) at the
# top left and grey (180), after resizing
_SQUARE, _WHITE, _GREY = 8, 255, 180


def _check_pixels(pixels, cfg: VisionConfig) -> np.ndarray:
  if not isinstance(pixels, np.ndarray):
    raise VisionError(f"pixels must be a NumPy uint8 array, got {type(pixels).__name__}")
  if pixels.dtype != np.uint8:
    raise VisionError(f"pixels must be uint8 (0-255), got {pixels.dtype}")
  rgba = cfg.channels == 3 and pixels.ndim in (3, 4) and pixels.shape[-1] == 4
  if pixels.ndim not in (3, 4) or (pixels.shape[-1] != cfg.channels and not rgba):
    raise VisionError(f"pixels must be [H, W, {cfg.channels}] (image) or [F, H, W, "
                      f"{cfg.channels}] (video frames), RGBA allowed, got shape "
                      f"{list(pixels.shape)}")
  return pixels if pixels.ndim == 4 else pixels[None]


def _on_chessboard(rgba: np.ndarray) -> np.ndarray:
  """``[H, W, 4]`` uint8 composited onto the chessboard: ``a * rgb + (1 - a) * board`` in
  float32, truncated to uint8 (K3's processor)."""
  h, w = rgba.shape[:2]
  grey = (np.arange(h)[:, None] // _SQUARE + np.arange(w)[None, :] // _SQUARE) % 2 == 1
  board = np.where(grey, _GREY, _WHITE).astype(np.uint8)[..., None]
  a = rgba[..., 3:4].astype(np.float32) / 255.0
  return (a * rgba[..., :3] + (1.0 - a) * board).astype(np.uint8)


def _resize(frame: np.ndarray, width: int, height: int, alpha: str) -> np.ndarray:
  """One ``[H, W, 3 or 4]`` frame resized (Pillow bicubic; RGBA resamples premultiplied) to RGB
  ``[height, width, 3]``; transparency per ``alpha`` (VisionConfig.alpha)."""
  from PIL import Image
  if frame.shape[-1] == 4 and alpha == "drop":  # K2.5: converted to RGB before resizing
    frame = frame[..., :3]
  image = Image.fromarray(np.ascontiguousarray(frame))
  if image.size != (width, height):
    image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
  out = np.asarray(image)
  return out if out.shape[-1] == 3 else _on_chessboard(out)


def preprocess(pixels: np.ndarray, cfg: VisionConfig) -> VisionItem:
  """``pixels``: uint8 ``[H, W, C]`` (an image) or ``[F, H, W, C]`` (the frames of one video
  chunk, ``F <= cfg.pos_emb_frames``); RGBA (C = 4) is made RGB as ``cfg.alpha`` says.
  VisionError for a wrong dtype or shape, an empty input, too many frames, pixels or patches
  (:func:`k3jax.vision.resize.resize_plan`)."""
  frames = _check_pixels(pixels, cfg)
  f, h, w = frames.shape[:3]
  c = cfg.channels
  plan = resize_plan(h, w, cfg, f)
  resized = np.stack([_resize(x, plan.width, plan.height, cfg.alpha) for x in frames])
  resized = np.pad(resized, ((0, 0), (0, plan.pad_height), (0, plan.pad_width), (0, 0)))
  x = (resized / 255.0).astype(np.float32)
  x -= np.asarray(cfg.image_mean)
  x *= 1.0 / np.asarray(cfg.image_std)
  p = cfg.patch_size
  _, rows, cols = plan.grid
  # [F, rows, p, cols, p, C] -> [F, rows, cols, C, p, p]: the reference's patch order and layout
  x = x.reshape(f, rows, p, cols, p, c).transpose(0, 1, 3, 5, 2, 4)
  return from_patches(x.reshape(-1, c * p * p), plan.grid, cfg)


def from_patches(patches: np.ndarray, grid: tuple[int, int, int], cfg: VisionConfig) -> VisionItem:
  """A :class:`VisionItem` from normalised patches in the reference processor's layout:
  ``patches`` ``[F * rows * cols, C * p * p]`` (or ``[N, C, p, p]``) float32 in (frame, row,
  column) order, ``grid`` = (frames, rows, cols) (its ``pixel_values`` and ``grid_thws``)."""
  f, rows, cols = (int(g) for g in grid)
  (kh, kw), width = cfg.merge_kernel, cfg.channels * cfg.patch_size ** 2
  patches = np.asarray(patches, np.float32).reshape(-1, width)
  if patches.shape[0] != f * rows * cols or rows % kh or cols % kw or f > cfg.pos_emb_frames:
    raise VisionError(f"{patches.shape[0]} patches do not fit grid {list(grid)} (rows a multiple "
                      f"of {kh}, columns of {kw}, at most {cfg.pos_emb_frames} frames)")
  if max(rows, cols) > cfg.rope_max_grid:
    raise VisionError(f"grid {rows}x{cols}: the rotary table covers {cfg.rope_max_grid} patches "
                      "a side (model.vision.rope_max_grid)")
  if patches.shape[0] > cfg.max_patches:
    raise VisionError(f"{patches.shape[0]} patches, over model.vision.max_patches="
                      f"{cfg.max_patches}")
  # merge-block order: [F, rows/kh, kh, cols/kw, kw] -> [F, rows/kh, cols/kw, kh, kw]
  order = np.arange(f * rows * cols).reshape(f, rows // kh, kh, cols // kw, kw)
  order = order.transpose(0, 1, 3, 2, 4).ravel()
  t, row, col = np.unravel_index(order, (f, rows, cols))
  blocks = (rows // kh) * (cols // kw)
  block = (row // kh) * (cols // kw) + col // kw
  tokens = block if cfg.temporal_pool else t * blocks + block
  rows_idx, rows_w = interpolation_taps(rows, cfg.pos_emb_height, cfg.pos_emb_interpolation)
  cols_idx, cols_w = interpolation_taps(cols, cfg.pos_emb_width, cfg.pos_emb_interpolation)
  return VisionItem(
      patches=patches[order],
      positions=np.stack([t, row, col], axis=-1).astype(np.int32),
      pos_rows=rows_idx[row], pos_row_weights=rows_w[row],
      pos_cols=cols_idx[col], pos_col_weights=cols_w[col],
      tokens=tokens.astype(np.int32), grid=(f, rows, cols),
      num_tokens=blocks * (1 if cfg.temporal_pool else f), merge=cfg.merge)
