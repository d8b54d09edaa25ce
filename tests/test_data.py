"""The data pipeline: packing and document boundaries, determinism, sources, tokenizers,
process sharding, the held-out split, and the iterator state through a checkpoint."""

import json
import re

import jax
import numpy as np
import pytest

from k3jax import checkpoint, config, data

BOS, EOS, PAD = 256, 257, 258
SEQ = 48


def cfg_for(source, *overrides):
  return config.from_dict({"data": {"source": str(source), "eval_fraction": 0.0, "seq_len": SEQ},
                           "model": {"vocab_size": 320, "bos_token_id": BOS, "eos_token_id": EOS,
                                     "pad_token_id": PAD},
                           "train": {"batch_size": 2}}, list(overrides))


def random_texts(n, seed=0):
  rng = np.random.default_rng(seed)
  words = ["alpha", "beta", "gamma", "delta", "x", "\u00e9t\u00e9", "\u4e2d\u6587", "  ", "\n"]
  # lengths straddle SEQ: most documents end up split across rows
  return [" ".join(rng.choice(words, size=int(rng.integers(1, 40)))) for _ in range(n)]


@pytest.fixture
def corpus(tmp_path):
  texts = random_texts(12)
  for i, t in enumerate(texts):
    (tmp_path / f"doc{i:02d}.txt").write_text(t, encoding="utf-8")
  return tmp_path, texts


def take(ds_or_it, n):
  it = iter(ds_or_it)
  return [next(it) for _ in range(n)]


def doc_pairs(text):
  x = [BOS] + list(text.encode("utf-8")) + [EOS]
  return x[:-1], x[1:]


def check_rows(batches):
  """Row invariants of the batch format; returns the rows' (inputs, targets) streams and the
  pieces (per segment) in order."""
  pieces = []
  for b in batches:
    assert set(b) == {"input_ids", "targets", "segment_ids", "positions", "weights"}
    assert b["input_ids"].dtype == np.int32 and b["weights"].dtype == np.float32
    for r in range(b["input_ids"].shape[0]):
      seg, pos = b["segment_ids"][r], b["positions"][r]
      np.testing.assert_array_equal(b["weights"][r], (seg > 0).astype(np.float32))
      assert seg[0] == 1 and np.all(np.diff(seg) >= 0) and np.all(np.diff(seg) <= 1)
      for s in np.unique(seg[seg > 0]):
        idx = np.nonzero(seg == s)[0]
        assert np.all(np.diff(idx) == 1)  # contiguous
        np.testing.assert_array_equal(pos[idx], np.arange(len(idx)))
        inp, tgt = b["input_ids"][r, idx], b["targets"][r, idx]
        np.testing.assert_array_equal(inp[1:], tgt[:-1])  # targets are the next input
        pieces.append((inp.tolist(), tgt.tolist()))
  return pieces


def test_packing_keeps_documents_apart_and_in_order(corpus):
  path, texts = corpus
  d = data.Data(cfg_for(path, "data.shuffle=false"))
  pieces = check_rows(take(d.dataset("train", SEQ), 12))
  # Concatenating the pieces gives back the documents in order, each as [bos] + bytes + [eos]
  # shifted by one; every piece lies inside one document, and documents start a new segment.
  expected_in, expected_tgt, starts = [], [], []
  for t in texts * 3:
    i, o = doc_pairs(t)
    starts.append(len(expected_in))
    expected_in += i
    expected_tgt += o
  got_in = [x for p in pieces for x in p[0]]
  got_tgt = [x for p in pieces for x in p[1]]
  assert got_in == expected_in[:len(got_in)] and got_tgt == expected_tgt[:len(got_tgt)]
  offset = 0
  for inp, tgt in pieces:
    end = offset + len(inp)
    assert not any(offset < s < end for s in starts), "a piece crosses a document boundary"
    if offset in starts:
      assert inp[0] == BOS
    offset = end
  assert BOS not in got_tgt and EOS not in got_in


