"""Images and image-text data: decoding (orientation, modes, limits, bad bytes, URLs), the
synthetic set, the JSONL and tar sources, packing that keeps images whole and masks their loss."""

import io
import json
import struct
import tarfile
import zlib

import numpy as np
import pytest
from PIL import Image

from k3jax import config, data, images, vision
from k3jax.synthetic_images import SyntheticImages
from k3jax.vision_prompt import VISION_PREFIX


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
  # transparency is kept (RGBA) for the vision processor to composite
  rgba = np.random.default_rng(1).integers(0, 256, (2, 3, 4), dtype=np.uint8)
  np.testing.assert_array_equal(images.decode(png(rgba)), rgba)
  pal = Image.fromarray(x).convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
  b = io.BytesIO()
  pal.save(b, format="PNG")
  np.testing.assert_array_equal(images.decode(b.getvalue()), np.asarray(pal.convert("RGB")))
  pal.info["transparency"] = 0
  b = io.BytesIO()
  pal.save(b, format="PNG", transparency=0)
  np.testing.assert_array_equal(images.decode(b.getvalue()), np.asarray(pal.convert("RGBA")))


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
  np.testing.assert_array_equal(images.decode_media(b.getvalue()), np.stack(frames))
  np.testing.assert_array_equal(images.decode_media(png(frames[0])), frames[0])
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


# ------------------------------------------------------------------------------ the pipeline


BOS, EOS, PAD, IMG = 256, 257, 258, 259
SEQ, ROW_PATCHES = 64, 96


def vl_cfg(source, *overrides):
  return config.from_dict({
      "data": {"source": str(source), "eval_fraction": 0.0, "seq_len": SEQ,
               "max_patches": ROW_PATCHES, "prefetch": 0},
      "model": {"vocab_size": 320, "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD,
                "vision": {"image_token_id": IMG, "max_patches": 64, "in_patch_limit": 64}},
      "train": {"batch_size": 2}}, list(overrides))


def take_rows(d, n, split="train"):
  it = iter(d.dataset(split, SEQ))
  return [next(it) for _ in range(n)]


def check_vl_rows(batches, cfg):
  """Row invariants: text as the text pipeline's; every image's placeholder run whole in one
  row with its visual tokens, placeholders never trained on."""
  for b in batches:
    assert b["input_ids"].shape == (2, SEQ) and b[VISION_PREFIX + "patches"].shape[:2] == \
        (2, ROW_PATCHES)
    for r in range(2):
      inp, tgt, w = b["input_ids"][r], b["targets"][r], b["weights"][r]
      seg = b["segment_ids"][r]
      np.testing.assert_array_equal(w, ((seg > 0) & (tgt != IMG)).astype(np.float32))
      real = seg > 0
      # the row's placeholders are exactly its images' visual tokens: no run is cut
      assert int(np.sum(inp[real] == IMG)) == int(b[VISION_PREFIX + "num_tokens"][r])
      for s in np.unique(seg[real]):
        idx = np.nonzero(seg == s)[0]
        np.testing.assert_array_equal(inp[idx][1:], tgt[idx][:-1])


def synthetic_runs(cfg, i):
  """(text ids, placeholder run lengths) of synthetic document ``i``."""
  from k3jax.synthetic_images import SyntheticImages
  doc = SyntheticImages(seed=cfg.data.seed, grid=28)[i]
  return doc, [vision.num_tokens(x.shape[0], x.shape[1], cfg.model.vision) for x in doc["images"]]


def test_synthetic_pipeline_keeps_images_whole_and_masks_them():
  cfg = vl_cfg("synthetic_images", "data.shuffle=false")
  d = data.Data(cfg)
  batches = take_rows(d, 6)
  check_vl_rows(batches, cfg)
  # the rows, joined, are the documents in order: text bytes and whole placeholder runs
  stream = []
  for b in batches:
    for r in range(2):
      seg = b["segment_ids"][r]
      stream += b["input_ids"][r][seg > 0].tolist()
  want = []
  for i in range(40):
    doc, runs = synthetic_runs(cfg, i)
    parts = doc["text"].split("<image>")
    want += [BOS] + list(parts[0].encode())
    for n, part in zip(runs, parts[1:]):
      want += [IMG] * n + list(part.encode())
  # images that do not fit a row's rest move to the next row with their text: the order holds
  assert stream == want[:len(stream)]
  assert sum(np.sum(b["input_ids"] == IMG) for b in batches) > 0


