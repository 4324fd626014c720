"""Beam search over HTTP, its running: vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions (n: the
beam width; the request's search is read by serve/openai/beam_request.py).

Each prompt's search (mtp_ray/beam_search.py) runs before the response starts, its steps admitted by the groups as
requests of one token each (GroupClient.open_each), so a refusal is a status as for any request; the n best beams
then go out as the choices, through the same rendering as sampled ones (text, logprobs, usage, streaming: each
choice's whole text in one chunk, as vLLM's)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from mtp_ray.beam_search import BeamSearch, BeamSearchSequence, ranked
from mtp_ray.engine.outputs import StepOutput
from mtp_ray.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mtp_ray.serve.cluster.groups import GroupClient
    from mtp_ray.serve.openai.request import ParsedRequest


class BeamChoice:
    """A finished beam as a choice's stream (GroupStream's face for ChoiceRunner): its whole output at once."""

    def __init__(self, out: StepOutput):
        self.out = out

    async def deltas(self) -> AsyncIterator[StepOutput]:
        yield self.out

    def cancel(self) -> None:  # (nothing runs: the search is over)
        pass


async def beam_streams(groups: GroupClient, req: ParsedRequest, info: dict) -> list[BeamChoice]:
    """Each prompt's n best beams, prompt by prompt (the choices' order), searched concurrently. info: the group's
    model facts (eos_token_ids; max_model_len, which bounds a search without max_tokens)."""
    assert req.beam is not None
    eos, params, ctx = tuple(info["eos_token_ids"]), req.params, info["max_model_len"]
    step = req.beam.step_params(req.top_logprobs or 0, params.cache_salt)
    # (max_tokens as the ingress left it: capped by the server's generation_config; None: what the context leaves)
    searches = [BeamSearch(p, replace(req.beam, max_tokens=params.max_tokens or max(1, ctx - len(p))), eos)
                for p in req.prompts]
    done = await _all([_search(groups, s, step) for s in searches])
    return [BeamChoice(_output(s.generated(seq), seq, s.prompt_len, req.top_logprobs))
            for s, seqs in zip(searches, done, strict=True) for seq in seqs]


async def _search(groups: GroupClient, search: BeamSearch, step: SamplingParams) -> list[BeamSearchSequence]:
    while batch := search.pending():
        streams = await groups.open_each([(ids, step) for ids in batch])
        outs = await _all([_whole(s) for s in streams])
        search.advance([ranked({**o.new_top_logprobs[0], o.new_token_ids[0]: o.new_logprobs[0]}) for o in outs])
    seqs = search.results()
    assert len(seqs) == search.params.beam_width, "a vocabulary of at least beam_width tokens"
    return seqs


async def _whole(stream: Any) -> StepOutput:
    """A one-token request's output, its deltas merged."""
    out: StepOutput | None = None
    async for d in stream.deltas():
        out = d if out is None else out.then(d)
    assert out is not None and out.new_token_ids, "a finished step has its token"
    return out


async def _all(coros: list) -> list:
    """Every result, or the first failure once the others were cancelled (a failed step ends the search)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


def _output(tokens: list[int], seq: BeamSearchSequence, n_prompt: int, top_n: int | None) -> StepOutput:
    """A beam as one finished StepOutput: its tokens, their log-probs, ranks and (when asked) top-n alternatives;
    one that ended with an end token (finish_reason "stop") has it last, out of the text (stop_token)."""
    chosen = [cands[t] for t, cands in zip(tokens, seq.logprobs, strict=True)]
    top = [dict(list((t, lp.logprob) for t, lp in cands.items())[:top_n]) if top_n else {} for cands in seq.logprobs]
    return StepOutput("beam", tokens, [c.logprob for c in chosen], top, True, seq.finish_reason,
                      num_prompt_tokens=n_prompt, stop_token=seq.finish_reason == "stop",
                      new_ranks=[c.rank for c in chosen])
