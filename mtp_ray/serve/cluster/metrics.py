"""Prometheus text exposition: vLLM's metric names (prefix `mtp_ray:`) plus the DP / MTP ones, over every ingress
replica and every engine group of the application (serve/cluster/metrics_hub.py collects their reports).

A series is named as in the exposition ('name' or 'name{a="b"}'); rendering adds model_name, and for a group's
series group="<id>" (group="retired" holds the totals of groups that went away, so every counter is monotonic)."""

from __future__ import annotations

import asyncio
import bisect
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from mtp_ray.engine.stats import ITERATION_TOKEN_BUCKETS

PREFIX = "mtp_ray:"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
N_BUCKETS = (1, 2, 5, 10, 20)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.n += 1

    def series(self, name: str) -> dict[str, float]:
        out, acc = {}, 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out[f'{name}_bucket{{le="{b}"}}'] = acc
        out[f'{name}_bucket{{le="+Inf"}}'] = self.n
        out[f"{name}_sum"], out[f"{name}_count"] = self.sum, self.n
        return out


class Metrics:
    """One ingress replica's request metrics (monotonic totals and the running gauge), reported to the hub."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        for name in ("prompt_tokens_total", "generation_tokens_total", "spec_decode_num_drafts_total",
                     "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                     "request_aborted_total", "request_retried_total",
                     "ingress_abort_calls_total", "ingress_abort_errors_total", "ingress_admission_calls_total"):
            self.totals[name] = 0.0  # exported from the start, as Prometheus counters should be
        self.running = 0
        self.spec_positions: int | None = None  # draft positions exported at zero (the group's k), once known
        self.hist = {"time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
                     "inter_token_latency_seconds": Histogram(ITL_BUCKETS),
                     "e2e_request_latency_seconds": Histogram(E2E_BUCKETS),
                     "request_prompt_tokens": Histogram(TOKEN_BUCKETS),
                     "request_generation_tokens": Histogram(TOKEN_BUCKETS),
                     "request_params_max_tokens": Histogram(TOKEN_BUCKETS),
                     "request_params_n": Histogram(N_BUCKETS),
                     # the engine's phases of each request (Request.timings)
                     "request_queue_time_seconds": Histogram(E2E_BUCKETS),
                     "request_prefill_time_seconds": Histogram(E2E_BUCKETS),
                     "request_decode_time_seconds": Histogram(E2E_BUCKETS),
                     "request_inference_time_seconds": Histogram(E2E_BUCKETS),
                     # the ingress's own share of TTFT: body + parse + tokenise, then the group's admission
                     "ingress_parse_seconds": Histogram(TTFT_BUCKETS),
                     "ingress_admit_seconds": Histogram(TTFT_BUCKETS)}
        self.ttft, self.itl, self.e2e = (self.hist[k] for k in ("time_to_first_token_seconds",
                                                                "inter_token_latency_seconds",
                                                                "e2e_request_latency_seconds"))

    def count(self, series: str, v: float = 1.0) -> None:
        self.totals[series] += v

    def admitted(self, n: int, max_tokens: int | None) -> None:
        self.hist["request_params_n"].observe(n)
        if max_tokens is not None:
            self.hist["request_params_max_tokens"].observe(max_tokens)

    def tokens(self, prompt_tokens: int, gen_tokens: int) -> None:
        self.totals["prompt_tokens_total"] += prompt_tokens
        self.totals["generation_tokens_total"] += gen_tokens

    def finished(self, prompt_tokens: int, gen_tokens: int, spec: dict, reason: str | None,
                 timings: dict[str, float] | None = None) -> None:
        c = self.totals
        self.tokens(prompt_tokens, gen_tokens)
        c[f'request_success_total{{finished_reason="{reason or "unknown"}"}}'] += 1
        c["spec_decode_num_drafts_total"] += spec.get("num_drafts", 0)
        c["spec_decode_num_draft_tokens_total"] += spec.get("num_draft_tokens", 0)
        c["spec_decode_num_accepted_tokens_total"] += spec.get("num_accepted_tokens", 0)
        for i, n in enumerate(spec.get("accepted_per_pos", [])):
            c[f'spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] += n
        self.hist["request_prompt_tokens"].observe(prompt_tokens)
        self.hist["request_generation_tokens"].observe(gen_tokens)
        for phase, v in (timings or {}).items():  # queue_s -> request_queue_time_seconds, ...
            self.hist[f"request_{phase[:-2]}_time_seconds"].observe(v)

    async def spec_counters(self, info: Callable[[], Awaitable[dict]]) -> None:
        """The per-position acceptance counters exist from the start, at zero, as Prometheus counters should (one
        per draft position: the group's k, from `info`); without the group's answer they come with the first
        drafts."""
        if self.spec_positions is None:
            try:
                k = int((await asyncio.wait_for(info(), 2)).get("k", 0))
            except Exception:  # no group yet: /metrics still answers
                return
            self.spec_positions = k
            for i in range(k):
                self.totals.setdefault(f'spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}', 0.0)

    def snapshot(self) -> dict[str, Any]:
        totals = dict(self.totals)
        for name, h in self.hist.items():
            totals.update(h.series(name))
        return {"totals": totals, "gauges": {"num_requests_running": self.running}}


def group_snapshot(health: dict) -> dict[str, Any]:
    """A group's report (from EngineGroup.monitor.health()): its counters per rank and its gauges."""
    totals: dict[str, float] = {"group_restarts_total": health.get("restarts", 0),
                                # the group's share of admissions (validate, route, the rank's ack): bench/serve.py
                                "group_admits_total": health.get("admits", 0),
                                "group_admit_seconds_total": health.get("admit_s", 0.0),
                                "abort_calls_total": sum(health.get("abort_calls", [])),
                                "abort_errors_total": sum(health.get("abort_errors", []))}
    gauges: dict[str, float] = {"group_healthy": int(bool(health.get("healthy"))),
                                "group_sleep_level": health.get("sleeping", 0),  # (GET /is_sleeping reads it)
                                "num_requests_waiting": sum(r.get("num_waiting", 0) for r in health.get("ranks", []))}
    cc = health.get("cache_config")
    if cc:  # vLLM's cache_config_info: the cache settings as labels of a gauge that is always 1
        gauges["cache_config_info{" + ",".join(f'{k}="{v}"' for k, v in sorted(cc.items())) + "}"] = 1
    for r, rank in enumerate(health.get("ranks", [])):
        c, lab, pc = rank.get("counters", {}), f'{{rank="{r}"}}', rank.get("prefix_cache", {})
        totals.update({f"dpmeta_steps_total{lab}": rank.get("step", 0),
                       f"dpmeta_gathers_total{lab}": c.get("gathers", 0),
                       f"dummy_forwards_total{lab}": c.get("dummy_forwards", 0),
                       f"waves_total{lab}": c.get("waves", 0),
                       f"ep_collectives_total{lab}": rank.get("collectives", 0),
                       f"num_preemptions_total{lab}": rank.get("num_preemptions", 0),
                       # what the engine did, next to what the ingress streamed (bench/serve.py compares them)
                       f"rank_generation_tokens_total{lab}": rank.get("spec", {}).get("output_tokens", 0),
                       f"rank_step_seconds_total{lab}": rank.get("spec", {}).get("step_s", 0.0),
                       # vLLM's prefix-cache counters: prompt tokens looked up / found cached at admission
                       f"prefix_cache_queries_total{lab}": pc.get("prefix_cache_queries", 0),
                       f"prefix_cache_hits_total{lab}": pc.get("prefix_cache_hits", 0)})
        totals.update(_iteration_tokens(rank.get("spec", {}), r))
        gauges.update({f"kv_cache_usage_perc{lab}": rank.get("kv_usage", 0.0),
                       f"rank_num_requests_running{lab}": rank.get("num_running", 0),
                       f"rank_num_requests_waiting{lab}": rank.get("num_waiting", 0),
                       f"prefix_cache_blocks{lab}": pc.get("named_blocks", 0),
                       f"prefix_cache_snapshots{lab}": pc.get("snapshots", 0)})
    return {"totals": totals, "gauges": gauges}


def _iteration_tokens(stats: dict, rank: int) -> dict[str, float]:
    """vLLM's iteration_tokens_total histogram of one rank, from its EngineStats counts."""
    counts = stats.get("iteration_tokens")
    if not counts:
        return {}
    out, acc = {}, 0
    for b, c in zip((*ITERATION_TOKEN_BUCKETS, "+Inf"), counts, strict=True):
        acc += c
        out[f'iteration_tokens_total_bucket{{rank="{rank}",le="{b}"}}'] = acc
    out[f'iteration_tokens_total_sum{{rank="{rank}"}}'] = stats.get("iteration_tokens_sum", 0)
    out[f'iteration_tokens_total_count{{rank="{rank}"}}'] = acc
    return out


def with_labels(series: str, labels: str) -> str:
    """'name{a="b"}' + 'c="d"' -> 'name{c="d",a="b"}'."""
    name, brace, rest = series.partition("{")
    return f"{name}{{{labels},{rest}" if brace else f"{name}{{{labels}}}"


def render(view: dict[str, Any], model_name: str) -> str:
    """The exposition text of a hub view: ingress series summed over the ingress replicas (live and retired),
    group series per group; each family once, typed (# TYPE), its histogram buckets in `le` order."""
    esc = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    L = f'model_name="{esc}"'
    ingress: dict[str, float] = defaultdict(float, view["retired"].get("ingress", {}))
    running = 0
    for snap in view["live"].get("ingress", {}).values():
        for s, v in snap["totals"].items():
            ingress[s] += v
        running += snap["gauges"].get("num_requests_running", 0)
    out = [f"{PREFIX}num_requests_running{{{L}}} {running}"]
    out += [f"{PREFIX}{with_labels(s, L)} {v}" for s, v in sorted(ingress.items())]
    waiting = 0
    for gid, snap in sorted(view["live"].get("group", {}).items()):
        gl = f'{L},group="{gid}"'
        out += [f"{PREFIX}{with_labels(s, gl)} {v}" for s, v in sorted(snap["totals"].items())]
        out += [f"{PREFIX}{with_labels(s, gl)} {v}" for s, v in sorted(snap["gauges"].items())
                if s != "num_requests_waiting"]
        waiting += snap["gauges"].get("num_requests_waiting", 0)
    rl = f'{L},group="retired"'
    out += [f"{PREFIX}{with_labels(s, rl)} {v}" for s, v in sorted(view["retired"].get("group", {}).items())]
    out.append(f"{PREFIX}num_requests_waiting{{{L}}} {waiting}")
    return typed(out)


HISTOGRAMS = frozenset(Metrics().hist) | {"iteration_tokens_total"}
_PART = {"_bucket": 0, "_sum": 1, "_count": 2}


def _family(name: str) -> tuple[str, str, int]:
    """A series' metric name -> (its family, the family's type, its place in a histogram: bucket, sum, count)."""
    bare = name.removeprefix(PREFIX)
    for suffix, part in _PART.items():
        if bare.endswith(suffix) and bare[: -len(suffix)] in HISTOGRAMS:
            return name[: -len(suffix)], "histogram", part
    return name, "counter" if bare.endswith("_total") else "gauge", 0


def typed(lines: list[str]) -> str:
    """'name{labels} value' lines -> the exposition: families apart, each after its # TYPE line; within a histogram
    each label set's buckets in increasing `le` (then _sum, _count), as Prometheus' parsers require."""
    families: dict[str, tuple[str, list[tuple]]] = {}
    for line in lines:
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        fam, kind, part = _family(name)
        pairs = labels.rstrip("}").split(",")
        le = next((x[4:-1] for x in pairs if x.startswith('le="')), None)
        rest = ",".join(x for x in pairs if not x.startswith('le="'))
        key = (rest, part, float(le) if le is not None else 0.0)
        families.setdefault(fam, (kind, []))[1].append((key, line))
    out = []
    for fam in sorted(families):
        kind, rows = families[fam]
        out.append(f"# TYPE {fam} {kind}")
        out += [line for _, line in sorted(rows, key=lambda r: r[0])]
    return "\n".join(out) + "\n"
