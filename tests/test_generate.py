"""Decoding: text in and text out, top-k sampling, and one clear error for every decoding
argument out of range (issue 43 item 3, issue 42 item 9)."""

import types

import jax
import numpy as np
import pytest
from flax import nnx

import k3jax
from k3jax import tokenizer as tokenizer_lib
from k3jax.generate import GenerateError, encode_prompt, sample
from test_train import SMALL
from conftest import tiny_config

MODEL_OVERRIDES = [o for o in SMALL if o.startswith("model.")] + ["model.max_position=40"]


@pytest.fixture(scope="module")
def model():
  return k3jax.K3Model(tiny_config(*MODEL_OVERRIDES).model, rngs=nnx.Rngs(np.random.randint(1 << 30)))


def test_top_k_keeps_the_k_likeliest():
  logits = jax.random.normal(jax.random.key(np.random.randint(1 << 30)), (4, 50))
  keys = jax.random.split(jax.random.key(1), 64)
  got = np.stack([np.asarray(sample(logits, k, temperature=1.5, top_k=3)) for k in keys])
  top3 = np.argsort(np.asarray(logits), axis=-1)[:, -3:]
  assert all(set(got[:, b]) <= set(top3[b]) for b in range(4))
  assert len(set(got[:, 0])) > 1  # still sampling, not greedy
  np.testing.assert_array_equal(sample(logits, keys[0], temperature=1.0, top_k=1),
                                np.argmax(logits, axis=-1))


@pytest.mark.slow
def test_text_prompts_start_with_bos_and_come_back_as_text(model):
  cfg = model.cfg
  rng = jax.random.key(np.random.randint(1 << 30))
  kw = dict(max_new_tokens=5, temperature=0.9, top_k=20, rng=rng, eos_id=-1)
  text = k3jax.generate(model, "x = 1", **kw)
  ids = k3jax.generate(model, [[cfg.bos_token_id, *b"x = 1"]], **kw)[0]
  assert isinstance(text, str) and text == tokenizer_lib.ByteTokenizer().decode(ids)
  both = k3jax.generate(model, ["x = 1", "def"], **kw)
  assert isinstance(both, list) and both[0] == text
  with pytest.raises(GenerateError, match="mix strings and token lists"):
    k3jax.generate(model, ["a", [1, 2]], max_new_tokens=1)


def test_chat_template_wraps_text_prompts(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {"[UNK]": 0, "hi": 1, "<user>": 2, "<bot>": 3}
  tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tk.pre_tokenizer = pre_tokenizers.Whitespace()
  tk.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(
      '{"chat_template": "{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}<bot>"}')
  tok = tokenizer_lib.make_tokenizer(tmp_path)
  ids = encode_prompt("hi", tok, bos_id=7)
  assert ids[0] == 7 and ids[1:] == tok.encode(tokenizer_lib.apply_chat_template(
      tok, [{"role": "user", "content": "hi"}]))
  assert encode_prompt("hi", tok, bos_id=7, chat=False) == [7, 1]


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must lie in \(0, 1\]"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(max_new_tokens=36), r"plus max_new_tokens \(36\) exceeds the model's maximum length max_position=40"),
    (dict(prompts=["x" * 45]), r"longest prompt \(46 tokens\)"),
    (dict(prompts=[""]), "empty prompt text"),
    (dict(prompts=[[]]), "every prompt needs at least one token"),
    (dict(prompts=[]), "every prompt needs at least one token"),
    (dict(top_p=0.0, temperature=-1.0), "temperature must be >= 0.*top_p must lie"),
])
def test_bad_decoding_arguments_are_refused(kwargs, message):
  # every check runs before the model is touched: a stand-in with the config is enough
  model = types.SimpleNamespace(cfg=tiny_config(*MODEL_OVERRIDES).model)
  kw = dict(prompts=["abcd"], max_new_tokens=4) | kwargs
  with pytest.raises(GenerateError, match=message):
    k3jax.generate(model, kw.pop("prompts"), **kw)
