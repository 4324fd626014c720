"""Serve application builder: `serve run deployments/qwen35_mtp.yaml` imports `mtp_ray.serve.app:build_app`.

args (the YAML's `args:`):
  engine:              EngineConfig fields (model, dtype, device, cache, scheduler, spec, parallel, timeouts)
  served_model_name:   the model id clients send, or a list of ids (vLLM's: any is taken, the first is reported;
                       default: the model directory's name)
  group:               Serve options of the group deployment (autoscaling_config, num_replicas, ...)
  ingress:             Serve options of the HTTP ingress deployment
  server:              ServerConfig fields (api_key, request limits, parsers, generation_config, ...)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from mtp_ray.config.engine import EngineConfig
from mtp_ray.config.model import ModelConfig
from mtp_ray.config.server import ServerConfig
from mtp_ray.engine.sampling_params import model_defaults
from mtp_ray.runtime.placement import rank_bundles
from mtp_ray.serve.cluster.deployment import GroupDeployment
from mtp_ray.serve.cluster.routing import ServingGroupsRouter
from mtp_ray.serve.cluster.scaling import with_group_policy
from mtp_ray.serve.http.ingress import Ingress

REPLICA_CPU = 0.1  # bundle 0 of a group replica holds the replica actor itself; the ranks take the others


def group_bundles(cfg: EngineConfig) -> list[dict[str, float]]:
    return [{"CPU": REPLICA_CPU}] + rank_bundles(cfg)


def ingress_logging(cfg: Any) -> Any:
    """The ingress's Serve logging_config: Serve's access-log line per HTTP request off unless asked for
    (`ingress: {logging_config: {enable_access_log: true}}`). Each line is formatted and written by the replica and,
    under `serve run`, shipped to the driver's console: with the log on, a CPU server's client tok/s at 128 streams
    was 0.82-0.88 of that with it off (bench/serve.py, variants ...l; docs/performance.md)."""
    if cfg is None or isinstance(cfg, dict):
        return {"enable_access_log": False, **(cfg or {})}
    return cfg  # a LoggingConfig object: as the caller made it


def check_model(cfg: EngineConfig) -> None:
    """The model's own limits, at deploy time (the build runs on the head node, which must read the model as every
    rank node does): a bad update is refused there, where the group would fail in new replicas after Serve began
    to replace the old ones."""
    try:
        mc = ModelConfig.from_pretrained(cfg.model)
    except (OSError, ValueError) as e:
        raise ValueError(f"engine.model: {e}") from None
    cfg.check_fits(mc)


def check_defaults(server: ServerConfig, model: str) -> dict[str, float | int]:
    """The sampling defaults requests get (server.generation_config), read and checked at deploy time: a bad value
    would otherwise fail every request that leaves the field out."""
    try:
        return model_defaults(server.generation_config, model)
    except (OSError, ValueError) as e:
        raise ValueError(f"server.generation_config ({server.generation_config}): {e}") from None


def access_notice(server: ServerConfig) -> str:
    """One line on who may call the server (serve/http/guard.py)."""
    if server.api_key is not None:
        return ("mtp-ray: API key set: every route but /health, /ping and /health_generate needs "
                "`Authorization: Bearer <key>`")
    hosts = f", {', '.join(server.allowed_hosts)}" if server.allowed_hosts else ""
    return ("mtp-ray: no API key (server.api_key or MTP_RAY_API_KEY): the server is OPEN to every client that reaches "
            f"its port. Web pages are kept out: Host must be localhost, an IP address{hosts} (server.allowed_hosts), "
            "and the admin routes (/sleep, /wake_up, cache and memory commands) answer only loopback clients that "
            "send no Origin")


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    args = dict(args or {})
    unknown = set(args) - {"engine", "served_model_name", "group", "ingress", "server"}
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}")
    for name in ("engine", "group", "ingress", "server"):
        if not isinstance(args.get(name) or {}, dict):
            raise ValueError(f"args.{name} must be a mapping, got {type(args[name]).__name__}")
    engine = dict(args.get("engine") or {})
    cfg = EngineConfig.from_dict(engine)  # validate now: a bad YAML fails at deploy time, not in a replica
    check_model(cfg)
    server = ServerConfig.from_dict(args.get("server"))
    defaults = check_defaults(server, cfg.model)
    # where `serve run` shows it (the build runs in its process; a replica's log lines stay in the replica's file)
    print(access_notice(server), file=sys.stderr, flush=True)
    deploy = time.time_ns()  # this build of the app: its metrics start from zero (serve/cluster/metrics_hub.py)
    name = args.get("served_model_name") or Path(cfg.model).name
    names = [name] if isinstance(name, str) else name
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"served_model_name must be a model name or a list of them, got {name!r}")
    # (graceful_shutdown_timeout_s: Serve's 20 s for running requests to end before a replaced group stops)
    group_opts = {"max_ongoing_requests": 512, "health_check_period_s": 5, "health_check_timeout_s": 30,
                  # new requests pass over a group whose stats (every second) say it cannot serve
                  # (serve/cluster/routing.py)
                  "request_router_config": RequestRouterConfig(request_router_class=ServingGroupsRouter,
                                                               request_routing_stats_period_s=1.0,
                                                               request_routing_stats_timeout_s=5.0),
                  **dict(args.get("group") or {})}
    group = serve.deployment(GroupDeployment, name="EngineGroup").options(
        ray_actor_options={"num_cpus": REPLICA_CPU},
        placement_group_bundles=group_bundles(cfg),
        placement_group_strategy=cfg.parallel.placement_strategy,
        **with_group_policy(group_opts),  # autoscaling on the groups' requests in flight (serve/cluster/scaling.py)
    ).bind(engine, deploy)
    ingress_args = dict(args.get("ingress") or {})
    ingress_opts = {"max_ongoing_requests": 1000, **ingress_args,
                    "logging_config": ingress_logging(ingress_args.get("logging_config"))}
    ingress = serve.deployment(Ingress, name="OpenAIIngress").options(
        ray_actor_options={"num_cpus": 0.1}, **ingress_opts)
    return ingress.bind(group, names, cfg.tokenizer or cfg.model, server, cfg.timeouts.queue_s, deploy, defaults)
