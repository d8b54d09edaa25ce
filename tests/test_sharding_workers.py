"""Subprocess bodies of the sharding tests (8 simulated CPU devices); no tests are collected
from this file.

``python tests/test_sharding_workers.py NAME [NAME ...]`` sets ``XLA_FLAGS`` before importing jax,
enables float64, runs the checks NAME one after another and prints one JSON line: each check's
measured errors (or the traceback it raised) under its name; the pytest files
(``test_sharding_parallel.py``) assert on them.
"""

import json
import os
import sys
import traceback


def _setup():
  """8 host devices and float64, before jax is imported (only in the subprocess)."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import jax
  jax.config.update("jax_enable_x64", True)
  import jax.numpy as jnp
  import numpy as np
  from k3jax.config import MeshConfig
  from sharding import mesh as mesh_lib
  globals().update(jax=jax, jnp=jnp, np=np, MeshConfig=MeshConfig, mesh_lib=mesh_lib)


def _max_rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-30))


def _packed_segments(rng, b, t):
  """Documents of random lengths packed in rows, some padding (id 0) at the end of row 0."""
  seg = np.zeros((b, t), np.int32)
  for i in range(b):
    pos, doc = 0, 1
    while pos < t:
      n = int(rng.integers(3, t // 2))
      seg[i, pos:pos + n] = doc
      pos, doc = pos + n, doc + 1
  seg[0, -5:] = 0
  return seg


def model_layouts():
  """Loss and gradients of the tiny preset under every layout vs one device."""
  from flax import nnx
  from k3jax.config import load
  from k3jax.latent_moe import RouterBias
  from k3jax.model import K3Model
  from k3jax.train_step import _loss
  import sharding

  cfg = load("configs/k3_tiny.yaml", ["model.param_dtype=float64", "model.compute_dtype=float64",
                                       "model.kda.chunk_size=16", "model.num_layers=3", "model.mla_layers=[2]"])
  b, t = 8, 32
  rng = np.random.default_rng(0)
  model = K3Model(cfg.model, rngs=nnx.Rngs(0))
  graphdef, params, biases = nnx.split(model, nnx.Param, RouterBias)
  params, biases = nnx.to_pure_dict(params), nnx.to_pure_dict(biases)
  biases = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.05, x.dtype), biases)
  seg = _packed_segments(rng, b, t)
  batch = {"input_ids": jnp.asarray(rng.integers(0, 256, (b, t)), jnp.int32),
           "targets": jnp.asarray(rng.integers(0, 256, (b, t)), jnp.int32),
           "segment_ids": jnp.asarray(seg),
           "weights": jnp.asarray((seg > 0).astype(np.float64))}

  def loss_and_grad(p, bs, bt):
    (l, (w, stats, _)), g = jax.value_and_grad(_loss, argnums=1, has_aux=True)(graphdef, p, bs, bt)
    return l / w, jax.tree.map(lambda x: x / w, g), stats

  ref_l, ref_g, ref_stats = jax.jit(loss_and_grad)(params, biases, batch)
  names = mesh_lib.names_tree(model)
  layouts = [("data", dict(data=8), True), ("fsdp", dict(data=1, fsdp=8), True),
             ("expert", dict(data=2, expert=4), True), ("expert_plain", dict(data=2, expert=4), False),
             ("context", dict(data=2, context=4), True),
             ("mix", dict(data=2, expert=2, context=2), True),
             ("mix_plain", dict(data=2, expert=2, context=2), False),
             ("context_experts", dict(data=2, context=4, expert_axes=("expert", "context")), True)]
  out = {}
  for name, sizes, moonep in layouts:
    print(name, file=sys.stderr, flush=True)
    mesh_cfg = MeshConfig(**{"data": 1, **sizes, "moonep": moonep})
    mesh = mesh_lib.make_mesh(mesh_cfg)
    with sharding.layout(mesh_cfg), jax.set_mesh(mesh):
      p = mesh_lib.shard_params(params, mesh, names)
      bt = jax.tree.map(lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh)), batch)
      l, g, stats = jax.jit(loss_and_grad)(p, biases, bt)
    # by the parameter's dtype: KDA's A_log and dt_bias stay float32 (their gradients' sums over
    # the tokens round at 1e-7 in another order of the devices' partial sums); the rest float64
    errs = {"float64": 0.0}
    for p_, r, x in zip(jax.tree.leaves(params), jax.tree.leaves(ref_g), jax.tree.leaves(g)):
      errs[str(p_.dtype)] = max(errs.get(str(p_.dtype), 0.0), _max_rel(r, x))
    stat_err = max(_max_rel(a, b) for a, b in zip(jax.tree.leaves(ref_stats), jax.tree.leaves(stats)))
    out[name] = {"loss": abs(float(l) - float(ref_l)), "grad": errs["float64"],
                 "grad_f32": errs.get("float32", 0.0), "stats": stat_err}
  return out



def moe_local_sort():
  """Sizes of the token-expert sorts in the compiled gradient of the tiny model on data=8 and on
  context=8 meshes (experts whole): each device sorts only its own tokens' pairs."""
  import re
  from flax import nnx
  from k3jax.config import load
  from k3jax.latent_moe import RouterBias
  from k3jax.train_state import abstract_model
  from k3jax.train_step import _loss
  import sharding

  cfg = load("configs/k3_tiny.yaml", [])
  graphdef, params, biases = nnx.split(abstract_model(cfg), nnx.Param, RouterBias)
  params, biases = nnx.to_pure_dict(params), nnx.to_pure_dict(biases)
  b, t = 8, 64
  out = {"pairs": b * t * cfg.model.moe.top_k}
  for name, sizes in (("data8", dict(data=8)), ("context8", dict(data=1, context=8))):
    mesh_cfg = MeshConfig(**sizes)
    mesh = mesh_lib.make_mesh(mesh_cfg)
    with sharding.layout(mesh_cfg), jax.set_mesh(mesh):
      sh = mesh_lib.batch_sharding(mesh)
      batch = {k: jax.ShapeDtypeStruct((b, t), jnp.float32 if k == "weights" else jnp.int32,
                                       sharding=sh)
               for k in ("input_ids", "targets", "segment_ids", "positions", "weights")}
      grad = jax.jit(jax.grad(lambda p, bs, bt: _loss(graphdef, p, bs, bt)[0]))
      text = grad.lower(params, biases, batch).compile().as_text()
    out[name] = sorted({int(n) for n in re.findall(r"= \(?s32\[(\d+)\][^\n]*? sort\(", text)})
  return out