def write_png(path, h, w, seed=0):
  path.write_bytes(png(rand_pixels(h, w, seed)))
  return path.name


@pytest.fixture
def jsonl_corpus(tmp_path):
  (tmp_path / "img").mkdir()
  a = "img/" + write_png(tmp_path / "img" / "a.png", 28, 56)
  b = "img/" + write_png(tmp_path / "img" / "b.png", 60, 30, seed=1)  # resized to the grid
  f0, f1 = (write_png(tmp_path / f"f{i}.png", 28, 28, seed=2 + i) for i in range(2))
  gif = io.BytesIO()
  Image.fromarray(rand_pixels(28, 28, 5)).save(
      gif, format="GIF", save_all=True, append_images=[Image.fromarray(rand_pixels(28, 28, 6))])
  (tmp_path / "clip.gif").write_bytes(gif.getvalue())
  lines = [
      {"text": "one <image> two", "images": [a]},
      {"text": "plain text only"},
      {"text": "<image> and <image> end", "images": [b, images.data_url(png(rand_pixels(28, 28)))]},
      {"text": "video <image> gif <image>.", "images": [[f0, f1], "clip.gif"]},
      {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is "},
                                                 {"type": "image_url", "image_url": {"url": a}}]},
                    {"role": "assistant", "content": "a picture"}]},
  ]
  (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
  return tmp_path


def test_jsonl_images_videos_chats(jsonl_corpus):
  cfg = vl_cfg(jsonl_corpus / "docs.jsonl", "data.shuffle=false")
  d = data.Data(cfg)
  src = d.source
  assert len(src) == 5
  encoded = [d._encode(src[i]) for i in range(5)]
  v = cfg.model.vision
  assert [len(e["items"]) for e in encoded] == [1, 0, 2, 2, 1]
  assert [it.grid[0] for it in encoded[3]["items"]] == [2, 2]  # two videos of two frames
  e = encoded[0]
  n = vision.num_tokens(28, 56, v)
  want = [BOS] + list(b"one ") + [IMG] * n + list(b" two")
  assert e["input_ids"].tolist() == want and e["targets"].tolist() == want[1:] + [EOS]
  assert e["spans"].tolist() == [[5, n]]
  np.testing.assert_array_equal(e["weights"], (e["targets"] != IMG).astype(np.float32))
  chat = encoded[4]["input_ids"].tolist()
  text = bytes(t for t in chat if t < 256).decode()
  assert text == "user: what is \nassistant: a picture" and chat.count(IMG) == n
  check_vl_rows(take_rows(d, 4), cfg)


def test_tar_shards(tmp_path):
  tar_path = tmp_path / "shard-000.tar"
  with tarfile.open(tar_path, "w") as tar:
    def add(name, payload):
      info = tarfile.TarInfo(name)
      info.size = len(payload)
      tar.addfile(info, io.BytesIO(payload))
    add("s1.png", png(rand_pixels(28, 28)))
    add("s1.txt", b"a caption")
    add("s2.json", json.dumps({"text": "x <image> y <image>"}).encode())
    add("s2.0.png", png(rand_pixels(28, 56, 1)))
    add("s2.1.jpg", png(rand_pixels(28, 28, 2), format="JPEG"))
    add("s3.txt", "text only é".encode())
  cfg = vl_cfg(tar_path)
  d = data.Data(cfg)
  docs = {k.split(":")[1]: d.source[i] for i, k in enumerate(d.source.keys)}
  assert docs["s1"].text == "<image>a caption" and len(docs["s1"].images) == 1
  assert docs["s2"].text == "x <image> y <image>" and len(docs["s2"].images) == 2
  assert docs["s3"].images == ()
  check_vl_rows(take_rows(d, 3), cfg)


def test_bad_records_name_the_file_and_record(tmp_path):
  write_png(tmp_path / "ok.png", 28, 28)
  (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
  cases = [
      ({"text": "<image> <image>", "images": ["ok.png"]}, "docs.jsonl:1: the text holds 2 image"),
      ({"text": "<image>", "images": ["missing.png"]}, "docs.jsonl:1: image file .*missing.png"),
      ({"text": "<image>", "images": ["http://x/y.png"]}, "docs.jsonl:1: image .* web URL"),
      ({"text": 3}, "docs.jsonl:1: no string field 'text'"),
  ]
  for record, match in cases:
    (tmp_path / "docs.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(data.DataError, match=match):
      data.Data(vl_cfg(tmp_path / "docs.jsonl"))
  # found when the worker decodes it: the error names the line and the image, training stops
  (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "a <image>", "images": ["bad.png"]}))
  with pytest.raises(data.DataError, match=r"docs.jsonl at byte 0: image 0: .*corrupt"):
    take_rows(data.Data(vl_cfg(tmp_path / "docs.jsonl")), 1)
  big = tmp_path / "big.png"
  write_png(big, 28 * 8, 28 * 8)  # 256 patches: over the row's 96
  (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "<image>", "images": ["big.png"]}))
  take_rows(data.Data(vl_cfg(tmp_path / "docs.jsonl")), 1)  # scaled down to in_patch_limit
  with pytest.raises(data.DataError, match="docs.jsonl at byte 0: image 0: .*max_patches=64"):
    take_rows(data.Data(vl_cfg(tmp_path / "docs.jsonl", "model.vision.in_patch_limit=1024")), 1)
  with pytest.raises(data.DataError, match="cannot fit one row of 64 tokens and 96 patches"):
    take_rows(data.Data(vl_cfg(tmp_path / "docs.jsonl", "model.vision.max_patches=256",
                               "model.vision.in_patch_limit=256")), 1)


