"""MoonViT-V2 on one GPU: the released K3 tower and projector (27 blocks of width 1024, 12 heads
of 128, patchmerger_v2 into 7168) on 1, 4 and 16 images of 1024 x 1024 (74 x 74 patches, 1369
visual tokens each), one image per batch row. Times the forward (``encode_images``) and forward
plus backward (gradients of every tower and projector parameter), bf16, with the model FLOPs of
``k3jax.flops.vision_forward_flops`` (3x for forward+backward) and the attention implementation
used (``model.mla.implementation``: the Pallas kernels by default on GPU), after checking the
visual tokens against the same tower with XLA attention. Rows go to ``$OUT/vision_bench.json``
as they are measured.

  python3 benchmarks/vision.py                        # 1, 4, 16 images
  python3 benchmarks/vision.py --images 1,4 --remat   # the blocks recomputed in the backward
  python3 benchmarks/vision.py --images 1 --size 112 --interpret   # CPU: the path, one sample

The LLM step to compare with is ``benchmarks/bench_train.py``'s (same card, same run).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax import config as config_lib  # noqa: E402
from k3jax import vision  # noqa: E402
from k3jax.convert.hf_vision import K3_VISION_CONFIG, vision_from_hf  # noqa: E402
from k3jax.flops import vision_forward_flops  # noqa: E402
from k3jax.vision.projector import Projector  # noqa: E402
from k3jax.vision.tower import VisionTower  # noqa: E402
from timing import Rows, kernel_bench_args, median_ms  # noqa: E402

ROWS = Rows("vision_bench.json")
TEXT_HIDDEN = 7168


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--images", default="1,4,16")
  p.add_argument("--size", type=int, default=1024, help="image side in pixels")
  p.add_argument("--remat", action="store_true")
  p.add_argument("--layers", type=int, default=27)
  args, _, _, reps = kernel_bench_args(p, budget=600)
  fields = vision_from_hf({**K3_VISION_CONFIG, "vt_num_hidden_layers": args.layers}, TEXT_HIDDEN,
                          163605)
  model = config_lib.from_dict({"model": {
      "hidden_size": TEXT_HIDDEN, "vocab_size": 163840, "param_dtype": args.dtype, "compute_dtype": args.dtype,
      "remat": "full" if args.remat else "none", "vision": fields}}).model
  modules = nnx.List([VisionTower(model, rngs=nnx.Rngs(0)), Projector(model, rngs=nnx.Rngs(1))])
  graphdef, params = nnx.split(modules)
  dtype = model.cdtype

  def encoder(graph):
    def encode(p, a):
      tower, projector = nnx.merge(graph, p)
      return projector(tower(a, dtype))
    return jax.jit(encode)

  fwd = encoder(graphdef)
  # the same tower with XLA attention: the reference the kernels are checked against
  xla_model = dataclasses.replace(model, mla=dataclasses.replace(model.mla, implementation="xla"))
  xla_graph = nnx.split(nnx.List([VisionTower(xla_model, rngs=nnx.Rngs(0)),
                                  Projector(xla_model, rngs=nnx.Rngs(1))]))[0]
  loss = lambda p, a: jnp.sum(fwd(p, a).astype(jnp.float32) ** 2)
  fwdbwd = jax.jit(jax.grad(loss))
  rng = np.random.default_rng(0)
  image = rng.integers(0, 256, (args.size, args.size, 3), np.uint8)
  item = vision.preprocess(image, model.vision)
  one = {k: jnp.asarray(v) for k, v in vision.batch([item], max_patches=item.num_patches).items()}
  ROWS.check("check_vs_xla_attention", ["visual_tokens"], [fwd(params, one)],
             [encoder(xla_graph)(params, one)], tol=2e-2)
  for n in (int(x) for x in args.images.split(",")):
    arrays = {k: jnp.asarray(v) for k, v in
              vision.batch([[item] for _ in range(n)], max_patches=item.num_patches).items()}
    flops = vision_forward_flops(model, arrays)
    res = {}
    for part, fn, mult in (("fwd", fwd, 1), ("fwdbwd", fwdbwd, 3)):
      ms = median_ms(fn, params, arrays, **reps, max_sample_s=0.3)
      res[f"{part}_ms"] = round(ms, 3)
      res[f"{part}_TFLOPs"] = round(mult * flops / ms / 1e9, 1)
    ROWS.emit({"name": f"vision_{n}x{args.size}", "images": n, "patches": item.num_patches * n,
               "tokens": item.num_tokens * n, "layers": args.layers, "remat": args.remat,
               "dtype": args.dtype, "attention": model.mla.implementation or "default",
               "device": jax.devices()[0].device_kind, **res})


if __name__ == "__main__":
  main()
