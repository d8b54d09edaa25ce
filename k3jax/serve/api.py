"""The OpenAI-compatible HTTP API over the serving engine: :func:`make_app`.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` as server-sent
events ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(docs/serving.md). Each choice of a request is one engine request: its tokens come back through a
callback on the engine's thread, are handed to the event loop and turned into text there
(:class:`k3jax.serve.text_stream.TextStream`: whole characters, stop strings cut). A client that
disconnects, streaming or not, cancels its engine requests; a stop string found cancels its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import uuid
from typing import Any, AsyncIterator

import fastapi
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException

from k3jax import images as images_lib
from k3jax import vision_prompt
from k3jax import tokenizer as tokenizer_lib
from k3jax.generate import encode_prompt
from k3jax.serve import protocol
from k3jax.serve.metrics import ServerMetrics
from k3jax.serve.protocol import APIError
from k3jax.serve.text_stream import TextStream
from k3jax.serve.types import RequestError, SamplingParams, TokenOutput
from k3jax.vision import VisionError

# stands for an image part in the chat template's text, split off again before tokenising
IMAGE_MARKER = "\ufffcimage\ufffc"
# choice i of a request with seed s samples with seed (s + i * SEED_STRIDE) mod 2**31: choice 0
# keeps the request's seed, the others differ from it and from each other
SEED_STRIDE = 0x9E3779B1
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


@dataclasses.dataclass(eq=False)
class _Choice:
  """One engine request: a choice of an HTTP request."""
  index: int
  prompt: list[int]
  params: SamplingParams
  text: TextStream
  images: list = ()  # vision items of the prompt's placeholders, in order
  rid: int | None = None
  tokens: int = 0
  cached_tokens: int = 0
  finish: str | None = None
  logprobs: list[TokenOutput] = dataclasses.field(default_factory=list)  # not yet reported
  text_offset: int = 0  # characters of the token texts reported so far (completions' logprobs)
  first_at: float | None = None
  last_at: float = 0.0


@dataclasses.dataclass
class _Piece:
  """Text released for a choice, the tokens' logprobs that came with it, and its end."""
  choice: _Choice
  text: str
  logprobs: list[TokenOutput]
  finish: str | None


class _Run:
  """The engine requests of one HTTP request, their outputs as :class:`_Piece` s."""

  def __init__(self, server: _Server, choices: list[_Choice], arrived: float, logprobs: bool):
    self.server, self.choices, self.arrived, self.logprobs = server, choices, arrived, logprobs
    self._loop = asyncio.get_running_loop()
    self._queue: asyncio.Queue = asyncio.Queue()

  def submit(self) -> None:
    try:
      for c in self.choices:
        extra = {"images": c.images} if c.images else {}
        c.rid = self.server.engine.submit(c.prompt, c.params, functools.partial(self._on_output, c),
                                          **extra)
    except RequestError as e:
      self.cancel()
      raise APIError(str(e)) from None

  def _on_output(self, choice: _Choice, out: TokenOutput) -> None:  # on the engine's thread
    try:
      self._loop.call_soon_threadsafe(self._queue.put_nowait, (choice, time.monotonic(), out))
    except RuntimeError:  # the event loop is closed: the server has stopped
      pass

  def cancel(self) -> None:
    """Cancels every engine request still running (a client gone, an error)."""
    for c in self.choices:
      if c.finish is None and c.rid is not None:
        self.server.engine.cancel(c.rid)

  async def pieces(self) -> AsyncIterator[_Piece]:
    running = len(self.choices)
    while running:
      piece = self._take(*await self._queue.get())
      if piece is not None:
        running -= piece.finish is not None
        yield piece

  def _take(self, c: _Choice, now: float, out: TokenOutput) -> _Piece | None:
    if c.finish is not None:
      return None  # the abort after a stop string's cancel
    if out.finish_reason == "error":
      c.finish = "error"
      raise APIError(f"the engine failed on this request: {out.error}", status=500,
                     type="server_error")
    c.cached_tokens = out.cached_tokens
    text = ""
    if out.token is not None:
      if c.first_at is None:
        c.first_at = now
        self.server.metrics.ttft.observe(now - self.arrived)
      c.last_at = now
      c.tokens += 1
      if self.logprobs:
        c.logprobs.append(out)
      if out.finish_reason != "stop":  # a stop token is no text
        text = c.text.push(out.token)
    finish = out.finish_reason
    if c.text.stopped:
      if finish is None:
        self.server.engine.cancel(c.rid)
      finish = "stop"
    elif finish is not None:
      text += c.text.finish()
    if finish is not None:
      c.finish = finish
      if c.tokens > 1:
        self.server.metrics.tpot.observe((c.last_at - c.first_at) / (c.tokens - 1))
    if not text and finish is None:
      return None
    piece = _Piece(c, text, c.logprobs, finish)
    c.logprobs = []
    return piece


