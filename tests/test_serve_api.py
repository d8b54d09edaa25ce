"""The HTTP API (issue 39 items 1, 2 and 7) through the official ``openai`` client against a real
uvicorn server on a free port: over :class:`fake_engine.FakeEngine` for the API's own behaviour
(cheap), over the real engine with ``k3_tiny`` for greedy output equal to ``k3jax.generate``,
and ``serve.py`` as a process (both slow)."""

import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import uvicorn

import fake_engine
from conftest import tiny_config
from fake_engine import FakeEngine
from k3jax.serve.api import SEED_STRIDE, make_app
from k3jax.serve.text_stream import TextStream
from k3jax.serve.types import SamplingParams
from k3jax.tokenizer import ByteTokenizer, PLAIN_TEMPLATE

MODEL = "tiny-served"
BOS = 256
# serve.num_pages * serve.page_size = 192 cache tokens < serve.max_model_len = 256
SERVE = ("serve.max_model_len=256", "serve.block_size=32", "serve.page_size=16",
         "serve.num_pages=12", "serve.max_batch=4", "serve.default_max_tokens=24")


class ServerThread:
  """uvicorn serving ``app`` from a thread on a free port of 127.0.0.1."""

  def __init__(self, app):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
    self.thread.start()
    deadline = time.monotonic() + 30
    while not self.server.started:
      assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
      time.sleep(0.01)
    self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

  def stop(self):
    self.server.should_exit = True
    self.thread.join()


@pytest.fixture(scope="module")
def fake():
  cfg = tiny_config(*SERVE)
  engine = FakeEngine(cfg.model, cfg.serve, step_s=0.005)
  engine.start()
  server = ServerThread(make_app(engine, ByteTokenizer(), model_name=MODEL))
  server.engine = engine
  yield server
  server.stop()
  engine.shutdown()


def expected(prompt_ids, count, **params) -> str:
  return ByteTokenizer().decode(fake_engine.tokens(prompt_ids, SamplingParams(**params), count))


def ids(text: str) -> list[int]:
  return [BOS] + list(text.encode())


def test_completion(fake):
  r = fake.client.completions.create(model=MODEL, prompt="Once upon", max_tokens=20, temperature=0)
  assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
  (c,) = r.choices
  assert c.text == expected(ids("Once upon"), 20, temperature=0) and c.finish_reason == "length"
  assert c.logprobs is None
  assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (10, 20, 30)
  prompt, params = fake.engine.submitted[max(fake.engine.submitted)]
  assert prompt == ids("Once upon") and params.max_tokens == 20 and params.temperature == 0


def test_completion_of_token_ids_and_batches(fake):
  r = fake.client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5, temperature=0)
  assert r.choices[0].text == expected([5, 6, 7], 5, temperature=0)
  assert fake.engine.submitted[max(fake.engine.submitted)][0] == [5, 6, 7]  # no BOS added
  r = fake.client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=4, n=2,
                                     temperature=0)
  assert [c.index for c in r.choices] == [0, 1, 2, 3]
  assert [c.text for c in r.choices] == [expected(ids(p), 4, temperature=0) for p in "ab ab cd cd".split()]
  assert r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 16


def test_default_max_tokens_fits_the_context():
  cfg = tiny_config(*SERVE, "serve.num_pages=0")  # a cache for the whole context
  engine = FakeEngine(cfg.model, cfg.serve)
  engine.start()
  server = ServerThread(make_app(engine, ByteTokenizer(), model_name=MODEL))
  try:
    r = server.client.completions.create(model=MODEL, prompt="x", temperature=0)
    assert r.usage.completion_tokens == 24  # serve.default_max_tokens
    r = server.client.completions.create(model=MODEL, prompt=list(range(250)), temperature=0)
    assert r.usage.completion_tokens == 6  # the room left in serve.max_model_len
  finally:
    server.stop()
    engine.shutdown()


