"""Parameter and cache accounting from a config, without allocating weights.

``python -m k3jax.info CONFIG [key=value ...]`` prints JSON with ``total_params``,
``active_params`` (the weights one token is multiplied by: the embedding lookup excluded, the
output head included, routed experts counted at ``top_k / num_experts``), a per-component
breakdown and the decode cache size.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import cli, config as config_lib
from k3jax.config import ModelConfig


def abstract_params(cfg: ModelConfig):
  """The model's parameter state as ``jax.ShapeDtypeStruct`` leaves (nothing allocated)."""
  from k3jax.train_state import abstract_model
  return nnx.state(abstract_model(cfg), nnx.Param)


def _component(path: tuple) -> str:
  keys = [str(getattr(p, "key", p)) for p in path]
  if keys[0] == "embed_tokens":
    return "embedding"
  if keys[0] == "lm_head":
    return "lm_head"
  if keys[0] in ("vision_tower", "mm_projector"):
    return "vision"
  if keys[0] != "layers":
    return "final"
  rest = keys[2:]
  if rest[0] == "self_attn":
    return "attention"
  if rest[0] == "mlp":
    if rest[1] == "experts":
      return "routed_experts"
    if rest[1] == "shared_experts":
      return "shared_experts"
    if rest[1] == "gate":
      return "router"
    if rest[1].startswith("routed_expert_"):
      return "latent_projections"
    return "dense_mlp"
  if rest[0].endswith("_res"):
    return "attn_res"
  return "norms"


def param_counts(cfg: ModelConfig) -> dict:
  """Total and activated parameter counts with a per-component breakdown."""
  state = abstract_params(cfg)
  comp: dict[str, int] = defaultdict(int)
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    comp[_component(path)] += math.prod(leaf.shape)
  total = sum(comp.values())
  routed_active = comp["routed_experts"] * cfg.moe.top_k / cfg.moe.num_experts
  # the vision tower's weights multiply image patches, not the text tokens
  active = total - comp["embedding"] - comp["routed_experts"] - comp["vision"] + routed_active
  mla = len(cfg.mla_layers)
  kda = cfg.num_layers - mla
  k, a = cfg.kda, cfg.mla
  cbytes = jnp.dtype(cfg.cdtype).itemsize
  return {
      "config": cfg.name,
      "total_params": int(total),
      "active_params": int(round(active)),
      "components": dict(sorted(comp.items())),
      "layers": {"kda": kda, "mla": mla, "moe": sum(cfg.is_moe(i) for i in range(cfg.num_layers))},
      "cache": {
          "mla_bytes_per_token": mla * (a.kv_lora_rank + a.qk_rope_head_dim) * cbytes,
          "kda_state_bytes_per_request": kda * (
              k.value_heads * k.head_dim * k.v_head_dim * 4
              + (k.conv_size - 1) * (2 * k.num_heads * k.head_dim + k.value_heads * k.v_head_dim) * cbytes),
      },
  }


def main(argv: list[str] | None = None) -> int:
  p = cli.parser("python -m k3jax.info", "Parameter counts and cache sizes of a config.",
                 config_positional=True)
  args = cli.parse(p, argv)
  try:
    cfg = cli.load(args.config, args.overrides)
  except config_lib.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(json.dumps(param_counts(cfg.model), indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
