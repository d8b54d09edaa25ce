"""The text of one generated sequence, released piece by piece as its tokens arrive.

Two things hold text back: a piece that may end inside a character (a multi-byte UTF-8 character
split over byte tokens decodes to U+FFFD until its last byte comes) and a tail that may be the
start of a stop string. A stop string ends the text just before it. The pieces joined are the
text a decode of all tokens at once gives (up to the stop), streamed or not.
"""

from __future__ import annotations

from k3jax.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"  # what a decoder with errors="replace" makes of a cut character


class TextStream:
  """Feed tokens with :meth:`push`, end with :meth:`finish`; each returns the text released.

  The decoded window is ``ids[prefix:]``: ``ids[prefix:read]`` decodes to text already taken,
  so a token is decoded with the ones before it (tokenizers that drop a leading space of a
  decode, or merge bytes across tokens, see their context) and the window stays short."""

  def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
    self._tokenizer = tokenizer
    self._stop = tuple(stop)
    self._ids: list[int] = []
    self._prefix = self._read = 0
    self._text = ""  # decoded so far (cut characters excluded)
    self._sent = 0  # characters of _text released
    self.stopped = False  # a stop string was found: nothing more is released

  def push(self, token: int) -> str:
    self._ids.append(int(token))
    self._decode(final=False)
    return self._release(final=False)

  def finish(self) -> str:
    """The text held back, released at the end of the sequence (a cut character as U+FFFD)."""
    self._decode(final=True)
    return self._release(final=True)

  def _decode(self, *, final: bool) -> None:
    done = self._tokenizer.decode(self._ids[self._prefix:self._read])
    window = self._tokenizer.decode(self._ids[self._prefix:])
    if len(window) > len(done) and (final or not window.endswith(_INCOMPLETE)):
      self._text += window[len(done):]
      self._prefix, self._read = self._read, len(self._ids)

  def _release(self, *, final: bool) -> str:
    if self.stopped:
      return ""
    # a match cannot start in released text: a possible start is always held back
    hits = [i for i in (self._text.find(s, self._sent) for s in self._stop) if i >= 0]
    if hits:
      end = min(hits)
      self.stopped = True
    elif final:
      end = len(self._text)
    else:
      end = len(self._text) - max((_overlap(self._text, s) for s in self._stop), default=0)
    piece = self._text[self._sent:end]
    self._sent = max(self._sent, end)
    return piece


def _overlap(text: str, stop: str) -> int:
  """The length of the longest end of ``text`` that is a proper start of ``stop``."""
  for k in range(min(len(stop) - 1, len(text)), 0, -1):
    if text.endswith(stop[:k]):
      return k
  return 0
