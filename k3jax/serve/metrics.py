"""The server's Prometheus metrics (``GET /metrics``), in a registry of the app's own.

Counted by the HTTP layer: requests by endpoint and status, time to first token and time per
output token (per engine request). Read from :class:`k3jax.serve.types.EngineStats` at scrape
time: running and waiting requests, cache pages and KDA slots in use, prefix-cache hits (MLA
tokens from cached pages and KDA checkpoints restored, counted apart), preemptions, tokens.
"""

from __future__ import annotations

from typing import Callable

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from k3jax.serve.types import EngineStats

# EngineStats field -> (series, help); gauges, then counters (exposed with the suffix _total)
GAUGES = {
    "running": ("k3jax_requests_running", "requests in the running batch"),
    "waiting": ("k3jax_requests_waiting", "requests waiting to start (or to resume after preemption)"),
    "pages_used": ("k3jax_cache_pages_used", "MLA cache pages in use (requests' and the prefix cache's)"),
    "pages_total": ("k3jax_cache_pages_total", "MLA cache pages in the pool"),
    "slots_used": ("k3jax_kda_slots_used", "KDA state slots in use (requests' and checkpoints')"),
    "slots_total": ("k3jax_kda_slots_total", "KDA state slots in the pool"),
}
COUNTERS = {
    "prefix_hit_tokens": ("k3jax_prefix_hit_tokens", "prompt tokens whose MLA latents came from cached pages"),
    "kda_checkpoint_hits": ("k3jax_kda_checkpoint_hits", "KDA state checkpoints restored into a request's slot"),
    "preemptions": ("k3jax_preemptions", "requests preempted for cache pages (recomputed later)"),
    "prompt_tokens": ("k3jax_prompt_tokens", "prompt tokens prefilled"),
    "generation_tokens": ("k3jax_generation_tokens", "tokens generated"),
    "steps": ("k3jax_engine_steps", "engine steps run"),
}


class _EngineCollector:
  """Reads the engine's statistics when scraped."""

  def __init__(self, stats: Callable[[], EngineStats]):
    self._stats = stats

  def collect(self):
    stats = self._stats()
    for field, (name, doc) in GAUGES.items():
      yield GaugeMetricFamily(name, doc, value=getattr(stats, field))
    for field, (name, doc) in COUNTERS.items():
      yield CounterMetricFamily(name, doc, value=getattr(stats, field))


class ServerMetrics:
  """The registry of one app: its HTTP counters and histograms and the engine's statistics."""

  def __init__(self, stats: Callable[[], EngineStats]):
    """``stats``: the engine's current statistics (called at each scrape)."""
    self.registry = prometheus_client.CollectorRegistry()
    self.requests = prometheus_client.Counter(
        "k3jax_requests", "HTTP requests answered, by endpoint and status code",
        ["endpoint", "status"], registry=self.registry)
    self.ttft = prometheus_client.Histogram(
        "k3jax_time_to_first_token_seconds", "from a request's arrival to its first token",
        buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
        registry=self.registry)
    self.tpot = prometheus_client.Histogram(
        "k3jax_time_per_output_token_seconds", "a request's mean time between output tokens",
        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        registry=self.registry)
    self.registry.register(_EngineCollector(stats))

  def exposition(self) -> tuple[bytes, str]:
    """The scrape's body and content type."""
    return prometheus_client.generate_latest(self.registry), prometheus_client.CONTENT_TYPE_LATEST