def test_shuffling_is_deterministic_by_seed(corpus):
  path, _ = corpus
  d = data.Data(cfg_for(path))
  a, b = take(d.dataset("train", SEQ, seed=1), 6), take(data.Data(cfg_for(path)).dataset(
      "train", SEQ, seed=1), 6)
  c = take(d.dataset("train", SEQ, seed=2), 6)
  for x, y in zip(a, b):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  assert any(not np.array_equal(x["input_ids"], z["input_ids"]) for x, z in zip(a, c))
  check_rows(c)


def test_iterator_state_round_trips_through_a_checkpoint(corpus, tmp_path_factory):
  path, _ = corpus
  d = data.Data(cfg_for(path))
  it = iter(d.dataset("train", SEQ, seed=3))
  take(it, 3)
  tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "layers": {0: {"b": np.ones(4)}}}
  ck = checkpoint.Checkpointer(tmp_path_factory.mktemp("ck"), keep=2)
  assert ck.save(3, tree, it, {"step": 3}, wait=True)
  assert not ck.save(3, tree, it, {"step": 3})  # an existing step is never replaced
  after = take(it, 4)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  step, restored, meta, it2 = ck.restore_latest(abstract, lambda s: iter(d.dataset("train", SEQ,
                                                                                  seed=3)))
  assert step == 3 and meta == {"step": 3}
  np.testing.assert_array_equal(restored["w"], tree["w"])
  for x, y in zip(after, take(it2, 4)):
    np.testing.assert_array_equal(x["input_ids"], y["input_ids"])
  for s in (4, 5, 6):
    ck.save(s, tree, it, {"step": s})
  ck.wait()
  assert ck.steps() == [5, 6]  # keep-last-K
  ck.close()