def test_chat_plain_template(fake):
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
  r = fake.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                          temperature=0)
  text = "".join(PLAIN_TEMPLATE.format(**m) for m in messages) + "assistant: "
  assert text == "system: Be brief.\nuser: Hi\nassistant: "
  assert fake.engine.submitted[max(fake.engine.submitted)][0] == ids(text)
  (c,) = r.choices
  assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
  assert c.message.role == "assistant" and c.message.content == expected(ids(text), 12, temperature=0)
  assert c.finish_reason == "length"


@pytest.mark.parametrize("chat", [False, True])
def test_stream_equals_non_stream(fake, chat):
  kw = dict(model=MODEL, max_tokens=40, temperature=0.7, seed=3, n=2)
  if chat:
    kw["messages"] = [{"role": "user", "content": "Grüße"}]
    create = fake.client.chat.completions.create
  else:
    kw["prompt"] = "Grüße"
    create = fake.client.completions.create
  whole = create(**kw)
  parts, finish, usage = {0: [], 1: []}, {}, None
  for chunk in create(**kw, stream=True, stream_options={"include_usage": True}):
    if chunk.usage is not None:
      usage = chunk.usage
    for c in chunk.choices:
      parts[c.index].append((c.delta.content or "") if chat else c.text)
      if c.finish_reason:
        finish[c.index] = c.finish_reason
  texts = [(c.message.content if chat else c.text) for c in whole.choices]
  assert ["".join(parts[i]) for i in (0, 1)] == texts
  # never half a character, but where max_tokens cut one
  assert not any("\ufffd" in p for i in (0, 1) for p in parts[i][:-1])
  assert any(not p.isascii() for p in parts[0])  # multi-byte characters came whole
  assert finish == {0: "length", 1: "length"}
  assert usage.completion_tokens == whole.usage.completion_tokens == 80
  # n > 1: seeds derived per choice, choice 0 keeping the request's
  assert texts[0] != texts[1]
  seeds = [p.seed for _, p in list(fake.engine.submitted.values())[-2:]]
  assert seeds == [3, (3 + SEED_STRIDE) % 2**31]


def test_logprobs(fake):
  r = fake.client.completions.create(model=MODEL, prompt="ab", max_tokens=6, temperature=0,
                                     logprobs=3)
  lp = r.choices[0].logprobs
  assert lp.token_logprobs == [fake_engine.logprob(i) for i in range(6)]
  assert "".join(lp.tokens).encode("utf-8", "replace") and len(lp.tokens) == 6
  # alternatives keyed by their text: the byte tokens of a cut character all read U+FFFD
  assert all(len(t) == 3 for tok, t in zip(lp.tokens, lp.top_logprobs) if tok.isascii())
  assert any(tok.isascii() for tok in lp.tokens)
  assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
  r = fake.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
  content = r.choices[0].logprobs.content
  assert [e.logprob for e in content] == [fake_engine.logprob(i) for i in range(5)]
  assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob for e in content)
  streamed = [e for ch in fake.client.chat.completions.create(
      model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=5, temperature=0,
      logprobs=True, top_logprobs=2, stream=True) for c in ch.choices if c.logprobs
      for e in c.logprobs.content]
  assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(fake, stream):
  full = expected(ids("s"), 60, temperature=0)
  stop = ["☃ 𝄞", "zzz"]
  cut = full[:full.index(stop[0])]
  before = set(fake.engine.cancelled)
  r = fake.client.completions.create(model=MODEL, prompt="s", max_tokens=60, temperature=0,
                                     stop=stop, stream=stream)
  if stream:
    chunks = list(r)
    text = "".join(c.choices[0].text for c in chunks)
    finish = chunks[-1].choices[0].finish_reason
  else:
    text, finish = r.choices[0].text, r.choices[0].finish_reason
  assert (text, finish) == (cut, "stop")
  deadline = time.monotonic() + 5
  while fake.engine.cancelled == before:  # the engine request was cancelled when the stop matched
    assert time.monotonic() < deadline
    time.sleep(0.01)