def _mesh(**sizes):
  return mesh_lib.make_mesh(MeshConfig(**{"data": 1, **sizes}))


def kda_context():
  """Context-parallel KDA vs the single-device op: outputs, final state, gradients of q, k, v,
  the raw gate input, the beta logits, the initial state, A_log and dt_bias."""
  import pallas_kernels.kda as kda_ops
  from sharding import context_parallel as cp
  rng = np.random.default_rng(1)
  b, t, h, hv, kd = 2, 64, 2, 4, 64
  q, k = (jnp.asarray(rng.normal(size=(b, t, h, kd))) for _ in range(2))
  v = jnp.asarray(rng.normal(size=(b, t, hv, kd)))
  g = jnp.asarray(rng.normal(size=(b, t, hv, kd)))
  beta = jnp.asarray(rng.normal(size=(b, t, hv)))
  s0 = jnp.asarray(rng.normal(size=(b, hv, kd, kd)) * 0.1)
  a_log = jnp.asarray(rng.normal(size=(hv,)) * 0.3)
  dt_bias = jnp.asarray(rng.normal(size=(hv * kd,)) * 0.1)
  gate = dict(use_qk_l2norm=True, gate="bounded", beta_is_logit=True, chunk_size=16,
              output_final_state=True)
  splits = {  # rank pieces are 8 (context=8) or 16 (context=4) tokens long
      "one_segment": np.ones((b, t), np.int32),
      "crossing": np.array([[1] * 5 + [2] * 30 + [3] * 29, [1] * 50 + [2] * 14], np.int32),
      "at_boundaries": np.array([[1] * 16 + [2] * 16 + [3] * 8 + [4] * 24,
                                 [1] * 8 + [2] * 40 + [3] * 3 + [4] * 13], np.int32),
      "short_docs": np.repeat(np.arange(1, 23, dtype=np.int32), 3)[None, :t].repeat(b, 0),
  }

  def loss(fn, q, k, v, g, beta, s0, a_log, dt_bias, seg):
    o, s = fn(q, k, v, g, beta, initial_state=s0, segment_ids=seg, A_log=a_log, dt_bias=dt_bias,
              **gate)
    return jnp.sum(o * o) + jnp.sum(s * s), (o, s)

  grads = tuple(range(8))  # q, k, v, g, beta, initial state, A_log, dt_bias
  ref = jax.jit(jax.value_and_grad(lambda *a: loss(kda_ops.kda, *a), argnums=grads, has_aux=True))
  par = jax.jit(jax.value_and_grad(lambda *a: loss(cp.kda, *a), argnums=grads, has_aux=True))
  out = {}
  for mname, sizes in (("context8", dict(context=8)), ("data2_context4", dict(data=2, context=4))):
    mesh = _mesh(**sizes)
    for sname, seg in splits.items():
      (_, (o1, s1)), g1 = ref(q, k, v, g, beta, s0, a_log, dt_bias, jnp.asarray(seg))
      with jax.set_mesh(mesh):
        (_, (o2, s2)), g2 = par(q, k, v, g, beta, s0, a_log, dt_bias, jnp.asarray(seg))
      out[f"{mname}/{sname}"] = {"o": _max_rel(o1, o2), "state": _max_rel(s1, s2),
                                 "grad": max(_max_rel(a, c) for a, c in zip(g1, g2))}
  return out


