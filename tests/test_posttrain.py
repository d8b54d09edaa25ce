"""Post-training on CPU with a shrunk k3_tiny: SFT loss masking, the importance ratio against the
engine's behaviour log-probs, pause/resume exactness on the engine, GRPO's reward rising and OPD
lowering the student's KL to its teachers (the last two slow)."""


import jax
import numpy as np
import pytest
from flax import nnx

from k3jax import data as data_lib
from k3jax.latent_moe import RouterBias
from k3jax.model import K3Model
from k3jax.posttrain import loop, objective, sft, tasks
from k3jax.posttrain.rollout import Trajectory, to_batches
from k3jax.serve.engine import Engine
from k3jax.serve.types import SamplingParams
from k3jax.tokenizer import ByteTokenizer
from tests.conftest import tiny_config

SMALL = ("model.hidden_size=64", "model.num_layers=2", "model.mla_layers=[1]",
         "model.dense_layers=[0]", "model.dense_intermediate=128", "model.moe.num_experts=4",
         "model.moe.top_k=2", "model.moe.expert_intermediate=32", "model.moe.latent_dim=32",
         "model.kda.num_heads=2", "model.mla.num_heads=2", "model.mla.q_lora_rank=32",
         "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16",
         "model.mla.qk_rope_head_dim=16", "model.mla.v_head_dim=16",
         "serve.max_batch=64", "serve.prefill_rows=8", "serve.block_size=32", "serve.page_size=16",
         "serve.max_model_len=64", "serve.token_budget=256", "data.seq_len=128",
         "train.batch_size=4", "checkpoint.enabled=false", "data.prefetch=0")


def test_sft_masks_all_but_assistant_tokens():
  tok = ByteTokenizer()
  chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "copy 4"},
          {"role": "assistant", "content": "4"}, {"role": "user", "content": "2+3"},
          {"role": "assistant", "content": "5!"}]
  ids, mask = sft.encode_chat(tok, chat, 256, 257)
  assert ids[0] == 256
  assert [int(i) for i in ids[mask == 1]] == [ord("4"), 257, ord("5"), ord("!"), 257]
  text = tok.decode([int(i) for i in ids[mask == 0]])
  assert text == "system: be brief\nuser: copy 4\nassistant: \nuser: 2+3\nassistant: "
  # the pipeline: packed rows whose weights sit on assistant tokens only
  cfg = tiny_config("train.mode=sft", "data.source=builtin", "data.seq_len=64", "data.prefetch=0",
                    "posttrain.tasks=[add]")
  batch = next(iter(data_lib.Data(cfg).dataset("train", 64)))
  w = batch["weights"] > 0
  assert w.any() and (batch["segment_ids"][w] > 0).all()
  assert set(batch["targets"][w].tolist()) <= {ord(c) for c in "0123456789"} | {257}
  assert (~w & (batch["targets"] == 257)).sum() == 0  # every eos is trained on
  assert w.mean() < 0.3  # prompts are not


def test_sft_bad_chat_is_one_clear_error(tmp_path):
  path = tmp_path / "chat.jsonl"
  path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
  cfg = tiny_config("train.mode=sft", f"data.source={path}")
  with pytest.raises(data_lib.DataError, match="chat.jsonl:1: no assistant message"):
    data_lib.Data(cfg)


def test_task_rewards_and_budget():
  p = tasks.Problem("add", "7+6", "3", budget=3)
  assert tasks.reward(p, "3", True, 2) == 1.0
  assert tasks.reward(p, "4", True, 2) == 0.0
  assert tasks.reward(p, "3", False, 3) == -1.0  # never ended within its budget
  assert tasks.reward(p, "3", True, 4) == -1.0  # ended, but past the budget
  assert [q.answer for q in tasks.problems(("add",), 3, budget=2, seed=0)] == [
      str(sum(int(c) for c in q.prompt.split("+")) % 10)
      for q in tasks.problems(("add",), 3, budget=2, seed=0)]


@pytest.fixture(scope="module")
def setup():
  cfg = tiny_config(*SMALL)
  model = K3Model(cfg.model, rngs=nnx.Rngs(0))
  engine = Engine(model, cfg.serve)
  graphdef, params, biases = nnx.split(model, nnx.Param, RouterBias)
  return cfg, engine, graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(biases)


def _sample(engine, prompts, seed, max_tokens=6):
  outs = {}

  def cb(o):
    outs.setdefault(o.request_id, []).append(o)

  ids = [engine.submit(p, SamplingParams(max_tokens=max_tokens, seed=seed + i, ignore_eos=True), cb)
         for i, p in enumerate(prompts)]
  while engine.has_work():
    engine.step()
  return [[o for o in outs[i] if o.token is not None] for i in ids]


def _logp_and_batch(cfg, graphdef, params, biases, prompts, outs):
  trajs = [Trajectory(None, p, [o.token for o in out], [o.logprob for o in out], [0] * len(out))
           for p, out in zip(prompts, outs)]
  b = to_batches(trajs, 0, rows=2, seq_len=64, pad=cfg.model.pad_token_id,
                 per_token={"advantages": [np.ones(len(t.tokens)) for t in trajs]})[0]
  return np.asarray(jax.jit(objective.token_logps, static_argnums=0)(graphdef, params, biases, b)[0]), b


