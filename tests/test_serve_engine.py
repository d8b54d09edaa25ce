"""The serving engine on CPU with k3_tiny: greedy output equal to ``k3jax.generate``, batching and
prefix caching that change no token, preemption under memory pressure, and the cache's
bookkeeping (allocator, prefix index, coupled eviction) checked after every step."""

import collections
import dataclasses

import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3jax.generate import generate
from k3jax.model import K3Model
from k3jax.serve.cache import Allocator, PrefixIndex, block_keys
from k3jax.serve.engine import Engine
from k3jax.serve.types import RequestError, SamplingParams
from tests.conftest import tiny_config

# 24 pages of 16 tokens: four requests of ~100 tokens overflow it (preemption); blocks of 32
SERVE = ("serve.max_batch=4", "serve.prefill_rows=2", "serve.block_size=32", "serve.page_size=16",
         "serve.max_model_len=256", "serve.token_budget=64", "serve.num_pages=25")
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
  cfg = tiny_config(*SERVE)
  e = Engine(K3Model(cfg.model, rngs=nnx.Rngs(0)), cfg.serve)
  e.compile()
  step = e.step

  def checked_step():
    step()
    check_bookkeeping(e)

  e.step = checked_step
  yield e


@pytest.fixture
def fresh(engine):
  """The shared engine with an empty prefix index and prefix caching on."""
  engine.index.clear()
  engine.serve = dataclasses.replace(engine.serve, prefix_cache=True)
  yield engine
  engine.serve = dataclasses.replace(engine.serve, prefix_cache=True)


def check_bookkeeping(e: Engine):
  """Every reference the allocators count is held by a running request, a pending slot copy or
  the prefix index; no page of a request's writable tail is shared."""
  pages, slots = collections.Counter(), collections.Counter()
  for r in e.running:
    pages.update(r.pages)
    slots[r.slot] += 1
  for b in e.index.blocks.values():
    pages.update(b.pages)
    if b.checkpoint is not None:
      slots[b.checkpoint] += 1
  for src, _ in e._restores:
    if src:
      slots[src] += 1
  assert all(n >= 0 for n in e.pages.refs) and all(n >= 0 for n in e.slots.refs)
  assert [e.pages.refs[i] for i in range(1, len(e.pages.refs))] == [
      pages[i] for i in range(1, len(e.pages.refs))]
  assert [e.slots.refs[i] for i in range(1, len(e.slots.refs))] == [
      slots[i] for i in range(1, len(e.slots.refs))]
  per = e.serve.block_size // e.serve.page_size
  for r in e.running:
    for p in r.pages[len(r.blocks) * per:]:
      assert e.pages.refs[p] == 1, "a writable page is shared"
  for b in e.index.blocks.values():  # every cached block's parent is cached (coupled eviction)
    assert b.parent is None or e.index.blocks.get(b.parent.key) is b.parent


def prompts_of(rng, lengths, vocab=320):
  return [[int(t) for t in rng.integers(3, vocab, n)] for n in lengths]


def test_greedy_equals_generate(fresh):
  """Prompts of 1 token, unaligned lengths and several blocks, batched: the tokens
  ``k3jax.generate`` gives (float32)."""
  rng = np.random.default_rng(1)
  prompts = prompts_of(rng, (1, 5, 33, 70))
  model = nnx.merge(fresh._graphdef, fresh._params)
  want = generate(model, prompts, max_new_tokens=10)
  assert fresh.generate(prompts, GREEDY) == want


def test_routed_experts_with_padding_rows_equal_generate():
  """The routed MoE path (no dense decoding) with padding: three requests in a four-row decode
  step and prefill chunks with tails, whose padding is routed to the first row's experts; the
  tokens ``k3jax.generate`` gives (float32)."""
  cfg = tiny_config(*SERVE, "model.moe.dense_decode_tokens=0")
  e = Engine(K3Model(cfg.model, rngs=nnx.Rngs(2)), cfg.serve)
  prompts = prompts_of(np.random.default_rng(7), (3, 21, 40))
  want = generate(nnx.merge(e._graphdef, e._params), prompts, max_new_tokens=10)
  assert e.generate(prompts, GREEDY) == want


def test_decode_rows_start_at_min_decode_rows(engine):
  """A lone request decodes in a two-row step by default (serve.min_decode_rows), one row when
  asked; the tokens are the same either way (test_concurrent_equals_one_at_a_time runs lone
  requests through the padded step)."""
  assert engine.decode_sizes == (2, 4)
  cfg = tiny_config(*SERVE, "serve.min_decode_rows=1")
  one = Engine(K3Model(cfg.model, rngs=nnx.Rngs(0)), cfg.serve)
  assert one.decode_sizes == (1, 2, 4)
  cfg = tiny_config(*SERVE, "serve.max_batch=1")  # padding rows take no cache
  assert Engine(K3Model(cfg.model, rngs=nnx.Rngs(0)), cfg.serve).decode_sizes == (2,)


