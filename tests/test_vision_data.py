"""Images and image-text data: decoding (orientation, modes, limits, bad bytes, URLs), the
synthetic set, the JSONL and tar sources, packing that keeps images whole and masks their loss."""

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from k3jax import images
from k3jax.synthetic_images import SyntheticImages


def png(pixels, mode=None, **save):
  out = io.BytesIO()
  Image.fromarray(np.asarray(pixels), mode).save(out, format=save.pop("format", "PNG"), **save)
  return out.getvalue()


def rand_pixels(h, w, seed=0):
  return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def with_ihdr_size(data: bytes, w: int, h: int) -> bytes:
  """A PNG whose header claims ``w x h`` (CRC fixed), its pixel data unchanged."""
  ihdr = bytearray(data[16:29])
  ihdr[0:8] = struct.pack(">II", w, h)
  crc = struct.pack(">I", zlib.crc32(b"IHDR" + bytes(ihdr)) & 0xFFFFFFFF)
  return data[:16] + bytes(ihdr) + crc + data[33:]


def test_decode_png_jpeg_roundtrip_and_modes():
  x = rand_pixels(5, 7)
  np.testing.assert_array_equal(images.decode(png(x)), x)
  jpg = images.decode(png(x, format="JPEG", quality=95))
  assert jpg.shape == (5, 7, 3) and jpg.dtype == np.uint8
  grey = np.arange(12, dtype=np.uint8).reshape(3, 4) * 20
  np.testing.assert_array_equal(images.decode(png(grey)), np.repeat(grey[..., None], 3, -1))
  g16 = (np.arange(12, dtype=np.uint16).reshape(3, 4) * 5000)
  np.testing.assert_array_equal(images.decode(png(g16)),
                                np.repeat((g16 // 257).astype(np.uint8)[..., None], 3, -1))
  # transparency composited over white: alpha 0 -> white, alpha 255 -> the colour
  rgba = np.zeros((2, 2, 4), np.uint8)
  rgba[0, 0] = (10, 20, 30, 255)
  out = images.decode(png(rgba))
  np.testing.assert_array_equal(out[0, 0], (10, 20, 30))
  np.testing.assert_array_equal(out[1, 1], (255, 255, 255))
  pal = Image.fromarray(x).convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
  b = io.BytesIO()
  pal.save(b, format="PNG")
  np.testing.assert_array_equal(images.decode(b.getvalue()), np.asarray(pal.convert("RGB")))


def test_decode_applies_exif_orientation():
  x = rand_pixels(4, 6)
  img = Image.fromarray(x)
  exif = Image.Exif()
  exif[0x0112] = 6  # rotate 90 degrees clockwise to display
  b = io.BytesIO()
  img.save(b, format="PNG", exif=exif)
  out = images.decode(b.getvalue())
  np.testing.assert_array_equal(out, np.rot90(x, k=-1))


@pytest.mark.parametrize("data,match", [
    (b"", "empty"),
    (b"not an image at all", "supported format"),
    (b"II*\x00" + bytes(64), "supported format"),  # TIFF: not an accepted format
])
def test_bad_bytes_refused(data, match):
  with pytest.raises(images.ImageError, match=match):
    images.decode(data)


def test_truncated_and_huge_images_refused_before_decoding():
  good = png(rand_pixels(32, 32))
  with pytest.raises(images.ImageError, match="corrupt or truncated"):
    images.decode(good[:len(good) // 2])
  bomb = with_ihdr_size(good, 60000, 60000)  # past PIL's own bomb limit too
  with pytest.raises(images.ImageError, match="too large"):
    images.decode(bomb)  # the header alone says so: nothing is decoded
  with pytest.raises(images.ImageError, match="9000x9000 = 81,000,000 pixels"):
    images.decode(with_ihdr_size(good, 9000, 9000))
  with pytest.raises(images.ImageError, match="more than the limit of 100"):
    images.decode(good, max_pixels=100)
  with pytest.raises(images.ImageError, match="zero size|supported format"):
    images.decode(with_ihdr_size(good, 0, 32))


def test_gif_frames_and_videos():
  frames = [rand_pixels(8, 10, seed=s) // 64 * 64 for s in range(3)]  # few colours: exact in GIF
  b = io.BytesIO()
  Image.fromarray(frames[0]).save(b, format="GIF", save_all=True,
                                  append_images=[Image.fromarray(f) for f in frames[1:]])
  out = images.decode_frames(b.getvalue())
  assert out.shape == (3, 8, 10, 3)
  np.testing.assert_array_equal(out, np.stack(frames))
  with pytest.raises(images.ImageError, match="3 frames, more than the limit of 2"):
    images.decode_frames(b.getvalue(), max_frames=2)
  assert images.decode_frames(png(frames[0])).shape == (1, 8, 10, 3)
  with pytest.raises(images.ImageError, match="share one size"):
    images.stack_frames([frames[0], rand_pixels(4, 4)])


def test_data_urls():
  x = rand_pixels(3, 4)
  np.testing.assert_array_equal(images.from_url(images.data_url(png(x))), x)
  np.testing.assert_array_equal(images.from_url("data:;base64," + images.data_url(png(x))
                                                .split(",")[1]), x)
  with pytest.raises(images.ImageError, match="not fetched .*offline"):
    images.from_url("https://example.com/cat.png")
  with pytest.raises(images.ImageError, match="base64 data URL"):
    images.from_url("ftp://x/y.png")
  with pytest.raises(images.ImageError, match="malformed"):
    images.from_url("data:image/png;base64,@@@")
  with pytest.raises(images.ImageError, match="not an image"):
    images.from_url("data:text/plain;base64,aGk=")


def test_synthetic_set_is_deterministic_and_varied():
  a, b = SyntheticImages(64, seed=3), SyntheticImages(64, seed=3)
  shapes, texts = set(), 0
  for i in range(64):
    da, db = a[i], b[i]
    assert da["text"] == db["text"] and da["text"].count("<image>") == len(da["images"])
    for x, y in zip(da["images"], db["images"]):
      np.testing.assert_array_equal(x, y)
      assert x.dtype == np.uint8 and x.shape[0] % 28 == 0 and x.shape[1] % 28 == 0
      shapes.add(x.shape[:2])
    texts += not da["images"]
  assert len(shapes) > 5 and any(h != w for h, w in shapes) and 0 < texts < 20
  assert SyntheticImages(64, seed=4)[0]["text"] != a[0]["text"] or \
      not np.array_equal(SyntheticImages(64, seed=4)[0]["images"][0], a[0]["images"][0])
