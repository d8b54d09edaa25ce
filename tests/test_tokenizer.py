"""Tokenizers decode what they encode (bytes, HF tokenizer.json, tiktoken files) and render a
chat template when they carry one (issue 43 item 3)."""

import base64
import json
import random

import pytest

from k3jax import tokenizer
from k3jax.tokenizer import TokenizerError, apply_chat_template, make_tokenizer


def random_text(n=200):
  rng = random.Random()
  pool = "abc xyz 012 中文 é\n\t{}()"
  return "".join(rng.choice(pool) for _ in range(n))


def test_byte_round_trip_and_special_ids_skipped():
  tok = make_tokenizer("byte")
  text = random_text()
  assert tok.decode(tok.encode(text)) == text
  assert tok.decode([1000, *tok.encode("hi"), 300]) == "hi"
  assert tok.chat_template is None


def test_tiktoken_round_trip(tmp_path):
  ranks = {bytes([i]): i for i in range(256)}
  ranks.update({b"ab": 256, b"abc": 257})
  path = tmp_path / "tiktoken.model"
  path.write_text("".join(f"{base64.b64encode(k).decode()} {v}\n" for k, v in ranks.items()))
  tok = make_tokenizer(str(path))
  text = random_text()
  assert tok.decode(tok.encode(text)) == text
  assert tok.decode([257, 999]) == "abc"  # ids past the ranks (special tokens) are skipped
  assert make_tokenizer(tmp_path).vocab_size == 258  # a directory with tiktoken.model


def hf_tokenizer(directory, template=None):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = decoders.ByteLevel()
  tk.save(str(directory / "tokenizer.json"))
  if template is not None:
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
  return make_tokenizer(directory)


def test_hf_round_trip_and_chat_template(tmp_path):
  tok = hf_tokenizer(tmp_path, "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
  text = random_text()
  assert tok.decode(tok.encode(text)) == text
  assert tok.chat_template.startswith("{% for")
  messages = [{"role": "user", "content": "hi"}]
  try:
    import jinja2  # noqa: F401
    assert apply_chat_template(tok, messages) == "<user>hi<assistant>"
  except ImportError:
    assert apply_chat_template(tok, messages) == "user: hi\nassistant: "


def test_plain_template_without_one():
  messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
  out = apply_chat_template(tokenizer.ByteTokenizer(), messages)
  assert out == "user: hi\nassistant: yo\nassistant: "


@pytest.mark.parametrize("spec, message", [
    ("missing.json", r"--tokenizer: 'missing.json' is neither 'byte' nor an existing file"),
    (".", r"--tokenizer: directory '\.' holds neither tokenizer.json nor tiktoken.model"),
])
def test_bad_spec_named(spec, message, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(TokenizerError, match=message):
    make_tokenizer(spec, name="--tokenizer")