@pytest.mark.slow
def test_importance_ratio_is_one_for_the_sampling_policy(setup):
  cfg, engine, graphdef, params, biases = setup
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(3, 256, n)] for n in (5, 40, 9)]
  for version in range(2):
    if version:  # new weights pushed into the running engine: its log-probs follow them
      assert engine.index.blocks  # the first round's prompts were cached ...
      params = jax.tree.map(lambda x: x * 1.05, params)
      engine.update_weights(params, biases)
      assert not engine.index.blocks  # ... and are stale now
    outs = _sample(engine, prompts, seed=version * 10)
    logp, b = _logp_and_batch(cfg, graphdef, params, biases, prompts, outs)
    w = b["weights"] > 0
    ratio = np.exp(logp - b["behaviour_logp"])[w]
    np.testing.assert_allclose(ratio, 1.0, atol=2e-3)
  # exactly equal log-probs: ratio 1, no KL, the loss is the plain policy gradient -A
  terms = objective.token_terms(logp, {**b, "behaviour_logp": logp}, cfg.posttrain)
  assert np.all(np.asarray(terms["ratio"]) == 1.0) and np.all(np.asarray(terms["kl"]) == 0.0)
  np.testing.assert_allclose(np.asarray(terms["loss"]), -b["advantages"])


@pytest.mark.slow
def test_pause_resume_is_token_for_token(setup):
  cfg, engine, *_ = setup
  engine.index.clear()
  prompt = list(range(40, 75))
  params = SamplingParams(max_tokens=20, seed=123, ignore_eos=True)
  ref = engine.generate([prompt], params)[0]
  got, other = [], []
  rid = engine.submit(prompt, params, lambda o: o.token is not None and got.append(o.token))
  for _ in range(4):
    engine.step()
  engine.pause(rid)
  paused_at = len(got)
  assert 0 < paused_at < 20
  held = engine.paused[rid]
  slot, pages = held.slot, list(held.pages)
  assert slot is not None and pages
  # other work runs (and takes pages) while it is paused; its cache stays
  engine.submit(list(range(100, 150)), SamplingParams(max_tokens=8, seed=5),
                lambda o: o.token is not None and other.append(o.token))
  while engine.has_work():
    engine.step()
  assert len(got) == paused_at and len(other) == 8
  assert (held.slot, held.pages) == (slot, pages)  # its cache was kept, not recomputed
  assert engine.slots.refs[slot] >= 1 and all(engine.pages.refs[p] >= 1 for p in pages)
  engine.resume(rid)
  while engine.has_work():
    engine.step()
  assert got == ref


@pytest.mark.slow
def test_grpo_reward_rises(tmp_path):
  from k3jax import config, train
  sft_cfg = tiny_config(*SMALL, "train.mode=sft", "data.source=builtin", "posttrain.tasks=[copy]",
                        "train.steps=40", "train.eval_every=0", "checkpoint.enabled=true",
                        "checkpoint.every=40", "optimizer.lr=3e-3", "optimizer.warmup_steps=5")
  train.train(sft_cfg, tmp_path / "sft", progress=False)
  rl = config.replace(sft_cfg, ["train.mode=rl", f"train.init_from={tmp_path / 'sft'}",
                                "train.steps=16", "checkpoint.enabled=false",
                                "posttrain.prompts_per_step=8", "posttrain.group_size=8",
                                "posttrain.partial_fraction=0.75", "optimizer.lr=1e-3",
                                "optimizer.schedule=constant", "optimizer.warmup_steps=0",
                                "optimizer.weight_decay=0"])
  recs = loop.run(rl, tmp_path / "rl", progress=False)
  rewards = [r["reward"] for r in recs if r.get("reward") is not None]
  print(rewards)
  assert np.mean(rewards[-4:]) > np.mean(rewards[:4]) + 0.1
  assert any(r["stale_fraction"] > 0 for r in recs)  # partial rollout carried tokens over
  assert any(r["resumed"] > 0 for r in recs)


@pytest.mark.slow
def test_opd_lowers_the_students_kl_to_its_teachers(tmp_path):
  cfg = tiny_config(*SMALL, "train.mode=opd", "train.steps=12", "train.eval_every=12",
                    "posttrain.tasks=[copy,add]", "posttrain.teachers=[a,b]",
                    "posttrain.teacher_tasks=[copy,add]", "posttrain.prompts_per_step=4",
                    "posttrain.group_size=4", "posttrain.eval_prompts=8",
                    "optimizer.lr=2e-3", "optimizer.schedule=constant",
                    "optimizer.warmup_steps=0", "optimizer.weight_decay=0")
  teachers = []
  for seed in (1, 2):
    _, p, b = nnx.split(K3Model(cfg.model, rngs=nnx.Rngs(seed)), nnx.Param, RouterBias)
    p = nnx.to_pure_dict(p)
    p["lm_head"]["kernel"] = p["lm_head"]["kernel"] * 10  # peaked teachers: a KL worth closing
    teachers.append((p, nnx.to_pure_dict(b)))
  recs = loop.run(cfg, tmp_path / "opd", progress=False, teachers=teachers)
  kls = [r["eval_kl"] for r in recs if "eval_kl" in r]
  print(kls)
  assert kls[-1] < 0.7 * kls[0]
  assert all(r["teacher_kl"] > 0 for r in recs if "teacher_kl" in r)
