"""Scanned layer groups (``model.scan_layers``, k3jax/scan.py): the groups each config scans, and
scanned against unrolled decoders in float32 on CPU (logits, loss, gradients, router stats) for
both architectures. Decoding with scan_layers on (which runs unrolled): the golden Kimi Linear
test in test_convert.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import config as config_lib
from k3jax.model import K3Model
from conftest import ROOT, tiny_config

# Layers 1-6 scan as three groups of KDA + MLA; AttnRes commits at layers 0, 3 and 6 (group
# positions 0 and 1), so the scan carries blocks that grow inside it.
SMALL = ["model.num_layers=7", "model.mla_layers=[2,4,6]", "model.attn_res.block_size=3",
         "model.hidden_size=64", "model.dense_intermediate=96", "model.moe.num_experts=4",
         "model.moe.top_k=2", "model.moe.expert_intermediate=32", "model.moe.latent_dim=32",
         "model.kda.num_heads=2", "model.kda.head_dim=64", "model.kda.v_head_dim=64",
         "model.mla.num_heads=2", "model.mla.q_lora_rank=32", "model.mla.kv_lora_rank=32",
         "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=16", "model.mla.v_head_dim=16"]
KIMI_LINEAR = ["model.arch=kimi_linear", "model.attn_res.enabled=false", "model.kda.gate=softplus",
               "model.kda.output_gate=low_rank", "model.kda.output_gate_rank=16",
               "model.mla.q_lora_rank=0", "model.mla.output_gate=false", "model.activation=silu",
               "model.moe.latent_dim=0"]


@pytest.mark.parametrize("name, groups", [("k3", (3, 4, 22)), ("kimi_linear_48b", (1, 4, 6)),
                                          ("k3_1b", (1, 4, 3)), ("k3_tiny", (1, 1, 2))])
def test_layer_groups_of_the_presets(name, groups):
  m = config_lib.load(ROOT / "configs" / f"{name}.yaml").model
  assert m.layer_groups() == groups
  assert m.scan_layers == (name in ("k3", "kimi_linear_48b"))
  start, p, g = groups
  keys = [(m.layer_kind(i), m.is_moe(i)) for i in range(start, start + p * g)]
  assert keys == keys[:p] * g


def test_layer_groups_stop_at_the_remat_skip_layers():
  m = config_lib.load(ROOT / "configs" / "k3.yaml", ["model.remat_skip=10"]).model
  assert m.layer_groups() == (3, 4, 20)  # layers 83-92 run without remat, outside the scan
  m = config_lib.load(ROOT / "configs" / "k3.yaml", ["model.num_layers=3",
                                                    "model.mla_layers=[2]"]).model
  assert m.layer_groups()[2] == 0


def _models(*overrides):
  """(unrolled model, scanned model) of the same parameters, perturbed off their init (the AttnRes
  queries start at zero)."""
  cfg = tiny_config(*SMALL, *overrides).model
  graphdef, params, rest = nnx.split(K3Model(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
  params = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(next(keys), p.shape, p.dtype),
                        params)
  scanned = K3Model(cfg.__class__(**{**cfg.__dict__, "scan_layers": True}), rngs=nnx.Rngs(0))
  nnx.update(scanned, params, rest)
  # one parameter layout in both settings: what a checkpoint of either holds
  assert (jax.tree.map(jnp.shape, nnx.state(scanned)) ==
          jax.tree.map(jnp.shape, nnx.state(nnx.merge(graphdef, params, rest))))
  return nnx.merge(graphdef, params, rest), scanned


def _loss_and_grads(model, ids, seg):
  def loss(params, rest):
    m = nnx.merge(graphdef, params, rest)
    h, aux = m.hidden(ids, segment_ids=seg)
    logits = m.logits(h)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 7]), (logits, aux["moe"])
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return jax.jit(jax.value_and_grad(loss, has_aux=True))(params, rest)


# Layers 1-6 scan as two groups of KDA, KDA, MLA (a run of two like layers, one inner scan, then
# one layer); layers 7 and 8 (KDA) run as one scan outside the groups. AttnRes commits at layers 0
# and 5: inside the inner scan.
RUNS = ["model.num_layers=9", "model.mla_layers=[3,6]", "model.attn_res.block_size=5"]


def test_group_and_layer_runs():
  m = tiny_config(*SMALL, *RUNS, "model.remat=full").model
  assert (m.layer_groups(), m.group_runs(), m.layer_runs()) == ((1, 3, 2), [(0, 2), (2, 1)],
                                                               [(0, 1), (7, 2)])
  m = tiny_config(*SMALL, "model.remat=full").model
  assert (m.group_runs(), m.layer_runs()) == ([(0, 1), (1, 1)], [(0, 1)])
  # without full remat every layer runs alone (a run's scan would copy its saved activations)
  m = tiny_config(*SMALL, *RUNS, "model.remat=none").model
  assert (m.group_runs(), m.layer_runs()) == ([(0, 1), (1, 1), (2, 1)], [(0, 1), (7, 1), (8, 1)])
  m = config_lib.load(ROOT / "configs" / "k3.yaml").model
  assert (m.group_runs(), m.layer_runs()) == ([(0, 1), (1, 3)], [(0, 1), (1, 2), (91, 2)])
  # a layer that commits a block runs alone outside the groups: K3's layers 1 and 2 with
  # blocks of two layers
  m = config_lib.load(ROOT / "configs" / "k3.yaml", ["model.attn_res.block_size=2"]).model
  assert m.layer_runs()[:3] == [(0, 1), (1, 1), (2, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("arch, remat", [("kimi_k3", "full"), ("kimi_k3", "none"),
                                         ("kimi_linear", "full")])
def test_scanned_equals_unrolled(arch, remat):
  """Same logits, loss, gradients and per-layer router statistics (keys and values) as the
  unrolled decoder without remat, the scanned one under ``remat`` (``full`` with AttnRes: the
  scan's own backward; otherwise autodiff's, through per-layer remat without AttnRes); under
  full remat with inner scans over the groups' like layers and a scan outside them (``RUNS``).
  In float64, so that only the order of sums differs."""
  extra = (KIMI_LINEAR if arch == "kimi_linear" else []) + RUNS + [
      "model.param_dtype=float64", "model.compute_dtype=float64"]
  with jax.enable_x64(True):
    ids = jax.random.randint(jax.random.key(2), (2, 12), 0, 256)
    seg = jnp.asarray([[1] * 7 + [2] * 5, [1] * 12])
    unrolled, _ = _models(*extra)
    (want_loss, (want_logits, want_moe)), want_grads = _loss_and_grads(unrolled, ids, seg)
    assert list(want_moe) == [str(i) for i in range(1, 9)]
    _, scanned = _models(*extra, f"model.remat={remat}")
    assert scanned.cfg.layer_runs()[-1] == ((7, 2) if remat == "full" else (8, 1))
    (loss, (logits, moe)), grads = _loss_and_grads(scanned, ids, seg)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-12)
  np.testing.assert_allclose(logits, want_logits, rtol=1e-10, atol=1e-12)
  assert list(moe) == list(want_moe)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12), moe,
               want_moe)
  flat, want_flat = jax.tree.leaves(grads), jax.tree.leaves(want_grads)
  assert len(flat) == len(want_flat)
  for g, w in zip(flat, want_flat):
    np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12 * float(jnp.max(jnp.abs(w))))


def _mix_inputs(slots=3, shape=(2, 5, 8)):
  keys = jax.random.split(jax.random.key(3), slots + 3)
  buf = jnp.stack([jax.random.normal(k, shape) for k in keys[:slots]])
  prefix = jax.random.normal(keys[slots], shape)
  proj, norm = (jax.random.normal(k, shape[-1:]) for k in keys[slots + 1:])
  return buf, prefix, proj, norm


class _Query:
  """What BlockBuffer.mix reads of an AttnRes module, as plain arrays (differentiable)."""

  def __init__(self, proj, norm, implementation=None):
    self.proj, self.norm, self.eps, self.implementation = proj, norm, 1e-6, implementation


@pytest.mark.parametrize("count", [1, 2, 3])
def test_block_buffer_mix_matches_the_tuple_form(count):
  """BlockBuffer.mix (a switch over the block count with its own VJP) gives the values and
  gradients of the op on the tuple of committed blocks; slots past ``count`` get none."""
  from k3jax.attn_res import BlockBuffer, attn_res
  args = _mix_inputs()

  def scanned(buf, prefix, proj, norm):
    return jnp.sum(jnp.sin(BlockBuffer(buf, jnp.int32(count)).mix(_Query(proj, norm), prefix)))

  def tupled(buf, prefix, proj, norm):
    return jnp.sum(jnp.sin(attn_res(tuple(buf[i] for i in range(count)) + (prefix,), proj, norm,
                                    1e-6)))

  got = jax.jit(jax.value_and_grad(scanned, argnums=(0, 1, 2, 3)))(*args)
  want = jax.jit(jax.value_and_grad(tupled, argnums=(0, 1, 2, 3)))(*args)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), got, want)
  assert not np.any(np.asarray(got[1][0][count:]))


def test_block_buffer_mix_keeps_only_its_inputs(capsys):
  """The mix's backward keeps its inputs, not every branch's float32 intermediates (autodiff of
  a switch returns all branches' residuals from the forward: on TPU, where the op is XLA's, each
  source's float32 copy for every block count, live until the layer's backward)."""
  from k3jax.attn_res import BlockBuffer
  buf, prefix, proj, norm = (x.astype(jnp.bfloat16) for x in _mix_inputs(slots=4))

  def mix(buf, prefix, proj, norm, count):
    return BlockBuffer(buf, count).mix(_Query(proj, norm, "xla"), prefix)

  jax.ad_checkpoint.print_saved_residuals(mix, buf, prefix, proj, norm, jnp.int32(2))
  saved = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
  assert not [line for line in saved if "f32" in line], saved
  assert len(saved) <= 5, saved  # buf, prefix, proj, norm, the count
