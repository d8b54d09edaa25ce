"""The serving engine's image inputs: request checks, the vision tower's compiled encoder, and
each prefill row's visual tokens.

A request's images are encoded once, when it is admitted, into its visual tokens ``[M, d]`` on
device; a prefill step then takes, per row, the visual tokens of the placeholders in its chunk.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import vision
from k3jax.config import ModelConfig
from k3jax.serve import step as step_lib
from k3jax.serve.types import RequestError


def validate(cfg: ModelConfig, prompt, images) -> None:
  """Raises :class:`RequestError` when ``images`` (vision items) do not fit ``prompt``'s image
  placeholders or the model's limits."""
  v = cfg.vision
  if v is None:
    if images:
      raise RequestError("this model takes no images (it has no vision tower)")
    return
  if len(prompt) and int(prompt[-1]) == v.image_token_id:
    raise RequestError("the prompt must not end with an image placeholder (text follows it)")
  slots = sum(int(t) == v.image_token_id for t in prompt)
  tokens = sum(item.num_tokens for item in images)
  if slots != tokens:
    raise RequestError(f"the prompt holds {slots} image placeholders (id {v.image_token_id}) "
                       f"for images of {tokens} visual tokens")
  patches = sum(item.num_patches for item in images)
  if patches > v.max_patches:
    raise RequestError(f"the request's images have {patches} patches, more than "
                       f"model.vision.max_patches={v.max_patches} per request")


class ImageInputs:
  """The image side of one engine with a vision tower: ``graphdef`` the model's, ``rows`` the
  sharding of the step's per-row inputs (None: one device), ``scope`` the engine's mesh scope."""

  def __init__(self, cfg: ModelConfig, graphdef, rows, scope: Callable):
    self.cfg, self._graphdef, self._rows, self._scope = cfg, graphdef, rows, scope
    self.shape = (cfg.hidden_size, cfg.cdtype)  # a row's visual tokens: [T, d] of this dtype
    self._none = jax.device_put(jnp.zeros((1, cfg.hidden_size), cfg.cdtype), rows)
    self._encoder = None

  def compile(self, params) -> None:
    """Compiles the encoder for ``params`` (the model's state) once."""
    if self._encoder is None:
      example = vision.batch([], self.cfg.vision.max_patches, cfg=self.cfg.vision)
      with self._scope():
        self._encoder = step_lib.lower_encoder(self._graphdef, params, example,
                                               self._rows).compile()

  def encode(self, params, images) -> jax.Array:
    """The visual tokens ``[M, d]`` of ``images``, on device (run once per admission)."""
    self.compile(params)
    arrays = vision.batch(list(images), self.cfg.vision.max_patches)
    if self._rows is not None:
      arrays = jax.device_put(arrays, self._rows)
    with self._scope():
      return self._encoder(params, arrays)[0]

  def step_inputs(self, rows, n: int, t: int) -> dict:
    """A prefill step's ``vision`` input for ``rows`` (request, start, tokens) padded to ``n``:
    per row, the visual tokens of the placeholders in its chunk (``[t, d]``, zeros for rows
    without images) and their count."""
    count = np.zeros(n, np.int32)
    with self._scope():
      visual = [step_lib.visual_window(self._none, 1, t)] * n
      for i, (r, start, c) in enumerate(rows):
        if r.visual is not None:
          first, end = (int(r.before[min(p, len(r.prompt))]) for p in (start, start + c))
          visual[i], count[i] = step_lib.visual_window(r.visual, first, t), end - first
      stacked = jnp.stack(visual)
    if self._rows is not None:
      count = jax.device_put(count, self._rows)
    return {"visual_tokens": stacked, "num_tokens": count}
