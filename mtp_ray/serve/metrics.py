"""Prometheus text exposition for the ingress: vLLM-named request metrics plus the group's per-rank counters."""

from __future__ import annotations

import bisect
from collections import defaultdict

PREFIX = "mtp_ray:"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


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

    def lines(self, name: str, labels: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{{labels},le="{b}"}} {acc}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.n}')
        out += [f"{name}_sum{{{labels}}} {self.sum}", f"{name}_count{{{labels}}} {self.n}"]
        return out


class Metrics:
    def __init__(self, model_name: str):
        self.labels = f'model_name="{model_name}"'
        self.counters: dict[str, float] = defaultdict(float)
        for name in ("prompt_tokens_total", "generation_tokens_total", "spec_decode_num_drafts_total",
                     "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total"):
            self.counters[name] = 0.0  # exported from the start, as Prometheus counters should be
        self.accepted_per_pos: dict[int, int] = defaultdict(int)
        self.running = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def finished(self, prompt_tokens: int, gen_tokens: int, spec: dict, reason: str | None) -> None:
        c = self.counters
        c["prompt_tokens_total"] += prompt_tokens
        c["generation_tokens_total"] += gen_tokens
        c[f"request_success_total|{reason or 'unknown'}"] += 1
        c["spec_decode_num_drafts_total"] += spec.get("num_drafts", 0)
        c["spec_decode_num_draft_tokens_total"] += spec.get("num_draft_tokens", 0)
        c["spec_decode_num_accepted_tokens_total"] += spec.get("num_accepted_tokens", 0)
        for i, n in enumerate(spec.get("accepted_per_pos", [])):
            self.accepted_per_pos[i] += n

    def render(self, group: dict | None) -> str:
        L = self.labels
        out = [f"{PREFIX}num_requests_running{{{L}}} {self.running}"]
        waiting = sum(r.get("num_waiting", 0) for r in (group or {}).get("ranks", []))
        out.append(f"{PREFIX}num_requests_waiting{{{L}}} {waiting}")
        for key, v in sorted(self.counters.items()):
            name, _, reason = key.partition("|")
            lab = f'{L},finished_reason="{reason}"' if reason else L
            out.append(f"{PREFIX}{name}{{{lab}}} {v}")
        for i, n in sorted(self.accepted_per_pos.items()) or [(0, 0)]:
            out.append(f'{PREFIX}spec_decode_num_accepted_tokens_per_pos_total{{{L},position="{i}"}} {n}')
        out += self.ttft.lines(f"{PREFIX}time_to_first_token_seconds", L)
        out += self.itl.lines(f"{PREFIX}inter_token_latency_seconds", L)
        out += self.e2e.lines(f"{PREFIX}e2e_request_latency_seconds", L)
        if group:
            out.append(f"{PREFIX}group_restarts_total{{{L}}} {group.get('restarts', 0)}")
            out.append(f"{PREFIX}group_healthy{{{L}}} {int(bool(group.get('healthy')))}")
            for r, rank in enumerate(group.get("ranks", [])):
                rl = f'{L},rank="{r}"'
                c = rank.get("counters", {})
                out.append(f"{PREFIX}dpmeta_steps_total{{{rl}}} {rank.get('step', 0)}")
                out.append(f"{PREFIX}dpmeta_gathers_total{{{rl}}} {c.get('gathers', 0)}")
                out.append(f"{PREFIX}dummy_forwards_total{{{rl}}} {c.get('dummy_forwards', 0)}")
                out.append(f"{PREFIX}waves_total{{{rl}}} {c.get('waves', 0)}")
                out.append(f"{PREFIX}ep_collectives_total{{{rl}}} {rank.get('collectives', 0)}")
                out.append(f"{PREFIX}rank_num_requests_running{{{rl}}} {rank.get('num_running', 0)}")
                out.append(f"{PREFIX}rank_num_requests_waiting{{{rl}}} {rank.get('num_waiting', 0)}")
        return "\n".join(out) + "\n"
