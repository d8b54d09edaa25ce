"""Built-in verifiable tasks: small digit problems with an exact checker, sized so that ``k3_tiny``
learns them on a CPU in minutes.

``copy``: "copy 7" -> "7". ``add``: "3+5" -> the last digit of the sum ("8"; "7+6" -> "3").
A :class:`Problem` carries its task, prompt, answer and token budget; :func:`reward` scores a
completion: -1 when it did not end (eos) within the budget, 1 for the exact answer, else 0.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Problem:
  task: str
  prompt: str
  answer: str
  budget: int  # generated tokens allowed, the closing eos included


def _copy(rng: np.random.Generator) -> tuple[str, str]:
  d = int(rng.integers(10))
  return f"copy {d}", str(d)


def _add(rng: np.random.Generator) -> tuple[str, str]:
  a, b = (int(x) for x in rng.integers(10, size=2))
  return f"{a}+{b}", str((a + b) % 10)


TASKS = {"copy": _copy, "add": _add}


def problems(tasks: tuple[str, ...], n: int, *, budget: int, seed: int) -> list[Problem]:
  """``n`` problems drawn in turn from ``tasks`` (deterministic in ``seed``)."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    task = tasks[i % len(tasks)]
    prompt, answer = TASKS[task](rng)
    out.append(Problem(task, prompt, answer, budget))
  return out


def reward(problem: Problem, text: str, finished: bool, generated: int) -> float:
  """``text``: the completion decoded without its eos; ``finished``: it ended with eos;
  ``generated``: its tokens, eos included."""
  if not finished or generated > problem.budget:
    return -1.0
  return 1.0 if text.strip() == problem.answer else 0.0


def chats(tasks: tuple[str, ...], n: int, *, seed: int) -> list[list[dict[str, str]]]:
  """The embedded SFT set: ``n`` one-turn conversations answering the tasks' problems."""
  return [[{"role": "user", "content": p.prompt}, {"role": "assistant", "content": p.answer}]
          for p in problems(tasks, n, budget=1, seed=seed)]
