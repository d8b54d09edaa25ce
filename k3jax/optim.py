"""Optimizers and learning-rate schedules for the parameter tree of ``K3Model``.

``make_optimizer(cfg, params)`` returns an optax transformation for a pure-dict parameter tree
(``nnx.to_pure_dict`` of the ``nnx.Param`` state): gradient clipping by global norm, then

- ``adamw``: AdamW on every parameter;
- ``muon``: Muon on the weight matrices: ``optax.contrib.scale_by_muon``'s Nesterov momentum
  (normalised per matrix; its arithmetic and state, one reduction per leaf), then our own
  Newton-Schulz iteration (optax's quintic coefficients, 5 steps) carried in bf16
  (``optimizer.muon_ns_precision``; float32 accumulation inside each matmul, as in Moonlight and
  Keller Jordan's Muon: optax keeps the iterate in float32, so every step converted it for the
  matmuls and wrote float32 results, twice the traffic), update RMS
  matched to AdamW (``0.2 * sqrt(max(fan_in, fan_out))``); AdamW on everything that is not a
  hidden-layer matrix: norms, biases, ``A_log``, ``dt_bias``, Block AttnRes vectors, the embedding,
  ``lm_head`` and the short-conv kernels. Expert weights ``[E, L, 2F]`` / ``[E, F, L]`` are
  orthogonalised per expert (and gate/up separately); with ``optimizer.muon_per_head`` the attention projections are
  orthogonalised per head (``[d, H*K]`` viewed as ``[d, H, K]``).

Weight decay (decoupled, scaled by the learning rate) applies to matrices only: never to norms,
biases, ``A_log``, ``dt_bias`` or the AttnRes vectors.

Under ``model.scan_layers`` the transformation takes, returns and keeps its state in the train
state's layout, the scanned layers stacked by position (:mod:`k3jax.layer_stacks`): one op per
position and parameter instead of one per layer, the same arithmetic per layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from k3jax import layer_stacks
from k3jax.config import Config, OptimizerConfig

NO_DECAY_NAMES = ("A_log", "dt_bias", "bias")
ADAM_MATRIX_NAMES = ("embedding", "lm_head", "q_conv1d", "k_conv1d", "v_conv1d")


# ---------------------------------------------------------------------------------------------
# Schedules.


def total_steps(cfg: Config) -> int:
  """The run length: ``train.steps``."""
  return cfg.train.steps


def make_schedule(o: OptimizerConfig, steps: int) -> optax.Schedule:
  """Linear warmup to ``o.lr`` over ``o.warmup_steps`` (``lr * (step + 1) / warmup``), then:
  ``wsd``: constant, with a linear decay to ``lr * min_lr_ratio`` over the last
  ``decay_fraction`` of ``steps``; ``cosine``: cosine decay to ``lr * min_lr_ratio`` at ``steps``;
  ``constant``: constant."""
  lr, floor, warm = o.lr, o.lr * o.min_lr_ratio, max(o.warmup_steps, 0)

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warmup = lr * jnp.minimum(1.0, (step + 1.0) / max(warm, 1))
    if o.schedule == "constant":
      return warmup
    if o.schedule == "cosine":
      frac = jnp.clip((step - warm) / max(steps - warm, 1), 0.0, 1.0)
      decayed = floor + (lr - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
    else:  # wsd
      decay_steps = max(int(round(o.decay_fraction * steps)), 1)
      start = steps - decay_steps
      frac = jnp.clip((step - start) / decay_steps, 0.0, 1.0)
      decayed = lr + (floor - lr) * frac
    return jnp.where(step < warm, warmup, decayed)

  return schedule


# ---------------------------------------------------------------------------------------------
# Parameter roles, from the NNX attribute path of each leaf.


def _names(path) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def decay_mask(params) -> Any:
  """True for the leaves that get weight decay: matrices (ndim >= 2, not counting the stacked
  axis of a :mod:`~k3jax.layer_stacks` leaf) other than norms/biases."""
  def decays(path, x):
    names = _names(path)
    ndim = x.ndim - (names[:1] == (layer_stacks.STACKS,))
    return ndim >= 2 and not any(n in NO_DECAY_NAMES or "norm" in str(n) for n in names)
  return jax.tree_util.tree_map_with_path(decays, params)


@dataclasses.dataclass(frozen=True)
class _Role:
  """How one leaf is optimised: ``dims`` None means AdamW; ``view`` is the shape Muon sees."""
  view: tuple[int, ...]
  dims: MuonDimensionNumbers | None


def _head_split(cfg: Config, names: tuple, shape: tuple[int, ...]) -> tuple | None:
  """Per-head view of an attention projection: ``(view shape, dims)`` or None."""
  if len(names) < 5 or names[0] != "layers" or names[2] != "self_attn" or names[-1] != "kernel":
    return None
  layer, proj = int(names[1]), names[3]
  m = cfg.model
  if m.layer_kind(layer) == "kda":
    k = m.kda
    out_heads = {"q_proj": k.num_heads, "k_proj": k.num_heads, "v_proj": k.value_heads,
                 "g_proj": k.value_heads, "g_b_proj": k.value_heads, "f_b_proj": k.value_heads}
    in_heads = {"o_proj": k.value_heads}
  else:
    a = m.mla.num_heads
    out_heads = {"q_proj": a, "q_b_proj": a, "kv_b_proj": a, "g_proj": a}
    in_heads = {"o_proj": a}
  d_in, d_out = shape
  if proj in out_heads and d_out % out_heads[proj] == 0:
    h = out_heads[proj]
    return (d_in, h, d_out // h), MuonDimensionNumbers(reduction_axis=0, output_axis=2)
  if proj in in_heads and d_in % in_heads[proj] == 0:
    h = in_heads[proj]
    return (h, d_in // h, d_out), MuonDimensionNumbers(reduction_axis=1, output_axis=2)
  return None


def muon_roles(cfg: Config, params) -> Any:
  """A ``_Role`` per leaf: which leaves Muon orthogonalises, and in which view."""
  def role(path, x):
    names, shape = _names(path), tuple(x.shape)
    if x.ndim < 2 or any(n in ADAM_MATRIX_NAMES for n in names):
      return _Role(shape, None)
    if names[-1] == "w_gate_up" and x.ndim == 3:  # [E, L, 2F]: gate and up separately
      e, l, f2 = shape
      return _Role((e, l, 2, f2 // 2), MuonDimensionNumbers(reduction_axis=1, output_axis=3))
    if x.ndim == 3:  # [E, in, out]
      return _Role(shape, MuonDimensionNumbers(reduction_axis=1, output_axis=2))
    if x.ndim == 2 and cfg.optimizer.muon_per_head:
      split = _head_split(cfg, names, shape)
      if split is not None:
        return _Role(*split)
    if x.ndim == 2:
      return _Role(shape, MuonDimensionNumbers(reduction_axis=0, output_axis=1))
    return _Role(shape, None)
  return jax.tree_util.tree_map_with_path(role, params)


def _stacked_role(*roles: _Role) -> _Role:
  """The role of the layers' leaves ``roles`` (one role) stacked on a new leading axis: that axis
  is one more batch axis of Muon's matrices."""
  if any(r != roles[0] for r in roles):
    raise ValueError(f"stacked layers with different optimizer roles: {roles}")
  view, dims = (len(roles),) + roles[0].view, roles[0].dims
  if dims is not None:
    shift = lambda a: tuple(x + 1 for x in _as_axes(a))
    dims = MuonDimensionNumbers(reduction_axis=shift(dims.reduction_axis),
                                output_axis=shift(dims.output_axis))
  return _Role(view, dims)


