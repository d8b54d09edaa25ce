"""The training loop behind ``python train.py [--config CONFIG] [--run-dir DIR] [key=value ...]``.

With no arguments it trains the packaged ``k3_tiny`` config on the embedded default data (the Python
standard library's source, byte-level tokens) into ``runs/k3_tiny``. Running again with the same
run directory resumes from its latest complete checkpoint, exactly where it stopped.
``train.init_from=DIR`` starts a new run from the weights of an HF, Orbax or run directory
(parameters and router biases; a fresh optimizer, step 0); a run directory that already has a
checkpoint resumes from it instead, and says so.

The loop, step by step:
  config -> checks before any work (the mesh divides the batch, the run directory is writable)
  -> data (grain, packed rows, every file checked) -> the training state
  (:mod:`k3jax.train_state`: the model split into pure param / router-bias dicts, the optimizer
  state, the rng) -> restore the latest checkpoint that matches its checksums (same data
  settings, or ``data.reset_iterator``) -> ``config.yaml`` -> for each step: next batch, the train step (compiled ahead of time once
  per stage, so nothing recompiles it), metrics, eval every ``train.eval_every`` steps, an async
  checkpoint every ``checkpoint.every`` steps -> a final checkpoint. SIGTERM / SIGINT finish the current step, save a checkpoint and exit with status
  128 + signal number.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import tempfile
import time
import uuid
from typing import Callable

import jax
import yaml

from k3jax import checkpoint as checkpoint_lib
from k3jax import cli, convert
from k3jax import run_dir as run_dir_lib
from k3jax import config as config_lib
from k3jax import data as data_lib
from k3jax import flops as flops_lib
from k3jax import metrics as metrics_lib
from k3jax import storage
from k3jax import tokenizer as tokenizer_lib
from k3jax import train_step as step_lib
from k3jax import vision_data
from k3jax.vision_prompt import batch_vision
from k3jax.data import stage_at, stages
from k3jax.train_state import abstract_model, init_train_state
import sharding

DEFAULT_CONFIG = "k3_tiny"
# The settings that decide which rows the data iterator yields: a resume that changes one of them
# is refused unless data.reset_iterator=true (the saved iterator position means nothing then).
DATA_KEYS = ("data.source", "data.tokenizer", "data.text_field", "data.seq_len",
             "data.eval_fraction", "data.seed", "data.shuffle", "train.batch_size",
             "data.image_marker", "data.max_patches")


class TrainError(RuntimeError):
  """The run cannot continue (a run directory it cannot write or that holds another model, other
  data settings on resume, repeated non-finite steps, a non-finite state to save)."""


def parse_args(argv):
  p = cli.parser("train.py", "Pre-trains a K3 model.", config_default=DEFAULT_CONFIG)
  p.add_argument("--run-dir", default=None,
                 help="run directory: a local path or gs://BUCKET/PATH (default runs/<model.name>)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  return cli.parse(p, argv)


def init_weights(cfg: config_lib.Config, state):
  """``state`` with its params and router biases replaced by those of ``train.init_from``, each
  cast to its dtype and placed as its sharding; every name and shape is checked against the
  config first (:func:`k3jax.pretrained.read_weights`)."""
  from k3jax import pretrained
  src = storage.path(cfg.train.init_from)
  if not src.is_dir():
    raise TrainError(f"train.init_from: {cfg.train.init_from} is not a directory")
  shapes = state.shapes().arrays("params", "biases")  # one entry per layer, as stored
  leaves = [leaf for tree in (shapes["params"], shapes["biases"])
            for leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]
  values = pretrained.read_weights(src, cfg.model, shardings={
      pretrained.key_of(path): x.sharding for path, x in leaves})
  place = lambda path, x: jax.device_put(
      jax.numpy.asarray(values[pretrained.key_of(path)], x.dtype), x.sharding)
  return state.with_arrays(params=jax.tree_util.tree_map_with_path(place, shapes["params"]),
                           biases=jax.tree_util.tree_map_with_path(place, shapes["biases"]))


def data_settings(cfg: config_lib.Config) -> dict:
  """``{key: value}`` of :data:`DATA_KEYS` in ``cfg`` and the number of processes (each keeps its
  own iterator position), as JSON data (what a checkpoint records)."""
  tree = config_lib.to_dict(cfg)
  settings = {k: tree[k.split(".")[0]][k.split(".")[1]] for k in DATA_KEYS}
  return json.loads(json.dumps({**settings, "processes": jax.process_count()}))


def vision_spec(cfg: config_lib.Config) -> dict:
  """:func:`k3jax.train_step.batch_spec`'s vision arguments for ``cfg`` (none for a text model)."""
  patches = vision_data.row_patches(cfg)
  return {"vision": cfg.model.vision, "patches": patches} if patches else {}


