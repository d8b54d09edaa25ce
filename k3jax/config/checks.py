"""Checks that a config's values fit together (:func:`validate`), each naming its key."""

from __future__ import annotations

from typing import Any

from k3jax.config.model import IMPLEMENTATIONS, KERNEL_HEAD_DIMS, ConfigError, ModelConfig
from k3jax.config.run import Config


# ---------------------------------------------------------------------------------------------


def _check(cond: bool, key: str, msg: str) -> None:
  if not cond:
    raise ConfigError(f"{key}: {msg}")


def _one_of(value: Any, options: tuple, key: str) -> None:
  _check(value in options, key, f"must be one of {options}, got {value!r}")


def validate(cfg: Config) -> None:
  m = cfg.model
  _one_of(m.arch, ("kimi_k3", "kimi_linear"), "model.arch")
  _one_of(m.activation, ("situ", "silu"), "model.activation")
  _one_of(m.param_dtype, ("float32", "bfloat16", "float64"), "model.param_dtype")
  _one_of(m.compute_dtype, ("float32", "bfloat16", "float64"), "model.compute_dtype")
  _one_of(m.remat, ("none", "full", "dots", "dots_kernels"), "model.remat")
  _check(0 <= m.remat_skip <= m.num_layers, "model.remat_skip",
         f"must be in [0, num_layers={m.num_layers}], got {m.remat_skip}")
  for name in ("vocab_size", "hidden_size", "num_layers", "dense_intermediate"):
    _check(getattr(m, name) > 0, f"model.{name}", "must be positive")
  for name in ("mla_layers", "dense_layers"):
    for i in getattr(m, name):
      _check(0 <= i < m.num_layers, f"model.{name}",
             f"layer index {i} out of range for num_layers={m.num_layers}")
  for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
    _check(0 <= getattr(m, name) < m.vocab_size, f"model.{name}", "must be a token id < vocab_size")

  for part, names in IMPLEMENTATIONS.items():
    _one_of(getattr(m, part).implementation, (None, *names), f"model.{part}.implementation")

  k = m.kda
  _one_of(k.gate, ("bounded", "softplus"), "model.kda.gate")
  _one_of(k.output_gate, ("full", "low_rank"), "model.kda.output_gate")
  _one_of(k.conv_implementation, (None, "xla", "pallas", "pallas_gpu"),
          "model.kda.conv_implementation")
  _one_of(m.attn_res.implementation, (None, "xla", "pallas", "pallas_gpu"),
          "model.attn_res.implementation")
  _one_of(m.glu_implementation, (None, "xla", "pallas", "pallas_gpu", "pallas_tpu"),
          "model.glu_implementation")
  _check(k.head_dim in KERNEL_HEAD_DIMS, "model.kda.head_dim",
         f"the KDA kernels take head dims {KERNEL_HEAD_DIMS}, got {k.head_dim}")
  _check(k.v_head_dim in KERNEL_HEAD_DIMS, "model.kda.v_head_dim",
         f"the KDA kernels take head dims {KERNEL_HEAD_DIMS}, got {k.v_head_dim}")
  _check(k.num_heads > 0, "model.kda.num_heads", "must be positive")
  _check(k.value_heads % k.num_heads == 0, "model.kda.num_v_heads",
         f"must be a multiple of num_heads={k.num_heads}, got {k.num_v_heads}")
  _check(k.gate_lower_bound < 0, "model.kda.gate_lower_bound", "must be negative")
  _check(k.conv_size >= 1, "model.kda.conv_size", "must be >= 1")
  _check(k.chunk_size in (16, 32, 64, 128), "model.kda.chunk_size", "must be 16, 32, 64 or 128")

  a = m.mla
  _check(a.num_heads > 0, "model.mla.num_heads", "must be positive")
  _check(a.kv_lora_rank > 0, "model.mla.kv_lora_rank", "must be positive")
  _check(a.q_lora_rank >= 0, "model.mla.q_lora_rank", "must be >= 0")
  for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
    _check(getattr(a, name) > 0, f"model.mla.{name}", "must be positive")

  e = m.moe
  _one_of(e.balancing, ("quantile", "quantile_hist", "sign", "none"), "model.moe.balancing")
  _check(e.num_experts > 0, "model.moe.num_experts", "must be positive")
  _check(1 <= e.top_k <= e.num_experts, "model.moe.top_k",
         f"top_k={e.top_k} must be between 1 and num_experts={e.num_experts}")
  _check(e.top_k < e.num_experts or e.balancing == "none", "model.moe.balancing",
         "quantile balancing needs top_k < num_experts")
  _check(e.balancing_iters >= 1, "model.moe.balancing_iters", "must be >= 1")
  _check(e.latent_dim >= 0, "model.moe.latent_dim", "must be >= 0")
  _check(e.num_shared_experts >= 0, "model.moe.num_shared_experts", "must be >= 0")
  _check(e.dense_decode_tokens >= 0, "model.moe.dense_decode_tokens",
         f"must be >= 0 (0: never), got {e.dense_decode_tokens}")
  _check(e.dense_decode_unpicked_mb >= 0, "model.moe.dense_decode_unpicked_mb",
         f"must be >= 0, got {e.dense_decode_unpicked_mb}")

  _check(m.attn_res.block_size > 0, "model.attn_res.block_size", "must be positive")
  if m.vision is not None:
    _validate_vision(m)

  _check(cfg.data.seq_len > 0, "data.seq_len", "must be positive")
  _check(bool(cfg.data.image_marker), "data.image_marker", "must not be empty")
  _check(cfg.data.max_patches >= 0, "data.max_patches", "must be >= 0 (0: model.vision.max_patches)")
  _check(0.0 <= cfg.data.eval_fraction < 1.0, "data.eval_fraction", "must be in [0, 1)")
  _check(cfg.data.prefetch >= 0, "data.prefetch", "must be >= 0")
  t = cfg.train
  _check(t.steps >= 0, "train.steps", "must be >= 0")
  _check(t.batch_size > 0, "train.batch_size", "must be positive")
  _check(t.grad_accum > 0, "train.grad_accum", "must be positive")
  _check(t.loss_chunk > 0, "train.loss_chunk", "must be positive")
  _check(t.log_every > 0, "train.log_every", "must be positive")
  _check(t.eval_every >= 0, "train.eval_every", "must be >= 0 (0: no eval)")
  _check(t.eval_batches > 0, "train.eval_batches", "must be positive")
  _check(t.max_nonfinite > 0, "train.max_nonfinite", "must be positive")
  _check(t.batch_size % t.grad_accum == 0, "train.grad_accum",
         f"must divide train.batch_size={t.batch_size}")
  _one_of(t.mode, ("pretrain", "sft", "rl", "opd"), "train.mode")
  for i, s in enumerate(t.stages):
    _check(s.seq_len > 0 and s.steps > 0, f"train.stages[{i}]", "seq_len and steps must be positive")
  o = cfg.optimizer
  _one_of(o.name, ("adamw", "muon"), "optimizer.name")
  _one_of(o.schedule, ("wsd", "cosine", "constant"), "optimizer.schedule")
  _one_of(o.muon_ns_precision, ("bf16", "f32"), "optimizer.muon_ns_precision")
  _one_of(o.ns_form, ("sums", "polynomial"), "optimizer.ns_form")
  _check(o.lr > 0, "optimizer.lr", f"must be positive, got {o.lr}")
  _check(0 <= o.min_lr_ratio <= 1, "optimizer.min_lr_ratio", "must be in [0, 1]")
  _check(o.warmup_steps >= 0, "optimizer.warmup_steps", "must be >= 0")
  _check(0 <= o.decay_fraction <= 1, "optimizer.decay_fraction", "must be in [0, 1]")
  for name in ("b1", "b2", "muon_beta"):
    _check(0 <= getattr(o, name) < 1, f"optimizer.{name}", "must be in [0, 1)")
  _check(o.eps > 0, "optimizer.eps", "must be positive")
  for name in ("weight_decay", "grad_clip"):
    _check(getattr(o, name) >= 0, f"optimizer.{name}", "must be >= 0")
  _check(cfg.checkpoint.every > 0, "checkpoint.every", "must be positive")
  _check(cfg.checkpoint.keep > 0, "checkpoint.keep", "must be positive")
  for name in ("data", "fsdp", "expert", "context", "tensor"):
    v = getattr(cfg.mesh, name)
    _check(v == -1 or v > 0, f"mesh.{name}", "must be positive or -1 (the rest of the devices)")
  _check(sum(getattr(cfg.mesh, n) == -1 for n in ("data", "fsdp", "expert", "context", "tensor")) <= 1,
         "mesh", "at most one axis may be -1")
  ea = cfg.mesh.expert_axes
  _check(len(ea) > 0 and len(set(ea)) == len(ea) and set(ea) <= {"data", "fsdp", "expert", "context"},
         "mesh.expert_axes", f"{list(ea)}: must be distinct axes among data, fsdp, expert, context")
  s = cfg.serve
  _check(0 <= s.port < 65536, "serve.port", f"must be in [0, 65535] (0: any free port), got {s.port}")
  for name in ("max_batch", "prefill_rows", "min_decode_rows", "block_size", "page_size",
               "max_model_len", "token_budget", "checkpoint_every", "default_max_tokens"):
    _check(getattr(s, name) > 0, f"serve.{name}", f"must be positive, got {getattr(s, name)}")
  _check(s.block_size % s.page_size == 0, "serve.block_size",
         f"must be a multiple of serve.page_size={s.page_size}, got {s.block_size}")
  _check(s.num_pages >= 0 and s.num_slots >= 0, "serve", "num_pages and num_slots must be >= 0 "
         "(0: sized from max_batch and max_model_len)")
  _check(s.token_budget >= s.block_size, "serve.token_budget",
         f"must be at least serve.block_size={s.block_size}, got {s.token_budget}")
  _validate_posttrain(cfg)


