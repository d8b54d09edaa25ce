"""Visual tokens into the text sequence: the ``image_token_id`` placeholders of a row take the
row's visual tokens in order."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_visual(x: jax.Array, input_ids: jax.Array, visual: jax.Array, num_tokens: jax.Array,
                 image_token_id: int, token_offset: jax.Array | None = None) -> jax.Array:
  """x ``[B, T, d]`` token embeddings, input_ids ``[B, T]``, visual ``[B, M, d]`` with the row's
  ``num_tokens`` ``[B]`` valid -> x with the k-th placeholder of row b replaced by
  ``visual[b, token_offset[b] + k]`` (``token_offset``: placeholders of the row before this
  window, for chunked prefill; default 0). Placeholders beyond the row's visual tokens keep
  their token embedding."""
  is_image = input_ids == image_token_id
  k = jnp.cumsum(is_image, axis=1, dtype=jnp.int32) - 1
  if token_offset is not None:
    k = k + token_offset[:, None]
  use = is_image & (k < num_tokens[:, None])
  picked = jnp.take_along_axis(visual, jnp.clip(k, 0, visual.shape[1] - 1)[..., None], axis=1)
  return jnp.where(use[..., None], picked.astype(x.dtype), x)
