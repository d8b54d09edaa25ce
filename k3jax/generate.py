"""Cached decoding: prefill plus single-token steps with the hybrid cache, and sampling.

Per request the cache holds, for KDA layers, the short-conv tails and the float32 recurrent state,
and for MLA layers the latent ``[c, k_r]`` of every token (``kv_b_proj`` absorbed at decode).
Prompts of different lengths are right-padded; ``lengths [B]`` tracks each request.

``python -m k3jax.generate --config configs/k3_tiny.yaml --prompt "def main("`` generates from a
randomly initialised model (or from trained parameters with ``--run-dir``).
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.model import K3Model


@functools.partial(jax.jit, static_argnums=(0, 4))
def _prefill(graphdef, state, tokens, lengths, max_len):
  model = nnx.merge(graphdef, state)
  b, t = tokens.shape
  valid = jnp.arange(t)[None, :] < lengths[:, None]
  h, aux = model.hidden(tokens, valid=valid, cache=model.init_cache(b, max_len))
  last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
  return model.logits(last), aux["cache"]


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _decode(graphdef, state, cache, tokens, lengths):
  model = nnx.merge(graphdef, state)
  h, aux = model.hidden(tokens[:, None], cache=cache, decode=True, lengths=lengths)
  return model.logits(h[:, -1]), aux["cache"]


def sample(logits: jax.Array, rng: jax.Array, temperature: float = 0.0, top_p: float = 1.0):
  """``[B, V]`` logits -> ``[B]`` int32 tokens: greedy at temperature 0, else temperature and
  nucleus (top-p) sampling."""
  if temperature <= 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (always at least the top token)
    keep = (cum - probs) < top_p
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def generate(model: K3Model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, rng: jax.Array | None = None,
             eos_id: int | None = None) -> list[list[int]]:
  """Generates up to ``max_new_tokens`` after each prompt; stops a request at ``eos_id``.

  Returns the new tokens of each request (the eos token included when produced).
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("generate: every prompt needs at least one token")
  vocab = model.cfg.vocab_size
  if any(not 0 <= t < vocab for p in prompts for t in p):
    raise ValueError(f"generate: prompt token ids must lie in [0, {vocab})")
  rng = jax.random.key(0) if rng is None else rng
  graphdef, state = nnx.split(model)
  b = len(prompts)
  t = max(len(p) for p in prompts)
  tokens = np.full((b, t), model.cfg.pad_token_id, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
  logits, cache = _prefill(graphdef, state, jnp.asarray(tokens), lengths, t + max_new_tokens)
  out = [[] for _ in range(b)]
  done = np.zeros(b, bool)
  for step in range(max_new_tokens):
    rng, key = jax.random.split(rng)
    nxt = sample(logits, key, temperature, top_p)
    host = np.asarray(nxt)
    for i in range(b):
      if not done[i]:
        out[i].append(int(host[i]))
        done[i] = eos_id is not None and host[i] == eos_id
    if done.all() or step == max_new_tokens - 1:
      break
    lengths = lengths + 1
    logits, cache = _decode(graphdef, state, cache, nxt, lengths)
  return out


def main(argv: list[str] | None = None) -> None:
  from k3jax import config as config_lib
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="configs/k3_tiny.yaml")
  p.add_argument("--prompt", default="def main(")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("overrides", nargs="*", help="config overrides key=value")
  args = p.parse_args(argv)
  cfg = config_lib.load(args.config, args.overrides)
  model = K3Model(cfg.model, rngs=nnx.Rngs(args.seed))
  prompt = list(args.prompt.encode("utf-8"))
  new = generate(model, [prompt], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                 top_p=args.top_p, rng=jax.random.key(args.seed), eos_id=cfg.model.eos_token_id)[0]
  text = bytes(t for t in new if t < 256).decode("utf-8", errors="replace")
  print(f"prompt: {args.prompt!r}\ntokens: {new}\ntext: {text!r}")


if __name__ == "__main__":
  main(sys.argv[1:])