def mla_context():
  """Context-parallel MLA (latent all-gather, zigzag queries) vs dense causal attention."""
  from pallas_kernels.mla import reference
  from sharding import context_parallel as cp
  rng = np.random.default_rng(2)
  b, t, h, r, nope, rope, vd = 2, 32, 2, 16, 8, 8, 16
  q = jnp.asarray(rng.normal(size=(b, t, h, nope + rope)))
  lat = jnp.asarray(rng.normal(size=(b, t, r + rope)))
  w = jnp.asarray(rng.normal(size=(r, h, nope + vd)) * 0.3)
  # late windows of both rows skip the key blocks before their document
  seg = jnp.asarray(np.array([[1] * 7 + [2] * 20 + [3] * 5, [1] * 3 + [2] * 29], np.int32))
  scale = (nope + rope) ** -0.5

  def dense(q, lat, w):
    kv = jnp.einsum("btr,rhd->bthd", lat[..., :r], w)
    k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(lat[:, :, None, r:], (b, t, h, rope))], -1)
    return reference.attention(q, k, kv[..., nope:], segment_ids=seg, causal=True, scale=scale)

  def loss(fn, *a):
    o = fn(*a)
    return jnp.sum(o * jnp.cos(o)), o

  ref = jax.jit(jax.value_and_grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2), has_aux=True))
  (_, o1), g1 = ref(q, lat, w)
  out = {}
  kernels = ((True, "pallas_gpu"), (False, "pallas_gpu"), (True, "pallas_tpu"))
  # balanced: each zigzag half at its offset into the gathered sequence; the reference and the
  # Pallas kernels (interpret mode); key blocks of 8: the keys up-projected 8 at a time and the
  # blocks' attention merged by their log-sum-exps (blocks wholly after a half, and rows whose
  # document has no key in a block)
  cases = [("context4", dict(data=2, context=4), None, ((True, "xla"), (False, "xla"), kernels[0])),
           ("context8", dict(context=8), None, ((True, "xla"), (False, "xla"), *kernels)),
           ("context4/blocks8", dict(data=2, context=4), 8, ((True, "xla"), (False, "xla"),
                                                               kernels[0], kernels[2]))]
  for mname, sizes, key_block, runs in cases:
    for balanced, impl in runs:
      blocks = {} if key_block is None else {"block_keys": key_block}
      fn = lambda q, lat, w: cp.mla_attention(q, lat, w, segment_ids=seg, scale=scale,
                                              nope_dim=nope, balanced=balanced,
                                              implementation=impl, **blocks)
      with jax.set_mesh(_mesh(**sizes)):
        (_, o2), g2 = jax.jit(jax.value_and_grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2),
                                                 has_aux=True))(q, lat, w)
      out[f"{mname}/balanced={balanced}/{impl}"] = {"o": _max_rel(o1, o2),
                                                    "grad": max(_max_rel(a, c) for a, c in zip(g1, g2))}
  return out


