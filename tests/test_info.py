import json
import subprocess
import sys

import pytest

from k3jax import config
from k3jax.info import param_counts
from conftest import ROOT, tiny_config


@pytest.mark.slow
def test_k3_counts_match_release():
  out = subprocess.run([sys.executable, "-m", "k3jax.info", str(ROOT / "configs" / "k3.yaml")],
                       capture_output=True, text=True, check=True, cwd=ROOT)
  info = json.loads(out.stdout)
  assert abs(info["total_params"] / 2.78e12 - 1) < 0.01
  assert abs(info["active_params"] / 104.2e9 - 1) < 0.01
  # the released config's count by this rule: 2.7795T and 104.19B
  assert abs(info["total_params"] - 2.7795e12) < 1e9
  assert abs(info["active_params"] - 104.19e9) < 0.01e9
  assert info["cache"]["mla_bytes_per_token"] == 24 * 576 * 2


def test_kimi_linear_and_small_presets():
  kl = param_counts(config.load(ROOT / "configs" / "kimi_linear_48b.yaml").model)
  assert 47e9 < kl["total_params"] < 50e9 and 2.8e9 < kl["active_params"] < 3.3e9
  one_b = param_counts(config.load(ROOT / "configs" / "k3_1b.yaml").model)
  assert 0.9e9 < one_b["total_params"] < 1.2e9
  tiny = param_counts(config.load(ROOT / "configs" / "k3_tiny.yaml").model)
  assert 1e6 < tiny["total_params"] < 10e6


def test_attention_flops_follow_the_documents():
  """MFU counts causal attention over each token's own document: the mean context from packed
  segment ids against a token-by-token count, and the attention FLOPs scale with it."""
  import numpy as np
  from k3jax import flops
  rng = np.random.default_rng(3)
  seg = np.sort(rng.integers(0, 5, size=(3, 40)), axis=1)  # id 0 = padding at each row's start
  seg[1] = 7  # one document over the whole row
  keys = tokens = 0
  for row in seg:
    for i, s in enumerate(row):
      if s > 0:
        j = i
        while j > 0 and row[j - 1] == s:
          j -= 1
        keys, tokens = keys + i - j + 1, tokens + 1
  assert flops.mean_causal_context(seg) == keys / tokens
  assert flops.mean_causal_context(np.full((2, 9), 3)) == 5.0  # (T + 1) / 2
  m = tiny_config().model
  whole = flops.forward_flops_per_token(m, 64)
  short = flops.forward_flops_per_token(m, 64, context=8.0)
  assert whole["attention"] == pytest.approx(short["attention"] * 32.5 / 8.0)
  assert whole["total"] - whole["attention"] == pytest.approx(short["total"] - short["attention"])