def _validate_vision(m: ModelConfig) -> None:
  v = m.vision
  for name in ("patch_size", "channels", "hidden_size", "num_layers", "num_heads",
               "intermediate_size", "pos_emb_height", "pos_emb_width", "pos_emb_frames",
               "rope_max_grid", "in_patch_limit", "frame_patch_limit", "side_limit", "max_patches",
               "max_pixels"):
    _check(getattr(v, name) > 0, f"model.vision.{name}", f"must be positive, got {getattr(v, name)}")
  _check(v.qkv_size >= 0, "model.vision.qkv_size", "must be >= 0 (0: hidden_size)")
  _check(v.attn_size % v.num_heads == 0, "model.vision.num_heads",
         f"must divide the attention width {v.attn_size}, got {v.num_heads}")
  _check(v.head_dim % 4 == 0, "model.vision.num_heads",
         f"the 2D rotary embedding needs a head dim divisible by 4, got {v.head_dim}")
  _check(len(v.merge_kernel) == 2 and min(v.merge_kernel) > 0, "model.vision.merge_kernel",
         f"must be two positive sizes (rows, cols), got {list(v.merge_kernel)}")
  _check(v.max_patches % v.merge == 0, "model.vision.max_patches",
         f"must be a multiple of the merge kernel's {v.merge} patches, got {v.max_patches}")
  for name in ("image_mean", "image_std"):
    _check(len(getattr(v, name)) == v.channels, f"model.vision.{name}",
           f"needs one value per channel ({v.channels})")
  _check(min(v.image_std) > 0, "model.vision.image_std", "must be positive")
  _check(v.norm_eps > 0 and v.projector_eps > 0, "model.vision.norm_eps",
         "norm_eps and projector_eps must be positive")
  _one_of(v.pos_emb_interpolation, ("bicubic", "bilinear"), "model.vision.pos_emb_interpolation")
  _one_of(v.norm, ("layernorm", "rmsnorm"), "model.vision.norm")
  _one_of(v.video_attention, ("joint", "divided"), "model.vision.video_attention")
  _one_of(v.projector, ("patchmerger", "patchmerger_v2"), "model.vision.projector")
  _one_of(v.alpha, ("chessboard", "drop"), "model.vision.alpha")
  _check(0 <= v.image_token_id < m.vocab_size, "model.vision.image_token_id",
         f"must be a token id < vocab_size={m.vocab_size}, got {v.image_token_id}")
  _check(v.image_token_id not in (m.bos_token_id, m.eos_token_id, m.pad_token_id),
         "model.vision.image_token_id", "must differ from the bos, eos and pad ids")