@dataclasses.dataclass(frozen=True)
class _Placement:
  """A leaf's logical axis names (None: replicated), parameter shape and Muon view."""
  names: tuple | None
  shape: tuple[int, ...]
  view: tuple[int, ...]

  def spec(self):
    """The view's PartitionSpec on the current mesh, the parameter laid out as
    :func:`sharding.mesh.shard_params` lays it out; None where the view would split a sharded
    dimension unevenly."""
    from sharding.mesh import fit_spec, spec_axes
    from sharding.rules import logical_spec
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    spec = (None,) * len(self.shape)
    if self.names:
      axes = [a for a in mesh.axis_names if sizes[a] > 1]
      spec = tuple(fit_spec(logical_spec(self.names, None, axes), self.shape, sizes))
      spec += (None,) * (len(self.shape) - len(spec))
    if self.view == self.shape:
      return jax.sharding.PartitionSpec(*spec)
    i = next(i for i, (a, b) in enumerate(zip(self.shape, self.view)) if a != b)  # split in two
    if self.view[i] % math.prod(sizes[a] for a in spec_axes([spec[i]])):
      return None
    return jax.sharding.PartitionSpec(*(spec[:i] + (spec[i], None) + spec[i + 1:]))


def _placements(cfg: Config, params, roles, names=None, stacks=()) -> Any:
  """A :class:`_Placement` per leaf of ``params`` by its logical axis ``names`` (built from the
  model when None; per layer, stacked here by ``stacks`` as ``params`` is), or None when
  ``params`` is not the model's parameter tree."""
  from k3jax.train_state import abstract_model
  from sharding.mesh import names_tree
  names = names_tree(abstract_model(cfg)) if names is None else names
  names = layer_stacks.stack_names(names, stacks)
  is_names = layer_stacks.is_names
  if jax.tree.structure(names, is_leaf=is_names) != jax.tree.structure(params):
    return None
  return jax.tree.map(lambda n, x, r: _Placement(n, tuple(x.shape), r.view), names, params, roles,
                      is_leaf=is_names)


