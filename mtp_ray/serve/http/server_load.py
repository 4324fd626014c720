"""vLLM's GET /load: how many generation requests this ingress replica is answering now ({"server_load": n}), for
load balancers that pick the least loaded server. A request counts from its arrival until its response ended: a
stream until its last chunk went out or its client went away."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable

from starlette.responses import Response, StreamingResponse


class ServerLoad:
    def __init__(self) -> None:
        self.n = 0

    async def count(self, handler: Awaitable[Response]) -> Response:
        """The handler's response, the request counted until it ended."""
        self.n += 1
        try:
            resp = await handler
        except BaseException:  # (cancelled: the client went away while it was admitted)
            self.n -= 1
            raise
        if isinstance(resp, StreamingResponse):
            resp.body_iterator = self._until_end(resp.body_iterator)
        else:
            self.n -= 1
        return resp

    async def _until_end(self, chunks: AsyncIterator) -> AsyncIterator:
        try:
            async for chunk in chunks:
                yield chunk
        finally:  # (closed early when its client goes away)
            self.n -= 1
