"""Cached decoding: prefill plus single-token steps with the hybrid cache, and sampling.

Per request the cache holds, for KDA layers, the short-conv tails and the float32 recurrent state,
and for MLA layers the latent ``[c, k_r]`` of every token (``kv_b_proj`` absorbed at decode).
Prompts of different lengths are right-padded; ``lengths [B]`` tracks each request.

``python -m k3jax.generate --checkpoint RUN_DIR|HF_DIR|ORBAX_DIR --prompt "def main("`` prints the
text generated from a trained or converted model (``--config k3_tiny``: a freshly initialised one).
Text prompts start with the BOS token, as every training document does, and go through the
tokenizer's chat template when it has one.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import tokenizer as tokenizer_lib
from k3jax.model import K3Model
from k3jax.serve.step import filter_logits


class GenerateError(ValueError):
  """A decoding argument or prompt that cannot be used."""


@functools.partial(jax.jit, static_argnums=(0, 4))
def _prefill(graphdef, state, tokens, lengths, max_len, vision=None):
  model = nnx.merge(graphdef, state)
  b, t = tokens.shape
  valid = jnp.arange(t)[None, :] < lengths[:, None]
  h, aux = model.hidden(tokens, valid=valid, cache=model.init_cache(b, max_len), vision=vision)
  last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
  return model.logits(last), aux["cache"]


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _decode(graphdef, state, cache, tokens, lengths):
  model = nnx.merge(graphdef, state)
  h, aux = model.hidden(tokens[:, None], cache=cache, decode=True, lengths=lengths)
  return model.logits(h[:, -1]), aux["cache"]


def sample(logits: jax.Array, rng: jax.Array, temperature: float = 0.0, top_p: float = 1.0,
           top_k: int = 0):
  """``[B, V]`` logits -> ``[B]`` int32 tokens: greedy at temperature 0, else temperature,
  top-k (the ``top_k`` likeliest tokens; 0 keeps all) and nucleus (top-p) sampling."""
  if temperature <= 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  n = logits.shape[0]
  x = filter_logits(logits, jnp.full((n,), temperature, jnp.float32),
                    jnp.full((n,), top_p, jnp.float32), jnp.full((n,), top_k, jnp.int32))
  return jax.random.categorical(rng, x, axis=-1).astype(jnp.int32)


def check_decoding(*, max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
  """Raises one :class:`GenerateError` listing every decoding argument out of range."""
  problems = []
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
    problems.append(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
  if not temperature >= 0.0:
    problems.append(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
  if not 0.0 < top_p <= 1.0:
    problems.append(f"top_p must lie in (0, 1] (1: no nucleus cut), got {top_p!r}")
  if not isinstance(top_k, (int, np.integer)) or top_k < 0:
    problems.append(f"top_k must be an integer >= 0 (0: no top-k cut), got {top_k!r}")
  if problems:
    raise GenerateError("generate: " + "; ".join(problems))


def encode_prompt(text: str, tokenizer: tokenizer_lib.Tokenizer, bos_id: int, *,
                  chat: bool | None = None) -> list[int]:
  """``[bos] + ids`` of ``text`` as training sees a document's start; with ``chat`` (default:
  when the tokenizer has a chat template) ``text`` is the user's turn of a chat."""
  if chat or (chat is None and tokenizer.chat_template is not None):
    text = tokenizer_lib.apply_chat_template(tokenizer, [{"role": "user", "content": text}])
  return [bos_id] + tokenizer.encode(text)