def check_layout(cfg: config_lib.Config, num_devices: int) -> None:
  """Refuses a batch or sequence length that the mesh of ``cfg.mesh`` on ``num_devices`` devices
  does not split evenly (rows over the batch axes, each stage's tokens over ``context``)."""
  sizes = sharding.mesh.axis_sizes(cfg.mesh, num_devices)
  ways = math.prod(sizes[a] for a in sharding.DEFAULT_RULES["batch"])
  if cfg.train.batch_size % ways:
    raise config_lib.ConfigError(
        f"train.batch_size={cfg.train.batch_size}: the mesh {sizes} splits the rows of a batch "
        f"{ways} ways ({' x '.join(sharding.DEFAULT_RULES['batch'])}); use a multiple of {ways}")
  for stage in stages(cfg):
    if stage.seq_len % sizes["context"]:
      key = f"train.stages[{stage.index}].seq_len" if cfg.train.stages else "data.seq_len"
      raise config_lib.ConfigError(f"{key}={stage.seq_len}: must be a multiple of mesh.context="
                                   f"{sizes['context']}")


def _check_writable(path: storage.AnyPath) -> None:
  """Creates ``path`` if needed and a file of a unique name in it (removed at once): permissions
  alone do not tell (root writes anyway, a read-only mount refuses anyway; a bucket's access
  rights are only known by writing)."""
  try:
    storage.makedirs(path)
    if storage.is_remote(path):
      probe = path / f".write-probe-{uuid.uuid4().hex}"
      probe.write_text("")
      probe.unlink()
    else:
      with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-"):
        pass
  except Exception as e:  # OSError, or the object store client's own errors (a missing bucket)
    raise TrainError(f"cannot write to {path}: {getattr(e, 'strerror', None) or e}; use a "
                     "writable --run-dir") from e


def check_run_dir(run_dir: storage.AnyPath, cfg: config_lib.Config) -> None:
  """Refuses a run directory (or its ``checkpoints``) that cannot be written, and on a resume a
  different model (keys the saved config lacks take their defaults)."""
  _check_writable(run_dir)
  if cfg.checkpoint.enabled:
    _check_writable(run_dir / "checkpoints")
  path = run_dir / "config.yaml"
  if path.exists():
    saved = yaml.safe_load(path.read_text()) or {}
    if config_lib.from_dict({"model": saved.get("model") or {}}).model != cfg.model:
      raise TrainError(f"{run_dir} holds a run of a different model (see {path}); "
                       "use another --run-dir")


def record_config(run_dir: storage.AnyPath, cfg: config_lib.Config) -> None:
  """Writes ``config.yaml``: the settings the run goes on with, once it has started from them."""
  storage.write(run_dir / "config.yaml",
                     yaml.safe_dump(config_lib.to_dict(cfg), sort_keys=False))


def keep_data_position(cfg: config_lib.Config) -> Callable[[dict], bool]:
  """``keep_position`` for :meth:`Checkpointer.restore_latest`: True when the checkpoint's data
  settings are this config's; False (a fresh iterator) when they differ and
  ``data.reset_iterator`` is set; otherwise the resume is refused naming the keys."""
  now = data_settings(cfg)

  def keep(meta: dict) -> bool:
    saved = meta.get("data")
    changed = [k for k in now if saved is not None and k in saved and saved[k] != now[k]]
    if not changed:
      return True
    diff = "; ".join(f"{k}: {saved[k]!r} -> {now[k]!r}" for k in changed)
    if cfg.data.reset_iterator:
      if jax.process_index() == 0:
        print(f"data settings changed since the checkpoint ({diff}); data.reset_iterator=true: "
              "the data starts from its beginning", flush=True)
      return False
    raise TrainError(f"the run's checkpoint was saved with other data settings ({diff}); its "
                     "data position means nothing for these. Resume with the saved settings, or "
                     "set data.reset_iterator=true to start the new data from its beginning")
  return keep


class _Signals:
  """Turns SIGTERM / SIGINT into a flag that the loop checks after every step."""

  def __init__(self):
    self.received: int | None = None
    self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

  def _handle(self, signum, frame):
    if self.received is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C stops at once
    self.received = signum

  def restore(self):
    for s, h in self._old.items():
      signal.signal(s, h)


