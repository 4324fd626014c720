"""RolloutEngine: an engine group behind a Ray actor handle that any actor can call.

Method names are vLLM's and SGLang's (the ones verl / OpenRLHF call); only some contracts match:
- as SGLang: init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name,
  backend) (default backend gloo, not nccl) and update_weights_from_distributed(names, dtypes, shapes,
  group_name) (no flush_cache / load_format); abort_all_requests() aborts everything in flight.
- as vLLM: sleep(level) (1: KV freed, weights to host; 2: both dropped), wake_up(tags) with "weights" /
  "kv_cache", reset_prefix_cache().
- not as either: generate takes token ids and a SamplingParams dict (n = 1 per prompt) and returns its own dict;
  update_weights_from_tensor takes (name, tensor or ObjectRef) pairs, not serialized CUDA-IPC handles, so there
  are no zero-copy colocated updates; no routed experts are returned; pause_generation's modes are "abort" and
  "wait" only (no SGLang "retract" / "in_place", no vLLM "keep"); get_stats and set_asleep_policy are this
  project's own.
"""

from __future__ import annotations

import asyncio
import time

import ray

from mtp_ray.config.engine import EngineConfig
from mtp_ray.engine.detok import STOP_NEEDS_TOKENIZER, Detokenizer
from mtp_ray.engine.outputs import prompt_logprob_dicts
from mtp_ray.engine.rollout_checks import WAKE_TAGS, check_backend, woken_by
from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.prompts import BAD_WORDS_NEED_TOKENIZER, tokenizer_or_none
from mtp_ray.runtime.batcher import detached
from mtp_ray.runtime.group import EngineGroup

STOP_REASON = {"stop": "completed", "length": "length", "abort": "aborted"}


