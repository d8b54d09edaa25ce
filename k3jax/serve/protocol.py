"""The OpenAI request bodies the server reads, checked field by field, and the error it answers.

A body is parsed in one step (:func:`parse`): malformed JSON, a field of the wrong type, a value
out of range or a parameter the server does not support is an :class:`APIError` (HTTP 400 with
OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``) naming the field. Fields
the server does not know are ignored, as OpenAI's own clients send some (``user``, ...).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic

from k3jax.serve.types import TOP_LOGPROBS


class APIError(Exception):
  """An HTTP error with OpenAI's body: ``status`` 400 for bad requests (``invalid_request_error``),
  404 for an unknown model, 500 for an engine failure (``server_error``)."""

  def __init__(self, message: str, *, status: int = 400, param: str | None = None,
               code: str | None = None, type: str = "invalid_request_error"):
    super().__init__(message)
    self.message, self.status, self.param, self.code, self.type = message, status, param, code, type

  def body(self) -> dict[str, Any]:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


class _Body(pydantic.BaseModel):
  # strict: "16" is not an integer and 1.5 not a count, as OpenAI's API answers
  model_config = pydantic.ConfigDict(strict=True, extra="allow")

  @pydantic.model_validator(mode="before")
  @classmethod
  def _null_is_absent(cls, data: Any) -> Any:
    """A field sent as null takes its default, as OpenAI reads it."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Body):
  include_usage: bool = False


class _Request(_Body):
  """The sampling fields both endpoints share; ``top_k`` and ``ignore_eos`` are extensions."""
  model: str
  max_tokens: int | None = None  # None: serve.default_max_tokens, cut to the room left in the context
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  stop: str | list[str] | None = None
  seed: int | None = None
  n: int = 1
  stream: bool = False
  stream_options: StreamOptions | None = None
  ignore_eos: bool = False
  # accepted at their neutral values only
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: dict[str, float] | None = None


class CompletionRequest(_Request):
  """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either (a batch: ``n``
  choices per prompt, indexed prompt by prompt)."""
  prompt: str | list[int] | list[str] | list[list[int]]
  logprobs: int | None = None  # 0..TOP_LOGPROBS alternatives per token; None: no logprobs
  echo: bool = False
  suffix: str | None = None
  best_of: int | None = None


class TextPart(_Body):
  type: Literal["text"]
  text: str


class ImageURL(_Body):
  url: str
  detail: str = "auto"  # accepted and ignored: images run at their native resolution


class ImagePart(_Body):
  type: Literal["image_url"]
  image_url: ImageURL


class ChatMessage(_Body):
  role: str
  content: str | list[Annotated[TextPart | ImagePart, pydantic.Field(discriminator="type")]] | \
      None = None

  def text(self, marker: str = "") -> str:
    """The message's text, ``marker`` standing for each image part."""
    if isinstance(self.content, list):
      return "".join(p.text if isinstance(p, TextPart) else marker for p in self.content)
    return self.content or ""

  def image_urls(self) -> list[str]:
    if not isinstance(self.content, list):
      return []
    return [p.image_url.url for p in self.content if isinstance(p, ImagePart)]


class ChatCompletionRequest(_Request):
  """``POST /v1/chat/completions``."""
  messages: list[ChatMessage]
  logprobs: bool = False
  top_logprobs: int | None = None
  max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens (wins when given)


def parse(cls: type[_Request], raw: bytes, *, max_n: int) -> _Request:
  """The request of type ``cls`` in the JSON body ``raw``, every field checked; ``max_n`` bounds
  ``n`` (choices per prompt). Raises :class:`APIError` naming the first field in error."""
  try:
    req = cls.model_validate_json(raw)
  except pydantic.ValidationError as e:
    raise _validation_error(e) from None
  _check_ranges(req, max_n=max_n)
  return req


def _validation_error(e: pydantic.ValidationError) -> APIError:
  errors = e.errors(include_url=False)
  first = errors[0]
  if first["type"] == "json_invalid":
    return APIError(f"the body is not valid JSON: {first['msg']}")
  if not first["loc"]:
    return APIError(f"the body must be a JSON object, got {first['input']!r:.80}")
  param = str(first["loc"][0])
  # a union fails once per member, each loc going on with the member's name: keep what they share
  locs = [e["loc"] for e in errors if e["loc"][:1] == first["loc"][:1]]
  loc = locs[0]
  for other in locs[1:]:
    loc = loc[:next((i for i, (a, b) in enumerate(zip(loc, other)) if a != b), len(loc))]
  where = ".".join(map(str, loc))
  if first["type"] == "missing" and len(locs) == 1:
    return APIError(f"'{where}' is required", param=param)
  why = "has the wrong type" if len(locs) > 1 else first["msg"]
  return APIError(f"'{where}': {why} (got {first['input']!r:.80})", param=param)


def _check_ranges(req: _Request, *, max_n: int) -> None:
  def bad(param: str, message: str):
    raise APIError(f"'{param}' {message}", param=param)

  max_tokens = req.max_tokens
  if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
    max_tokens = req.max_completion_tokens
  if max_tokens is not None and max_tokens < 1:
    bad("max_tokens", f"must be at least 1, got {max_tokens}")
  if not req.temperature >= 0.0:
    bad("temperature", f"must be >= 0 (0: greedy), got {req.temperature}")
  if not 0.0 < req.top_p <= 1.0:
    bad("top_p", f"must lie in (0, 1], got {req.top_p}")
  if req.top_k < 0:
    bad("top_k", f"must be >= 0 (0: no top-k cut), got {req.top_k}")
  if not 1 <= req.n <= max_n:
    bad("n", f"must lie in [1, {max_n}] (serve.max_batch), got {req.n}")
  if req.stop is not None and any(s == "" for s in stop_strings(req)):
    bad("stop", "must not hold an empty string")
  if req.presence_penalty != 0.0 or req.frequency_penalty != 0.0:
    bad("presence_penalty" if req.presence_penalty != 0.0 else "frequency_penalty",
        "is not supported (only 0)")
  if req.logit_bias:
    bad("logit_bias", "is not supported")
  if isinstance(req, CompletionRequest):
    if req.logprobs is not None and not 0 <= req.logprobs <= TOP_LOGPROBS:
      bad("logprobs", f"must lie in [0, {TOP_LOGPROBS}], got {req.logprobs}")
    if req.echo:
      bad("echo", "is not supported")
    if req.suffix:
      bad("suffix", "is not supported")
    if req.best_of is not None and req.best_of != req.n:
      bad("best_of", "is not supported (only equal to n)")
    if isinstance(req.prompt, list) and (req.prompt == [] or [] in req.prompt):
      bad("prompt", "must not be empty")
  else:
    if not req.messages:
      bad("messages", "must hold at least one message")
    if req.top_logprobs is not None:
      if not req.logprobs:
        bad("top_logprobs", "needs 'logprobs': true")
      if not 0 <= req.top_logprobs <= TOP_LOGPROBS:
        bad("top_logprobs", f"must lie in [0, {TOP_LOGPROBS}], got {req.top_logprobs}")


def stop_strings(req: _Request) -> tuple[str, ...]:
  """``stop`` as a tuple (a single string or a list)."""
  if req.stop is None:
    return ()
  return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