def evaluate(eval_fn, params, biases, data: data_lib.Data, seq_len: int, batches: int,
             batch_sharding) -> float:
  """Mean held-out token loss over the first ``batches`` eval batches (the same every time)."""
  it = iter(data.dataset("eval", seq_len))
  loss, weight = 0.0, 0.0
  for _ in range(batches):
    l, w = eval_fn(params, biases, step_lib.place_batch(next(it), batch_sharding))
    loss, weight = loss + float(l), weight + float(w)
  return loss / max(weight, 1.0)


def train(cfg: config_lib.Config, run_dir, *, progress: bool = True) -> dict:
  """Runs (or resumes) the training of ``cfg`` in ``run_dir`` (a local path or ``gs://`` URL);
  returns the last metrics record. ``train.mode`` rl and opd run :mod:`k3jax.posttrain.loop` (a
  local run directory; sft is this loop on chat data)."""
  if cfg.train.mode in ("rl", "opd"):
    from k3jax.posttrain import loop
    return loop.run(cfg, run_dir, progress=progress)[-1]
  sharding.mesh.initialize_distributed()
  with sharding.layout(cfg.mesh):
    return _train(cfg, storage.checkpoint_path(run_dir), progress)


def _train(cfg: config_lib.Config, run_dir: storage.AnyPath, progress: bool) -> dict:
  check_layout(cfg, jax.device_count())
  check_run_dir(run_dir, cfg)
  # The mesh of cfg.mesh (one device: every axis 1). The state is built outside the mesh context
  # (the model's logical axis names are not mesh axes); the steps run inside.
  mesh = sharding.make_mesh(cfg.mesh)
  data = data_lib.Data(cfg, process_index=jax.process_index(), process_count=jax.process_count())
  all_stages = stages(cfg)
  total = cfg.train.steps
  batch_sharding = sharding.batch_sharding(mesh)

  state = init_train_state(cfg, mesh)

  def stage_iter(stage):  # a fresh training iterator of ``stage``
    return iter(data.dataset("train", stage.seq_len, seed=cfg.data.seed + stage.index))

  def data_iter(step: int):  # the iterator a checkpoint at ``step`` saved: that of step - 1
    return stage_iter(stage_at(all_stages, max(step - 1, 0)))

  ckpt = None
  if cfg.checkpoint.enabled:
    ckpt = checkpoint_lib.Checkpointer(run_dir / "checkpoints", keep=cfg.checkpoint.keep,
                                       async_save=cfg.checkpoint.async_save)
  step, nonfinite_run = 0, 0
  it = None
  is_main = jax.process_index() == 0
  # The restore target: the shapes and shardings of the state just built (no second build), one
  # entry per layer as checkpoints hold them.
  target = state.shapes().arrays()
  restored = ckpt and ckpt.restore_latest(target, data_iter, keep_data_position(cfg))
  if restored is not None:
    step, arrays, meta, it = restored
    state = state.with_arrays(**arrays)
    nonfinite_run = int(meta.get("nonfinite_run", 0))
  elif cfg.train.init_from:
    state = init_weights(cfg, state)
  stage = stage_at(all_stages, max(step - 1, 0))
  it = it or data_iter(step)

  donate = jax.default_backend() != "cpu"
  step_fn = step_lib.jit_train_step(
      step_lib.make_train_step(cfg, state.graphdef, state.tx, state.schedule), donate=donate,
      state=state)
  eval_fn = jax.jit(step_lib.make_eval_step(state.graphdef, cfg.train))
  peak, peak_note = flops_lib.device_peak_flops(cfg.train.peak_tflops)
  if is_main:
    record_config(run_dir, cfg)
  metrics = metrics_lib.Metrics(run_dir, total_steps=total, start_step=step, enabled=is_main,
                                progress=progress)
  n_params = sum(x.size for x in jax.tree.leaves(state.params))
  metrics.say(f"{cfg.model.name}: {n_params / 1e6:.2f}M parameters, {data.num_docs('train')} "
              f"training / {data.num_docs('eval')} held-out documents, {total} steps of "
              f"{cfg.train.batch_size} rows, run dir {run_dir}")
  metrics.say(f"mfu peak: {peak_note}")
  if data.source.skipped:
    metrics.say(f"data: skipped {len(data.source.skipped)} binary or non-UTF-8 files (the first: "
                f"{data.source.skipped[0]})")
  if mesh.devices.size > 1:  # parameters a mesh axis cannot split (one device splits nothing)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    names = sharding.names_tree(abstract_model(cfg))
    whole = sharding.mesh.unsplit_warning(
        sharding.mesh.unsplit_params(state.shapes().arrays()["params"], names, sizes), sizes,
        sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params)))
    if whole:
      metrics.say(whole)
  if restored is not None:
    metrics.say(f"resumed from step {step} ({run_dir / 'checkpoints' / str(step)})"
                + (f"; train.init_from={cfg.train.init_from} is not used: the run's own "
                   "checkpoint wins" if cfg.train.init_from else ""))
  elif cfg.train.init_from:
    metrics.say(f"initialised the weights from {cfg.train.init_from} (fresh optimizer, step 0)")
  if step >= total:
    metrics.say(f"the run is complete (step {step} of train.steps={total}); nothing to do")

  def save(at_step: int, *, wait: bool = False) -> None:
    if ckpt is None:
      return
    meta = {"step": at_step, "stage": stage.index, "nonfinite_run": nonfinite_run,
            "data": data_settings(cfg)}
    try:
      ckpt.save(at_step, state.arrays(), it, meta, wait=wait)
    except checkpoint_lib.NonFiniteError as e:
      raise TrainError(f"{e}. Stopping; the last checkpoint is intact.") from e

  signals = _Signals()
  record: dict = {}
  compiled: dict[int, object] = {}  # seq_len -> the step's executable: one compile per stage
  compile_s = None  # the last compile's seconds, logged with the step after it
  last_time, last_step = time.perf_counter(), step
  contexts: list[float] = []  # mean attention context of each step's rows since the last log
  tower: list[float] = []  # the vision tower's training FLOPs of each step since the last log
  in_mesh = jax.set_mesh(mesh)
  in_mesh.__enter__()
  try:
    while step < total:
      now = stage_at(all_stages, step)
      if now.index != stage.index:
        stage, it = now, stage_iter(now)
        metrics.say(f"stage {now.index}: seq_len {now.seq_len} from step {step}")
      host_batch = next(it)
      contexts.append(flops_lib.mean_causal_context(host_batch["segment_ids"]))
      images = batch_vision(host_batch)
      tower.append(3 * flops_lib.vision_forward_flops(cfg.model, images) if images else 0.0)
      batch = step_lib.place_batch(host_batch, batch_sharding)
      try:
        if stage.seq_len not in compiled:
          compiled[stage.seq_len], report = step_lib.compile_train_step(
              step_fn, state, step_lib.batch_spec(cfg.train.batch_size, stage.seq_len,
                                                  batch_sharding, **vision_spec(cfg)))
          compile_s = report.total_s
          mem = report.memory
          temps = "" if mem is None else f"; {mem.temp_size_in_bytes / 2**30:.1f} GiB of " \
                                         "temporaries per device"
          metrics.say(f"compiled the step for {cfg.train.batch_size} x {stage.seq_len} tokens: "
                      f"{report}{temps}")
          last_time, last_step = time.perf_counter(), step  # tokens/s: steps, not compiles
          contexts[:], tower[:] = contexts[-1:], tower[-1:]
        state, out = step_lib.apply_step(compiled[stage.seq_len], state, step, batch)
      except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
          raise
        raise TrainError(out_of_memory(cfg, stage.seq_len, step + 1, e)) from e
      step += 1
      out = jax.device_get(out)
      if out["nonfinite"]:
        nonfinite_run += 1
        metrics.say(f"step {step}: non-finite loss or gradient, update skipped "
                    f"({nonfinite_run} in a row)")
        if nonfinite_run >= cfg.train.max_nonfinite:
          raise TrainError(f"{nonfinite_run} non-finite steps in a row (train.max_nonfinite="
                           f"{cfg.train.max_nonfinite}); last loss {out['loss']}, grad norm "
                           f"{out['grad_norm']}. Stopping; the last checkpoint is intact.")
      else:
        nonfinite_run = 0

      if step % cfg.train.log_every == 0 or step == total or step == 1:
        elapsed = time.perf_counter() - last_time
        tokens = (step - last_step) * cfg.train.batch_size * stage.seq_len
        tps = tokens / elapsed if elapsed > 0 and step > last_step else None
        # model FLOPs per token: the text's, and the tower's of the step spread over its tokens
        fpt = flops_lib.train_flops_per_token(cfg.model, stage.seq_len,
                                              sum(contexts) / max(len(contexts), 1)) \
            + sum(tower) / max(len(tower), 1) / (cfg.train.batch_size * stage.seq_len)
        contexts.clear()
        tower.clear()
        record = {"step": step, "loss": out["loss"], "grad_norm": out["grad_norm"],
                  "lr": out["lr"], "tokens_per_s": tps,
                  "mfu": (fpt * tps / peak) if (peak and tps) else None,
                  "target_tokens": out["tokens"], "nonfinite": out["nonfinite"],
                  "moe_load_max_mean": out["moe_load_max_mean"], "seq_len": stage.seq_len}
        if compile_s is not None:
          record["compile_s"], compile_s = compile_s, None
        metrics.write(record)
        metrics.say(f"step {step:6d}  loss {float(out['loss']):.4f}  grad_norm "
                    f"{float(out['grad_norm']):.3f}  lr {float(out['lr']):.2e}"
                    + (f"  {tps:,.0f} tok/s" if tps else ""))
        metrics.progress(step, loss=float(out["loss"]), tok_s=f"{tps:,.0f}" if tps else "-")
        last_time, last_step = time.perf_counter(), step

      if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == total) and \
          data.num_docs("eval"):
        t_eval = time.perf_counter()
        eval_loss = evaluate(eval_fn, state.params, state.biases, data, stage.seq_len,
                             cfg.train.eval_batches, batch_sharding)
        metrics.write({"step": step, "eval_loss": eval_loss})
        metrics.say(f"step {step:6d}  eval loss {eval_loss:.4f}")
        last_time += time.perf_counter() - t_eval

      if signals.received is not None:
        name = signal.Signals(signals.received).name
        save(step, wait=True)
        metrics.say(f"{name}: {'saved checkpoint' if ckpt else 'stopped'} at step {step}; exiting")
        raise SystemExit(128 + signals.received)
      if step % cfg.checkpoint.every == 0 or step == total:
        t_save = time.perf_counter()
        save(step, wait=step == total)
        last_time += time.perf_counter() - t_save
  finally:
    in_mesh.__exit__(None, None, None)
    signals.restore()
    if ckpt is not None:
      ckpt.close()
    metrics.close()
  return record