def expert_dispatch():
  """Expert-parallel dispatch (plain and MoonEP) vs the single-device expert MLP, on skewed
  routing that needs redundant experts."""
  import pallas_kernels.moe as moe_ops
  from pallas_kernels.glu import glu_packed
  from sharding import expert_parallel as ep
  rng = np.random.default_rng(3)
  n, width, f, e, k = 64, 16, 8, 16, 4
  x = jnp.asarray(rng.normal(size=(n, width)))
  logits = rng.normal(size=(n, e)) + np.where(np.arange(e) < 3, 3.0, 0.0)  # experts 0-2 hot
  ids = jnp.asarray(np.argsort(-logits, axis=1)[:, :k].astype(np.int32))
  wts = jnp.asarray(rng.uniform(0.1, 1.0, size=(n, k)))
  w1 = jnp.asarray(rng.normal(size=(e, width, 2 * f)) * 0.3)
  w2 = jnp.asarray(rng.normal(size=(e, f, width)) * 0.3)

  def loss(fn, x, wts, w1, w2):
    y = fn(x, ids, wts, w1, w2, lambda gu: glu_packed(gu, "situ"))
    return jnp.sum(y * jnp.sin(y)), y

  ref = jax.jit(jax.value_and_grad(lambda *a: loss(moe_ops.expert_mlp, *a), argnums=(0, 1, 2, 3),
                                   has_aux=True))
  (_, y1), g1 = ref(x, wts, w1, w2)
  out = {}
  for mname, sizes in (("expert8", dict(expert=8)), ("data2_expert4", dict(data=2, expert=4))):
    for moonep in (True, False):
      fn = lambda *a: ep.moe_dispatch(*a, moonep=moonep)
      with jax.set_mesh(_mesh(**sizes)):
        (_, y2), g2 = jax.jit(jax.value_and_grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2, 3),
                                                 has_aux=True))(x, wts, w1, w2)
      out[f"{mname}/moonep={moonep}"] = {"y": _max_rel(y1, y2),
                                         "grad": max(_max_rel(a, c) for a, c in zip(g1, g2))}
  # Capacity 0.5 on expert=8 (plain dispatch): each of the 8 ranks sends at most 2 of its 8
  # tokens' 32 pairs to each rank, in token-major order; a dropped pair adds nothing, i.e. the
  # dropless MLP with its routing weight zeroed (and its weight's gradient zero).
  er, cap, local = e // 8, 2, n // 8
  keep = np.zeros((n, k), bool)
  for dev in range(8):
    seen = np.zeros(8, int)
    for i in range(dev * local, (dev + 1) * local):
      for j in range(k):
        d = int(ids[i, j]) // er
        keep[i, j], seen[d] = seen[d] < cap, seen[d] + 1
  kept = jnp.asarray(keep, wts.dtype)
  (_, y1), g1 = jax.jit(jax.value_and_grad(
      lambda x, w, w1, w2: loss(moe_ops.expert_mlp, x, w * kept, w1, w2), argnums=(0, 1, 2, 3),
      has_aux=True))(x, wts, w1, w2)
  fn = lambda *a: ep.moe_dispatch(*a, moonep=False, capacity_factor=0.5)
  with jax.set_mesh(_mesh(expert=8)):
    (_, y2), g2 = jax.jit(jax.value_and_grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2, 3),
                                             has_aux=True))(x, wts, w1, w2)
  out["expert8/capacity0.5"] = {"y": _max_rel(y1, y2),
                                "grad": max(_max_rel(a, c) for a, c in zip(g1, g2)),
                                "dropped": int((~keep).sum())}
  return out


def conv_sharded():
  """The KDA short conv with the fused Pallas kernel (interpret mode) under batch and channel
  splits, and under a sequence split (which keeps the XLA form), vs one device."""
  from k3jax.kda import short_conv
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(8, 40, 64)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(4, 64)), jnp.float32)
  seg = jnp.asarray(_packed_segments(rng, 8, 40))
  r = jnp.asarray(rng.normal(size=x.shape), jnp.float32)

  def loss(x, w):
    y = short_conv(x, w, seg, implementation="pallas_gpu")[0]
    return jnp.sum(y * r), y

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  (_, y1), g1 = step(x, w)
  out = {}
  for name, sizes in (("data8", dict(data=8)), ("data2_tensor4", dict(data=2, tensor=4)),
                      ("fsdp4_tensor2", dict(fsdp=4, tensor=2)), ("data4_context2",
                                                                   dict(data=4, context=2))):
    with jax.set_mesh(_mesh(**sizes)):
      (_, y2), g2 = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
    out[name] = {"y": _max_rel(y1, y2), "grad": max(_max_rel(a, c) for a, c in zip(g1, g2))}
  return out


