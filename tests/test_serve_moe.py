"""The MoE's decoding path: few tokens run every routed expert densely
(:func:`k3jax.latent_moe.all_experts`), against a float64 NumPy loop and against the routed path
of the same layer (float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.glu import glu_activation
from k3jax.latent_moe import LatentMoE, all_experts
from tests.conftest import tiny_config


def _silu(x):
  return x / (1.0 + np.exp(-x))


def _reference(x, ids, weights, w1, w2, activation):
  """Each token's k experts one at a time, float64 (``activation`` on float64 rows)."""
  out = np.zeros((x.shape[0], w2.shape[-1]))
  for n in range(x.shape[0]):
    for j in range(ids.shape[1]):
      e = ids[n, j]
      h = activation((x[n] @ w1[e])[None])[0]
      out[n] += weights[n, j] * (h @ w2[e])
  return out


@pytest.mark.parametrize("n", [1, 5, 12])
def test_all_experts_matches_a_loop(n):
  """Awkward sizes: one token, a token count below and above the experts; repeated experts
  across tokens, random weights (the activation a plain SiLU-GLU, so that the loop is
  independent of the kernels)."""
  rng = np.random.default_rng(n)
  e, d, f, k = 6, 12, 10, 3
  x = rng.normal(size=(n, d)).astype(np.float32)
  ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
  weights = rng.uniform(0.1, 1.0, size=(n, k)).astype(np.float32)
  w1 = rng.normal(size=(e, d, 2 * f)).astype(np.float32) / np.sqrt(d)
  w2 = rng.normal(size=(e, f, d)).astype(np.float32) / np.sqrt(f)
  glu_np = lambda gu: _silu(gu[:, :f]) * gu[:, f:]
  glu_jax = lambda gu: jax.nn.silu(gu[:, :f]) * gu[:, f:]
  got = jax.jit(lambda *a: all_experts(*a, glu_jax))(x, ids, weights, w1, w2)
  want = _reference(*(a.astype(np.float64) if a.dtype == np.float32 else a
                      for a in (x, ids, weights, w1, w2)), glu_np)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)


# k3_tiny's MoE (16 experts, top 4, latent experts, shared experts, SiTU) and a Kimi Linear-like
# one (full-width experts, SiLU)
MOES = {"k3": (), "kimi_linear": ("model.moe.latent_dim=0", "model.activation=silu")}


@pytest.mark.parametrize("moe_case", list(MOES))
def test_dense_decoding_equals_the_routed_path(moe_case):
  """Float32, on 6 tokens: decoding takes the dense path and gives the routed path's output."""
  cfg = tiny_config("model.param_dtype=float32", "model.compute_dtype=float32",
                    *MOES[moe_case]).model
  moe = LatentMoE(cfg, rngs=nnx.Rngs(3))
  graphdef, state = nnx.split(moe)
  rng = np.random.default_rng(0)
  state = jax.tree.map(lambda a: a + 0.3 * jnp.asarray(rng.normal(size=a.shape), a.dtype), state)
  moe = nnx.merge(graphdef, state)
  assert moe.dense(4) and moe.dense(6) and moe.dense(1)  # tiny experts: little left unpicked
  assert not moe.dense(cfg.moe.dense_decode_tokens + 1)
  x = jnp.asarray(rng.normal(size=(2, 3, cfg.hidden_size)), jnp.float32)
  dense, stats = moe(x, decoding=True)
  routed, _ = moe(x)
  assert stats is None
  scale = float(jnp.max(jnp.abs(routed)))
  np.testing.assert_allclose(np.asarray(dense), np.asarray(routed), atol=2e-6 * scale)


def test_glu_activation_is_shared_across_layers():
  """Two MoE layers of one config have one graphdef (the activation is built per call), so a
  decode step traces and lowers their calls once (tests/test_serve_compile.py)."""
  cfg = tiny_config().model
  a, b = LatentMoE(cfg, rngs=nnx.Rngs(0)), LatentMoE(cfg, rngs=nnx.Rngs(1))
  assert nnx.split(a)[0] == nnx.split(b)[0]
  assert a.act.func is glu_activation(cfg, packed=True).func