def out_of_memory(cfg: config_lib.Config, seq_len: int, step: int, e: Exception) -> str:
  """The message for step ``step`` (1-based, as in the logs) running out of device memory: what
  ran, what XLA said, what helps."""
  said = str(e).strip().splitlines()[0][:300]
  return (f"the training step ran out of device memory at step {step} ({cfg.train.batch_size} x "
          f"{seq_len} tokens per step, model.remat={cfg.model.remat}, "
          f"model.remat_skip={cfg.model.remat_skip}, "
          f"model.kda.save_residuals={cfg.model.kda.save_residuals}): {said}\n"
          "Less memory per device: model.remat=full, model.remat_skip=0, "
          "model.kda.save_residuals=false, a smaller "
          "train.batch_size with train.grad_accum, or more devices on mesh.fsdp / mesh.context. "
          "On GPUs JAX uses at most XLA_PYTHON_CLIENT_MEM_FRACTION of the memory (train.py's "
          "default 0.92; e.g. 0.95 allows more). `python -m k3jax.plan CONFIG --mesh LAYOUT "
          "--memory GB` estimates the peak for every model.remat_skip and names the largest that "
          "fits. The last checkpoint is intact.")


def main(argv=None) -> int:
  """The command line: trains, returns the exit status (2 for a bad config, data or run dir)."""
  # A training process owns its GPUs: JAX may use 92% of each (its default is 75%) unless told
  # otherwise; JAX reads this when it first touches a device.
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
  os.environ["XLA_FLAGS"] = cli.training_xla_flags(os.environ.get("XLA_FLAGS", ""))
  args = parse_args(sys.argv[1:] if argv is None else argv)
  cli.use_compile_cache()  # a resumed run loads its compiled step from disk
  try:
    cfg = cli.load(args.config, args.overrides)
    train(cfg, args.run_dir or f"runs/{cfg.model.name}", progress=not args.no_progress)
  except (config_lib.ConfigError, data_lib.DataError, tokenizer_lib.TokenizerError, TrainError,
          checkpoint_lib.LayoutError, convert.ConversionError, run_dir_lib.RunDirError,
          storage.StorageError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0