def test_text_stream_holds_cut_characters_and_stop_prefixes():
  tok = ByteTokenizer()
  data = "aé☃𝄞b".encode() + b"\xff\xe2\x82" + "€x".encode()
  s = TextStream(tok)
  pieces = [s.push(b) for b in data] + [s.finish()]
  assert "".join(pieces) == data.decode("utf-8", "replace")
  assert all("\ufffd" not in p for p in pieces[:4 + 1])
  s = TextStream(tok, ("xyz", "b!"))
  pieces = [s.push(b) for b in b"axyb!x"]
  assert pieces == ["a", "", "", "xy", "", ""] and s.stopped and s.finish() == ""
  s = TextStream(tok, ("xyz",))
  assert [s.push(b) for b in b"axy"] + [s.finish()] == ["a", "", "", "xy"]


BAD = [
    ("/v1/completions", b'{"model": "m", "prompt": "a",', None),
    ("/v1/completions", b'[1, 2]', None),
    ("/v1/completions", {"prompt": "a", "model": None}, "model"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "16"}, "max_tokens"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": "a", "stop": 3}, "stop"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "a", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "a", "top_k": -1}, "top_k"),
    ("/v1/completions", {"prompt": "a", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "a", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": [1, 320]}, "prompt"),
    ("/v1/completions", {"prompt": [1, -1]}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "a" * 300, "max_tokens": 1}, None),  # longer than the context
    ("/v1/completions", {"prompt": "a", "max_tokens": 250}, None),  # does not fit the cache alone
    ("/v1/completions", {"prompt": "a", "frequency_penalty": 1.0}, "frequency_penalty"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"content": "a"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
]


@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_is_400_and_the_server_keeps_serving(fake, stream):
  with httpx.Client(base_url=fake.url, timeout=30) as http:
    for path, body, param in BAD:
      if isinstance(body, dict):
        body = {"model": MODEL, "stream": stream} | body
        body = json.dumps({k: v for k, v in body.items() if v is not None}).encode()
      r = http.post(path, content=body, headers={"content-type": "application/json"})
      assert r.status_code == 400, (body, r.text)
      err = r.json()["error"]
      assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param, (body, err)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2,
                                           "temperature": None, "stop": None, "user": "u"})
    assert r.status_code == 200, r.text  # null is the default; unknown fields are ignored
  with pytest.raises(openai.BadRequestError, match="max_tokens"):
    fake.client.completions.create(model=MODEL, prompt="a", max_tokens=0)
  with pytest.raises(openai.NotFoundError, match="does not exist"):
    fake.client.completions.create(model="gpt-4", prompt="a")
  r = fake.client.completions.create(model=MODEL, prompt="still", max_tokens=3, temperature=0)
  assert r.choices[0].text == expected(ids("still"), 3, temperature=0)


def test_disconnect_cancels_the_engine_request(fake):
  body = {"model": MODEL, "prompt": "long", "max_tokens": 150, "temperature": 0}  # 0.75 s
  for stream in (True, False):
    n = len(fake.engine.submitted)
    with httpx.Client(base_url=fake.url, timeout=0.2 if not stream else 30) as http:
      if stream:
        with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
          assert r.status_code == 200
          next(r.iter_lines())
      else:
        with pytest.raises(httpx.ReadTimeout):
          http.post("/v1/completions", json=body)
    rid = n  # the fake numbers requests in order
    deadline = time.monotonic() + 5
    while rid not in fake.engine.cancelled:
      assert time.monotonic() < deadline, f"stream={stream}: the engine request was not cancelled"
      time.sleep(0.01)