def test_sources_jsonl_parquet_arrayrecord_match_text(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  from array_record.python.array_record_module import ArrayRecordWriter
  texts = random_texts(5, seed=4)
  (tmp_path / "j").mkdir()
  with open(tmp_path / "j" / "a.jsonl", "w") as f:
    for t in texts:
      f.write(json.dumps({"text": t, "id": 1}) + "\n\n")
  (tmp_path / "p").mkdir()
  pq.write_table(pa.table({"text": texts}), tmp_path / "p" / "a.parquet", row_group_size=2)
  (tmp_path / "r").mkdir()
  w = ArrayRecordWriter(str(tmp_path / "r" / "a.array_record"), "group_size:1")
  for t in texts:
    w.write(np.asarray(list(t.encode("utf-8")), "<i4").tobytes())
  w.close()
  (tmp_path / "t").mkdir()
  for i, t in enumerate(texts):
    (tmp_path / "t" / f"{i}.txt").write_text(t, encoding="utf-8")
  streams = []
  for sub in ("t", "j/*.jsonl", "p", "r"):
    d = data.Data(cfg_for(tmp_path / sub, "data.shuffle=false"))
    assert d.num_docs("train") == len(texts)
    streams.append(np.concatenate([b["input_ids"] for b in take(d.dataset("train", SEQ), 4)]))
  for s in streams[1:]:
    np.testing.assert_array_equal(s, streams[0])


@pytest.mark.parametrize("bad, message", [
    ('{"body": "x"}', "no field 'text' (data.text_field); fields: ['body']"),
    ('{"text": "unterminated', "not a JSON line"),
    ('["text"]', "no field 'text'"),
    ('{"text": 3}', "field 'text' is int, not text"),
])
def test_a_bad_jsonl_line_is_named_by_file_and_line_before_any_batch(tmp_path, bad, message):
  lines = [json.dumps({"text": t}) for t in random_texts(6, seed=3)]
  lines.insert(4, "")  # blank lines count in the numbering
  lines.insert(5, bad)
  (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
  with pytest.raises(data.DataError, match=re.escape(f"{tmp_path / 'a.jsonl'}:6: {message}")):
    data.Data(cfg_for(tmp_path / "a.jsonl"))


def test_binary_files_are_skipped_and_counted_never_decoded(tmp_path):
  texts = random_texts(4, seed=5)
  for i, t in enumerate(texts):
    (tmp_path / f"doc{i}.txt").write_text(t, encoding="utf-8")
  rng = np.random.default_rng()
  (tmp_path / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\0" + rng.bytes(200))
  (tmp_path / "latin1.md").write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
  d = data.Data(cfg_for(tmp_path, "data.shuffle=false"))
  assert sorted(p.name for p in d.source.skipped) == ["image.txt", "latin1.md"]
  assert len(d.source) == 4
  stream = [x for piece in check_rows(take(d.dataset("train", SEQ), 20)) for x in piece[0]]
  assert stream[:40] == doc_pairs(texts[0])[0][:40]
  assert b"\xef\xbf\xbd" not in bytes(x for x in stream if x < 256)  # no U+FFFD


def test_unreadable_empty_and_all_binary_sources_are_errors(tmp_path):
  (tmp_path / "bad").mkdir()
  (tmp_path / "bad" / "doc.txt").symlink_to("/proc/self/mem")  # unreadable, even for root
  with pytest.raises(data.DataError, match=re.escape(f"{tmp_path / 'bad' / 'doc.txt'}: cannot read")):
    data.Data(cfg_for(tmp_path / "bad"))
  (tmp_path / "empty").mkdir()
  for i in range(3):
    (tmp_path / "empty" / f"{i}.txt").write_text("")
  with pytest.raises(data.DataError, match="its 3 training documents are empty"):
    data.Data(cfg_for(tmp_path / "empty"))
  (tmp_path / "bin").mkdir()
  (tmp_path / "bin" / "a.txt").write_bytes(b"\0\1\2")
  with pytest.raises(data.DataError, match=r"holds no documents \(1 binary or non-UTF-8 files"):
    data.Data(cfg_for(tmp_path / "bin"))
  (tmp_path / "blank.jsonl").write_text("\n\n")
  with pytest.raises(data.DataError, match="holds no documents"):
    data.Data(cfg_for(tmp_path / "blank.jsonl"))


def test_an_empty_held_out_split_is_an_error_when_eval_runs(tmp_path):
  texts = random_texts(8, seed=9)
  held = data.split_indices([f"doc{i}.txt" for i in range(8)], 0.3)[1]
  for i, t in enumerate(texts):
    (tmp_path / f"doc{i}.txt").write_text("" if i in held else t)
  eval_on = ["data.eval_fraction=0.3", "train.eval_every=10"]
  with pytest.raises(data.DataError, match="no held-out text for the eval every "
                                           "train.eval_every=10 steps"):
    data.Data(cfg_for(tmp_path, *eval_on))
  data.Data(cfg_for(tmp_path, *eval_on[:1], "train.eval_every=0"))  # no eval: fine
  (tmp_path / "one").mkdir()
  (tmp_path / "one" / "a.txt").write_text(texts[0])
  with pytest.raises(data.DataError, match=r"\(0 held-out documents"):
    data.Data(cfg_for(tmp_path / "one", *eval_on))


@pytest.mark.parametrize("ids, bad", [({"bos_token_id": 1}, "model.bos_token_id=1"),
                                      ({"pad_token_id": 255}, "model.pad_token_id=255")])
def test_special_ids_that_the_tokenizer_gives_to_text_are_refused(tmp_path, ids, bad):
  (tmp_path / "a.txt").write_text(random_texts(1)[0])
  with pytest.raises(config.ConfigError, match=re.escape(bad)):
    data.Data(cfg_for(tmp_path / "a.txt", *(f"model.{k}={v}" for k, v in ids.items())))


def test_special_ids_may_be_the_tokenizers_own_special_tokens(tmp_path):
  from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
  tk = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
  tk.pre_tokenizer = pre_tokenizers.Whitespace()
  tk.add_special_tokens([AddedToken("<s>"), AddedToken("</s>"), AddedToken("<pad>")])  # 3, 4, 5
  tk.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "a.txt").write_text("hello world")
  tok = f"data.tokenizer={tmp_path / 'tokenizer.json'}"
  data.Data(cfg_for(tmp_path / "a.txt", tok, "model.bos_token_id=3", "model.eos_token_id=4",
                    "model.pad_token_id=5"))
  with pytest.raises(config.ConfigError, match="model.eos_token_id=2"):
    data.Data(cfg_for(tmp_path / "a.txt", tok, "model.bos_token_id=3", "model.eos_token_id=2",
                      "model.pad_token_id=5"))


@pytest.mark.parametrize("source, message", [
    ("/nonexistent/path/*.txt", "no data files found"),
    ("MIXED", "mixes file kinds"),
])
def test_bad_sources_give_clear_errors(tmp_path, source, message):
  if source == "MIXED":
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.jsonl").write_text("{}\n")
    source = str(tmp_path)
  with pytest.raises(data.DataError, match=message):
    data.Data(cfg_for(source))


def test_tiktoken_file_with_kimi_pattern(tmp_path):
  import base64
  ranks = {bytes([i]): i for i in range(256)}
  ranks.update({b"ab": 256, b"abc": 257, "中文".encode(): 258})
  ranks["中".encode()[:2]] = 259
  ranks["中".encode()] = 260
  ranks["文".encode()[:2]] = 261
  ranks["文".encode()] = 262
  path = tmp_path / "tiktoken.model"
  path.write_text("".join(f"{base64.b64encode(k).decode()} {v}\n" for k, v in
                          sorted(ranks.items(), key=lambda kv: kv[1])))
  tok = data.make_tokenizer(str(path))
  assert tok.vocab_size == 263
  assert tok.encode("abc ab") == [257, 32, 256]
  # Kimi's pattern splits a Han run from the letters that follow it.
  assert tok.encode("中文abc") == [258, 257]


def test_hf_tokenizer_json_and_vocab_check(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {"[UNK]": 0, "hello": 1, "world": 2}
  tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tk.pre_tokenizer = pre_tokenizers.Whitespace()
  tk.save(str(tmp_path / "tokenizer.json"))
  assert data.make_tokenizer(str(tmp_path / "tokenizer.json")).encode("hello world x") == [1, 2, 0]
  big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(400)}, unk_token="w0"))
  big.save(str(tmp_path / "big.json"))
  (tmp_path / "a.txt").write_text("hello")
  with pytest.raises(data.DataError, match="vocabulary of 400 ids does not fit model.vocab_size=320"):
    data.Data(cfg_for(tmp_path / "a.txt", f"data.tokenizer={tmp_path / 'big.json'}"))


def test_processes_read_disjoint_documents(corpus):
  path, texts = corpus
  seen = []
  for p in (0, 1):
    d = data.Data(cfg_for(path, "data.shuffle=false"), process_index=p, process_count=2)
    assert d.local_batch == 1
    pieces = check_rows(take(d.dataset("train", SEQ), 30))
    stream = [x for piece in pieces for x in piece[0]]
    expected = [x for t in texts[p::2] for x in doc_pairs(t)[0]]
    assert stream[:len(expected)] == expected
    seen.append(stream)


def test_stdlib_default_and_held_out_split():
  cfg = config.load("configs/k3_tiny.yaml", ["data.eval_fraction=0.05"])
  d = data.Data(cfg)
  train, held = set(d.splits["train"]), set(d.splits["eval"])
  assert not train & held and len(train) + len(held) == len(d.source)
  assert 0.02 < len(held) / len(d.source) < 0.08
  assert all(k.endswith(".py") for k in d.source.keys)
  assert d.source.keys == sorted(d.source.keys)
  # The split depends on the document keys only.
  tr2, held2 = data.split_indices(d.source.keys, 0.05)
  assert set(held2) == held
  check_rows(take(d.dataset("eval", 64), 2))