def muon_sharded():
  """One Muon update of the tiny preset's parameters (float32, Newton-Schulz in float32) with
  the parameters split over expert and FSDP meshes vs one device: the stacked Newton-Schulz of
  same-shaped leaves must give every leaf its own update on any layout, also with the layers
  stacked by scan position (``model.scan_layers``, k3jax/layer_stacks.py); and how many
  matrices Newton-Schulz iterates per device (all 255 on one device)."""
  from flax import nnx
  from k3jax import layer_stacks, optim
  from k3jax.config import load
  from k3jax.latent_moe import RouterBias
  from k3jax.model import K3Model
  cfg = load("configs/k3_tiny.yaml", ["optimizer.name=muon", "optimizer.muon_ns_precision=f32"])
  model = K3Model(cfg.model, rngs=nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.split(model, nnx.Param, RouterBias)[1])
  rng = np.random.default_rng(6)
  grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), params)
  names = mesh_lib.names_tree(model)
  tx, _ = optim.make_optimizer(cfg, params, names)
  scanned = load("configs/k3_tiny.yaml", ["optimizer.name=muon", "optimizer.muon_ns_precision=f32",
                                           "model.scan_layers=true"])
  stacked, _ = optim.make_optimizer(scanned, params, names)
  stacks = layer_stacks.positions(scanned.model)

  def update(p, g, tx=tx):
    return tx.update(g, tx.init(p), p)[0]

  iterated = []  # matrices per Newton-Schulz call, as traced (per device inside shard_map)
  iterate = optim._iterate
  optim._iterate = lambda y, *a: iterated.append(y.shape[0]) or iterate(y, *a)
  try:
    with jax.default_matmul_precision("highest"):
      ref = jax.jit(update)(params, grads)
    out = {"matrices": sum(iterated)}
    for name, sizes in (("expert", dict(data=2, expert=4)), ("fsdp", dict(data=1, fsdp=8))):
      iterated.clear()
      mesh = mesh_lib.make_mesh(MeshConfig(**{"data": 1, **sizes}))
      with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        got = jax.jit(update)(mesh_lib.shard_params(params, mesh, names),
                              mesh_lib.shard_params(grads, mesh, names))
        out[name] = max(jax.tree.leaves(jax.tree.map(_max_rel, ref, got)))
        out[name + "_iterated"] = sum(iterated)
        got = jax.jit(lambda p, g: layer_stacks.unstack(
            update(*layer_stacks.stack((p, g), stacks), stacked), stacks))(
            mesh_lib.shard_params(params, mesh, names), mesh_lib.shard_params(grads, mesh, names))
        out[name + "_stacked"] = max(jax.tree.leaves(jax.tree.map(_max_rel, ref, got)))
  finally:
    optim._iterate = iterate
  return out


def qb_histogram():
  """Histogram QB summed over ranks vs exact sort-based QB on the global batch."""
  from k3jax import router
  from k3jax.config import MoEConfig
  rng = np.random.default_rng(4)
  n, e = 512, 16
  cfg = MoEConfig(num_experts=e, top_k=4, balancing="quantile_hist", balancing_bins=200,
                  balancing_iters=1)  # one exact QB step: what one histogram gives
  scores = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(n, e)) + np.linspace(-1, 1, e)))
  bias = jnp.asarray(rng.normal(size=(e,)) * 0.3)
  valid = jnp.asarray(rng.uniform(size=n) > 0.1)
  ids, _ = router.route(scores, bias, cfg)
  exact = router.quantile_bias(scores, bias, cfg, valid)
  lo, width = router.hist_edges(bias, cfg.balancing_bins)
  with jax.set_mesh(_mesh(data=2, expert=2, context=2)):
    hist = jax.jit(lambda s, b, i, v: router.sharded_bias_stat(s, b, i, cfg, v))(scores, bias,
                                                                                ids, valid)
  approx = router.bias_from_histogram(hist, bias, cfg)
  local = router.quantile_histogram(scores, bias, cfg, valid)
  return {"max_err_in_bins": float(jnp.max(jnp.abs(approx - exact)) / width),
          "hist_equal": bool(jnp.all(hist == local)), "count": int(hist[0].sum()),
          "valid": int(valid.sum())}