class RolloutEngine:
    def __init__(self, config: EngineConfig | dict, placement_group=None, bundle_offset: int = 0):
        cfg = config if isinstance(config, EngineConfig) else EngineConfig.from_dict(config)
        self._attach(EngineGroup(cfg, placement_group, bundle_offset))

    def _attach(self, group: EngineGroup) -> None:
        """The handle's state over `group` (a Serve replica, serve/cluster/deployment.py, makes its group itself)."""
        self.group = group
        self._started: asyncio.Task | None = None
        self._tok = None  # loaded for the first request with stop strings
        self._woken: set[str] = set()  # wake_up tags named since the last sleep

    async def start(self) -> dict:
        if self._started is None:
            self._started = detached(self.group.start())  # its pollers outlive the first caller's request
        await self._started
        return self.group.monitor.health()

    async def generate(self, prompt_token_ids: list[int] | list[list[int]],
                       sampling_params: dict | SamplingParams | None = None) -> dict | list[dict]:
        """One prompt (list of ids) -> one result; a batch (list of lists) -> a list of results, in order.
        sampling_params: a dict of SamplingParams fields, or a SamplingParams."""
        await self.start()
        if isinstance(sampling_params, SamplingParams):
            params = sampling_params  # (a copy: it came through Ray)
        elif sampling_params is None or isinstance(sampling_params, dict):
            params = SamplingParams.from_dict(dict(sampling_params or {}))
        else:
            raise ValueError("sampling_params must be a dict of SamplingParams fields or a SamplingParams, got "
                             f"{type(sampling_params).__name__}")
        if params.bad_words:  # to token sequences, as vLLM's: once for the batch (its prompts share the params)
            params.update_from_tokenizer(await self._tokenizer(BAD_WORDS_NEED_TOKENIZER))
        if prompt_token_ids and all(isinstance(p, list) for p in prompt_token_ids):
            return list(await asyncio.gather(*[self._one(p, params) for p in prompt_token_ids]))
        return await self._one(prompt_token_ids, params)

    async def _one(self, ids: list[int], params: SamplingParams) -> dict:
        if params.n != 1:
            raise ValueError("n must be 1 per prompt on the rollout handle (repeat the prompt instead)")
        ids = params.truncated(ids, self.group.max_model_len)  # truncate_prompt_tokens, as LLM.generate
        detok = await self._stop_strings(params)
        c = await self.group.collect(ids, params)  # whole results: no per-step wake-up of 256 coroutines
        last, tokens, lps, tops, reason = c.last, c.token_ids, c.log_probs, c.top_log_probs, c.last.finish_reason
        if detok is not None and any(x in detok.decode(tokens) for x in params.stop):
            # stop strings, read back from the whole output (one decode when none is in it): its tokens through the
            # one completing the first stop
            for t in tokens:
                detok.add([t])
                if detok.stopped_by is not None:
                    n = detok.stop_tokens or len(detok.token_ids)
                    tokens, lps, tops, reason = tokens[:n], lps[:n], tops[:n], "stop"
                    break
        out = {"token_ids": tokens, "log_probs": lps, "stop_reason": STOP_REASON.get(reason, "completed"),
               "finish_reason": reason, "spec": last.spec}
        if params.alternatives:  # logprobs = n (or logprob_token_ids): per token {token: logprob}, the sampled
            # token first and the top n (vLLM's: n + 1 entries, or n when the sampled one is among them)
            out["top_log_probs"] = [{t: lp, **top} for t, lp, top in zip(tokens, lps, tops, strict=True)]
        if params.prompt_logprobs is not None:
            out["prompt_log_probs"] = prompt_logprob_dicts(c.prompt_log_probs, ids)
        return out

    async def _stop_strings(self, params: SamplingParams) -> Detokenizer | None:
        """A Detokenizer for a request with stop strings (the tokenizer loaded on first use), else None."""
        if not params.stop:
            return None
        return Detokenizer(await self._tokenizer(STOP_NEEDS_TOKENIZER), params.stop, params.skip_special_tokens,
                           params.include_stop_str_in_output, min_tokens=params.min_tokens)

    async def _tokenizer(self, missing: str):
        """The model's tokenizer, loaded on first use; none (no tokenizer files): ValueError(missing)."""
        if self._tok is None:
            cfg = self.group.cfg
            self._tok = await asyncio.to_thread(tokenizer_or_none, cfg.tokenizer or cfg.model)
            if self._tok is None:
                raise ValueError(missing)
        return self._tok

    # ---- RL control (verl / OpenRLHF / SGLang names) ----
    async def abort_all_requests(self) -> int:
        return self.group.abort_all()

    async def pause_generation(self, mode: str = "abort") -> None:
        """New requests wait until resume_generation(); in-flight ones are aborted ('abort') or finish ('wait')."""
        if mode not in ("abort", "wait"):
            raise ValueError("mode must be 'abort' or 'wait'")
        self.group.commands.hold()
        if mode == "abort":
            await self.abort_all_requests()
        while self.group.reqs:
            await asyncio.sleep(0.02)

    async def resume_generation(self) -> None:
        self.group.commands.release()

    async def sleep(self, level: int = 1, in_flight: str = "abort") -> list[dict]:
        """1: KV cache freed, weights offloaded to host; 2: both dropped. Returns each rank's memory while asleep."""
        await self.start()
        out = await self.group.commands.sleep(level, in_flight)
        self._woken = set()
        return out

    async def wake_up(self, tags: list[str] | None = None) -> list[dict]:
        """The weights and caches back (graphs recaptured); each rank's memory. tags (vLLM's): "weights" /
        "kv_cache" for a wake-up in two calls with update_weights between them (it writes the sleeping weights):
        the group wakes once both were named ([] until then); None: both."""
        self._woken |= woken_by(tags)
        if self._woken != WAKE_TAGS:
            return []
        self._woken = set()
        return await self.group.commands.wake_up()

    async def update_weights(self, weights) -> list[dict]:
        """weights: [(name, tensor or ObjectRef)], {name: tensor}, or an ObjectRef of either; names as in the
        checkpoint (mtp.* to the MTP head; each expert to the rank that owns it). Call it once per chunk."""
        await self.start()
        return await self.group.commands.update_weights(weights)

    async def update_weights_from_tensor(self, named_tensors) -> list[dict]:
        return await self.update_weights(named_tensors)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update",
                                        backend: str = "gloo") -> list[dict]:
        """The trainer (its own ranks, rank_offset of them first) and every engine rank join one process group; the
        ranks wait (up to 300 s) for the trainer to join the rendezvous, so the arguments are checked here first."""
        check_backend(backend)
        dp = self.group.dp
        if not (isinstance(rank_offset, int) and rank_offset >= 0 and isinstance(world_size, int)
                and world_size >= rank_offset + dp):
            raise ValueError(f"world_size ({world_size!r}) must hold rank_offset ({rank_offset!r}) trainer ranks and "
                             f"this engine's {dp} ranks")
        if not (isinstance(master_port, int) and 0 < master_port < 65536):
            raise ValueError(f"master_port must be a port number, got {master_port!r}")
        await self.start()
        return await self.group.commands.command("init_weights_update_group", master_address, master_port, rank_offset,
                                        world_size, group_name, backend)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                              group_name: str = "weight_update") -> list[dict]:
        cmds = self.group.commands
        return await cmds.command("update_weights_from_distributed", list(names), [str(d) for d in dtypes],
                                  [list(s) for s in shapes], group_name, wait_in_flight=True,
                                  then=cmds.mark_weights_updated)

    async def reset_prefix_cache(self) -> bool:
        await self.start()
        return all(await self.group.commands.command("reset_prefix_cache", wait_in_flight=True))

    async def set_asleep_policy(self, policy: str) -> None:
        if policy not in ("wait", "fail"):
            raise ValueError("policy must be 'wait' or 'fail'")
        self.group.commands.asleep_policy = policy

    async def health(self, live_stats: bool = False) -> dict:
        """The group's health from its last polls; live_stats: with every rank's counters asked now (`stats`)."""
        h = self.group.monitor.health()
        if live_stats:
            h["rank_stats"] = await self.group.monitor.rank_stats()
        return h

    async def get_stats(self) -> dict:
        await self.start()
        return {"health": self.group.monitor.health(), "ranks": await self.group.monitor.rank_stats(),
                "group_cpu_s": time.process_time(),  # this actor's process: request routing, output unpacking
                "memory": await self.group.commands.command("memory")}

    async def worker_handles(self) -> list:
        await self.start()
        return list(self.group.workers)

    async def shutdown(self) -> None:
        await self.group.shutdown()


def launch_engine(config: EngineConfig | dict, placement_group=None, bundle_offset: int = 0, name: str | None = None):
    """Create the engine actor inside the current Ray job and wait until its group serves; returns the handle."""
    actor = ray.remote(RolloutEngine).options(num_cpus=0, max_concurrency=1000, name=name)
    handle = actor.remote(config, placement_group, bundle_offset)
    try:
        ray.get(handle.start.remote())
    except BaseException:
        ray.kill(handle, no_restart=True)  # its group released what it held; the actor would serve nothing
        raise
    return handle
