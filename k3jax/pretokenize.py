"""Pre-tokenised ArrayRecord shards for pod-scale training.

    python -m k3jax.pretokenize SRC DST --shards N [--tokenizer byte|PATH] [--text-field text]

reads every document of ``SRC`` (any ``data.source``: a directory, file or glob of text, JSONL,
Parquet or ArrayRecord, local or ``gs://``), tokenises it once and writes ``DST/tokens-KKKKK-of-
NNNNN.array_record``: document ``i`` goes to shard ``i mod N``, as one record of little-endian
int32 ids (no bos/eos: training adds them). ``DST/pretokenize.json`` lists the shards with their
document and token counts, the source and the tokenizer.

Training on ``data.source=DST`` then indexes nothing up front: host ``p`` of ``P`` opens only the
shards ``p, p + P, ...`` (:func:`k3jax.data.open_source`), so ``N`` must be at least the number of
hosts, and a multiple of it keeps the hosts' shares even. Train with ``data.tokenizer=byte`` (the
ids are already made; the model's ``vocab_size`` must hold the tokenizer's).

``DST`` appears only when complete (a temporary directory renamed into place; on ``gs://`` a
temporary prefix copied under ``DST`` with ``pretokenize.json`` last).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from k3jax import data as data_lib
from k3jax import storage
from k3jax import tokenizer as tokenizer_lib
from k3jax.convert.errors import ConversionError
from k3jax.convert.output import check_interrupt, staged_dir

MANIFEST = data_lib.PRETOKENIZED_MANIFEST


def shard_name(k: int, n: int) -> str:
  return f"tokens-{k:05d}-of-{n:05d}.array_record"


def pretokenize(src: str, dst, *, shards: int, tokenizer: str = "byte",
                text_field: str = "text") -> dict:
  """Writes the shards of ``src`` into the new directory ``dst`` (see the module docstring);
  returns the manifest."""
  from array_record.python.array_record_module import ArrayRecordWriter
  if shards < 1:
    raise data_lib.DataError(f"--shards must be at least 1, got {shards}")
  dst = storage.path(dst)
  tok = tokenizer_lib.make_tokenizer(tokenizer, name="--tokenizer")
  source = data_lib.open_source(src, text_field)
  if not len(source):
    raise data_lib.DataError(f"{src!r} holds no documents")
  names = [shard_name(k, shards) for k in range(shards)]
  counts = np.zeros((shards, 2), np.int64)  # documents, tokens
  t0 = time.perf_counter()
  with staged_dir(dst, last=(MANIFEST,)) as out:
    # ArrayRecord writes local files: a remote destination's shards are made here and copied
    local = Path(tempfile.mkdtemp(prefix="k3jax-pretokenize-")) if storage.is_remote(out) else out
    try:
      writers = [ArrayRecordWriter(str(local / name), "group_size:1") for name in names]
      for i in range(len(source)):
        check_interrupt()
        doc = source[i]
        ids = doc if isinstance(doc, np.ndarray) else np.asarray(tok.encode(doc), np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= 2**31):
          raise data_lib.DataError(f"{src!r} document {source.keys[i]}: ids outside int32")
        writers[i % shards].write(ids.astype("<i4").tobytes())
        counts[i % shards] += (1, ids.size)
      for w in writers:
        w.close()
      if local is not out:
        for name in names:
          storage.copy(local / name, out / name)
    finally:
      if local is not out:
        shutil.rmtree(local, ignore_errors=True)
    manifest = {"format": 1, "source": src, "tokenizer": tokenizer,
                "vocab_size": tok.vocab_size, "documents": int(counts[:, 0].sum()),
                "tokens": int(counts[:, 1].sum()),
                "shards": [{"file": name, "documents": int(d), "tokens": int(t)}
                           for name, (d, t) in zip(names, counts)]}
    storage.write(out / MANIFEST, json.dumps(manifest, indent=1))
  return {**manifest, "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
  """The command line; prints the manifest's totals as JSON; returns the exit status (2: bad
  input)."""
  p = argparse.ArgumentParser(prog="python -m k3jax.pretokenize",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("src", help="documents: a directory, file or glob (local or gs://...)")
  p.add_argument("dst", help="the new directory of shards (local or gs://...)")
  p.add_argument("--shards", type=int, required=True,
                 help="number of shard files: at least the number of training hosts")
  p.add_argument("--tokenizer", default="byte", help="'byte', a tokenizer.json or tiktoken file")
  p.add_argument("--text-field", default="text", help="the text field of JSONL / Parquet records")
  args = p.parse_args(argv)
  try:
    out = pretokenize(args.src, args.dst, shards=args.shards, tokenizer=args.tokenizer,
                      text_field=args.text_field)
  except (data_lib.DataError, tokenizer_lib.TokenizerError, ConversionError,
          storage.StorageError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(json.dumps({k: v for k, v in out.items() if k != "shards"}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