def test_models_health_metrics(fake):
  (m,) = fake.client.models.list().data
  assert m.id == MODEL and m.owned_by == "k3jax"
  with httpx.Client(base_url=fake.url) as http:
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", content=b"{").status_code == 400
    r = fake.client.completions.create(model=MODEL, prompt="x" * 70, max_tokens=2)
    r = fake.client.completions.create(model=MODEL, prompt="x" * 70 + "y", max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens == 64  # two blocks of 32 shared
    text = http.get("/metrics").text
  for series in ("k3jax_requests_total", "k3jax_time_to_first_token_seconds_bucket",
                 "k3jax_time_per_output_token_seconds_count", "k3jax_requests_running",
                 "k3jax_requests_waiting", "k3jax_cache_pages_used", "k3jax_prefix_hit_tokens_total",
                 "k3jax_kda_checkpoint_hits_total", "k3jax_preemptions_total"):
    assert f"\n{series}" in text, series
  assert 'k3jax_requests_total{endpoint="/v1/completions",status="400"}' in text
  assert 'k3jax_requests_total{endpoint="/v1/completions",status="200"}' in text
  hits = [line for line in text.splitlines() if line.startswith("k3jax_prefix_hit_tokens_total")]
  assert float(hits[0].split()[-1]) >= 64


# ------------------------------------------------------------------------------ the real engine

REAL = ("serve.max_batch=4", "serve.prefill_rows=2", "serve.block_size=32", "serve.page_size=16",
        "serve.max_model_len=256", "serve.num_pages=14", "serve.model_name=" + MODEL)


def serve_process(root, log, config: str, overrides):
  """``python serve.py --config CONFIG`` (random weights, seed 0) on a free port: yields (an
  openai client, the server's URL), stops it with SIGINT after."""
  with open(log, "w") as err:
    proc = subprocess.Popen([sys.executable, "serve.py", "--config", config, "--port", "0",
                             *overrides], cwd=root, stdout=subprocess.PIPE, stderr=err, text=True)
  lines = queue.Queue()
  threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
  try:
    line = lines.get(timeout=540)
  except queue.Empty:
    line = ""
  if not line.startswith(f"serving {MODEL} at http://127.0.0.1:"):
    proc.kill()
    pytest.fail(f"serve.py did not start: {line!r}\n{log.read_text()[-3000:]}")
  url = line.split()[-1]
  yield openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300), url[:-len("/v1")]
  proc.send_signal(signal.SIGINT)
  assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def served(root, tmp_path_factory):
  """``python serve.py`` of k3_tiny's random float32 weights (seed 0) on a free port."""
  yield from serve_process(root, tmp_path_factory.mktemp("serve") / "stderr.txt", "k3_tiny", REAL)


@pytest.mark.slow
def test_served_greedy_equals_generate(served):
  """Greedy text through the server (concurrent requests, completions and chat) equals
  k3jax.generate of the same weights, prompt by prompt."""
  import jax
  from flax import nnx

  import k3jax
  client, _ = served
  prompts = ["def main(", "Grüße aus ☃ ", "x" * 70]
  jobs = [("completion", p) for p in prompts] + [("chat", "Hello")]
  got = [None] * len(jobs)

  def ask(i, kind, text):
    if kind == "chat":
      r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                         max_tokens=12, temperature=0)
      got[i] = r.choices[0].message.content
    else:
      got[i] = client.completions.create(model=MODEL, prompt=text, max_tokens=12,
                                         temperature=0).choices[0].text
  threads = [threading.Thread(target=ask, args=(i, *job)) for i, job in enumerate(jobs)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  model = k3jax.K3Model(tiny_config().model, rngs=nnx.Rngs(0))
  want = k3jax.generate(model, prompts, max_new_tokens=12, temperature=0, rng=jax.random.key(0))
  want.append(k3jax.generate(model, "Hello", max_new_tokens=12, temperature=0, chat=True))
  assert got == want


@pytest.mark.slow
def test_served_stream_cache_metrics_and_bad_input(served):
  client, url = served
  kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0.9, seed=7, n=2)
  whole = client.completions.create(**kw)
  parts = {0: "", 1: ""}
  for chunk in client.completions.create(**kw, stream=True):
    for c in chunk.choices:
      parts[c.index] += c.text
  assert [parts[0], parts[1]] == [c.text for c in whole.choices]
  prompt = "0123456789" * 8  # 81 tokens with BOS: two 32-token blocks can be reused
  first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
  second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
  assert second.choices[0].text == first.choices[0].text
  assert second.usage.prompt_tokens_details.cached_tokens == 64
  with httpx.Client(base_url=url, timeout=60) as http:
    for body in ({"prompt": "a" * 300, "max_tokens": 1},  # longer than serve.max_model_len
                 {"prompt": "a", "max_tokens": 230},  # 15 pages of 16, the cache holds 14
                 {"prompt": [3, 320], "max_tokens": 1}):
      r = http.post("/v1/completions", json={"model": MODEL} | body)
      assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert http.get("/health").status_code == 200
    metrics = http.get("/metrics").text
  assert client.models.list().data[0].id == MODEL
  values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
            if line and not line.startswith("#")}
  assert values["k3jax_prefix_hit_tokens_total"] >= 64
  assert values["k3jax_kda_checkpoint_hits_total"] >= 1
  assert values['k3jax_requests_total{endpoint="/v1/completions",status="400"}'] == 3
  assert "k3jax_time_to_first_token_seconds_count" in values and "k3jax_cache_pages_used" in values
  r = client.completions.create(model=MODEL, prompt="still serving", max_tokens=3, temperature=0)
  assert r.usage.completion_tokens >= 1