def serve_mesh():
  """Greedy tokens of the serving engine on data=2, expert=2, tensor=2 (experts over expert,
  heads over tensor, the KDA slots' heads too) vs one device, with a prefix hit."""
  from flax import nnx
  from k3jax.config import load
  from k3jax.model import K3Model
  from k3jax.serve.engine import Engine
  from k3jax.serve.types import SamplingParams
  from sharding.mesh import spec_axes
  cfg = load("configs/k3_tiny.yaml", [
      "serve.max_batch=2", "serve.prefill_rows=1", "serve.block_size=16", "serve.page_size=16",
      "serve.max_model_len=128", "serve.token_budget=16", "mesh.data=2", "mesh.expert=2",
      "mesh.tensor=2"])
  model = K3Model(cfg.model, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(3, 320, n)] for n in (3, 21)]
  prompts.append(prompts[1][:17] + [5, 6])
  sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
  one = Engine(model, cfg.serve).generate(prompts, sp)
  e = Engine(model, cfg.serve, mesh=cfg.mesh)
  out = e.generate(prompts[:2], sp) + e.generate(prompts[2:], sp)
  state = next(p["state"] for p in e._pools if "state" in p)
  # the mesh axes each weight of the steps is split over: the routed experts' and the others'
  split = {"experts": set(), "others": set()}
  for path, leaf in jax.tree_util.tree_leaves_with_path(e._step_params):
    split["experts" if "experts" in jax.tree_util.keystr(path) else "others"] |= set(
        spec_axes(leaf.sharding.spec))
  return {"equal": out == one, "hits": e.stats.prefix_hit_tokens,
          "state_spec": str(state.sharding.spec), "devices": len(state.sharding.device_set),
          **{k: sorted(v) for k, v in split.items()}}



def serve_layout():
  """The serving layout (tests/test_serve_layout.py) with heads over tensor=2 (data=2,
  expert=2) and tensor=4 (data=2) against the separate layout on one device."""
  from test_serve_layout import fused_vs_separate
  return {f"tensor{t}/{k}": v for t, mc in ((2, MeshConfig(data=2, expert=2, tensor=2)),
                                            (4, MeshConfig(data=2, tensor=4)))
          for k, v in fused_vs_separate(mc).items()}


def scanned_model():
  """Loss, gradients and router statistics of a scanned decoder (tests/test_scan.py's seven
  layers, ``remat: full``: the scan's own backward) against the unrolled one, both on
  data=2,expert=2,context=2 (MoonEP, context-parallel KDA and MLA), float32."""
  from flax import nnx
  from k3jax import layer_stacks
  from k3jax.config import load
  from k3jax.latent_moe import RouterBias
  from k3jax.model import K3Model
  from k3jax.train_step import _loss
  from test_scan import SMALL
  import sharding

  rng = np.random.default_rng(0)
  b, t = 8, 32
  seg = _packed_segments(rng, b, t)
  batch = {"input_ids": jnp.asarray(rng.integers(0, 256, (b, t)), jnp.int32),
           "targets": jnp.asarray(rng.integers(0, 256, (b, t)), jnp.int32),
           "segment_ids": jnp.asarray(seg), "weights": jnp.asarray((seg > 0).astype(np.float32))}
  mesh_cfg = MeshConfig(data=2, expert=2, context=2)
  mesh = mesh_lib.make_mesh(mesh_cfg)
  out = []
  for scan, stacked in (("false", False), ("true", False), ("true", True)):
    cfg = load("configs/k3_tiny.yaml", SMALL + ["model.remat=full", f"model.scan_layers={scan}"])
    model = K3Model(cfg.model, rngs=nnx.Rngs(0))
    graphdef, params, biases = nnx.split(model, nnx.Param, RouterBias)
    params, biases = nnx.to_pure_dict(params), nnx.to_pure_dict(biases)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
    params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype),
                          params)
    names = mesh_lib.names_tree(model)
    stacks = layer_stacks.positions(cfg.model) if stacked else []
    grad = jax.value_and_grad(_loss, argnums=1, has_aux=True)
    with sharding.layout(mesh_cfg), jax.set_mesh(mesh):
      # stacked: laid out as a scanned run's train state holds them
      p = mesh_lib.shard_params(layer_stacks.stack(params, stacks), mesh,
                                layer_stacks.stack_names(names, stacks))
      bt = jax.tree.map(lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh)), batch)
      (loss, aux), g = jax.jit(lambda p, bs, bt: grad(graphdef, p, bs, bt))(p, biases, bt)
      out.append(((loss, aux), layer_stacks.unstack(g, stacks)))
  ((l0, (_, s0, _)), g0) = out[0]
  rel = {}
  for name, ((l1, (_, s1, _)), g1) in zip(("", "stacked_"), out[1:]):
    rel.update({
        name + "loss": _max_rel(l0, l1),
        name + "grad": max(_max_rel(a, b) for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1))),
        name + "stats": max(_max_rel(a, b) for a, b in zip(jax.tree.leaves(s0),
                                                          jax.tree.leaves(s1)))})
  return rel