async def _disconnected(request: fastapi.Request) -> None:
  """Returns when the client has gone (the body already read, the next message is the end)."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


class _Server:
  """What the routes share: the engine, the tokenizer, the metrics; request -> choices ->
  response."""

  def __init__(self, engine, tokenizer: tokenizer_lib.Tokenizer, model_name: str):
    if tokenizer.vocab_size > engine.cfg.vocab_size:
      raise tokenizer_lib.TokenizerError(f"the tokenizer's {tokenizer.vocab_size} ids do not fit the model's "
                       f"vocab_size {engine.cfg.vocab_size}")
    self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
    self.metrics = ServerMetrics(lambda: engine.stats)
    self.created = int(time.time())

  def parse(self, cls, raw: bytes):
    req = protocol.parse(cls, raw, max_n=self.engine.serve.max_batch)
    if req.model != self.model_name:
      raise APIError(f"the model {req.model!r} does not exist (this server has "
                     f"{self.model_name!r})", status=404, param="model", code="model_not_found")
    return req

  def text_prompt(self, text: str) -> list[int]:
    return encode_prompt(text, self.tokenizer, self.engine.cfg.bos_token_id, chat=False)

  def image_prompt(self, text: str, urls: list[str]) -> tuple[list[int], list]:
    """The prompt of a chat with images: ``text`` holds :data:`IMAGE_MARKER` where each image of
    ``urls`` (data URLs) goes. Returns (ids with each image's placeholder run, the images'
    vision items in order); a bad image is an :class:`APIError` (400) saying which and why."""
    cfg = self.engine.cfg.vision
    if cfg is None:
      raise APIError(f"the model {self.model_name!r} takes no images (it has no vision tower)",
                     param="messages")
    per_image = []
    for k, url in enumerate(urls):
      try:
        pixels = images_lib.from_url(url, max_pixels=cfg.max_pixels)
        per_image.append(vision_prompt.preprocess(pixels, cfg))
      except VisionError as e:  # images_lib.ImageError too
        raise APIError(f"image {k} of the messages: {e}", param="messages") from None
    pieces = text.split(IMAGE_MARKER)
    if len(pieces) != len(urls) + 1:
      raise APIError(f"the messages' text holds the reserved image marker {IMAGE_MARKER!r}",
                     param="messages")
    ids, _, items = vision_prompt.interleave(
        [self.text_prompt(pieces[0])] + [self.tokenizer.encode(p) for p in pieces[1:]], per_image,
        cfg.image_token_id)
    return ids.tolist(), items

  def choices(self, req, prompts: list[list[int]], max_tokens: int | None,
              logprobs: int | None, images: list = ()) -> list[_Choice]:
    """``req.n`` choices per prompt, each prompt checked by the engine before any is submitted;
    ``logprobs``: alternatives per token (None: no logprobs); ``images``: the vision items of
    the (one) prompt's placeholders."""
    vocab = self.engine.cfg.vocab_size
    stop = protocol.stop_strings(req)
    out = []
    for prompt in prompts:
      if any(not 0 <= t < vocab for t in prompt):
        raise APIError(f"'prompt' token ids must lie in [0, {vocab})", param="prompt")
      room = self.engine.max_model_len - len(prompt)
      n_tokens = max_tokens or max(1, min(self.engine.serve.default_max_tokens, room))
      for i in range(req.n):
        seed = None if req.seed is None else (req.seed + i * SEED_STRIDE) % 2**31
        params = SamplingParams(max_tokens=n_tokens, temperature=req.temperature, top_p=req.top_p,
                                top_k=req.top_k, seed=seed, ignore_eos=req.ignore_eos,
                                logprobs=logprobs or 0)
        if i == 0:
          try:
            self.engine.validate(prompt, params, **({"images": images} if images else {}))
          except RequestError as e:
            raise APIError(str(e)) from None
        out.append(_Choice(len(out), prompt, params, TextStream(self.tokenizer, stop),
                           images=images))
    return out

  def usage(self, prompts: list[list[int]], choices: list[_Choice]) -> dict[str, Any]:
    n = len(choices) // len(prompts)
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(c.tokens for c in choices)
    # a prompt's cached tokens: those every one of its choices found in the prefix cache
    cached = sum(min(c.cached_tokens for c in choices[i * n:(i + 1) * n]) for i in range(len(prompts)))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}

  def token_text(self, token: int) -> str:
    return self.tokenizer.decode([token])

  def completion_logprobs(self, c: _Choice, outs: list[TokenOutput]) -> dict[str, Any]:
    tokens = [self.token_text(o.token) for o in outs]
    offsets = []
    for t in tokens:
      offsets.append(c.text_offset)
      c.text_offset += len(t)
    return {"tokens": tokens, "token_logprobs": [o.logprob for o in outs],
            "top_logprobs": [{self.token_text(t): lp for t, lp in o.top_logprobs} for o in outs],
            "text_offset": offsets}

  def chat_logprobs(self, outs: list[TokenOutput]) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
      text = self.token_text(token)
      return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [entry(o.token, o.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in
                                                                       o.top_logprobs]}
                        for o in outs], "refusal": None}

  async def respond(self, request: fastapi.Request, req, prompts: list[list[int]],
                    choices: list[_Choice], arrived: float, *, chat: bool, logprobs: bool):
    run = _Run(self, choices, arrived, logprobs)
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
            "model": self.model_name}

    def choice_body(piece: _Piece, text: str, *, delta: bool) -> dict[str, Any]:
      lp = None
      if logprobs:
        lp = (self.chat_logprobs(piece.logprobs) if chat
              else self.completion_logprobs(piece.choice, piece.logprobs))
      body = {"index": piece.choice.index, "logprobs": lp, "finish_reason": piece.finish}
      if not chat:
        return body | {"text": text}
      if delta:
        return body | {"delta": {"content": text} if text else {}}
      return body | {"message": {"role": "assistant", "content": text}}

    if req.stream:
      kind = "chat.completion.chunk" if chat else "text_completion"
      usage = req.stream_options is not None and req.stream_options.include_usage

      async def events():  # submits when it starts: a client gone before costs nothing
        try:
          run.submit()
          if chat:  # the role first, as OpenAI streams it
            for c in choices:
              yield json.dumps(head | {"object": kind, "choices": [
                  {"index": c.index, "delta": {"role": "assistant", "content": ""},
                   "logprobs": None, "finish_reason": None}]})
          async for piece in run.pieces():
            yield json.dumps(head | {"object": kind,
                                     "choices": [choice_body(piece, piece.text, delta=True)]})
          if usage:
            yield json.dumps(head | {"object": kind, "choices": [],
                                     "usage": self.usage(prompts, choices)})
          yield "[DONE]"
        except APIError as e:
          yield json.dumps(e.body())
          yield "[DONE]"
        finally:
          run.cancel()
      return EventSourceResponse(events())

    async def collect() -> list[_Piece]:
      return [p async for p in run.pieces()]
    run.submit()
    pieces = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
      await asyncio.wait({pieces, gone}, return_when=asyncio.FIRST_COMPLETED)
      if not pieces.done():
        return Response(status_code=499)  # the client has gone: nobody reads this
      got = pieces.result()
    finally:
      gone.cancel()
      pieces.cancel()
      run.cancel()
    merged = []
    for c in choices:
      mine = [p for p in got if p.choice is c]
      merged.append(choice_body(_Piece(c, "", [o for p in mine for o in p.logprobs], c.finish),
                                "".join(p.text for p in mine), delta=False))
    return head | {"object": "chat.completion" if chat else "text_completion", "choices": merged,
                   "usage": self.usage(prompts, choices)}


