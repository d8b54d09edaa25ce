"""The safetensors reader under random header mutations and truncations (hypothesis): every
mutated checkpoint either loads exactly the original arrays or raises ConversionError, never
another exception, and never allocates more than a small bound (sizes are checked against the
file before anything is read)."""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from k3jax.convert import ConversionError, load_hf_params

GOLDEN = Path(__file__).resolve().parent / "golden" / "kimi_linear_tiny"
RAW = (GOLDEN / "model.safetensors").read_bytes()
(N,) = struct.unpack("<Q", RAW[:8])
HEADER = json.loads(RAW[8:8 + N])
DATA = RAW[8 + N:]
NAMES = sorted(k for k in HEADER if k != "__metadata__")
ALLOC_LIMIT = 2 * len(RAW) + (8 << 20)  # the arrays read, their float copies, and slack

json_values = st.recursive(
    st.none() | st.booleans() | st.text(max_size=6) | st.sampled_from(["F32", "BF16", "I32", "U8"])
    | st.integers(-2, 2 ** 70) | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)
small_ints = st.integers(-1, len(DATA) + 16) | st.sampled_from([2 ** 31, 2 ** 40, 2 ** 63])


@st.composite
def mutated(draw) -> bytes:
  """The checkpoint file with one random change to its header, header length or size."""
  header = json.loads(json.dumps(HEADER))
  kind = draw(st.sampled_from(["field", "entry", "offsets", "shape", "rename", "length",
                               "bytes", "truncate"]))
  name = draw(st.sampled_from(NAMES))
  if kind == "field":
    header[name][draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(json_values)
  elif kind == "entry":
    header[name] = draw(json_values)
  elif kind == "offsets":
    header[name]["data_offsets"] = [draw(small_ints), draw(small_ints)]
  elif kind == "shape":
    header[name]["shape"] = draw(st.lists(small_ints, max_size=3))
  elif kind == "rename":
    header[draw(st.text(max_size=8))] = header.pop(name)
  blob = json.dumps(header).encode()
  out = struct.pack("<Q", len(blob)) + blob + DATA
  if kind == "length":
    out = struct.pack("<Q", draw(st.integers(0, 2 ** 64 - 1))) + out[8:]
  elif kind == "bytes":
    at = draw(st.integers(8, 8 + len(blob) - 1))
    out = out[:at] + bytes(draw(st.lists(st.integers(0, 255), min_size=1, max_size=8))) + out[at + 8:]
  elif kind == "truncate":
    out = out[:draw(st.integers(0, len(out) - 1))]
  return out


@pytest.fixture(scope="module")
def reference():
  return load_hf_params(GOLDEN)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=mutated())
def test_mutated_headers_load_exactly_or_raise_conversion_error(reference, data):
  cfg, want = reference
  with tempfile.TemporaryDirectory() as d:
    shutil.copy(GOLDEN / "config.json", d)
    (Path(d) / "model.safetensors").write_bytes(data)
    tracemalloc.start()
    try:
      _, got = load_hf_params(d, cfg)
    except ConversionError:
      got = None
    finally:
      peak = tracemalloc.get_traced_memory()[1]
      tracemalloc.stop()
  assert peak < ALLOC_LIMIT, peak
  if got is not None:
    assert got.keys() == want.keys()
    for k, v in want.items():
      assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k


def test_huge_claims_fail_fast_without_allocating(tmp_path):
  """A header length of 2^62 and a tensor claiming 2^40 elements: ConversionError, tiny peak."""
  shutil.copy(GOLDEN / "config.json", tmp_path)
  header = json.loads(json.dumps(HEADER))
  header[NAMES[0]].update(shape=[2 ** 20, 2 ** 20], data_offsets=[0, 2 ** 42])
  blob = json.dumps(header).encode()
  for data, needle in ((struct.pack("<Q", 2 ** 62) + RAW[8:], "header length 4611686018427387904"),
                       (struct.pack("<Q", len(blob)) + blob + DATA, f"{NAMES[0]}: data_offsets")):
    (tmp_path / "model.safetensors").write_bytes(data)
    tracemalloc.start()
    try:
      with pytest.raises(ConversionError, match=needle):
        load_hf_params(tmp_path)
    finally:
      peak = tracemalloc.get_traced_memory()[1]
      tracemalloc.stop()
    assert peak < 8 << 20, peak