def _viewed(inner: optax.GradientTransformation, roles) -> optax.GradientTransformation:
  """Runs ``inner`` on the leaves reshaped to their role's view, and reshapes updates back."""
  is_role = lambda r: isinstance(r, _Role)

  def to_view(tree):
    return jax.tree.map(lambda r, x: x.reshape(r.view), roles, tree, is_leaf=is_role)

  def init(params):
    return inner.init(to_view(params))

  def update(updates, state, params=None):
    shapes = jax.tree.map(jnp.shape, updates)
    new, state = inner.update(to_view(updates), state, None if params is None else to_view(params))
    new = jax.tree.map(lambda u, s: u.reshape(s), new, shapes, is_leaf=lambda s: isinstance(s, tuple))
    return new, state

  return optax.GradientTransformation(init, update)


NS_COEFFS = (3.4445, -4.775, 2.0315)  # the quintic Newton-Schulz step of optax / Keller Jordan
NS_STEPS = 5
# How a step forms ``X <- a X + (b A + c A^2) X`` (``optimizer.ns_form``):
# - "sums": two elementwise sums, ``b A + c A^2`` over [m, m] and ``a X + (.) X`` over [m, n];
# - "polynomial": ``X <- P X`` with ``P = (c A) A + (b A + a I)``: one elementwise pass over A
#   forms both ``c A`` and ``b A + a I`` (the scalars in float32), and the sum rides the matmul
#   as its added operand (XLA's GPU GEMM rewriter folds such an add into the cuBLAS call), so
#   there is no pass over X. In bf16 its distance to a float64 iteration is that of "sums" on
#   random matrices and less on nearly low-rank ones (benchmarks/RESULTS.md, Training run 45).
NS_FORMS = ("sums", "polynomial")
_NS_DTYPE = {"bf16": jnp.bfloat16, "f32": jnp.float32}


def _as_axes(a) -> tuple[int, ...]:
  return (a,) if isinstance(a, int) else tuple(a)


def _dims(ndim: int, dims: MuonDimensionNumbers):
  """(batch, reduction, output) dimensions of an ndim-array under ``dims``."""
  red, out = _as_axes(dims.reduction_axis), _as_axes(dims.output_axis)
  red, out = tuple(a % ndim for a in red), tuple(a % ndim for a in out)
  return tuple(a for a in range(ndim) if a not in red + out), red, out


def _matrices(x: jax.Array, dims: MuonDimensionNumbers, transpose: bool | None = None):
  """x viewed as matrices ``[batch, m, n]`` by ``dims``, transposed to be wide (``m <= n``, or as
  ``transpose`` says), the ``sqrt(max(fan_in, fan_out))`` of the view, and the function that
  takes such matrices back to x's layout."""
  batch, red, out = _dims(x.ndim, dims)
  perm = batch + red + out
  size = lambda axes: math.prod(x.shape[a] for a in axes)
  m, n = size(red), size(out)
  transpose = m > n if transpose is None else transpose
  y = x.transpose(perm).reshape(size(batch), m, n)
  inv = tuple(sorted(range(x.ndim), key=lambda i: perm[i]))

  def undo(z):
    z = z.mT if transpose else z
    return z.reshape(tuple(x.shape[a] for a in perm)).transpose(inv).astype(x.dtype)

  return (y.mT if transpose else y), math.sqrt(max(m, n)), undo