@pytest.mark.slow
def test_served_disconnect_cancels(served):
  """A streaming client that goes away after the first token: the engine request ends long
  before its 200 tokens."""
  _, url = served

  def metric(http, name):
    line = next(x for x in http.get("/metrics").text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])
  with httpx.Client(base_url=url, timeout=60) as http:
    before = metric(http, "k3jax_generation_tokens_total")
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as other:
      with other.stream("POST", "/v1/completions", json=body) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 60
    while metric(http, "k3jax_requests_running") or metric(http, "k3jax_requests_waiting"):
      assert time.monotonic() < deadline
      time.sleep(0.05)
    assert metric(http, "k3jax_generation_tokens_total") - before < 200


# ------------------------------------------------------------------------------ images

IMG = 259  # k3_tiny_vl's model.vision.image_token_id
VL = ("serve.max_batch=2", "serve.prefill_rows=1", "serve.block_size=32", "serve.page_size=16",
      "serve.max_model_len=256", "serve.num_pages=20", "serve.model_name=" + MODEL)


def image_url(h, w, seed):
  from k3jax import images
  pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
  return images.data_url(images.encode_png(pixels)), pixels


def image_chat(url, text="what is this? "):
  return [{"role": "user", "content": [{"type": "text", "text": text},
                                       {"type": "image_url", "image_url": {"url": url}}]}]


def test_image_parts_refused_by_a_text_model_and_bad_urls(fake):
  with httpx.Client(base_url=fake.url, timeout=60) as http:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": image_chat(
        image_url(28, 28, 0)[0])})
    assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"], r.text
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": "not an object"}]}]})
    assert r.status_code == 400, r.text


@pytest.fixture(scope="module")
def served_vl(root, tmp_path_factory):
  """``python serve.py --config k3_tiny_vl`` (random weights, seed 0) on a free port."""
  yield from serve_process(root, tmp_path_factory.mktemp("serve_vl") / "stderr.txt", "k3_tiny_vl",
                           VL)


