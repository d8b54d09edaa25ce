"""The reference processor's size rule: how an image or video chunk is scaled and padded.

An input of ``width x height`` pixels is scaled down (never up) until its patch count fits the
patch limit and each side fits ``side_limit`` patches, truncated to whole pixels, then padded
right and bottom with zero pixels to a multiple of ``patch_size * merge_kernel`` (Kimi K2.5's
``navit_resize_image``, reproduced in plain Python floats so the sizes agree to the pixel).
"""

from __future__ import annotations

import dataclasses
import math

from k3jax.config import VisionConfig


class VisionError(ValueError):
  """An image or video the tower cannot take: empty, too large, or of the wrong dtype/shape."""


@dataclasses.dataclass(frozen=True)
class ResizePlan:
  height: int  # after scaling, before padding (pixels)
  width: int
  pad_height: int  # zero rows added at the bottom
  pad_width: int  # zero columns added on the right
  grid: tuple[int, int, int]  # (frames, rows, cols) of patches
  num_patches: int
  num_tokens: int  # visual tokens the language model sees (after the pixel shuffle)


def resize_plan(height: int, width: int, cfg: VisionConfig, frames: int = 1) -> ResizePlan:
  """The scaled and padded size of one image (``frames == 1``) or video chunk; VisionError for
  an empty input, too many frames, pixels or patches."""
  if min(height, width, frames) <= 0:
    raise VisionError(f"image of {frames}x{height}x{width} (frames x height x width) is empty")
  if frames > cfg.pos_emb_frames:
    raise VisionError(f"video chunk of {frames} frames: the tower takes at most "
                      f"{cfg.pos_emb_frames} frames a chunk (model.vision.pos_emb_frames); split "
                      "the video into chunks (k3jax.vision.video_chunks)")
  if height * width > cfg.max_pixels:
    raise VisionError(f"image of {width}x{height} pixels is over model.vision.max_pixels="
                      f"{cfg.max_pixels}")
  p, side = cfg.patch_size, cfg.side_limit
  limit = cfg.in_patch_limit if frames == 1 else cfg.frame_patch_limit
  s1 = math.sqrt(limit / (max(1.0, width // p) * max(1.0, height // p)))
  scale = min(1.0, s1, side * p / width, side * p / height)
  new_w = min(max(1, int(width * scale)), side * p)
  new_h = min(max(1, int(height * scale)), side * p)
  kh, kw = cfg.merge_kernel
  pad_h = (kh * p - new_h % (kh * p)) % (kh * p)
  pad_w = (kw * p - new_w % (kw * p)) % (kw * p)
  rows, cols = (new_h + pad_h) // p, (new_w + pad_w) // p
  patches = frames * rows * cols
  if patches > cfg.max_patches:
    raise VisionError(f"image of {width}x{height} pixels x {frames} frames needs {patches} "
                      f"patches after resizing, over model.vision.max_patches={cfg.max_patches}")
  tokens = (rows // kh) * (cols // kw) * (1 if cfg.temporal_pool else frames)
  return ResizePlan(new_h, new_w, pad_h, pad_w, (frames, rows, cols), patches, tokens)


def num_tokens(height: int, width: int, cfg: VisionConfig, frames: int = 1) -> int:
  """Visual tokens of an image (or a video chunk of ``frames`` frames) of ``height x width``
  pixels, without building its patches: the number of ``image_token_id`` placeholders it needs."""
  return resize_plan(height, width, cfg, frames).num_tokens
