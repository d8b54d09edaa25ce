"""Pod-scale data (issue 41 item 6): pre-tokenised ArrayRecord shards written by
``python -m k3jax.pretokenize``, each process opening only its own shard files, together covering
the corpus once; remote shards fetched by the host that reads them only."""

import json

import numpy as np
import pytest

from fake_gcs import fake_gcs
from k3jax import data, pretokenize
from test_data import SEQ, cfg_for, random_texts, take

TEXTS = random_texts(23, seed=7)


@pytest.fixture
def jsonl(tmp_path):
  path = tmp_path / "corpus.jsonl"
  path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
  return path


def ids(text):
  return tuple(text.encode("utf-8"))


def test_shards_hold_every_document_once_round_robin(jsonl, tmp_path, capsys):
  assert pretokenize.main([str(jsonl), str(tmp_path / "tok"), "--shards", "3"]) == 0
  assert json.loads(capsys.readouterr().out)["documents"] == len(TEXTS)
  manifest = json.loads((tmp_path / "tok" / pretokenize.MANIFEST).read_text())
  assert [s["documents"] for s in manifest["shards"]] == [8, 8, 7]
  assert manifest["tokens"] == sum(len(ids(t)) for t in TEXTS)
  for k, shard in enumerate(manifest["shards"]):
    source = data.TokenRecords([tmp_path / "tok" / shard["file"]])
    assert [tuple(source[i]) for i in range(len(source))] == [ids(t) for t in TEXTS[k::3]]
  assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
  assert pretokenize.main([str(jsonl), str(tmp_path / "tok"), "--shards", "3"]) == 2
  assert "already exists" in capsys.readouterr().err


def _opened(monkeypatch):
  """The ArrayRecord files each data source opens, by file name."""
  opened = []
  real = data.grain.sources.ArrayRecordDataSource

  def counting(paths, *args, **kw):
    opened.extend(p.rsplit("/", 1)[-1] for p in paths)
    return real(paths, *args, **kw)
  monkeypatch.setattr(data.grain.sources, "ArrayRecordDataSource", counting)
  return opened


@pytest.mark.parametrize("eval_fraction", [0.0, 0.2])
def test_each_process_opens_only_its_shards_and_together_they_cover_the_corpus_once(
    jsonl, tmp_path, monkeypatch, eval_fraction):
  pretokenize.pretokenize(str(jsonl), tmp_path / "tok", shards=5)
  opened = _opened(monkeypatch)
  docs = []
  for p in (0, 1):
    opened.clear()
    d = data.Data(cfg_for(tmp_path / "tok", f"data.eval_fraction={eval_fraction}"),
                  process_index=p, process_count=2)
    assert opened == [pretokenize.shard_name(k, 5) for k in range(p, 5, 2)]
    for split in ("train", "eval"):
      docs += [tuple(d.source[i]) for i in d.splits[split]]
    assert d.local_batch == 1 and take(d.dataset("train", SEQ), 2)[0]["input_ids"].shape == (1, SEQ)
  assert sorted(docs) == sorted(ids(t) for t in TEXTS)


def test_fewer_shards_or_a_larger_vocabulary_than_the_model_is_one_clear_error(jsonl, tmp_path):
  pretokenize.pretokenize(str(jsonl), tmp_path / "tok", shards=2)
  with pytest.raises(data.DataError, match="2 ArrayRecord files for 3 processes.*--shards"):
    data.Data(cfg_for(tmp_path / "tok"), process_index=0, process_count=3)
  manifest = tmp_path / "tok" / pretokenize.MANIFEST
  manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "tokenizer": "big.json",
                                  "vocab_size": 400}))
  with pytest.raises(data.DataError, match="'big.json', 400 ids, more than model.vocab_size=320"):
    data.Data(cfg_for(tmp_path / "tok"))


def test_remote_shards_are_fetched_only_by_the_host_that_reads_them(jsonl, tmp_path, monkeypatch):
  monkeypatch.setenv("K3JAX_CACHE", str(tmp_path / "cache"))
  with fake_gcs(tmp_path / "gcs", monkeypatch):
    pretokenize.pretokenize(str(jsonl), "gs://bkt/tok", shards=4)
    assert sorted(p.name for p in (tmp_path / "gcs" / "bkt" / "tok").iterdir()) == sorted(
        [pretokenize.MANIFEST] + [pretokenize.shard_name(k, 4) for k in range(4)])
    d = data.Data(cfg_for("gs://bkt/tok"), process_index=1, process_count=2)
  cached = tmp_path / "cache" / "remote" / "gs" / "bkt" / "tok"
  assert sorted(p.name for p in cached.iterdir()) == [pretokenize.shard_name(k, 4) for k in (1, 3)]
  assert sorted(tuple(d.source[i]) for i in range(len(d.source))) == sorted(
      ids(t) for t in TEXTS[1::4] + TEXTS[3::4])
