"""Host-side bookkeeping of the hybrid cache: who owns which MLA page and KDA slot, and the
prefix index over both (SPEC section 8).

Device memory is two pools per layer kind (:mod:`k3jax.serve.step`): MLA pages of ``page_size``
latent tokens and KDA slots (a float32 recurrent state plus conv tails). Id 0 of each pool is
never handed out: unmapped positions and padding rows write there. An :class:`Allocator` counts
references to every id; a request holds one on each page it maps and on its own slot, and the
:class:`PrefixIndex` holds one on each page of a cached block and on each checkpoint slot.

The prefix index keys prompt blocks of ``block_size`` tokens by a hash chain (block ``i``'s key
covers tokens ``[0, (i+1) * block_size)``). A block owns its pages and, optionally, a KDA
checkpoint: a slot holding every KDA layer's state and conv tails after the block's last token.
A prefix hit is valid up to the end of the last matched block that has a checkpoint. Eviction is
LRU over leaf blocks, so a block's descendants (whose checkpoints depend on its pages) always go
first; checkpoints may be evicted alone when slots run short.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools


class Allocator:
  """Reference-counted ids ``1 .. n - 1`` (id 0 is the shared scratch entry)."""

  def __init__(self, n: int, what: str):
    if n < 2:
      raise ValueError(f"{what}: need at least 2 entries (one is scratch), got {n}")
    self.what = what
    self.refs = [0] * n
    self._free = collections.deque(range(1, n))

  @property
  def total(self) -> int:
    return len(self.refs) - 1

  @property
  def free(self) -> int:
    return len(self._free)

  @property
  def used(self) -> int:
    return self.total - self.free

  def alloc(self) -> int | None:
    """A fresh id with one reference, or None when none is free."""
    if not self._free:
      return None
    i = self._free.popleft()
    self.refs[i] = 1
    return i

  def incref(self, i: int) -> None:
    if self.refs[i] <= 0:
      raise AssertionError(f"{self.what} {i}: reference to a free entry")
    self.refs[i] += 1

  def decref(self, i: int) -> None:
    if self.refs[i] <= 0:
      raise AssertionError(f"{self.what} {i}: released more often than taken")
    self.refs[i] -= 1
    if self.refs[i] == 0:
      self._free.append(i)


@dataclasses.dataclass(eq=False)
class Block:
  """One cached prompt block: its tokens, the pages holding their MLA latents, and optionally
  the slot of the KDA checkpoint taken after its last token."""
  key: int
  parent: Block | None
  tokens: tuple[int, ...]
  pages: tuple[int, ...]
  checkpoint: int | None = None
  children: int = 0
  last_use: int = 0


@dataclasses.dataclass(frozen=True)
class Hit:
  """A prefix match: ``length`` tokens (a block boundary) whose MLA ``pages`` and KDA
  ``checkpoint`` slot can be reused (``length`` 0: no hit)."""
  length: int = 0
  pages: tuple[int, ...] = ()
  checkpoint: int | None = None


def chain_key(parent_key: int, block_tokens) -> int:
  """The key of a block: a hash of its tokens and its parent's key (0 for the first block)."""
  return hash((parent_key, tuple(block_tokens)))


def block_keys(tokens, block_size: int, n_blocks: int) -> list[int]:
  """The hash chain of the first ``n_blocks`` full blocks of ``tokens``."""
  keys, key = [], 0
  for i in range(n_blocks):
    key = chain_key(key, tokens[i * block_size:(i + 1) * block_size])
    keys.append(key)
  return keys


class PrefixIndex:
  """Cached blocks by hash-chain key, with coupled LRU eviction (see the module docstring)."""

  def __init__(self, pages: Allocator, slots: Allocator, block_size: int):
    self.pages, self.slots, self.block_size = pages, slots, block_size
    self.blocks: dict[int, Block] = {}
    self._clock = itertools.count(1)

  def lookup(self, tokens) -> tuple[list[Block], Hit]:
    """The chain of cached blocks ``tokens`` starts with, and the longest valid hit: it ends at
    a block that has a checkpoint and leaves at least one token of ``tokens`` to compute (the
    last token's logits are needed). Marks the hit's blocks used."""
    n = (len(tokens) - 1) // self.block_size
    chain, parent = [], None
    for i, key in enumerate(block_keys(tokens, self.block_size, n)):
      b = self.blocks.get(key)
      if b is None or b.parent is not parent or b.tokens != tuple(
          tokens[i * self.block_size:(i + 1) * self.block_size]):
        break
      chain.append(b)
      parent = b
    best = max((i for i, b in enumerate(chain) if b.checkpoint is not None), default=-1)
    if best < 0:
      return chain, Hit()
    now = next(self._clock)
    for b in chain[:best + 1]:
      b.last_use = now
    pages = tuple(p for b in chain[:best + 1] for p in b.pages)
    return chain, Hit((best + 1) * self.block_size, pages, chain[best].checkpoint)

  def insert(self, key: int, parent: Block | None, tokens, pages) -> Block | None:
    """Registers a full block (taking a reference on each page), or returns the block already
    cached under ``key``; None when ``parent`` is no longer cached (a block another request
    cached first, whose pages the caller holds no reference on, may be evicted under it): every
    cached block's parent stays cached."""
    if parent is not None and self.blocks.get(parent.key) is not parent:
      return None
    b = self.blocks.get(key)
    if b is not None:
      b.last_use = next(self._clock)
      return b
    for p in pages:
      self.pages.incref(p)
    b = Block(key, parent, tuple(tokens), tuple(pages), last_use=next(self._clock))
    if parent is not None:
      parent.children += 1
    self.blocks[key] = b
    return b

  def set_checkpoint(self, block: Block, slot: int) -> None:
    """Gives ``block`` the checkpoint in ``slot`` (the index takes over its reference)."""
    if block.checkpoint is not None:
      raise AssertionError("block already has a checkpoint")
    block.checkpoint = slot

  def _remove(self, b: Block) -> None:
    del self.blocks[b.key]
    if b.parent is not None:
      b.parent.children -= 1
    for p in b.pages:
      self.pages.decref(p)
    if b.checkpoint is not None:
      self.slots.decref(b.checkpoint)

  def evict_pages(self, needed: int) -> None:
    """Removes least recently used leaf blocks whose pages only the index holds until
    ``needed`` pages are free (or nothing more can go)."""
    while self.pages.free < needed:
      leaves = [b for b in self.blocks.values()
                if b.children == 0 and all(self.pages.refs[p] == 1 for p in b.pages)]
      if not leaves:
        return
      self._remove(min(leaves, key=lambda b: b.last_use))

  def evict_checkpoint(self) -> bool:
    """Frees the least recently used checkpoint slot that only the index holds; False if none."""
    held = [b for b in self.blocks.values()
            if b.checkpoint is not None and self.slots.refs[b.checkpoint] == 1]
    if not held:
      return False
    b = min(held, key=lambda b: b.last_use)
    self.slots.decref(b.checkpoint)
    b.checkpoint = None
    return True

  def clear(self) -> None:
    """Drops every block (new weights make the cached states stale)."""
    while self.blocks:
      leaf = next(b for b in self.blocks.values() if b.children == 0)
      self._remove(leaf)
