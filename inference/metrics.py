"""The server's Prometheus metrics (vLLM's names, with the gpt_jax: prefix), in a registry
of their own: what the engine holds and has done, updated by the engine thread after each
command and step."""

from __future__ import annotations

import time

import prometheus_client as prom

from inference import compile_cache

WINDOW_S = 10.0  # the generation_tokens_per_second window


class Metrics:
    """The server's Prometheus metrics, in a registry of their own (vLLM's names, with the
    gpt_jax: prefix)."""

    def __init__(self):
        prom.disable_created_metrics()  # no *_created series beside each counter
        r = self.registry = prom.CollectorRegistry()
        g = lambda name, doc: prom.Gauge(f"gpt_jax:{name}", doc, registry=r)  # noqa: E731
        self.running = g("num_requests_running", "samples being prefilled or decoded")
        self.waiting = g("num_requests_waiting", "samples waiting for a slot")
        self.pages_used = g("kv_pages_used", "KV cache pages in use")
        self.pages_free = g("kv_pages_free", "KV cache pages free")
        self.pages_total = g("kv_pages_total", "KV cache pages in the pool")
        self.mesh_axis = prom.Gauge("gpt_jax:mesh_axis_size", "devices along each axis of "
                                    "the engine's mesh (tensor parallelism: model)", ["axis"],
                                    registry=r)
        self.mesh_devices = g("mesh_devices", "devices the engine runs on")
        self.kv_bytes_per_device = g("kv_cache_bytes_per_device",
                                     "bytes of the KV page pools each device holds")
        self.hit_rate = g("prefix_cache_hit_rate",
                          "prompt tokens reused from cached pages / prompt tokens, since start")
        self.spec_rate = g("spec_decode_draft_acceptance_rate",
                           "accepted / drafted speculative tokens, since start")
        self.spec_per_step = g("spec_decode_tokens_per_verification", "tokens a speculative "
                               "sample emitted per verification step, since start")
        self.spec_drafted = g("spec_decode_num_draft_tokens", "drafted tokens, since start")
        self.spec_accepted = g("spec_decode_num_accepted_tokens", "accepted drafted tokens, "
                               "since start")
        self.recent: list[tuple[float, int]] = []  # (time, tokens) of each step, last 10 s
        g("generation_tokens_per_second", "generated tokens per second over the last 10 s"
          ).set_function(self._tokens_per_s)
        g("xla_programs_compiled", "programs XLA compiled in this process (all of them: the "
          "engine's, the checkpoint load's, the warmup's helpers)"
          ).set_function(lambda: compile_cache.programs().compiled)
        g("xla_programs_loaded", "programs loaded from the persistent compilation cache "
          "(inference.compile_cache) in this process (all of them, as xla_programs_compiled)"
          ).set_function(lambda: compile_cache.programs().loaded)
        self.prompt_tokens = prom.Counter("gpt_jax:prompt_tokens", "prompt tokens admitted",
                                          registry=r)
        self.generation_tokens = prom.Counter("gpt_jax:generation_tokens", "tokens generated",
                                              registry=r)
        self.finished = prom.Counter("gpt_jax:request_success", "samples finished",
                                     ["finished_reason"], registry=r)
        self.ttft = prom.Histogram(
            "gpt_jax:time_to_first_token_seconds", "request arrival to its first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.tpot = prom.Histogram(
            "gpt_jax:time_per_output_token_seconds", "per sample: (finish - first token) / "
            "(tokens - 1)", buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r)

    def update(self, stats: dict, page_size: int, now: float, new_tokens: int) -> None:
        self.running.set(stats["running"] + stats["prefilling"])
        self.waiting.set(stats["waiting"])
        self.pages_used.set(stats["pages_in_use"])
        self.pages_free.set(stats["free_pages"])
        self.pages_total.set(stats["total_pages"])
        mesh = stats["mesh"]
        for axis, size in mesh["axes"].items():
            self.mesh_axis.labels(axis).set(size)
        self.mesh_devices.set(mesh["devices"])
        self.kv_bytes_per_device.set(mesh["kv_cache_bytes_per_device"])
        reused = stats["prefix_cache_hits"] * page_size
        self.hit_rate.set(reused / max(1, reused + stats["prefilled_tokens"]))
        self.spec_rate.set(stats["spec_acceptance_rate"])
        self.spec_per_step.set(stats["spec_tokens_per_verification"])
        self.spec_drafted.set(stats["spec_drafted_tokens"])
        self.spec_accepted.set(stats["spec_accepted_tokens"])
        self.generation_tokens.inc(new_tokens)
        if new_tokens:  # a new list, so a scrape on another thread reads a whole one
            self.recent = [(t, k) for t, k in self.recent if now - t <= WINDOW_S] + \
                [(now, new_tokens)]

    def _tokens_per_s(self) -> float:
        now = time.monotonic()
        return sum(k for t, k in self.recent if now - t <= WINDOW_S) / WINDOW_S
