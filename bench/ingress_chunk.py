"""The ingress's own Python per streamed chunk, without Ray or Serve (CPU): a rank's step messages for N streams
(packed by runtime/outboxes.py as a rank packs them) go through an ingress replica's code path as in serving:
Deliveries' dispatch, each stream's GroupStream / ChoiceRunner (metrics, detokenisation, stop checks) and its
ChunkWriter chunks serialized as server-sent events. One step per pull (every stream gets a chunk per step: the most
chunks the path can see).
What is left of a chunk's cost in serving is Starlette's and Serve's (bench/serve.py --profile-s shows both).

    python bench/ingress_chunk.py [--streams 1 16 64 128] [--steps 200] [--out bench/results/ingress_chunk.json]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import machine, write_json  # noqa: E402

from mtp_ray.engine.outputs import StepOutput  # noqa: E402
from mtp_ray.prompts import load_tokenizer  # noqa: E402
from mtp_ray.runtime.messages import Admission  # noqa: E402
from mtp_ray.runtime.outboxes import Outboxes  # noqa: E402
from mtp_ray.serve.cluster.delivery import Deliveries  # noqa: E402
from mtp_ray.serve.cluster.groups import Admitted, GroupStream  # noqa: E402
from mtp_ray.serve.cluster.metrics import Metrics  # noqa: E402
from mtp_ray.serve.http.choices import ChoiceRunner  # noqa: E402
from mtp_ray.serve.openai.bodies import sse_stream  # noqa: E402
from mtp_ray.serve.openai.chat_request import ChatServing  # noqa: E402
from mtp_ray.serve.openai.choice import new_choices  # noqa: E402
from mtp_ray.serve.openai.limits import Limits  # noqa: E402
from mtp_ray.serve.openai.request import parse_completion  # noqa: E402
from mtp_ray.serve.openai.streaming import ChunkWriter  # noqa: E402

MODEL = str(Path(__file__).resolve().parent.parent / "mtp_ray/assets/tiny-qwen35-mtp")


class Client:
    """The part of GroupClient a GroupStream uses once its request is admitted."""

    max_resends = 0

    def __init__(self) -> None:
        self.deliveries = Deliveries()

    def count(self, name: str) -> None:
        pass


async def run(tok, streams: int, steps: int) -> dict:
    client, box = Client(), Outboxes()
    sub = client.deliveries.subscriber
    pulls = []
    for i in range(streams):
        box.route(f"r{i}", sub)
    for s in range(steps):
        done = s == steps - 1
        box.publish(s, [StepOutput(f"r{i}", [100 + (7 * s + i) % 1500], [-0.5], [{}], done, "length" if done else None)
                        for i in range(streams)])
        pulls.append(box.take(sub, 0, lambda: False))
    runner = ChoiceRunner(Metrics(), lambda e: e)
    limits = Limits(4, 4, 4, 10**9)
    events = 0

    async def consume(i: int) -> None:
        nonlocal events
        req = parse_completion({"prompt": [5, 6, 7], "max_tokens": steps, "stream": True}, tok, limits)
        c = new_choices(req, tok, ChatServing(None, None))[0]
        q = client.deliveries.expect(f"r{i}")
        stream = GroupStream(client, [5, 6, 7], req.params, Admitted(Admission(f"r{i}", "g", 1, 0, None), q))
        w = ChunkWriter(f"cmpl-{i}", "m", req, [c], False, tok)
        async for _ in sse_stream(runner.events(w, [c], {0: stream}, time.monotonic())):
            events += 1

    tasks = [asyncio.create_task(consume(i)) for i in range(streams)]
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    for msgs in pulls:
        client.deliveries._dispatch(msgs)
        for _ in range(4):  # the streams take their deltas (each a few hops on the loop)
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    dt = time.perf_counter() - t0
    return {"streams": streams, "steps": steps, "events": events,
            "us_per_chunk": round(1e6 * dt / (streams * steps), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="bench/results/ingress_chunk.json")
    args = ap.parse_args()
    tok = load_tokenizer(MODEL)
    rows = [asyncio.run(run(tok, n, args.steps)) for n in args.streams]
    write_json({"machine": machine(), "tokenizer": "bundled (byte-level BPE)", "runs": rows}, args.out)


if __name__ == "__main__":
    main()
