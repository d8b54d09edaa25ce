"""Image bytes -> uint8 RGB pixels, for the data pipeline and the server.

:func:`decode` turns the bytes of a PNG, JPEG, GIF, WebP or BMP file into ``[H, W, 3]`` uint8
RGB: the EXIF orientation applied, palette, greyscale and 16-bit images converted; an image with
transparency stays ``[H, W, 4]`` RGBA, which :func:`k3jax.vision.preprocess` composites as the
reference processor does (``model.vision.alpha``). :func:`decode_frames` keeps every frame of
an animated GIF/WebP (a short video, ``[F, H, W, 3]``); :func:`decode_media` gives a still image
or an animation's frames. :func:`from_url` reads an OpenAI ``image_url``: a ``data:`` URL with
base64 bytes; ``http(s)`` URLs are refused (k3jax fetches nothing over the network).

Every failure is one :class:`ImageError` saying what is wrong: empty or corrupt bytes, a format
not in :data:`FORMATS`, a zero-size image, or dimensions past ``max_pixels`` / ``max_frames``.
The dimensions are read from the file's header and checked before any pixel is decoded, so a
small file declaring a huge image (a decompression bomb) costs nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings

import numpy as np
from PIL import Image, ImageOps

from k3jax.vision import VisionError


FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
# the default bound on width x height checked from the header (about 8192 x 8192)
MAX_PIXELS = 1 << 26
MAX_FRAMES = 64


class ImageError(VisionError):
  """Image bytes or a URL that cannot be used (the message says why)."""


def _open(data: bytes, max_pixels: int) -> Image.Image:
  """The lazily opened image of ``data``, its format and dimensions checked from the header."""
  if not isinstance(data, (bytes, bytearray, memoryview)):
    raise ImageError(f"image data must be bytes, got {type(data).__name__}")
  if not len(data):
    raise ImageError("the image is empty (0 bytes)")
  try:
    with warnings.catch_warnings():
      # PIL's own bomb check warns or raises past ~89M pixels; ours is max_pixels, below
      warnings.simplefilter("ignore", Image.DecompressionBombWarning)
      img = Image.open(io.BytesIO(bytes(data)), formats=FORMATS)
  except Image.DecompressionBombError as e:
    raise ImageError(f"the image is too large to decode ({e})") from None
  except Image.UnidentifiedImageError:
    raise ImageError(f"not an image in a supported format ({', '.join(FORMATS)}), or its header "
                     "is corrupt") from None
  except (OSError, SyntaxError, ValueError) as e:
    raise ImageError(f"the image's header is corrupt: {e}") from None
  w, h = img.size
  if w <= 0 or h <= 0:
    raise ImageError(f"the image has zero size ({w}x{h})")
  if w * h > max_pixels:
    raise ImageError(f"the image is {w}x{h} = {w * h:,} pixels, more than the limit of "
                     f"{max_pixels:,}")
  return img


def _has_alpha(img: Image.Image) -> bool:
  return img.mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in img.info


def _pixels(img: Image.Image, alpha: bool) -> np.ndarray:
  """The current frame of ``img`` as ``[H, W, 3]`` uint8 RGB, or ``[H, W, 4]`` RGBA when
  ``alpha`` (the vision processor composites transparency its own way)."""
  if img.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16/32-bit greyscale: keep the top 8 bits
    a = np.asarray(img, np.int64)
    scale = 257 if img.mode.startswith("I;16") else max(1, int(a.max()) // 255 + 1)
    grey = np.clip(a // scale, 0, 255).astype(np.uint8)
    return np.repeat(grey[..., None], 3, axis=-1)
  if img.mode == "F":
    grey = np.clip(np.asarray(img, np.float32), 0, 255).astype(np.uint8)
    return np.repeat(grey[..., None], 3, axis=-1)
  return np.asarray(img.convert("RGBA" if alpha else "RGB"), np.uint8)


def _load(img: Image.Image):
  try:
    img.load()
  except Image.DecompressionBombError as e:
    raise ImageError(f"the image is too large to decode ({e})") from None
  except (OSError, SyntaxError, ValueError, EOFError) as e:
    raise ImageError(f"the {img.format} image is corrupt or truncated: {e}") from None


def decode(data: bytes, *, max_pixels: int = MAX_PIXELS) -> np.ndarray:
  """The bytes of one image -> ``[H, W, 3]`` uint8 RGB (``[H, W, 4]`` RGBA for an image with
  transparency), EXIF orientation applied (the first frame of an animation)."""
  img = _open(data, max_pixels)
  _load(img)
  try:
    img = ImageOps.exif_transpose(img)
  except (OSError, SyntaxError, ValueError) as e:  # a broken EXIF block
    raise ImageError(f"the {img.format} image has a corrupt EXIF block: {e}") from None
  return _pixels(img, _has_alpha(img))


def decode_frames(data: bytes, *, max_pixels: int = MAX_PIXELS,
                  max_frames: int = MAX_FRAMES) -> np.ndarray:
  """Every frame of an image file (an animated GIF or WebP: a short video) -> ``[F, H, W, 3]``
  uint8 RGB (``[F, H, W, 4]`` with transparency); a still image gives ``F = 1``."""
  img = _open(data, max_pixels)
  n = getattr(img, "n_frames", 1)
  if n > max_frames:
    raise ImageError(f"the {img.format} animation has {n} frames, more than the limit of "
                     f"{max_frames}")
  frames, alpha = [], _has_alpha(img)
  for i in range(n):
    try:
      img.seek(i)
    except EOFError as e:
      raise ImageError(f"the {img.format} animation is truncated at frame {i}: {e}") from None
    _load(img)
    frames.append(_pixels(img, alpha))
  return np.stack(frames)


def decode_media(data: bytes, *, max_pixels: int = MAX_PIXELS,
                 max_frames: int = MAX_FRAMES) -> np.ndarray:
  """An image file as the vision processor takes it: ``[H, W, C]`` for a still image,
  ``[F, H, W, C]`` for an animation of several frames (a short video)."""
  if getattr(_open(data, max_pixels), "n_frames", 1) == 1:
    return decode(data, max_pixels=max_pixels)  # with its EXIF orientation
  return decode_frames(data, max_pixels=max_pixels, max_frames=max_frames)


def stack_frames(frames: list[np.ndarray]) -> np.ndarray:
  """Decoded frames of one video (each ``[H, W, 3]``, all of one size) -> ``[F, H, W, 3]``."""
  if not frames:
    raise ImageError("a video needs at least one frame")
  sizes = {f.shape for f in frames}
  if len(sizes) > 1:
    raise ImageError(f"the frames of a video must share one size, got {sorted(sizes)}")
  return np.stack(frames)


def url_bytes(url: str) -> bytes:
  """The bytes of an OpenAI ``image_url``: a ``data:[<mime>][;...];base64,<data>`` URL.
  ``http(s)`` URLs are refused: nothing is fetched over the network."""
  if not isinstance(url, str) or not url:
    raise ImageError("the image URL is empty")
  head = url[:16].lower()
  if head.startswith(("http://", "https://")):
    raise ImageError(f"image URLs over http(s) are not fetched (this server works offline): "
                     f"{url[:80]!r}; send the image inline as a data URL "
                     "(data:image/png;base64,...)")
  header, comma, payload = url.partition(",")
  params = header.lower().split(";")
  if not (comma and params[0].startswith("data:") and params[-1] == "base64"):
    raise ImageError(f"unsupported image URL {url[:40]!r}...: expected a base64 data URL "
                     "(data:image/png;base64,...)")
  mime = params[0][len("data:"):]
  if mime and not mime.startswith("image/"):
    raise ImageError(f"the data URL holds {mime!r}, not an image")
  try:
    return base64.b64decode(payload, validate=True)
  except (binascii.Error, ValueError) as e:
    raise ImageError(f"the data URL's base64 payload is malformed: {e}") from None


def from_url(url: str, *, max_pixels: int = MAX_PIXELS) -> np.ndarray:
  """:func:`decode_media` of :func:`url_bytes`: an image, or an animation's frames."""
  return decode_media(url_bytes(url), max_pixels=max_pixels)


def encode_png(pixels: np.ndarray) -> bytes:
  """``[H, W, 3]`` uint8 -> PNG bytes (synthetic data, tests, clients)."""
  out = io.BytesIO()
  Image.fromarray(np.asarray(pixels, np.uint8)).save(out, format="PNG")
  return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
  """``data`` as a base64 data URL."""
  return f"data:{mime};base64,{base64.b64encode(data).decode()}"
