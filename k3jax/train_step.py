"""The training step: a pure function of (params, opt_state, biases, step, rng, batch).

``params`` and ``biases`` are pure dicts (``nnx.to_pure_dict``) of the model's ``nnx.Param`` and
``RouterBias`` state, the scanned layers' parameters stacked by position or not
(:mod:`k3jax.layer_stacks`); the model is rebuilt inside the step from a static graphdef
(:func:`k3jax.layer_stacks.merge`). One step:

1. splits the batch ``[B, T]`` into ``train.grad_accum`` micro-batches ``[B/A, T]`` and scans over
   them, summing the gradients of the summed token loss (so the result is the token-weighted mean
   over the whole batch, whatever the split);
2. computes the global gradient norm; when the loss or the norm is not finite, skips the update
   (parameters, optimizer state and router biases unchanged) and reports ``nonfinite = 1``;
3. otherwise applies the optimizer and installs the next router bias of every MoE layer
   (Quantile Balancing through ``router.next_bias`` over the micro-batches' statistics).

Metrics: ``loss``, ``grad_norm``, ``lr``, ``nonfinite``, ``tokens`` (tokens with a target),
``moe_load_max_mean`` ``[n_moe_layers]`` (max over mean expert load per MoE layer, in layer order),
and the token means of any sums a custom loss reports (post-training's objectives,
:mod:`k3jax.posttrain.objective`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from k3jax import layer_stacks, losses, router
from k3jax.config import Config, TrainConfig, VisionConfig
from k3jax.vision_prompt import VISION_PREFIX, batch_vision

Batch = dict[str, jax.Array]


def moe_layers(cfg: Config) -> list[int]:
  return [i for i in range(cfg.model.num_layers) if cfg.model.is_moe(i)]


def _loss(graphdef, params, biases, batch: Batch, train: TrainConfig = TrainConfig()):
  """(summed token loss, (summed weights, per-layer router stats, {})) of one micro-batch; the
  head's logits are formed ``train.loss_chunk`` tokens at a time (stored in bf16 when
  ``train.bf16_logits``)."""
  model, stacked = layer_stacks.merge(graphdef, params, biases)
  h, aux = model.hidden(batch["input_ids"], segment_ids=batch["segment_ids"],
                        vision=batch_vision(batch), stacked=stacked)
  with jax.named_scope("lm_head_loss"):
    loss_sum, weight_sum = losses.cross_entropy(h, model.lm_head.kernel[...], batch["targets"],
                                                batch["weights"], chunk_size=train.loss_chunk,
                                                logits_dtype=jnp.bfloat16 if train.bf16_logits
                                                else None)
  return loss_sum, (weight_sum, aux["moe"], {})


def _set_biases(biases, new: dict[int, jax.Array]):
  """``biases`` with ``layers[i].mlp.gate.bias`` replaced by ``new[i]``."""
  def pick(path, b):
    keys = [getattr(k, "key", k) for k in path]
    return new.get(keys[1], b) if keys[0] == "layers" else b
  return jax.tree_util.tree_map_with_path(pick, biases)


def _bias_of(biases, i: int) -> jax.Array:
  return biases["layers"][i]["mlp"]["gate"]["bias"]


def make_train_step(cfg: Config, graphdef, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, loss: Callable | None = None) -> Callable:
  """The (unjitted) step ``(params, opt_state, biases, step, rng, batch) -> (params, opt_state,
  biases, metrics)`` on a :class:`~k3jax.train_state.TrainState`'s trees (the scanned layers'
  parameters and moments stacked, :mod:`k3jax.layer_stacks`: their gradients come out of the scan
  stacked); ``tx``: :func:`k3jax.optim.make_optimizer`'s of ``cfg``. ``loss``: ``(graphdef,
  params, biases, micro-batch) -> (summed token loss, (summed weights, per-layer router stats,
  {name: summed per-token metric}))``; None: next-token cross-entropy."""
  accum = cfg.train.grad_accum
  grad_fn = jax.value_and_grad(loss or functools.partial(_loss, train=cfg.train), argnums=1,
                               has_aux=True)
  layers = moe_layers(cfg)

  def train_step(params, opt_state, biases, step, rng, batch: Batch):
    del rng  # the model has no stochastic parts; kept in the signature for ones that do
    if accum == 1:
      (loss_sum, (weight_sum, stats, extra)), grads = grad_fn(graphdef, params, biases, batch)
      stats_list = [stats]
    else:
      micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)

      def body(carry, mb):
        g_acc, l_acc, w_acc = carry
        (l, (w, st, ex)), g = grad_fn(graphdef, params, biases, mb)
        return (jax.tree.map(jnp.add, g_acc, g), l_acc + l, w_acc + w), (st, ex)

      zeros = jax.tree.map(jnp.zeros_like, params)
      zero = jnp.zeros((), jnp.float32)
      (grads, loss_sum, weight_sum), (stacked, extras) = jax.lax.scan(body, (zeros, zero, zero),
                                                                      micro)
      extra = jax.tree.map(lambda x: jnp.sum(x, 0), extras)
      stats_list = [jax.tree.map(lambda x, a=a: x[a], stacked) for a in range(accum)]

    denom = jnp.maximum(weight_sum, 1.0)
    grads = jax.tree.map(lambda g: g / denom.astype(g.dtype), grads)
    grad_norm = optax.tree.norm(grads)
    loss = loss_sum / denom
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def apply(operands):
      params, opt_state, biases = operands
      with jax.named_scope("optimizer"):
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
      new = {i: router.next_bias(cfg.model.moe, _bias_of(biases, i),
                                 [s[str(i)] for s in stats_list]) for i in layers}
      return params, opt_state, _set_biases(biases, new)

    params, opt_state, biases = jax.lax.cond(finite, apply, lambda ops: ops,
                                             (params, opt_state, biases))
    loads = [sum(s[str(i)]["load"] for s in stats_list) for i in layers]
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": jnp.asarray(schedule(step), jnp.float32),
        "nonfinite": (~finite).astype(jnp.int32),
        "tokens": weight_sum,
        "moe_load_max_mean": (jnp.stack([jnp.max(l) / jnp.maximum(jnp.mean(l), 1e-9) for l in loads])
                              if loads else jnp.zeros((0,), jnp.float32)),
        **{k: v / denom for k, v in extra.items()},
    }
    return params, opt_state, biases, metrics

  return train_step


def make_eval_step(graphdef, train: TrainConfig = TrainConfig()) -> Callable:
  """``(params, biases, batch) -> (summed token loss, summed weights)``, the loss as ``train``
  forms it (chunk, logits dtype)."""
  def eval_step(params, biases, batch: Batch):
    loss_sum, (weight_sum, *_) = _loss(graphdef, params, biases, batch, train)
    return loss_sum, weight_sum
  return eval_step


def jit_train_step(step_fn: Callable, *, donate: bool, state=None) -> Callable:
  """jax.jit of the step; donates params, optimizer state and biases when ``donate``; ``state``
  (a :class:`~k3jax.train_state.TrainState` of arrays or of ``ShapeDtypeStruct``s with
  shardings) pins the outputs to its layout."""
  out = None if state is None else (
      *jax.tree.map(lambda x: x.sharding, (state.params, state.opt_state, state.biases)), None)
  return jax.jit(step_fn, donate_argnums=(0, 1, 2) if donate else (), out_shardings=out)


def batch_spec(batch: int, seq_len: int, sharding=None, *, vision: VisionConfig | None = None,
               patches: int = 0) -> dict[str, jax.ShapeDtypeStruct]:
  """The step's abstract batch: ``input_ids``, ``targets``, ``segment_ids``, ``positions`` int32
  and ``weights`` float32, each ``[batch, seq_len]`` laid out by ``sharding``; with ``vision``,
  the rows' vision arrays of ``patches`` patches (:func:`k3jax.vision.batch`, keys
  ``vision_<name>``, rows split as the batch's)."""
  out = {k: jax.ShapeDtypeStruct((batch, seq_len), jnp.float32 if k == "weights" else jnp.int32,
                                 sharding=sharding)
         for k in ("input_ids", "targets", "segment_ids", "positions", "weights")}
  if vision is not None:
    from k3jax.vision import batch as vision_batch
    rows = _rows_only(sharding)
    out.update({VISION_PREFIX + k: jax.ShapeDtypeStruct((batch,) + v.shape[1:], v.dtype,
                                                        sharding=rows)
                for k, v in vision_batch([], patches, cfg=vision).items()})
  return out


