"""Request logs and Prometheus metrics.

One log line per request (method, path, status, model, tokens, drafted and accepted tokens when speculative decoding
was asked for, duration; key=value). Prompts are never logged
unless ``CORRAL_LOG_PROMPTS=1``; keys and Authorization headers never are. Routes add what they know (model,
token counts) through :func:`daemon.logs.note`, which writes into a per-request dict shared with the middleware.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from daemon import logs
from daemon.api.security import ASGIApp, Receive, Scope, Send

log = logging.getLogger("daemon.access")

ENDPOINTS = ("/api/", "/v1/")
PROBES = frozenset({"/health", "/health/ready"})  # liveness and readiness checks (daemon/api/lifecycle.py)


class Metrics:
    def __init__(self, scheduler: Any) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "corral_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.request_seconds = Histogram(
            "corral_request_duration_seconds", "HTTP request duration", ["endpoint"], registry=r
        )
        self.prompt_tokens = Counter(
            "corral_prompt_tokens", "Prompt tokens (Ollama's prompt_eval_count)", ["model"], registry=r
        )
        self.cached_tokens = Counter(
            "corral_prompt_cached_tokens",
            "Prompt tokens reused from the KV cache, not evaluated again",
            ["model"],
            registry=r,
        )
        self.generated_tokens = Counter("corral_generated_tokens", "Tokens generated", ["model"], registry=r)
        # speculative decoding (llama-server's draft_n and draft_n_accepted), counted for requests that asked for it
        self.draft_tokens = Counter(
            "corral_draft_tokens", "Tokens drafted by speculative decoding (draft_n)", ["model"], registry=r
        )
        self.draft_accepted_tokens = Counter(
            "corral_draft_accepted_tokens",
            "Drafted tokens the model accepted (draft_n_accepted)",
            ["model"],
            registry=r,
        )
        self.ttft = Histogram(
            "corral_time_to_first_token_seconds",
            "Time from request to first token",
            ["model"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.tps = Histogram(
            "corral_tokens_per_second",
            "Decode speed per request",
            ["model"],
            buckets=(1, 5, 10, 20, 50, 100, 200, 500, 1000, 2000),
            registry=r,
        )
        self.pulled_bytes = Counter("corral_pulled_bytes", "Bytes downloaded from registries", registry=r)
        r.register(_SchedulerCollector(scheduler))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SchedulerCollector(Collector):
    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterator[Any]:
        s = self.scheduler
        yield GaugeMetricFamily("corral_queue_depth", "Requests waiting for a model", value=s.queue_depth())
        loaded = s.loaded()
        yield GaugeMetricFamily("corral_loaded_models", "Models loaded now", value=len(loaded))
        ram = GaugeMetricFamily("corral_model_ram_bytes", "RAM used by a loaded model", labels=["model"])
        vram = GaugeMetricFamily("corral_model_vram_bytes", "VRAM used by a loaded model", labels=["model"])
        for item in loaded:
            e = item["entry"]
            ram.add_metric([e.ref.name], e.memory.ram)
            vram.add_metric([e.ref.name], e.memory.vram)
        yield ram
        yield vram
        c = s.counters
        yield CounterMetricFamily("corral_model_loads", "Model loads", value=c["loads"])
        yield CounterMetricFamily("corral_model_unloads", "Model unloads", value=c["unloads"])
        yield CounterMetricFamily("corral_model_evictions", "Models evicted to make room", value=c["evictions"])
        yield CounterMetricFamily("corral_model_load_seconds", "Seconds spent loading models", value=c["load_seconds"])


def endpoint_of(path: str) -> str:
    if path.startswith("/api/blobs/"):
        return "/api/blobs"
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    if path.startswith(ENDPOINTS) or path in ("/", "/metrics", "/health", "/health/ready"):
        return path
    return "other"


class Observe:
    """ASGI middleware: times every request, logs one line, feeds the metrics."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        info: dict[str, Any] = {"status": 500}
        token = logs.request_facts.set(info)
        started = time.monotonic()

        async def send_status(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                info["status"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            logs.request_facts.reset(token)
            seconds = time.monotonic() - started
            endpoint = endpoint_of(scope["path"])
            self.metrics.requests.labels(endpoint, str(info["status"])).inc()
            self.metrics.request_seconds.labels(endpoint).observe(seconds)
            model = info.get("model")
            if model and info.get("eval_count") is not None:
                self.metrics.prompt_tokens.labels(model).inc(info.get("prompt_eval_count", 0))
                self.metrics.cached_tokens.labels(model).inc(info.get("prompt_cached", 0))
                self.metrics.generated_tokens.labels(model).inc(info["eval_count"])
                if info.get("draft_n") is not None:
                    self.metrics.draft_tokens.labels(model).inc(info["draft_n"])
                    self.metrics.draft_accepted_tokens.labels(model).inc(info.get("draft_n_accepted", 0))
                if info.get("ttft") is not None:
                    self.metrics.ttft.labels(model).observe(info["ttft"])
                if info.get("eval_duration"):
                    self.metrics.tps.labels(model).observe(info["eval_count"] / (info["eval_duration"] / 1e9))
            # values from the request are quoted where they hold spaces, "=" or quotes (so no field can be forged);
            # control characters are escaped by the log formatter (so no line can be)
            extra = "".join(
                f" {k}={logs.quote(info[k])}"
                for k in ("model", "prompt_eval_count", "prompt_cached", "eval_count", "draft_n", "draft_n_accepted")
                if k in info
            )
            if "prompt" in info:
                extra += f" prompt={info['prompt']!r}"
            # a balancer's or orchestrator's health checks come every second or so: logged when they fail, and
            # with CORRAL_DEBUG when they pass
            quiet = scope["path"] in PROBES and info["status"] == 200
            log.log(
                logging.DEBUG if quiet else logging.INFO,
                "request method=%s path=%s status=%s%s duration=%.3fs",
                logs.quote(scope["method"]),
                logs.quote(scope["path"]),
                info["status"],
                extra,
                seconds,
            )