def generate(model: K3Model, prompts, *, tokenizer: tokenizer_lib.Tokenizer | None = None,
             max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             rng: jax.Array | None = None, eos_id: int | None = None, chat: bool | None = None,
             images: dict | None = None):
  """Generates up to ``max_new_tokens`` after each prompt; stops a request at ``eos_id``.

  images: :func:`k3jax.vision.batch`'s arrays, one row per prompt (a model with a vision tower):
  each prompt's ``image_token_id`` placeholders take its row's visual tokens at prefill. Token
  prompts carry the placeholders themselves (``num_tokens`` of them per row); text prompts get
  them right after the BOS token (the images before the text).

  prompts: a string, a list of strings, or a list of token-id lists. Text is encoded by
  ``tokenizer`` (default: bytes) after the BOS token (:func:`encode_prompt`; ``chat``: apply the
  chat template, default when the tokenizer has one), stops at the model's eos token unless
  ``eos_id`` says otherwise, and comes back as text (the eos token left out): a string for a
  string, a list of strings for a list. Token lists come back as the new tokens of each request
  (the eos token included when produced; no stop unless ``eos_id`` is given).
  """
  check_decoding(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
  cfg = model.cfg
  single = isinstance(prompts, str)
  prompts = [prompts] if single else list(prompts)
  text = bool(prompts) and all(isinstance(p, str) for p in prompts)
  if text:
    tokenizer = tokenizer or tokenizer_lib.ByteTokenizer()
    if tokenizer.vocab_size > cfg.vocab_size:
      raise GenerateError(f"generate: the tokenizer's {tokenizer.vocab_size} ids do not fit the "
                          f"model's vocab_size {cfg.vocab_size}")
    if any(not p for p in prompts):
      raise GenerateError("generate: empty prompt text")
    ids = [encode_prompt(p, tokenizer, cfg.bos_token_id, chat=chat) for p in prompts]
    if images is not None and cfg.vision is not None:
      n = np.asarray(images.get("num_tokens", np.zeros(len(ids), np.int32))).reshape(-1)
      if len(n) == len(ids):
        ids = [i[:1] + [cfg.vision.image_token_id] * int(k) + i[1:] for i, k in zip(ids, n)]
    eos_id = cfg.eos_token_id if eos_id is None else eos_id
  elif any(isinstance(p, str) for p in prompts):
    raise GenerateError("generate: prompts mix strings and token lists")
  else:
    ids = [list(p) for p in prompts]
  new = _generate_ids(model, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                      top_p=top_p, top_k=top_k, rng=rng, eos_id=eos_id,
                      vision=_check_images(model, ids, images))
  if not text:
    return new
  out = [tokenizer.decode(n[:-1] if n and n[-1] == eos_id else n) for n in new]
  return out[0] if single else out


def _check_images(model: K3Model, prompts: list[list[int]], images: dict | None) -> dict | None:
  """``images`` as device arrays after checking them against the model and the prompts."""
  if images is None:
    return None
  from k3jax.vision import ARRAY_NAMES
  v = model.cfg.vision
  if v is None:
    raise GenerateError("generate: images given, but the model has no vision tower "
                        "(model.vision is null)")
  missing = [k for k in ARRAY_NAMES if k not in images]
  if missing:
    raise GenerateError(f"generate: images lacks {missing} (pass k3jax.vision.batch's arrays)")
  n = np.asarray(images["num_tokens"]).reshape(-1)
  if len(n) != len(prompts):
    raise GenerateError(f"generate: images has {len(n)} rows for {len(prompts)} prompts")
  found = [sum(t == v.image_token_id for t in p) for p in prompts]
  wrong = [f"prompt {i}: {f} placeholders, {int(k)} visual tokens"
           for i, (f, k) in enumerate(zip(found, n)) if f != k]
  if wrong:
    raise GenerateError(f"generate: image placeholders (token {v.image_token_id}) do not match "
                        "the images: " + "; ".join(wrong))
  return {k: jnp.asarray(images[k]) for k in ARRAY_NAMES}


def _generate_ids(model: K3Model, prompts: list[list[int]], *, max_new_tokens: int,
                  temperature: float, top_p: float, top_k: int, rng: jax.Array | None,
                  eos_id: int | None, vision: dict | None = None) -> list[list[int]]:
  if not prompts or any(len(p) == 0 for p in prompts):
    raise GenerateError("generate: every prompt needs at least one token")
  vocab = model.cfg.vocab_size
  if any(not 0 <= t < vocab for p in prompts for t in p):
    raise GenerateError(f"generate: prompt token ids must lie in [0, {vocab})")
  t = max(len(p) for p in prompts)
  limit = model.cfg.max_position
  if t + max_new_tokens > limit:
    raise GenerateError(f"generate: the longest prompt ({t} tokens) plus max_new_tokens "
                        f"({max_new_tokens}) exceeds the model's maximum length "
                        f"max_position={limit}")
  rng = jax.random.key(0) if rng is None else rng
  graphdef, state = nnx.split(model)
  b = len(prompts)
  tokens = np.full((b, t), model.cfg.pad_token_id, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
  logits, cache = _prefill(graphdef, state, jnp.asarray(tokens), lengths, t + max_new_tokens,
                           vision)
  out = [[] for _ in range(b)]
  done = np.zeros(b, bool)
  for step in range(max_new_tokens):
    rng, key = jax.random.split(rng)
    nxt = sample(logits, key, temperature, top_p, top_k)
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


def default_tokenizer(checkpoint: Path | None, cfg_tokenizer: str) -> str:
  """The tokenizer of a model: a checkpoint directory's own ``tokenizer.json`` or
  ``tiktoken.model`` (in it or its ``hf_extra/``), else the training config's ``data.tokenizer``."""
  if checkpoint is not None:
    for d in (checkpoint, checkpoint / "hf_extra"):
      if any((d / f).is_file() for f in ("tokenizer.json", "tiktoken.model")):
        return str(d)
  return cfg_tokenizer


def add_model_arguments(p) -> None:
  """``--checkpoint`` and ``--tokenizer`` on the ``argparse`` parser ``p``, for :func:`load_model`."""
  p.add_argument("--checkpoint", default=None, metavar="DIR",
                 help="a train.py run directory (or its checkpoints/<step>), an HF or an Orbax directory")
  p.add_argument("--tokenizer", default=None, help="'byte', a tokenizer.json, a tiktoken file or a "
                 "directory with one (default: the checkpoint's own, else the run's data.tokenizer)")


def load_errors() -> tuple[type[Exception], ...]:
  """What :func:`load_model` raises for a bad config, checkpoint or tokenizer."""
  from k3jax import config as config_lib
  from k3jax import convert, run_dir, storage
  return (config_lib.ConfigError, convert.ConversionError, tokenizer_lib.TokenizerError,
          run_dir.RunDirError, storage.StorageError)


def load_model(config: str, overrides: list[str], *, checkpoint: str | None = None,
               tokenizer: str | None = None, seed: int = 0):
  """The config, model and tokenizer a command line decodes with: the weights of ``checkpoint``
  (a ``train.py`` run, HF or Orbax directory; the ``model.*`` overrides apply to its config), else
  a freshly initialised model of ``config`` (weights from ``seed``); the tokenizer ``tokenizer``,
  else the checkpoint's own, else the run's (or, without a checkpoint, the config's)
  ``data.tokenizer``. Returns ``(cfg, model, tokenizer)``: ``cfg`` is ``config`` with the
  overrides and the model's config."""
  from k3jax import cli, pretrained, run_dir, storage
  from k3jax import config as config_lib
  if checkpoint is None:
    cfg = cli.load(config, overrides)
    model = K3Model(cfg.model, rngs=nnx.Rngs(seed))
    spec = tokenizer or cfg.data.tokenizer
  else:
    ckpt = storage.path(checkpoint)
    mine = [o for o in overrides if o.startswith("model.")]
    model = pretrained.from_pretrained(ckpt, overrides=mine)
    cfg = dataclasses.replace(cli.load(config, [o for o in overrides if o not in mine]),
                              model=model.cfg)
    run = run_dir.find(ckpt)
    data_tok = config_lib.load(run.config_path).data.tokenizer if run else "byte"
    spec = tokenizer or default_tokenizer(ckpt, data_tok)
  return cfg, model, tokenizer_lib.make_tokenizer(spec, name="--tokenizer")


def main(argv: list[str] | None = None) -> int:
  """The ``python -m k3jax.generate`` / ``k3jax-generate`` command line; prints each prompt's
  generated text; returns the exit status (2: bad arguments, config or checkpoint)."""
  from k3jax import cli
  p = cli.parser("python -m k3jax.generate", __doc__.split("\n\n")[-1], config_default="k3_tiny",
                 config_help="config of a freshly initialised model (without --checkpoint): a "
                             "path or a packaged name; default k3_tiny")
  add_model_arguments(p)
  p.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable)")
  chat = p.add_mutually_exclusive_group()
  chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                    help="wrap the prompt in the chat template (default: when the tokenizer has one)")
  chat.add_argument("--no-chat", dest="chat", action="store_false", help="never use the chat template")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--top-k", type=int, default=0)
  p.add_argument("--seed", type=int, default=0)
  args = cli.parse(p, argv)
  prompts = args.prompt or ["def main("]
  try:
    check_decoding(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_p=args.top_p, top_k=args.top_k)
    _, model, tok = load_model(args.config, args.overrides, checkpoint=args.checkpoint,
                               tokenizer=args.tokenizer, seed=args.seed)
    texts = generate(model, prompts, tokenizer=tok, max_new_tokens=args.max_new_tokens,
                     temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                     rng=jax.random.key(args.seed), chat=args.chat)
  except (GenerateError, *load_errors()) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for prompt, text in zip(prompts, texts):
    print(prompt + text)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
