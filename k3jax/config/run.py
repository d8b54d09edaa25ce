"""The run's configuration around the model: data, optimizer, training, post-training,
checkpoints, mesh and serving, and :class:`Config`, which holds them all."""

from __future__ import annotations

import dataclasses

from k3jax.config.model import ModelConfig


@dataclasses.dataclass(frozen=True)
class DataConfig:
  source: str = "stdlib"  # "stdlib" (embedded default), or a path/glob of text/jsonl/parquet/arrayrecord
  tokenizer: str = "byte"  # "byte", a tokenizer.json path, or a tiktoken model file path
  text_field: str = "text"
  seq_len: int = 256
  eval_fraction: float = 0.02
  seed: int = 0
  shuffle: bool = True
  prefetch: int = 2  # batches prepared ahead in a background thread (0: none)
  # image-text data (model.vision set; k3jax.vision_data): the text standing for an image in a
  # document, and the vision patches of one packed row (0: model.vision.max_patches)
  image_marker: str = "<image>"
  max_patches: int = 0
  # A resume whose data settings (k3jax.train.DATA_KEYS) differ from its checkpoint's is refused unless this
  # is true: then the new data starts from its beginning instead of the saved iterator position.
  reset_iterator: bool = False


@dataclasses.dataclass(frozen=True)
class StageConfig:
  seq_len: int = 256
  steps: int = 0


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  name: str = "adamw"  # "adamw" or "muon"
  lr: float = 3e-3
  min_lr_ratio: float = 0.1
  schedule: str = "wsd"  # "wsd" (warmup-stable-decay), "cosine", "constant"
  warmup_steps: int = 20
  decay_fraction: float = 0.2
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  muon_per_head: bool = False
  muon_beta: float = 0.95  # Muon momentum
  # Matmul operands of Muon's Newton-Schulz iteration: "bf16" (float32 accumulation; float32
  # elsewhere) or "f32" (the backend's float32 matmul: TF32 on NVIDIA GPUs, exact on CPU).
  muon_ns_precision: str = "bf16"
  # The form of each Newton-Schulz step: "polynomial" or "sums" (k3jax.optim.NS_FORMS).
  ns_form: str = "polynomial"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 300
  batch_size: int = 8
  grad_accum: int = 1
  seed: int = 0
  eval_every: int = 50
  eval_batches: int = 4
  log_every: int = 10
  max_nonfinite: int = 5
  stages: tuple[StageConfig, ...] = ()
  peak_tflops: float = 0.0  # 0: look the device up
  # Tokens per chunk of the LM-head loss (logits [chunk, vocab] at a time): larger chunks
  # accumulate the head's gradient fewer times (benchmarks/RESULTS.md, Training run 20).
  loss_chunk: int = 4096
  # Store the head's logits in bf16 between its matmul and the softmax (k3jax/losses.py): half
  # the traffic of the step's largest tensors, each logit rounded to bf16 before the softmax.
  bf16_logits: bool = False
  # Start from the weights of this directory (an HF checkpoint, a converted Orbax directory or a
  # train.py run): parameters and router biases only, a fresh optimizer, step 0. "": random init.
  init_from: str = ""
  # "pretrain" (next-token loss on data.source), "sft" (chat JSONL, loss on assistant tokens),
  # "rl" (GRPO on posttrain.tasks) or "opd" (on-policy distillation from posttrain.teachers):
  # docs/posttraining.md.
  mode: str = "pretrain"


@dataclasses.dataclass(frozen=True)
class PostTrainConfig:
  """``train.mode`` sft, rl and opd (k3jax.posttrain, docs/posttraining.md)."""
  tasks: tuple[str, ...] = ("copy",)  # built-in verifiable tasks (k3jax.posttrain.tasks.TASKS)
  prompts_per_step: int = 8  # problems whose groups an iteration trains on
  group_size: int = 8  # samples per problem (GRPO normalises rewards within a group)
  token_budget: int = 4  # generated tokens a problem may use (eos included); over it: reward -1
  temperature: float = 1.0
  # Partial rollout: an iteration trains once this fraction of its groups has finished; the rest
  # are paused with their cache and resumed first in the next iteration (1.0: wait for all).
  partial_fraction: float = 1.0
  clip_eps: float = 0.2  # PPO clip of the importance ratio against the behaviour policy
  kl_coef: float = 0.0  # per-token KL(current || behaviour) penalty (k3 estimator)
  stale_kl_coef: float = 0.1  # added to kl_coef on tokens sampled by an older policy
  # OPD: teacher weight directories (HF, Orbax or run directories of this model) and the task each
  # one scores (same length; a task not listed goes to the first teacher).
  teachers: tuple[str, ...] = ()
  teacher_tasks: tuple[str, ...] = ()
  eval_prompts: int = 16  # fixed problems on which OPD measures the student's KL to its teachers
  seed: int = 0


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  enabled: bool = True  # false: neither restore nor save (benchmarks)
  every: int = 100
  keep: int = 3
  async_save: bool = True


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = -1
  fsdp: int = 1
  expert: int = 1
  context: int = 1
  tensor: int = 1
  moonep: bool = True
  # Mesh axes the routed experts are split over (expert parallelism). ("expert", "context") also
  # spreads them over the sequence-parallel ranks, whose tokens then go to experts by all-to-all.
  expert_axes: tuple[str, ...] = ("expert",)


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """``serve.py`` and :class:`k3jax.serve.engine.Engine` (docs/serving.md)."""
  host: str = "127.0.0.1"
  port: int = 8000  # 0: any free port (the URL printed when ready names it)
  model_name: str = ""  # the id /v1/models lists ("": the model config's name)
  max_batch: int = 64  # requests decoding together; decode steps compile for powers of two up to it
  prefill_rows: int = 4  # requests whose prompt chunks run in one prefill step
  # the fewest rows a decode step runs (one request pads to it): a one-row step was 2.1x slower
  # than two rows on an H100 (benchmarks/RESULTS.md, Serving run 13)
  min_decode_rows: int = 2
  block_size: int = 256  # prefix-cache block and largest prefill chunk (tokens; a multiple of page_size)
  page_size: int = 64  # MLA latent tokens per cache page
  num_pages: int = 0  # MLA pages per layer (0: enough for max_batch requests of max_model_len)
  num_slots: int = 0  # KDA state slots, requests' and prefix checkpoints' (0: 2 * max_batch + 1)
  max_model_len: int = 8192  # prompt plus generated tokens of one request
  token_budget: int = 2048  # prompt tokens prefilled per engine step (decode tokens not counted)
  prefix_cache: bool = True
  checkpoint_every: int = 1  # a KDA state checkpoint every this many blocks of a prompt
  default_max_tokens: int = 256  # max_tokens when a request leaves it out


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = ModelConfig()
  data: DataConfig = DataConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  train: TrainConfig = TrainConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  mesh: MeshConfig = MeshConfig()
  serve: ServeConfig = ServeConfig()
  posttrain: PostTrainConfig = PostTrainConfig()