class _CountRequests:
  """ASGI middleware counting answered requests by endpoint and status (``k3jax_requests_total``)."""

  def __init__(self, app, metrics: ServerMetrics):
    self.app, self.metrics = app, metrics

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    status = 500

    async def send_status(message):
      nonlocal status
      if message["type"] == "http.response.start":
        status = message["status"]
      await send(message)
    try:
      await self.app(scope, receive, send_status)
    finally:
      endpoint = scope["path"] if scope["path"] in ROUTES else "other"
      self.metrics.requests.labels(endpoint, str(status)).inc()


def make_app(engine, tokenizer: tokenizer_lib.Tokenizer, *, model_name: str) -> fastapi.FastAPI:
  """The API over ``engine`` (a started :class:`k3jax.serve.engine.Engine`), decoding text with
  ``tokenizer``; ``model_name`` is the model id clients name. Metrics go to a registry of this
  app's own."""
  server = _Server(engine, tokenizer, model_name)
  app = fastapi.FastAPI(title="k3jax", docs_url=None, redoc_url=None, openapi_url=None)
  app.add_middleware(_CountRequests, metrics=server.metrics)

  @app.exception_handler(APIError)
  async def api_error(request, e: APIError):
    return JSONResponse(e.body(), status_code=e.status)

  @app.exception_handler(RequestValidationError)
  async def validation_error(request, e: RequestValidationError):
    return JSONResponse(APIError(f"invalid request: {e.errors()}").body(), status_code=400)

  @app.exception_handler(HTTPException)
  async def http_error(request, e: HTTPException):
    return JSONResponse(APIError(str(e.detail), status=e.status_code).body(),
                        status_code=e.status_code, headers=e.headers)

  @app.post("/v1/completions")
  async def completions(request: fastapi.Request):
    arrived = time.monotonic()
    req = server.parse(protocol.CompletionRequest, await request.body())
    p = req.prompt
    batch = p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
    prompts = [server.text_prompt(x) if isinstance(x, str) else list(x) for x in batch]
    choices = server.choices(req, prompts, req.max_tokens, req.logprobs)
    return await server.respond(request, req, prompts, choices, arrived, chat=False,
                                logprobs=req.logprobs is not None)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: fastapi.Request):
    arrived = time.monotonic()
    req = server.parse(protocol.ChatCompletionRequest, await request.body())
    urls = [u for m in req.messages for u in m.image_urls()]
    marker = IMAGE_MARKER if urls else ""
    messages = [{"role": m.role, "content": m.text(marker)} for m in req.messages]
    text = tokenizer_lib.apply_chat_template(tokenizer, messages)
    if urls:  # decoding and patching off the event loop
      prompt, items = await asyncio.to_thread(server.image_prompt, text, urls)
    else:
      prompt, items = server.text_prompt(text), []
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    choices = server.choices(req, [prompt], max_tokens, logprobs, images=items)
    return await server.respond(request, req, [prompt], choices, arrived, chat=True,
                                logprobs=req.logprobs)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model",
                                        "created": server.created, "owned_by": "k3jax",
                                        "max_model_len": engine.max_model_len}]}

  @app.get("/health")
  async def health():
    return {"status": "ok"}

  @app.get("/metrics")
  async def metrics():
    body, content_type = server.metrics.exposition()
    return Response(body, media_type=content_type)

  return app
