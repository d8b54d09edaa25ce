"""``python serve.py`` / ``k3jax-serve``: one model behind the OpenAI-compatible API.

The model is ``--checkpoint``'s (a ``train.py`` run directory, an HF or an Orbax directory), else
a freshly initialised model of ``--config`` (random weights: its output is noise). The tokenizer
is ``--tokenizer``, else the checkpoint's own, else the run's or the config's ``data.tokenizer``.
Serving options are the config's ``serve.*`` keys (docs/serving.md); ``--host`` and ``--port``
replace ``serve.host`` and ``serve.port`` (port 0: any free port). With several devices the engine
runs on a mesh of them laid out by the ``mesh.*`` keys, with training's sharding rules. When the step shapes are
compiled and the socket listens it prints ``serving MODEL at http://HOST:PORT/v1``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys


def bind(host: str, port: int) -> socket.socket:
  """A listening-ready TCP socket on ``host:port`` (port 0: a free one the OS picks)."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
  except OSError:
    sock.close()
    raise
  return sock


async def _serve(server, sock: socket.socket, ready: str) -> None:
  """Runs the uvicorn ``server`` on ``sock``, printing ``ready`` once it listens."""
  task = asyncio.create_task(server.serve(sockets=[sock]))
  while not server.started and not task.done():
    await asyncio.sleep(0.05)
  if server.started:
    print(ready, flush=True)
  await task


def main(argv: list[str] | None = None) -> int:
  """The command line; returns the exit status (2: bad arguments, config, checkpoint or address)."""
  import jax
  import uvicorn

  from k3jax import cli
  from k3jax.generate import add_model_arguments, load_errors, load_model
  from k3jax.serve.api import make_app
  from k3jax.serve.engine import Engine
  p = cli.parser("python serve.py", __doc__.split("\n\n", 1)[1], config_default="k3_tiny",
                 config_help="YAML config (a path or a packaged name; default k3_tiny): the model "
                             "without --checkpoint, and the serve.* keys")
  add_model_arguments(p)
  p.add_argument("--host", default=None, help="address to listen on (default serve.host)")
  p.add_argument("--port", type=int, default=None, help="port (default serve.port; 0: a free one)")
  p.add_argument("--seed", type=int, default=0, help="seed of the random weights without --checkpoint")
  args = cli.parse(p, argv)
  cli.use_compile_cache()  # a restart loads the step shapes from disk
  logging.basicConfig(format="[%(name)s] %(message)s")
  logging.getLogger("k3jax").setLevel(logging.INFO)  # the engine's compile time
  overrides = list(args.overrides)
  overrides += [f"serve.{k}={v}" for k, v in (("host", args.host), ("port", args.port)) if v is not None]
  try:
    cfg, model, tok = load_model(args.config, overrides, checkpoint=args.checkpoint,
                                 tokenizer=args.tokenizer, seed=args.seed)
    s = cfg.serve
    name = s.model_name or cfg.model.name
    # several devices: a mesh of them with training's sharding rules (the mesh.* keys)
    engine = Engine(model, s, mesh=cfg.mesh if jax.device_count() > 1 else None)
    app = make_app(engine, tok, model_name=name)
  except load_errors() as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  try:
    sock = bind(s.host, s.port)
  except OSError as e:
    print(f"error: cannot listen on {s.host}:{s.port}: {e}", file=sys.stderr)
    return 2
  if args.checkpoint is None:
    print(f"[serve] no --checkpoint: {name} has random weights (seed {args.seed}); its output is "
          "noise", file=sys.stderr)
  host, port = sock.getsockname()[:2]
  engine.start()  # compiles every step shape first (the time is logged)
  try:
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    host = f"[{host}]" if ":" in host else host
    asyncio.run(_serve(server, sock, f"serving {name} at http://{host}:{port}/v1"))
  except KeyboardInterrupt:  # uvicorn stops on Ctrl-C, then raises it again for its caller
    pass
  finally:
    engine.shutdown()
  return 0