def test_concurrent_equals_one_at_a_time(fresh):
  """Batching changes no token, greedy or sampled (a seed fixes each request's stream)."""
  rng = np.random.default_rng(2)
  prompts = prompts_of(rng, (3, 17, 40, 9, 64, 2))
  params = [GREEDY, SamplingParams(max_tokens=8, temperature=0.9, top_p=0.8, seed=5,
                                   ignore_eos=True),
            SamplingParams(max_tokens=6, temperature=1.3, top_k=7, seed=11, ignore_eos=True)] * 2
  together = fresh.generate(prompts, params)
  fresh.serve = dataclasses.replace(fresh.serve, prefix_cache=False)
  alone = [fresh.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
  assert together == alone


def test_prefix_hits_change_no_token(fresh):
  """Aligned (a prompt ending one token past a boundary) and unaligned hits, branching
  prefixes: the tokens of the same requests without caching, and hits counted."""
  rng = np.random.default_rng(3)
  base = prompts_of(rng, (96,))[0]
  prompts = [base[:65], base[:65], base[:80], base[:64] + [7, 8, 9, 10, 11], base + [4] * 20,
             base[:40] + prompts_of(rng, (30,))[0]]
  fresh.serve = dataclasses.replace(fresh.serve, prefix_cache=False)
  want = [fresh.generate([p], GREEDY)[0] for p in prompts]
  fresh.serve = dataclasses.replace(fresh.serve, prefix_cache=True)
  hits, kda = fresh.stats.prefix_hit_tokens, fresh.stats.kda_checkpoint_hits
  got = [fresh.generate([p], GREEDY)[0] for p in prompts]
  assert got == want
  # 65 tokens reuse two blocks (the first request's), 80 two, the branch two, the long one two
  # (nothing before it filled its third block), the last one one
  assert fresh.stats.prefix_hit_tokens - hits == 64 + 64 + 64 + 64 + 32
  assert fresh.stats.kda_checkpoint_hits - kda == 5


@pytest.mark.slow
def test_memory_pressure_preempts_and_evicts(fresh):
  """More requests than the 24 pages hold: requests are preempted and recomputed, cached blocks
  evicted; the tokens are those of the requests one at a time."""
  rng = np.random.default_rng(4)
  prompts = prompts_of(rng, (100, 90, 110, 95, 70))
  params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
  preempted = fresh.stats.preemptions
  together = fresh.generate(prompts, params)
  assert fresh.stats.preemptions > preempted
  alone = [fresh.generate([p], params)[0] for p in prompts]
  assert together == alone
  again = fresh.generate(prompts[:2], params)  # some blocks evicted, some still cached
  assert again == alone[:2]


def test_stop_tokens_and_length(fresh):
  rng = np.random.default_rng(5)
  [p] = prompts_of(rng, (12,))
  free = fresh.generate([p], GREEDY)[0]
  stop = free[4]
  got = fresh.generate([p], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                           stop_token_ids=(stop,)))[0]
  assert got == free[:free.index(stop) + 1]
  assert fresh.generate([p], dataclasses.replace(GREEDY, max_tokens=3))[0] == free[:3]


def test_bad_requests_refused(engine):
  for prompt, params, match in [
      ([], GREEDY, "empty"),
      ([1, 320], GREEDY, r"\[0, 320\)"),
      ([1, 2], SamplingParams(max_tokens=0), "max_new_tokens"),
      ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
      ([1, 2], SamplingParams(top_p=0.0), "top_p"),
      ([1, 2], SamplingParams(logprobs=9), "logprobs"),
      ([1] * 250, SamplingParams(max_tokens=10), "context limit is 256"),
  ]:
    with pytest.raises(RequestError, match=match):
      engine.submit(prompt, params, lambda o: None)


def test_request_larger_than_the_cache_is_refused():
  cfg = tiny_config(*SERVE[:-1], "serve.num_pages=5")
  e = Engine(K3Model(cfg.model, rngs=nnx.Rngs(0)), cfg.serve)
  with pytest.raises(RequestError, match="needs 6 cache pages .* holds 4"):
    e.validate([1] * 80, SamplingParams(max_tokens=10))


def test_cancel_ends_a_request(fresh):
  events = []
  rid = fresh.submit([5, 6, 7], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True),
                     events.append)
  fresh.step()
  fresh.step()
  fresh.cancel(rid)
  while fresh.has_work():
    fresh.step()
  assert events[-1].finish_reason == "abort" and events[-1].token is None
  assert 1 <= len(events) - 1 < 50
  assert not fresh.running and fresh.slots.used == len(
      [b for b in fresh.index.blocks.values() if b.checkpoint is not None])


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_random_streams_cached_equals_uncached(fresh, data):
  """Random request streams sharing random prefixes: the same greedy tokens with and without
  prefix caching."""
  seed = data.draw(st.integers(0, 2**31))
  rng = np.random.default_rng(seed)
  roots = prompts_of(rng, (rng.integers(20, 90), rng.integers(20, 90)))
  prompts = []
  for _ in range(data.draw(st.integers(2, 6))):
    root = roots[rng.integers(2)]
    cut = int(rng.integers(1, len(root) + 1))
    prompts.append(root[:cut] + prompts_of(rng, (rng.integers(0, 20),))[0])
  fresh.index.clear()
  fresh.serve = dataclasses.replace(fresh.serve, prefix_cache=False)
  want = fresh.generate(prompts, GREEDY)
  fresh.serve = dataclasses.replace(fresh.serve, prefix_cache=True)
  assert fresh.generate(prompts, GREEDY) == want
  assert fresh.generate(prompts, GREEDY) == want  # now with the blocks cached