def _validate_posttrain(cfg: Config) -> None:
  from k3jax.posttrain.tasks import TASKS
  p = cfg.posttrain
  _check(len(p.tasks) > 0, "posttrain.tasks", "must name at least one task")
  for t in p.tasks + p.teacher_tasks:
    _one_of(t, tuple(TASKS), "posttrain.tasks" if t in p.tasks else "posttrain.teacher_tasks")
  for name in ("prompts_per_step", "group_size", "token_budget", "eval_prompts"):
    _check(getattr(p, name) > 0, f"posttrain.{name}", f"must be positive, got {getattr(p, name)}")
  _check(p.temperature > 0, "posttrain.temperature", "must be positive (rollouts sample)")
  _check(0 < p.partial_fraction <= 1, "posttrain.partial_fraction",
         f"must be in (0, 1], got {p.partial_fraction}")
  for name in ("clip_eps", "kl_coef", "stale_kl_coef"):
    _check(getattr(p, name) >= 0, f"posttrain.{name}", "must be >= 0")
  _check(not p.teacher_tasks or len(p.teacher_tasks) == len(p.teachers), "posttrain.teacher_tasks",
         f"must name one task per teacher ({len(p.teachers)} teachers)")
  _check(cfg.train.mode != "opd" or p.teachers, "posttrain.teachers",
         "train.mode=opd needs at least one teacher directory")