def test_the_synthetic_images_need_a_vision_model():
  with pytest.raises(data.DataError, match="needs a model with a vision tower"):
    data.Data(vl_cfg("synthetic_images", "model.vision=null"))


def test_an_image_token_id_the_tokenizer_gives_to_text_is_refused():
  with pytest.raises(config.ConfigError, match="model.vision.image_token_id=65: the tokenizer"):
    data.Data(vl_cfg("synthetic_images", "model.vision.image_token_id=65"))


def test_iterator_state_resumes_mid_document():
  cfg = vl_cfg("synthetic_images")
  d = data.Data(cfg)
  it = iter(d.dataset("train", SEQ, seed=1))
  for _ in range(3):
    next(it)
  state = it.get_state()
  assert state["cursor"] > 0  # the next row starts inside a document
  want = [next(it) for _ in range(3)]
  again = iter(d.dataset("train", SEQ, seed=1))
  again.set_state(json.loads(json.dumps(state)))
  for a, b in zip(want, [next(again) for _ in range(3)]):
    assert set(a) == set(b)
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


# ------------------------------------------------------------------------------ training


@pytest.mark.slow
def test_k3_tiny_vl_trains_text_and_images_with_the_tower(tmp_path, root):
  """The preset's pipeline through train.py on a smaller model: the loss falls, and every
  weight of the tower and projector gets a gradient from the text loss (they train jointly)."""
  import jax

  import sharding
  from k3jax import metrics, train, train_state, train_step
  from test_train import SMALL
  cfg = config.load(root / "configs" / "k3_tiny_vl.yaml",
                    [*SMALL, "train.steps=8", "data.max_patches=128", "optimizer.lr=3e-3"])
  d = data.Data(cfg)
  batch = next(iter(d.dataset("train", cfg.data.seq_len)))
  assert batch[VISION_PREFIX + "num_tokens"].sum() > 0 and (batch["input_ids"] != IMG).any()
  state = train_state.init_train_state(cfg, sharding.make_mesh(cfg.mesh))
  grads = jax.grad(lambda p: train_step._loss(state.graphdef, p, state.biases, batch,
                                              cfg.train)[0])(state.params)
  for path, g in jax.tree_util.tree_flatten_with_path(
      {k: grads[k] for k in ("vision_tower", "mm_projector")})[0]:
    assert np.isfinite(g).all() and np.abs(g).max() > 0, jax.tree_util.keystr(path)
  train.train(cfg, tmp_path / "run", progress=False)
  records = metrics.read_jsonl(tmp_path / "run" / "metrics.jsonl")
  losses = [r["loss"] for r in records if "loss" in r]
  assert len(losses) == 8 and losses[-1] < losses[0] - 1.0, losses