# ----------------------------------------------------------------------------- bookkeeping


def test_allocator_refcounts():
  a = Allocator(4, "page")
  x, y, z = a.alloc(), a.alloc(), a.alloc()
  assert {x, y, z} == {1, 2, 3} and a.alloc() is None
  a.incref(x)
  a.decref(x)
  assert a.free == 0
  a.decref(x)
  assert a.free == 1 and a.alloc() == x
  a.decref(y)
  with pytest.raises(AssertionError, match="released more often"):
    a.decref(y)
  with pytest.raises(AssertionError, match="free entry"):
    a.incref(y)


def test_a_block_another_request_cached_first_may_be_evicted_under_its_follower():
  """Two requests compute the same first block; the first registers it, the second's insert
  returns that block (its own pages stay its own, with no reference on the block's). Once the
  first request is gone the block can be evicted while the second still runs: the second's next
  block must not be cached under the evicted one (every cached block's parent stays cached).
  Found by test_random_streams_cached_equals_uncached."""
  from types import SimpleNamespace
  pages, slots = Allocator(9, "page"), Allocator(4, "slot")
  eng = SimpleNamespace(serve=SimpleNamespace(prefix_cache=True, block_size=4, page_size=2,
                                              checkpoint_every=1),
                        index=PrefixIndex(pages, slots, block_size=4), _checkpoints=[])
  eng._alloc_slot = slots.alloc
  toks = list(range(10, 19))  # two blocks and a token
  a, b = (SimpleNamespace(keys=toks, blocks=[], computed=4, slot=s,
                          pages=[pages.alloc() for _ in range(4)]) for s in (1, 2))
  Engine._register(eng, a)
  Engine._register(eng, b)
  assert b.blocks == a.blocks and b.blocks[0].pages == tuple(a.pages[:2])
  for p in a.pages:  # the first request ends
    pages.decref(p)
  eng.index.evict_pages(pages.free + 2)
  assert not eng.index.blocks  # the shared block went; the second request still holds it
  b.computed = 8
  Engine._register(eng, b)
  assert all(blk.parent is None or eng.index.blocks.get(blk.parent.key) is blk.parent
             for blk in eng.index.blocks.values())
  assert len(b.blocks) == 1 and not eng.index.blocks
  assert eng.index.insert(12345, b.blocks[0], toks[4:8], b.pages[2:4]) is None


def test_prefix_index_lookup_and_coupled_eviction():
  pages, slots = Allocator(9, "page"), Allocator(4, "slot")
  idx = PrefixIndex(pages, slots, block_size=4)
  toks = list(range(10, 22))  # three blocks
  keys = block_keys(toks, 4, 3)
  parent = None
  for i in range(3):
    own = [pages.alloc(), pages.alloc()]
    b = idx.insert(keys[i], parent, toks[4 * i:4 * i + 4], own)
    for p in own:
      pages.decref(p)  # the index's reference only
    if i != 1:
      idx.set_checkpoint(b, slots.alloc())
    parent = b
  # 12 tokens: the hit must leave a token, so it ends at block 1, which has no checkpoint -> block 0
  chain, hit = idx.lookup(toks)
  assert len(chain) == 2 and hit.length == 4 and hit.checkpoint == chain[0].checkpoint
  chain, hit = idx.lookup(toks + [99])
  assert hit.length == 12 and len(hit.pages) == 6
  chain, hit = idx.lookup(toks[:4] + [0, 0, 0, 0, 5])  # diverges after block 0
  assert len(chain) == 1 and hit.length == 4
  # eviction goes leaf first: freeing 2 pages drops block 2 (and its checkpoint), not block 0
  assert pages.free == 2
  idx.evict_pages(4)
  assert pages.free == 4 and len(idx.blocks) == 2 and slots.free == 2
  # pages a live request holds are not freed by eviction (nor their ancestors')
  block0, block1 = idx.blocks[keys[0]], idx.blocks[keys[1]]
  pages.incref(block1.pages[0])
  idx.evict_pages(8)
  assert len(idx.blocks) == 2 and pages.free == 4
  pages.decref(block1.pages[0])
  # a checkpoint goes alone, its block stays
  assert idx.evict_checkpoint() and block0.checkpoint is None and len(idx.blocks) == 2
  assert not idx.evict_checkpoint()
  idx.clear()
  assert pages.free == 8 and slots.free == 3