def _iterate(y: jax.Array, dtype, form: str) -> jax.Array:
  """``NS_STEPS`` steps ``X <- a X + (b A + c A^2) X``, ``A = X X^T``, on wide matrices ``y
  [..., m, n]`` in ``form`` (:data:`NS_FORMS`): the iterate, every matmul's operands and outputs
  in ``dtype`` (each matmul accumulates in float32 and rounds once at its output, so no float32
  product is written to memory and converted), the elementwise sums in float32. The steps run as
  a loop, so XLA compiles one step per group of leaves, not ``NS_STEPS`` (a TPU compile spends
  seconds on each instruction: benchmarks/RESULTS.md, "Newton-Schulz as a loop")."""
  if form not in NS_FORMS:
    raise ValueError(f"Newton-Schulz form: expected one of {NS_FORMS}, got {form!r}")
  a, b, c = NS_COEFFS
  dot = lambda u, v: jnp.matmul(u, v, preferred_element_type=dtype)
  y = y.astype(dtype)
  a_eye = a * jnp.eye(y.shape[-2], dtype=jnp.float32) if form == "polynomial" else None

  def step(_, y):
    s = dot(y, y.mT)  # A
    f = s.astype(jnp.float32)
    if form == "sums":
      s = (b * f + c * dot(s, s).astype(jnp.float32)).astype(dtype)  # b A + c A^2
      return (a * y.astype(jnp.float32) + dot(s, y).astype(jnp.float32)).astype(dtype)
    return dot(dot((c * f).astype(dtype), s) + (b * f + a_eye).astype(dtype), y)

  return jax.lax.fori_loop(0, NS_STEPS, step, y)


def newton_schulz(xs: list[jax.Array], dims: list[MuonDimensionNumbers], dtype,
                  rms: float, *, form: str) -> list[jax.Array]:
  """The orthogonalised ``xs`` (each Frobenius-normalised per matrix already), times ``rms *
  sqrt(max(fan_in, fan_out))``, each in its dtype, the steps in ``form`` (:data:`NS_FORMS`).
  Each x is viewed as matrices ``[batch, fan_in, fan_out]`` by its dimension numbers; leaves whose views have one shape (the same
  projection in every layer, every layer's experts) are stacked and iterated together, so the
  optimizer runs a few large batched matmuls instead of thousands of small kernels. The stack
  axis goes after each view's batch axis (``[batch, leaves, m, n]``, merged into one batch axis
  of the matmuls), so a batch axis split over a mesh (the experts) stays split in place."""
  views = [_matrices(x, d) for x, d in zip(xs, dims)]
  groups: dict[tuple, list[int]] = {}
  for i, (y, _, _) in enumerate(views):
    groups.setdefault(y.shape, []).append(i)
  out: list = [None] * len(xs)
  for members in groups.values():
    y = jnp.stack([views[i][0] for i in members], axis=1)
    nb, nl, m, n = y.shape
    done = _iterate(y.reshape(nb * nl, m, n), dtype, form).reshape(nb, nl, m, n)
    for k, i in enumerate(members):
      _, scale, undo = views[i]
      out[i] = undo(done[:, k].astype(jnp.float32) * (rms * scale))
  return out