def reference_greedy(root, pixels, text: str, n: int) -> str:
  """Greedy text of k3_tiny_vl's seed-0 model for a one-image chat, by full forwards (no
  cache), the prompt built here: bos, the plain template, the image's placeholders."""
  import jax.numpy as jnp
  from flax import nnx

  from k3jax import config, vision
  from k3jax.model import K3Model
  cfg = config.load(root / "configs" / "k3_tiny_vl.yaml")
  v = cfg.model.vision
  model = K3Model(cfg.model, rngs=nnx.Rngs(0))
  item = vision.preprocess(pixels, v)
  seq = [BOS] + list(f"user: {text}".encode()) + [IMG] * item.num_tokens + list(
      b"\nassistant: ")
  arrays = {k: jnp.asarray(x) for k, x in vision.batch([item], v.max_patches).items()}
  forward = nnx.jit(lambda m, ids: m(ids, vision=arrays))
  start = len(seq)
  seq = np.asarray(seq + [0] * n)  # one shape: causal, so the tail changes nothing before it
  for i in range(start, start + n):
    seq[i] = int(jnp.argmax(forward(model, jnp.asarray(seq[None]))[0, i - 1]))
  return ByteTokenizer().decode(seq[start:].tolist())


@pytest.mark.slow
def test_served_images_prefix_cache_and_bad_images(served_vl, root):
  """A chat with an image through the openai client equals the model's own greedy output; the
  same image again reuses the cached prefix, another image with the same placeholder ids does
  not (past the text before it); bad images are 400s and the server keeps serving."""
  from test_vision_data import png, with_ihdr_size
  from k3jax import images
  client, url = served_vl
  # bos + "user: " + text: 25 tokens before the image's 12 (112 x 84 pixels: 8 x 6 patches), so
  # the image straddles the first block's end (32): the second prefill chunk starts inside it
  text = "describe it, now: "
  first_url, pixels = image_url(112, 84, 1)
  ask = lambda u: client.chat.completions.create(model=MODEL, messages=image_chat(u, text),
                                                 max_tokens=8, temperature=0)
  first, again, other = ask(first_url), ask(first_url), ask(image_url(112, 84, 2)[0])
  assert first.choices[0].message.content == reference_greedy(root, pixels, text, 8)
  assert again.choices[0].message.content == first.choices[0].message.content
  assert first.usage.prompt_tokens == again.usage.prompt_tokens == 25 + 12 + len("\nassistant: ")
  assert again.usage.prompt_tokens_details.cached_tokens == 32  # a block that holds image tokens
  assert other.usage.prompt_tokens_details.cached_tokens == 0  # ... of another image: no hit
  good = png(np.zeros((28, 28, 3), np.uint8))
  bad = {"corrupt": (images.data_url(good[:40]), "corrupt"),
         "empty": ("data:image/png;base64,", "empty"),
         "huge": (images.data_url(with_ihdr_size(good, 9000, 9000)), "more than the limit"),
         "web": ("https://example.com/cat.png", "not fetched"),
         "not base64": ("data:image/png;base64,***", "malformed")}
  with httpx.Client(base_url=url, timeout=60) as http:
    for name, (u, why) in bad.items():
      r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": image_chat(u)})
      assert r.status_code == 400 and why in r.json()["error"]["message"], (name, r.text)
  r = client.chat.completions.create(model=MODEL, messages=image_chat(first_url), max_tokens=2)
  assert r.usage.completion_tokens >= 1


def test_command_line_errors_before_any_work(capsys):
  from k3jax.serve import cli
  assert cli.main(["--config", "nope"]) == 2
  assert "'nope' is neither a file nor a packaged config" in capsys.readouterr().err
  assert cli.main(["--port", "70000"]) == 2
  assert "serve.port" in capsys.readouterr().err
  assert cli.main(["--checkpoint", "/nonexistent/run"]) == 2
  assert "/nonexistent/run" in capsys.readouterr().err
  for argv in (["serve.max_batch=0", "--port", "0", "--config", "k3_tiny"],
               ["--config", "k3_tiny", "--port", "0", "serve.max_batch=0"]):  # overrides anywhere
    assert cli.main(argv) == 2
    assert "serve.max_batch: must be positive, got 0" in capsys.readouterr().err
