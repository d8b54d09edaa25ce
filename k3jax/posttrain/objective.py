"""The post-training objective: a clipped policy gradient against the behaviour policy, with a
per-token KL penalty that is stronger on stale tokens.

A batch is a packed ``[B, T]`` training batch (:func:`k3jax.train_step.batch_spec`) whose
``weights`` are 1 on sampled (completion) targets, plus per-target ``advantages``,
``behaviour_logp`` (the sampling policy's log-prob of the target, recorded by the engine) and
``stale`` (1 where an older policy than the newest sampled the token: partial rollout). Per token,
with ``r = exp(logp - behaviour_logp)`` and ``d = behaviour_logp - logp``::

  loss = -min(r * A, clip(r, 1 - eps, 1 + eps) * A) + (kl_coef + stale * stale_kl_coef) * (e^d - d - 1)

``e^d - d - 1`` is the non-negative k3 estimator of KL(current || behaviour): it limits how far
the update moves the log-prob of a token away from the policy that sampled it. The loss is a mean
over sampled tokens. GRPO passes group-normalised rewards as ``A`` on every token of a trajectory.
OPD passes ``A = 0`` and adds, at every position the student sampled, the exact reverse KL to
the teacher routed to that trajectory (:func:`policy_loss`); the ratio and KL terms still bound
the update on stale tokens.

Log-probs come from the full ``[B, T, V]`` logits of a micro-batch: post-training's rows are few.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax import layer_stacks
from k3jax.config import PostTrainConfig

RL_KEYS = ("advantages", "behaviour_logp", "stale")


def log_probs(graphdef, params, biases, batch) -> tuple[jax.Array, dict]:
  """(log-softmax of the model's logits ``[B, T, V]`` float32, per-layer router stats)."""
  model, stacked = layer_stacks.merge(graphdef, params, biases)
  h, aux = model.hidden(batch["input_ids"], segment_ids=batch["segment_ids"], stacked=stacked)
  return jax.nn.log_softmax(model.logits(h).astype(jnp.float32), axis=-1), aux["moe"]


def token_logps(graphdef, params, biases, batch) -> tuple[jax.Array, dict]:
  """(log-prob of each target under the model ``[B, T]`` float32, per-layer router stats)."""
  logp, stats = log_probs(graphdef, params, biases, batch)
  return jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0], stats


def token_terms(logp, batch, post: PostTrainConfig) -> dict[str, jax.Array]:
  """Per-token ``loss``, ``ratio``, ``kl`` (to the behaviour policy) and ``clipped`` ``[B, T]``."""
  adv, old = batch["advantages"], batch["behaviour_logp"]
  ratio = jnp.exp(logp - old)
  clipped = jnp.clip(ratio, 1.0 - post.clip_eps, 1.0 + post.clip_eps)
  pg = -jnp.minimum(ratio * adv, clipped * adv)
  d = old - logp
  kl = jnp.exp(d) - d - 1.0
  coef = post.kl_coef + post.stale_kl_coef * batch["stale"]
  return {"loss": pg + coef * kl, "ratio": ratio, "kl": kl,
          "clipped": (ratio * adv > clipped * adv).astype(jnp.float32)}


def policy_loss(post: PostTrainConfig):
  """The ``loss`` of :func:`k3jax.train_step.make_train_step` for post-training: (summed token
  loss, (sampled tokens, router stats, sums of ``ratio``, ``kl``, ``clipped``)). A batch with
  ``teacher_logp`` ``[B, T, V]`` (OPD: the routed teacher's log-probs at each position) adds the
  exact reverse KL ``sum_v p(v) (log p(v) - teacher_logp(v))`` of every sampled position (and
  its sum ``teacher_kl``)."""
  def loss(graphdef, params, biases, batch):
    full, stats = log_probs(graphdef, params, biases, batch)
    logp = jnp.take_along_axis(full, batch["targets"][..., None], axis=-1)[..., 0]
    terms = token_terms(logp, batch, post)
    w = batch["weights"]
    if "teacher_logp" in batch:
      terms["teacher_kl"] = jnp.sum(jnp.exp(full) * (full - batch["teacher_logp"]), -1)
      terms["loss"] = terms["loss"] + terms["teacher_kl"]
    sums = {k: jnp.sum(jax.lax.stop_gradient(terms[k]) * w)
            for k in ("ratio", "kl", "clipped", "teacher_kl") if k in terms}
    return jnp.sum(terms["loss"] * w), (jnp.sum(w), stats, sums)
  return loss
