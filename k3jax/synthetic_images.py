"""An image-text set rendered on the fly: coloured shapes and digits with captions that name them.

``data.source: synthetic_images`` (:mod:`k3jax.vision_data`) trains the tiny multimodal preset
on it with nothing on disk. Document ``i`` of seed ``s`` is always the same: its random choices
come from ``numpy.random.default_rng((s, i))``. Each document holds one to
:data:`MAX_IMAGES` images of varied sizes and aspect ratios (sides are multiples of ``grid``
pixels between ``grid`` and ``max_side``), each followed by a caption the model can only get
right by looking (``"<image> a red circle."``, ``"<image> the digit 7 in blue."``); a fraction
of documents is text only (a sentence about a shape, no image), so a run trains a mixture.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw, ImageFont

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220),
          "yellow": (230, 200, 30), "purple": (140, 50, 170), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle", "cross")
MAX_IMAGES = 2


class SyntheticImages:
  """``size`` documents ``{"text": str with one marker per image, "images": [[H, W, 3] uint8]}``;
  ``marker`` is the text standing for an image."""
  sizes, skipped = None, []

  def __init__(self, size: int = 4096, *, seed: int = 0, marker: str = "<image>", grid: int = 28,
               max_side: int = 112, text_only: float = 0.1):
    if max_side < grid:
      raise ValueError(f"max_side {max_side} is below the grid {grid}")
    self.size, self.seed, self.marker, self.grid, self.max_side = size, seed, marker, grid, max_side
    self.text_only = text_only
    self.keys = [f"synthetic:{i}" for i in range(size)]

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, i: int) -> dict:
    rng = np.random.default_rng((self.seed, int(i)))
    if rng.random() < self.text_only:
      color, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
      return {"text": f"a {color} {shape} is drawn in {color}.", "images": []}
    parts, images = [], []
    for _ in range(int(rng.integers(1, MAX_IMAGES + 1))):
      pixels, caption = self.render(rng)
      images.append(pixels)
      parts.append(f"{self.marker} {caption}.")
    return {"text": " ".join(parts), "images": images}

  def render(self, rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """One image ``[H, W, 3]`` uint8 and its caption."""
    sides = np.arange(self.grid, self.max_side + 1, self.grid)
    w, h = int(rng.choice(sides)), int(rng.choice(sides))
    background = tuple(int(c) for c in rng.integers(200, 256, 3))
    img = Image.new("RGB", (w, h), background)
    draw = ImageDraw.Draw(img)
    name = str(rng.choice(list(COLORS)))
    color = COLORS[name]
    side = min(w, h)
    r = side * float(rng.uniform(0.3, 0.45))
    cx = float(rng.uniform(r, w - r)) if w > 2 * r else w / 2
    cy = float(rng.uniform(r, h - r)) if h > 2 * r else h / 2
    if rng.random() < 0.3:
      digit = int(rng.integers(0, 10))
      font = ImageFont.load_default(size=max(8, int(side * 0.8)))
      draw.text((cx, cy), str(digit), fill=color, font=font, anchor="mm")
      return np.asarray(img), f"the digit {digit} in {name}"
    shape = str(rng.choice(SHAPES))
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
      draw.ellipse(box, fill=color)
    elif shape == "square":
      draw.rectangle(box, fill=color)
    elif shape == "triangle":
      draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=color)
    else:
      t = r / 3
      draw.rectangle((cx - r, cy - t, cx + r, cy + t), fill=color)
      draw.rectangle((cx - t, cy - r, cx + t, cy + r), fill=color)
    return np.asarray(img), f"a {name} {shape}"
