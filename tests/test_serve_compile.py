"""What a serving step traces: the decoder layers of one kind share one traced (and so one
lowered) call of their mixer, MLP and AttnRes, and decoding computes no router statistics."""

import collections

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.model import K3Model
from k3jax.serve import step as step_lib
from tests.conftest import tiny_config


def _decode_jaxpr():
  """The jaxpr of k3_tiny's serving decode forward over 2 rows."""
  cfg = tiny_config("model.param_dtype=float32", "model.compute_dtype=float32").model
  model = nnx.eval_shape(lambda: step_lib.serving_model(K3Model(cfg, rngs=nnx.Rngs(0)), 1))
  graphdef, state = nnx.split(model)
  pools = jax.eval_shape(lambda: step_lib.init_pools(model, num_pages=9, page_size=16,
                                                     num_slots=5))
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)

  def fwd(state, pools, tokens, starts, nvalid, table, slots):
    return step_lib.forward(nnx.merge(graphdef, state), pools, tokens, starts, nvalid, table,
                            slots, decode=True)

  return jax.make_jaxpr(fwd)(state, pools, i32(2, 1), i32(2), i32(2), i32(2, 4), i32(2))


def test_layers_of_one_kind_trace_once():
  """k3_tiny: layers 0-2 KDA, 3-4 MLA; layer 0 dense, 1-4 MoE; AttnRes blocks of 2. Its 19 module
  calls (5 mixers, 5 MLPs, 9 AttnRes mixes over 2, 3 or 4 sources) are 7 distinct traces: KDA,
  MLA, GLU, MoE and the three AttnRes widths."""
  jaxpr = _decode_jaxpr().jaxpr
  calls = [e for e in jaxpr.eqns if e.primitive.name in ("jit", "pjit")
           and e.params.get("name") == "_shared_call"]
  traces = collections.Counter(id(e.params["jaxpr"]) for e in calls)
  assert (len(calls), len(traces)) == (19, 7)


def test_decoding_computes_no_router_statistics():
  """Quantile balancing's statistics (a selection kernel per MoE layer) belong to training: a
  forward with a decode cache leaves them out."""
  cfg = tiny_config("model.param_dtype=float32", "model.compute_dtype=float32").model
  model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  tokens = jax.ShapeDtypeStruct((2, 1), jnp.int32)
  _, aux = nnx.eval_shape(lambda m, t: m.hidden(t, cache=m.init_cache(2, 64), decode=True,
                                                 lengths=jnp.ones(2, jnp.int32)), model, tokens)
  assert aux["moe"] == {}


def test_sampling_is_a_program_without_a_branch():
  """The step's sampling is its own program with no device-side branch (on a GPU, XLA copies a
  branch's predicate to the host and waits for it mid-program): the host picks ``draw``. Both
  forms agree where every row is greedy; ``draw=False`` leaves out the alternatives."""
  import functools

  import numpy as np

  n, v = 3, 50
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.standard_normal((n, v)), jnp.float32)
  args = (logits, jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32),
          jnp.zeros(n, jnp.float32), jnp.ones(n, jnp.float32), jnp.zeros(n, jnp.int32))
  outs = {}
  for draw in (False, True):
    fn = functools.partial(step_lib.sample, 4, draw)
    prims = {e.primitive.name for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns}
    assert "cond" not in prims, prims
    outs[draw] = jax.jit(fn)(*args)
  (tok0, lp0, ids0, _), (tok1, lp1, ids1, top1) = outs[False], outs[True]
  np.testing.assert_array_equal(tok0, tok1)
  np.testing.assert_array_equal(tok0[:n], np.argmax(np.asarray(logits), -1))
  np.testing.assert_array_equal(tok0[n:], 0)
  np.testing.assert_allclose(lp0, lp1)
  assert not np.asarray(ids0).any()
  np.testing.assert_array_equal(ids1[:, 0], tok1[:n])  # greedy: the top alternative
