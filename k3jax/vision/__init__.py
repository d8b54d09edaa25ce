"""MoonViT-V2: K3's vision tower, from pixels to visual tokens in the text sequence.

Host side (NumPy and Pillow, no JAX; data workers and the server):

- :func:`preprocess` ``(pixels, cfg) -> VisionItem``: uint8 ``[H, W, 3]`` (an image) or
  ``[F, H, W, 3]`` (a video chunk of ``F <= cfg.pos_emb_frames`` frames; :func:`video_chunks`
  cuts longer videos) resized as the reference processor does, normalised and cut into patches.
  :class:`VisionError` (a ValueError) for a wrong dtype or shape, an empty input, too many
  frames, pixels (``cfg.max_pixels``) or patches (``cfg.max_patches``).
- :func:`from_patches` ``(pixel_values, grid, cfg) -> VisionItem``: the same from patches a
  reference processor made (its ``pixel_values`` and ``grid_thws`` row).
- :func:`num_tokens` ``(height, width, cfg, frames=1)``: the visual tokens (``image_token_id``
  placeholders) an input of that size becomes, without building patches.
- :func:`batch` ``(items, max_patches) -> dict[str, np.ndarray]``: items packed into static
  arrays with a leading batch-row axis (names in its docstring); padding is marked and ignored.

Model side: ``cfg`` is ``ModelConfig.vision`` (:class:`k3jax.config.VisionConfig`, None for a
text-only model). The language model takes ``batch``'s arrays as ``vision=`` and replaces, row by
row, the embeddings of the ``image_token_id`` positions by the row's visual tokens in order.
"""

from k3jax.vision.packing import ARRAY_NAMES, batch
from k3jax.vision.preprocess import VisionItem, from_patches, preprocess, video_chunks
from k3jax.vision.resize import ResizePlan, VisionError, num_tokens, resize_plan

__all__ = ["ARRAY_NAMES", "ResizePlan", "VisionError", "VisionItem", "batch", "from_patches", "num_tokens",
           "preprocess", "resize_plan", "video_chunks"]
