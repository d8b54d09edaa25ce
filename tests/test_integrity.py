"""Checkpoint integrity without a model: checksums catch flipped bits, a corrupted or non-finite
checkpoint falls back to the previous one, a non-finite state is never saved, and metrics.jsonl
keeps one record per step across a resume."""

import json
import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from k3jax import checkpoint, metrics


def random_state(seed):
  rng = np.random.default_rng(seed)
  return {"params": {"w": jnp.asarray(rng.standard_normal((64, 48)), jnp.float32),
                     "b": jnp.asarray(rng.standard_normal(48), jnp.bfloat16)},
          "opt_state": {"mu": jnp.asarray(rng.standard_normal((64, 48)), jnp.float32),
                        "count": jnp.asarray(rng.integers(0, 1000), jnp.int32)},
          "rng": jnp.asarray(rng.integers(0, 2**32, 2, dtype=np.uint64), jnp.uint32)}


def data_iter():
  return iter(grain.MapDataset.range(100).to_iter_dataset())


def test_fingerprints_catch_every_single_bit_flip_and_name_non_finite_arrays():
  state = random_state(0)
  sums, nonfinite = checkpoint.fingerprints(state)
  assert nonfinite == [] and set(sums) == {"params.w", "params.b", "opt_state.mu",
                                           "opt_state.count", "rng"}
  compiles = checkpoint._tree_checks._cache_size()
  rng = np.random.default_rng(1)
  for name, leaf in (("params.w", ("params", "w")), ("params.b", ("params", "b")),
                     ("opt_state.count", ("opt_state", "count"))):
    x = np.asarray(state[leaf[0]][leaf[1]])
    for _ in range(20):
      raw = bytearray(x.tobytes())
      bit = int(rng.integers(len(raw) * 8))
      raw[bit // 8] ^= 1 << (bit % 8)
      flipped = np.frombuffer(bytes(raw), x.dtype).reshape(x.shape)
      other = {**state, leaf[0]: {**state[leaf[0]], leaf[1]: jnp.asarray(flipped)}}
      assert checkpoint.fingerprints(other)[0][name] != sums[name]
  # Every save of a same-layout state reuses one executable: nothing recompiles per checkpoint.
  assert checkpoint._tree_checks._cache_size() == compiles
  # Two words swapped keep the plain sum; the position-weighted one changes.
  w = np.asarray(state["params"]["w"]).copy()
  w[0, 0], w[3, 5] = w[3, 5], w[0, 0]
  swapped = checkpoint.fingerprints({**state, "params": {**state["params"], "w": jnp.asarray(w)}})
  assert swapped[0]["params.w"][0] == sums["params.w"][0]
  assert swapped[0]["params.w"][1] != sums["params.w"][1]
  w[2, 7] = np.nan
  bad = {**state, "params": {**state["params"], "w": jnp.asarray(w)}}
  assert checkpoint.fingerprints(bad)[1] == ["params.w"]


def largest_file(directory):
  files = [os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs]
  return max(files, key=os.path.getsize)


def xor_middle(path, n=64):
  """XORs ``n`` bytes in the middle of ``path`` with random nonzero bytes (the issue's bit flip)."""
  with open(path, "r+b") as f:
    size = f.seek(0, os.SEEK_END)
    f.seek(size // 2 - n // 2)
    chunk = bytearray(f.read(n))
    mask = np.random.default_rng(7).integers(1, 256, n, dtype=np.uint8)
    f.seek(size // 2 - n // 2)
    f.write(bytes(b ^ int(m) for b, m in zip(chunk, mask)))


def abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def test_a_bit_flipped_checkpoint_is_named_and_the_previous_one_restored(tmp_path, capsys):
  ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", async_save=False)
  states = {1: random_state(1), 2: random_state(2)}
  for step, state in states.items():
    ckpt.save(step, state, data_iter(), {"step": step})
  ckpt.close()
  xor_middle(largest_file(tmp_path / "ckpt" / "2"))
  ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", async_save=False)
  step, state, meta, _ = ckpt.restore_latest(abstract(states[1]), lambda s: data_iter())
  ckpt.close()
  err = capsys.readouterr().err
  assert step == 1 and meta == {"step": 1}
  assert f"checkpoint {tmp_path / 'ckpt' / '2'} does not match its checksums in " in err
  assert any(name in err for name in ("params.w", "opt_state.mu"))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               state, states[1])
  assert (tmp_path / "ckpt" / "2.corrupt").is_dir()


def test_a_non_finite_state_is_never_saved_nor_restored(tmp_path, capsys):
  ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", async_save=False)
  good = random_state(3)
  ckpt.save(1, good, data_iter(), {"step": 1})
  bad = {**good, "opt_state": {**good["opt_state"],
                               "mu": good["opt_state"]["mu"].at[5, 6].set(jnp.inf)}}
  with pytest.raises(checkpoint.NonFiniteError, match=r"opt_state\.mu"):
    ckpt.save(2, bad, data_iter(), {"step": 2})
  assert ckpt.steps() == [1]
  # One written anyway (as by code before this check, with matching checksums) is refused.
  ckpt.manager.save(2, args=ocp.args.Composite(
      state=ocp.args.StandardSave(bad), data=grain.checkpoint.CheckpointSave(data_iter()),
      meta=ocp.args.JsonSave({"step": 2, "checksums": checkpoint.fingerprints(bad)[0]})))
  ckpt.manager.wait_until_finished()
  step, _, _, _ = ckpt.restore_latest(abstract(good), lambda s: data_iter())
  ckpt.close()
  assert step == 1
  assert "holds non-finite values in opt_state.mu" in capsys.readouterr().err


def test_metrics_restart_at_the_restored_step(tmp_path):
  path = tmp_path / "metrics.jsonl"
  lines = [json.dumps({"step": s, "loss": float(v)})
           for s, v in zip(range(1, 8), np.random.default_rng(0).random(7))]
  path.write_text("\n".join(lines) + '\n{"step": 8, "lo')  # the last line cut by a kill
  m = metrics.Metrics(tmp_path, total_steps=10, start_step=4, progress=False)
  m.write({"step": 5, "loss": 0.5})
  m.close()
  assert [r["step"] for r in metrics.read_jsonl(path)] == [1, 2, 3, 4, 5]
  assert metrics.read_jsonl(path)[:4] == [json.loads(l) for l in lines[:4]]
