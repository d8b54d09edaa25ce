"""SFT data: conversations -> token ids with a loss mask on the assistant's tokens.

A conversation is a list of ``{"role", "content"}`` messages. Each assistant turn ``i`` is laid
out as ``apply_chat_template(messages[:i])`` (the prompt up to where its reply begins; the plain
``role: content`` layout when the tokenizer has no template) followed by the reply and eos; only
the reply and eos are trained on. The text between turns is what the template renders for the
longer history beyond the previous reply, so a multi-turn conversation is one document.
Rollouts prompt with :func:`prompt_ids`, the same layout.

Sources (``data.source`` with ``train.mode=sft``): ``"builtin"`` (conversations of the
``posttrain.tasks`` problems, generated in code) or JSONL files with a ``messages`` list per line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from k3jax.tokenizer import Tokenizer, apply_chat_template

BUILTIN_CHATS = 4096  # conversations of the "builtin" source


class ChatError(ValueError):
  """A conversation that cannot be trained on (bad roles, no assistant turn, a template that
  renders a history differently from its prefix)."""


def check_messages(messages, where: str) -> None:
  if not isinstance(messages, list) or not messages:
    raise ChatError(f"{where}: 'messages' must be a non-empty list")
  for m in messages:
    if not (isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)):
      raise ChatError(f"{where}: every message needs string 'role' and 'content', got {m!r}")
  if not any(m["role"] == "assistant" for m in messages):
    raise ChatError(f"{where}: no assistant message to train on")


def prompt_ids(tokenizer: Tokenizer, messages, bos: int) -> list[int]:
  """``[bos]`` + the template's prompt for ``messages``, ending where the reply begins."""
  return [bos] + tokenizer.encode(apply_chat_template(tokenizer, messages))


def encode_chat(tokenizer: Tokenizer, messages, bos: int, eos: int
                ) -> tuple[np.ndarray, np.ndarray]:
  """(ids ``[n]`` int32 starting with bos, mask ``[n]``: 1 on assistant tokens and their eos)."""
  ids, mask, text = [bos], [0], ""
  for i, m in enumerate(messages):
    if m["role"] != "assistant":
      continue
    prompt = apply_chat_template(tokenizer, messages[:i])
    if not prompt.startswith(text):
      raise ChatError("the chat template renders a history differently from its prefix; "
                      "multi-turn SFT needs a template that appends turns")
    lead, reply = tokenizer.encode(prompt[len(text):]), tokenizer.encode(m["content"]) + [eos]
    ids += lead + reply
    mask += [0] * len(lead) + [1] * len(reply)
    text = prompt + m["content"]
  return np.asarray(ids, np.int32), np.asarray(mask, np.int32)


class ChatEncode:
  """Conversation -> ``{"input_ids": x[:-1], "targets": x[1:], "loss_mask": mask[1:]}``."""

  def __init__(self, tokenizer: Tokenizer, bos: int, eos: int):
    self.tokenizer, self.bos, self.eos = tokenizer, bos, eos

  def __call__(self, messages) -> dict[str, np.ndarray]:
    ids, mask = encode_chat(self.tokenizer, messages, self.bos, self.eos)
    return {"input_ids": ids[:-1], "targets": ids[1:], "loss_mask": mask[1:]}


class Chats:
  """Conversations as a data source (``keys``, ``sizes``, ``skipped`` as :mod:`k3jax.data`'s
  sources): the built-in set or every line of JSONL files, each checked up front."""

  def __init__(self, source: str, files: list[Path], *, tasks: tuple[str, ...], seed: int):
    from k3jax.posttrain import tasks as tasks_lib
    self.skipped: list[Path] = []
    if source == "builtin":
      self.chats = tasks_lib.chats(tasks, BUILTIN_CHATS, seed=seed)
      self.keys = [f"builtin:{i}" for i in range(len(self.chats))]
    else:
      self.chats, self.keys = [], []
      for p in files:
        if p.suffix != ".jsonl":
          raise ChatError(f"data.source: SFT reads chat JSONL, got {p}")
        for n, line in enumerate(p.read_text().splitlines()):
          if not line.strip():
            continue
          where = f"{p}:{n + 1}"
          try:
            record = json.loads(line)
          except ValueError as e:
            raise ChatError(f"{where}: not a JSON line ({e})") from e
          messages = record.get("messages") if isinstance(record, dict) else None
          check_messages(messages, where)
          self.chats.append(messages)
          self.keys.append(f"{p.name}:{n}")
    self.sizes = [sum(len(m["content"]) for m in c if m["role"] == "assistant") for c in self.chats]

  def __len__(self) -> int:
    return len(self.chats)

  def __getitem__(self, i: int):
    return self.chats[i]
