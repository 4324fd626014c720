"""Wire format of what a rank sends to its group: one msgpack message per engine step, with all its requests'
token deltas (versioned, like vLLM's engine-core outputs), never one Ray object per token."""

from __future__ import annotations

import msgpack

from mtp_ray.engine.outputs import StepOutput

VERSION = 1

# one request's step on the wire: [request_id, new_token_ids, new_logprobs, new_top_logprobs as [(id, lp), ...]
# per token, finished, finish_reason, stop_reason, num_prompt_tokens, spec]
Row = list


def pack_step(step: int, outs: list[StepOutput]) -> bytes:
    rows = [[o.request_id, o.new_token_ids, o.new_logprobs, [list(t.items()) for t in o.new_top_logprobs],
             o.finished, o.finish_reason, o.stop_reason, o.num_prompt_tokens, o.spec] for o in outs]
    return msgpack.packb({"v": VERSION, "step": step, "outs": rows}, use_bin_type=True)


def unpack_rows(data: bytes) -> tuple[int, list[Row]]:
    """The step number and its rows as sent (no objects built: most consumers only append the tokens)."""
    msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if msg.get("v") != VERSION:
        raise ValueError(f"rank output message version {msg.get('v')} != {VERSION}")
    return msg["step"], msg["outs"]


def row_output(row: Row) -> StepOutput:
    rid, toks, lps, tops, fin, reason, stop, n, spec = row
    return StepOutput(rid, toks, lps, [dict((int(k), float(v)) for k, v in t) for t in tops], fin, reason, stop, n,
                      spec)