def _rows_only(sharding):
  """``sharding`` of ``[B, T]`` arrays -> the one that splits only the rows (vision arrays)."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(sharding.spec[0]))


def place_batch(batch: dict, sharding) -> dict:
  """This process's rows -> global ``[B, T]`` arrays laid out by ``sharding``
  (:func:`sharding.batch_sharding`); vision arrays split by rows only."""
  rows = _rows_only(sharding)
  return {k: jax.make_array_from_process_local_data(rows if k.startswith(VISION_PREFIX)
                                                    else sharding, v)
          for k, v in batch.items()}


def trace_train_step(jitted: Callable, state, batch: dict[str, jax.ShapeDtypeStruct]):
  """The jitted step traced for ``state`` (a :class:`~k3jax.train_state.TrainState` of arrays or
  of ``ShapeDtypeStruct``s: their shardings are the program's) and ``batch``
  (:func:`batch_spec`), under the current mesh: the program ``train.py`` compiles and
  :mod:`k3jax.plan` lowers."""
  step = jax.ShapeDtypeStruct((), jnp.int32)  # laid out as the scalar each call passes
  return jitted.trace(state.params, state.opt_state, state.biases, step, state.rng, batch)


def apply_step(executable: Callable, state, step: int, batch: dict) -> tuple[Any, dict]:
  """One step of the jitted or compiled train step on ``state`` (a
  :class:`~k3jax.train_state.TrainState`) at ``step`` (0-based): (the next state, the metrics)."""
  params, opt_state, biases, metrics = executable(state.params, state.opt_state, state.biases,
                                                  jnp.int32(step), state.rng, batch)
  return state.replace(params=params, opt_state=opt_state, biases=biases), metrics


@dataclasses.dataclass(frozen=True)
class CompileReport:
  """Seconds spent tracing, lowering and compiling a step, and XLA's memory analysis of the
  executable (None where the backend gives none)."""
  trace_s: float
  lower_s: float
  compile_s: float
  memory: Any = None

  @property
  def total_s(self) -> float:
    return self.trace_s + self.lower_s + self.compile_s

  def __str__(self) -> str:
    return (f"trace {self.trace_s:.1f} s + lower {self.lower_s:.1f} s + compile "
            f"{self.compile_s:.1f} s = {self.total_s:.1f} s")


def compile_train_step(jitted: Callable, state, batch: dict[str, jax.ShapeDtypeStruct]
                       ) -> tuple[Callable, CompileReport]:
  """:func:`trace_train_step`, lowered and compiled ahead of time. Calling the executable never
  compiles again (arguments laid out otherwise raise an error instead), where ``jax.jit``'s own
  dispatch may compile a second time (benchmarks/RESULTS.md, Training run 48)."""
  t0 = time.perf_counter()
  traced = trace_train_step(jitted, state, batch)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  compiled = lowered.compile()
  t3 = time.perf_counter()
  return compiled, CompileReport(t1 - t0, t2 - t1, t3 - t2, compiled.memory_analysis())