@pytest.mark.parametrize("moe_case", list(MOES))
def test_fused_inputs_match_the_separate_layout(moe_case):
  """The MoE's serving layout (the shared experts' gate and up and, where there is one, the
  latent projection one weight) against the separate parameters, float32, routed and dense
  paths; with 2 shards too."""
  cfg = tiny_config("model.param_dtype=float32", "model.compute_dtype=float32",
                    *MOES[moe_case]).model
  rng = np.random.default_rng(1)
  moe = LatentMoE(cfg, rngs=nnx.Rngs(4))
  graphdef, state = nnx.split(moe)
  state = jax.tree.map(lambda a: a + 0.3 * jnp.asarray(rng.normal(size=a.shape), a.dtype), state)
  x = jnp.asarray(rng.normal(size=(3, 5, cfg.hidden_size)), jnp.float32)
  for decoding in (False, True):
    want, _ = nnx.merge(graphdef, state)(x, decoding=decoding)
    for shards in (1, 2):
      fused = nnx.merge(graphdef, state)
      fused.fuse_inputs(shards)
      assert fused.fused and "routed_expert_down_proj" not in vars(fused)
      got, _ = fused(x, decoding=decoding)
      scale = float(jnp.max(jnp.abs(want)))
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6 * scale)


@pytest.mark.parametrize("config,dense,routed", [
    ("configs/k3_tiny.yaml:model.moe.dense_decode_unpicked_mb=0", (4, 6), (1, 3)),
    ("configs/k3_1b.yaml", (2, 6, 128), (129,)),  # two rows leave 32 experts, 50 MB, unpicked
    ("configs/k3.yaml", (56, 128), (2, 55)),  # 896 experts of 66 MB
    ("configs/kimi_linear_48b.yaml", (32, 128), (2, 31))])
def test_dense_decoding_where_few_expert_bytes_go_unpicked(config, dense, routed):
  """``LatentMoE.dense``: up to ``dense_decode_tokens`` tokens decode densely where their pairs
  leave at most ``dense_decode_unpicked_mb`` of expert weights unpicked (served in bf16)."""
  from k3jax import config as config_lib
  path, *over = config.split(":")
  cfg = config_lib.load(path, ["model.param_dtype=bfloat16", *over]).model
  moe = nnx.eval_shape(lambda: LatentMoE(cfg, rngs=nnx.Rngs(0)))
  assert all(moe.dense(n) for n in dense) and not any(moe.dense(n) for n in routed)


def test_dense_decode_settings_are_checked():
  from k3jax.config import ConfigError
  with pytest.raises(ConfigError, match="model.moe.dense_decode_tokens"):
    tiny_config("model.moe.dense_decode_tokens=-1")
  with pytest.raises(ConfigError, match="model.moe.dense_decode_unpicked_mb"):
    tiny_config("model.moe.dense_decode_unpicked_mb=-1")


@pytest.mark.parametrize("moe_case", list(MOES))
def test_padding_takes_the_first_tokens_experts(moe_case, monkeypatch):
  """Decoding on the routed path with padding (a serving step's padding rows and chunk tails):
  padding tokens go to the first token's experts, so they read no expert weights of their own;
  the real tokens keep their routing and their outputs, float32."""
  from k3jax import latent_moe
  cfg = tiny_config("model.param_dtype=float32", "model.compute_dtype=float32",
                    "model.moe.dense_decode_tokens=0", *MOES[moe_case]).model
  rng = np.random.default_rng(5)
  moe = LatentMoE(cfg, rngs=nnx.Rngs(6))
  graphdef, state = nnx.split(moe)
  state = jax.tree.map(lambda a: a + 0.3 * jnp.asarray(rng.normal(size=a.shape), a.dtype), state)
  moe = nnx.merge(graphdef, state)
  seen = []
  routed = latent_moe.expert_parallel.routed_experts

  def spy(x, ids, *a, **kw):
    seen.append(np.asarray(ids).reshape(-1, ids.shape[-1]))
    return routed(x, ids, *a, **kw)
  monkeypatch.setattr(latent_moe.expert_parallel, "routed_experts", spy)
  x = jnp.asarray(rng.normal(size=(3, 4, cfg.hidden_size)), jnp.float32)
  valid = jnp.asarray([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
  want, _ = moe(x, decoding=True)
  got, _ = moe(x, valid=valid, decoding=True)
  free, padded = seen
  v = np.asarray(valid).reshape(-1)
  assert len({tuple(r) for r in free[~v]} - {tuple(free[0])}) > 0  # padding routed its own way
  np.testing.assert_array_equal(padded[v], free[v])
  np.testing.assert_array_equal(padded[~v], np.broadcast_to(free[0], padded[~v].shape))
  np.testing.assert_array_equal(np.asarray(got)[np.asarray(valid)], np.asarray(want)[np.asarray(valid)])