def mesh_newton_schulz(xs: list[jax.Array], dims: list[MuonDimensionNumbers], specs: list,
                       dtype, rms: float, *, form: str) -> list[jax.Array]:
  """:func:`newton_schulz` of leaves laid out on the current mesh by ``specs`` (PartitionSpecs
  of the leaves as viewed): where a matrix's rows or columns are split over mesh axes, one
  ``all_to_all`` over those axes gives each device whole matrices, about its share of the
  stack, to iterate, and another sends them back. Left to the parameters' layout, XLA formed
  partial Gram matrices of each device's columns and all-reduced them at every step
  (benchmarks/RESULTS.md, MLA, "What grew per layer"). Newton-Schulz commutes with permuting a matrix's rows and columns, so the order the
  exchange puts them in does not matter. Leaves whose matrices are whole on every device take
  :func:`newton_schulz` as they lie."""
  from sharding.mesh import spec_axes
  mesh = jax.sharding.get_abstract_mesh()
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  groups: dict[tuple, list[tuple[int, bool]]] = {}  # (leaf, its matrices are tall)
  plain = []
  for i, (x, d, spec) in enumerate(zip(xs, dims, specs)):
    spec = tuple(spec) + (None,) * (x.ndim - len(spec))
    _, red, out = _dims(x.ndim, d)
    m, n = (math.prod(x.shape[a] for a in ax) for ax in (red, out))
    rows, cols = (spec_axes([spec[dim] for dim in ax]) for ax in (red, out))
    if m > n:
      rows, cols = cols, rows
    if rows or cols:
      groups.setdefault((min(m, n), max(m, n), rows, cols), []).append((i, m > n))
    else:
      plain.append(i)
  out_leaves: list = [None] * len(xs)
  for i, x in zip(plain, newton_schulz([xs[i] for i in plain], [dims[i] for i in plain], dtype,
                                       rms, form=form)):
    out_leaves[i] = x
  for (m, n, rows, cols), members in groups.items():
    k = math.prod(sizes[a] for a in rows + cols)

    def body(*local, members=members, rows=rows, cols=cols, k=k, n=n):
      # transposed as the whole matrices are (the local pieces' shapes may say otherwise)
      views = [_matrices(x, dims[i], transpose=tall) for x, (i, tall) in zip(local, members)]
      counts = [y.shape[0] for y, _, _ in views]
      y = jnp.concatenate([y for y, _, _ in views])
      b = y.shape[0]
      y = jnp.pad(y, ((0, -b % k), (0, 0), (0, 0)))
      for dim, axes in ((1, rows), (2, cols)):
        y = _whole(y, axes, dim)
      y = _iterate(y, dtype, form)
      for dim, axes in ((2, cols), (1, rows)):
        y = _split(y, axes, dim)
      done, start = [], 0
      for c, (_, _, undo) in zip(counts, views):
        done.append(undo(y[start:start + c].astype(jnp.float32) * (rms * math.sqrt(n))))
        start += c
      return tuple(done)

    in_specs = tuple(specs[i] for i, _ in members)
    done = jax.shard_map(body, in_specs=in_specs, out_specs=in_specs, check_vma=False)(
        *[xs[i] for i, _ in members])
    for (i, _), x in zip(members, done):
      out_leaves[i] = x
  return out_leaves


def _whole(y: jax.Array, axes: tuple[str, ...], dim: int) -> jax.Array:
  """``[b, r, c]`` matrices whose dimension ``dim`` (1 or 2) is split over mesh ``axes`` (k
  ranks) -> ``[b / k, ...]`` with that dimension whole (the ranks' pieces in rank order), by
  one ``all_to_all`` that sends the i-th b / k matrices to rank i. Inside ``shard_map``."""
  if not axes:
    return y
  k = math.prod(jax.lax.axis_size(a) for a in axes)
  y = jax.lax.all_to_all(y.reshape((k, -1) + y.shape[1:]), axes, 0, 0, tiled=True)
  y = jnp.moveaxis(y, 0, dim)  # [b / k, ..., k, piece, ...]
  shape = list(y.shape[:dim]) + [k * y.shape[dim + 1]] + list(y.shape[dim + 2:])
  return y.reshape(shape)


