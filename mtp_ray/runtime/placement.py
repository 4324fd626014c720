"""Where a group's ranks run: one placement-group bundle per DP rank (a GPU each on GPU machines), reserved before
any rank starts."""

from __future__ import annotations

import asyncio

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mtp_ray.config.engine import EngineConfig


def rank_bundles(cfg: EngineConfig) -> list[dict]:
    """One bundle per DP rank: a GPU each on GPU machines (device cuda, or auto with GPUs in the cluster)."""
    gpu = cfg.device == "cuda" or (cfg.device == "auto" and ray.is_initialized()
                                   and ray.cluster_resources().get("GPU", 0) > 0)
    cpu = cfg.parallel.cpus_per_rank
    return [{"CPU": cpu, "GPU": 1} if gpu else {"CPU": cpu} for _ in range(cfg.parallel.dp)]


def new_placement_group(cfg: EngineConfig):
    return placement_group(rank_bundles(cfg), strategy=cfg.parallel.placement_strategy)


async def wait_placed(cfg: EngineConfig, pg) -> None:
    """Until the ranks' placement group is ready; TimeoutError saying what it waited for after timeouts.start_s
    (the group's start fails with it)."""
    try:
        await asyncio.wait_for(pg.ready(), cfg.timeouts.start_s)
    except (TimeoutError, asyncio.TimeoutError):
        raise TimeoutError(f"group start failed: the placement group of {cfg.parallel.dp} rank bundles "
                           f"{rank_bundles(cfg)[0]} was not ready after timeouts.start_s={cfg.timeouts.start_s} s "
                           "(the cluster lacks the resources?)") from None


def spawn_ranks(cfg: EngineConfig, pg, bundle_offset: int, name: str) -> list:
    """One RankWorker actor per DP rank, each on its own bundle of `pg` (named `name`_r<rank> for an operator's
    `ray list actors`)."""
    # (imported here: the rank's module brings torch and the model, which the process that only places the ranks, a
    # Serve group replica or the `serve run` CLI, never runs)
    from mtp_ray.runtime.worker import RankWorker

    bundles = rank_bundles(cfg)
    cls = ray.remote(RankWorker)
    return [
        cls.options(
            num_cpus=bundles[r]["CPU"], num_gpus=bundles[r].get("GPU", 0), max_concurrency=16,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, bundle_offset + r), name=f"{name}_r{r}",
        ).remote(cfg, r, cfg.parallel.dp)
        for r in range(cfg.parallel.dp)
    ]