def vision_sharded():
  """The vision tower and projector (a loss on the visual tokens and its gradients) on 8 rows of
  images and video chunks under data=8, fsdp=8 and data=2,fsdp=2,tensor=2 vs one device, and
  how many parameters each layout splits."""
  import dataclasses
  from flax import nnx
  import sharding
  from k3jax import vision
  from k3jax.config import VisionConfig, load
  from k3jax.vision.projector import Projector
  from k3jax.vision.tower import VisionTower

  base = load("configs/k3_tiny.yaml", ["model.param_dtype=float64", "model.compute_dtype=float64"])
  cfg = dataclasses.replace(base.model, vision=VisionConfig(hidden_size=32, num_heads=2,
                                                            qkv_size=48, intermediate_size=64))
  modules = nnx.List([VisionTower(cfg, rngs=nnx.Rngs(0)), Projector(cfg, rngs=nnx.Rngs(1))])
  graphdef, state = nnx.split(modules)
  params = nnx.to_pure_dict(state)
  rng = np.random.default_rng(0)
  rows = [[vision.preprocess(rng.integers(0, 256, (28 * (1 + i % 3), 56, 3), np.uint8), cfg.vision)]
          + ([vision.preprocess(rng.integers(0, 256, (2, 28, 28, 3), np.uint8), cfg.vision)]
             if i % 2 else []) for i in range(8)]
  arrays = {k: jnp.asarray(v) for k, v in vision.batch(rows, max_patches=64).items()}

  def loss(p, a):
    s = nnx.state(modules)
    nnx.replace_by_pure_dict(s, p)
    m = nnx.merge(graphdef, s)
    return jnp.sum(m[1](m[0](a, jnp.float64)) ** 2)

  ref_l, ref_g = jax.jit(jax.value_and_grad(loss))(params, arrays)
  names = mesh_lib.names_tree(modules)
  out = {}
  for name, sizes in (("data", dict(data=8)), ("fsdp", dict(fsdp=8)),
                      ("mix", dict(data=2, fsdp=2, tensor=2))):
    mesh_cfg = MeshConfig(**{"data": 1, **sizes})
    mesh = mesh_lib.make_mesh(mesh_cfg)
    with sharding.layout(mesh_cfg), jax.set_mesh(mesh):
      p = mesh_lib.shard_params(params, mesh, names)
      rows = lambda x: jax.sharding.NamedSharding(
          mesh, sharding.rules.logical_spec(("batch",) + (None,) * (x.ndim - 1)))
      a = jax.tree.map(lambda x: jax.device_put(x, rows(x)), arrays)
      l, g = jax.jit(jax.value_and_grad(loss))(p, a)
      split = sum(1 for x in jax.tree.leaves(p) if not x.sharding.is_fully_replicated)
    out[name] = {"loss": _max_rel(ref_l, l),
                 "grad": max(_max_rel(r, x) for r, x in zip(jax.tree.leaves(ref_g), jax.tree.leaves(g))),
                 "split": split, "params": len(jax.tree.leaves(p))}
  return out


if __name__ == "__main__":
  _setup()
  out = {}
  for name in sys.argv[1:]:
    try:
      out[name] = globals()[name]()
    except Exception:  # reported to that check's test; the other checks still run
      out[name] = {"traceback": traceback.format_exc()}
  print(json.dumps(out))
