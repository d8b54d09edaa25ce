"""Tokenizers: ``encode(text) -> ids`` (no special tokens), ``decode(ids) -> text``, a vocabulary
size and, where the tokenizer ships one, a chat template.

``make_tokenizer(spec)`` takes ``"byte"`` (UTF-8 bytes as ids 0-255), a HF ``tokenizer.json``, a
tiktoken BPE file (Kimi's ``tiktoken.model``, split with Kimi's pre-tokenisation pattern), or a
directory holding one of the two. A ``tokenizer_config.json`` beside the file supplies the chat
template (its ``chat_template``), rendered with jinja2 when it is installed; without jinja2, or
for a template-less tokenizer asked for a chat, :data:`PLAIN_TEMPLATE` is used.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Protocol

from k3jax import storage

# Kimi's pre-tokenisation pattern (tokenization_kimi.py of the K2/K3 releases).
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# The chat layout used when a template cannot be rendered (no jinja2): one "role: content" line
# per message, then "assistant: " for the reply.
PLAIN_TEMPLATE = "{role}: {content}\n"


class TokenizerError(ValueError):
  """A tokenizer file cannot be found or loaded."""


class Tokenizer(Protocol):
  vocab_size: int
  chat_template: str | None

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes as ids 0-255; decoding skips ids above 255 (special tokens)."""
  vocab_size = 256
  chat_template = None

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))

  def decode(self, ids: list[int]) -> str:
    return bytes(int(t) for t in ids if 0 <= t < 256).decode("utf-8", errors="replace")


def _chat_template(path: Path) -> str | None:
  """``chat_template`` of the ``tokenizer_config.json`` beside ``path``, if any."""
  cfg = path.parent / "tokenizer_config.json"
  if not cfg.is_file():
    return None
  try:
    template = json.loads(cfg.read_text()).get("chat_template")
  except (json.JSONDecodeError, AttributeError) as e:
    raise TokenizerError(f"{cfg}: not a JSON object ({e})") from e
  return template if isinstance(template, str) else None


class HFTokenizer:
  """A HF ``tokenizers`` ``tokenizer.json``; special tokens are added by the pipeline, not here."""

  def __init__(self, path: str | Path):
    import tokenizers
    self.path = Path(path)
    self._tok = tokenizers.Tokenizer.from_file(str(path))
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.chat_template = _chat_template(Path(path))

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: list[int]) -> str:
    return self._tok.decode([int(t) for t in ids if 0 <= t < self.vocab_size],
                            skip_special_tokens=True)


class TiktokenTokenizer:
  """A tiktoken-format BPE file (base64 token, rank per line) with Kimi's split pattern; decoding
  skips ids beyond the file's ranks (special tokens)."""

  def __init__(self, path: str | Path):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    ranks = load_tiktoken_bpe(str(path))
    self._enc = tiktoken.Encoding(name=Path(path).stem, pat_str=KIMI_PATTERN,
                                  mergeable_ranks=ranks, special_tokens={})
    self.vocab_size = len(ranks)
    self.chat_template = _chat_template(Path(path))

  def encode(self, text: str) -> list[int]:
    return self._enc.encode_ordinary(text)

  def decode(self, ids: list[int]) -> str:
    return self._enc.decode([int(t) for t in ids if 0 <= t < self.vocab_size], errors="replace")


def make_tokenizer(spec: str | Path, *, name: str = "data.tokenizer") -> Tokenizer:
  """``"byte"``, a ``tokenizer.json`` path, a tiktoken BPE file path, or a directory with either
  (``tokenizer.json`` first, then ``tiktoken.model``). ``name`` is the setting that errors name."""
  if str(spec) == "byte":
    return ByteTokenizer()
  path = storage.path(spec)
  if path.is_dir():
    found = [path / f for f in ("tokenizer.json", "tiktoken.model") if (path / f).is_file()]
    if not found:
      raise TokenizerError(f"{name}: directory {str(spec)!r} holds neither tokenizer.json nor "
                           "tiktoken.model")
    path = found[0]
  elif not path.is_file():
    raise TokenizerError(f"{name}: {str(spec)!r} is neither 'byte' nor an existing file or directory")
  path = storage.local_copy(path)  # the tokenizer libraries open local files
  try:
    if path.suffix == ".json":
      return HFTokenizer(path)
    return TiktokenTokenizer(path)
  except Exception as e:  # the libraries' own errors do not name the file
    raise TokenizerError(f"{name}: cannot load {str(path)!r}: {e}") from e


def apply_chat_template(tokenizer: Tokenizer, messages: list[dict[str, str]], *,
                        bos_token: str = "", eos_token: str = "") -> str:
  """The prompt text for ``messages`` (``[{"role": ..., "content": ...}]``) ending where the
  assistant's reply begins: the tokenizer's template through jinja2, else :data:`PLAIN_TEMPLATE`."""
  template = tokenizer.chat_template
  if template is not None:
    try:
      import jinja2
    except ImportError:
      print("[tokenizer] jinja2 is not installed: the tokenizer's chat template is replaced by the "
            "plain 'role: content' layout (pip install jinja2)", file=sys.stderr)
    else:
      env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
      return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                              bos_token=bos_token, eos_token=eos_token)
  return "".join(PLAIN_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages) \
      + "assistant: "