def _split(y: jax.Array, axes: tuple[str, ...], dim: int) -> jax.Array:
  """The inverse of :func:`_whole`."""
  if not axes:
    return y
  k = math.prod(jax.lax.axis_size(a) for a in axes)
  y = y.reshape(y.shape[:dim] + (k, y.shape[dim] // k) + y.shape[dim + 1:])
  y = jax.lax.all_to_all(jnp.moveaxis(y, dim, 0), axes, 0, 0, tiled=True)
  return y.reshape((-1,) + y.shape[2:])


def _is_dims(d) -> bool:
  """A leaf of a dimension-numbers tree: Muon's numbers, or None for a leaf Muon leaves alone."""
  return d is None or isinstance(d, MuonDimensionNumbers)


def _momentum(beta: float, eps: float, dims_fn) -> optax.GradientTransformation:
  """Muon's bias-corrected Nesterov momentum, each matrix (of the views that ``dims_fn``'s
  dimension numbers give; leaves without them pass through) divided by its Frobenius norm plus
  ``eps``: ``optax.contrib.scale_by_muon(ns_steps=0)``'s arithmetic and state, with the norm as one
  reduction per leaf. optax's per-leaf ``vmap`` and zero-step ``scan`` took a third of k3_1b's
  step tracing (243 leaves; benchmarks/RESULTS.md, "k3_1b's compile on an H200")."""
  inner = optax.contrib.scale_by_muon(ns_steps=0, beta=beta, eps=eps, nesterov=True,
                                      weight_dimension_numbers=dims_fn)

  def normalised(x, d):
    if d is None:
      return x
    _, red, out = _dims(x.ndim, d)
    return x / (jnp.sqrt(jnp.sum(jnp.square(x), axis=red + out, keepdims=True)) + eps)

  def update(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                          optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                          optax.tree.bias_correction(updates, beta, count))
    dims, treedef = jax.tree.flatten(dims_fn(updates), is_leaf=_is_dims)
    done = [normalised(x, d) for x, d in zip(treedef.flatten_up_to(mu_hat), dims)]
    return treedef.unflatten(done), state._replace(count=count, mu=mu)

  return optax.GradientTransformation(inner.init, update)


def _orthogonalise(dims_fn, dtype, rms: float, form: str,
                   specs_fn=None) -> optax.GradientTransformation:
  """Stateless: :func:`newton_schulz` (in ``form``) on the leaves whose dimension numbers are
  set; on a mesh, with ``specs_fn`` (the updates tree -> each leaf's PartitionSpec, None where unknown) giving
  every such leaf's layout, :func:`mesh_newton_schulz`."""

  def update(updates, state, params=None):
    del params
    dims, treedef = jax.tree.flatten(dims_fn(updates), is_leaf=_is_dims)
    leaves = treedef.flatten_up_to(updates)
    picked = [i for i, d in enumerate(dims) if d is not None]
    xs, ds = [leaves[i] for i in picked], [dims[i] for i in picked]
    mesh = jax.sharding.get_abstract_mesh()
    specs = None
    if specs_fn is not None and not mesh.empty and mesh.size > 1:
      specs = treedef.flatten_up_to(specs_fn(updates))
      specs = [specs[i] for i in picked]
    if specs is not None and all(s is not None for s in specs):
      done = mesh_newton_schulz(xs, ds, specs, dtype, rms, form=form)
    else:
      done = newton_schulz(xs, ds, dtype, rms, form=form)
    for i, x in zip(picked, done):
      leaves[i] = x
    return treedef.unflatten(leaves), state

  return optax.GradientTransformation(optax.init_empty_state, update)


def make_optimizer(cfg: Config, params, names=None
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """(transformation, schedule) for the pure-dict parameter tree ``params`` (arrays or
  ShapeDtypeStructs, one entry per layer); the transformation takes trees with the scanned
  layers stacked (:func:`k3jax.layer_stacks.positions` of ``cfg``), as the train state holds
  them. ``names``: the parameters' logical axis names
  (:func:`sharding.mesh.names_tree`; by default built here from the abstract model), by which
  Muon lays out its Newton-Schulz on a mesh."""
  o = cfg.optimizer
  schedule = make_schedule(o, total_steps(cfg))
  stacks = layer_stacks.positions(cfg.model)
  if o.name == "adamw":
    base = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                       mask=decay_mask)
  else:
    roles = layer_stacks.stack(muon_roles(cfg, params), stacks, join=_stacked_role)
    params = jax.eval_shape(lambda p: layer_stacks.stack(p, stacks), params)
    is_role = lambda r: isinstance(r, _Role)
    labels = jax.tree.map(lambda r: "adam" if r.dims is None else "muon", roles, is_leaf=is_role)
    dims = jax.tree.map(lambda r: r.dims, roles, is_leaf=is_role)
    # Inside the partition the other branch's leaves are optax's masked (empty) nodes: keep them
    # as they are, so the dimension numbers have the updates' tree structure.
    muon_dims = lambda p: jax.tree.map(lambda d, x: d if hasattr(x, "shape") else x, dims, p,
                                       is_leaf=lambda d: d is None or
                                       isinstance(d, MuonDimensionNumbers))
    placements = _placements(cfg, params, roles, names, stacks)
    is_placement = lambda v: isinstance(v, _Placement)
    muon_specs = None if placements is None else (
        lambda p: jax.tree.map(lambda pl, x: pl.spec() if hasattr(x, "shape") else x,
                               placements, p, is_leaf=is_placement))
    muon = optax.chain(
        _momentum(o.muon_beta, o.eps, muon_dims),
        _orthogonalise(muon_dims, _NS_DTYPE[o.muon_ns_precision], rms=0.2, form=o.ns_form,
                       specs_fn=muon_specs),
        optax.add_decayed_weights(o.weight_decay),
        optax.scale_by_learning_rate(schedule))
    adam = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                       mask=decay_mask)
    base = _viewed(optax.partition({"muon": muon, "adam": adam}, labels), roles)
  parts = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip > 0 else []
  return optax.chain(*parts, base), schedule


def update_rms(updates) -> jax.Array:
  """Root mean square over all elements of an update tree."""
  leaves = jax.tree.leaves(updates)
  n = sum(math.prod(x.shape) for x in leaves)
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves) / n)
