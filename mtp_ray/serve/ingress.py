"""OpenAI-compatible HTTP ingress (FastAPI on Ray Serve): tokenises, validates, fans requests out to the group
deployment, detokenises and applies stop strings, streams server-sent events, keeps the metrics."""


import asyncio
import dataclasses
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from mtp_ray.engine.detok import Detokenizer
from mtp_ray.llm import load_tokenizer
from mtp_ray.runtime.group_monitor import GroupFailed, GroupUnavailable
from mtp_ray.serve.metrics import Metrics
from mtp_ray.serve.openai_protocol import ApiError, ParsedRequest, bad, check_length, parse_chat, parse_completion
from mtp_ray.serve.responses import Choice, chunk, final_response

app = FastAPI(title="mtp-ray")


def sse_event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


# a group that cannot serve right now: failed or restarting, a rank or the group replica gone, Serve without a replica
UNAVAILABLE = (GroupFailed, GroupUnavailable, RayActorError, ActorUnavailableError, DeploymentUnavailableError,
               ReplicaUnavailableError)


def classify(e: BaseException) -> ApiError:
    """Engine-side exceptions -> HTTP errors: bad input (ValueError, RequestError) 400, a group that cannot serve 503.
    An exception raised in the group replica arrives as a RayTaskError whose `cause` is the original."""
    cause = e.cause if isinstance(e, RayTaskError) and e.cause is not None else e
    msg = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
    if isinstance(cause, UNAVAILABLE):
        return ApiError(503, f"no engine group can serve the request right now: {msg}")
    if isinstance(cause, ValueError):
        return bad(msg)
    return ApiError(500, f"internal error: {msg}")


@serve.ingress(app)  # at import time, so that the driver and every replica see the same class-based routes
class Ingress:
    """FastAPI routes on a Serve ingress class."""

    def __init__(self, group, model_name: str, tokenizer: str):
        self.group = group
        self.model_name = model_name
        self.tok = load_tokenizer(tokenizer)
        self.metrics = Metrics(model_name)
        self._info: dict | None = None

    async def info(self) -> dict:
        if self._info is None:
            self._info = await self.group.info.remote()
        return self._info

    async def _body(self, request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad(f"malformed JSON body: {e}") from e
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", "model", "NotFoundError", "model_not_found")
        return body

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self.generate(request, chat=True)

    async def generate(self, request: Request, chat: bool):
        try:
            body = await self._body(request)
            req = (parse_chat if chat else parse_completion)(body, self.tok)
            max_len = (await self.info())["max_model_len"]
            for ids in req.prompts:
                check_length(ids, req.params, max_len)
        except ApiError as e:
            return error_response(e)
        except Exception as e:
            return error_response(classify(e))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        choices = [Choice(i * req.params.n + j, p, Detokenizer(self.tok, req.params.stop,
                                                              req.params.skip_special_tokens,
                                                              req.params.include_stop_str_in_output),
                          echo=self._echo_text(req, i))
                   for i, p in enumerate(req.prompts) for j in range(req.params.n)]
        if req.stream:
            return StreamingResponse(self._stream(rid, req, choices, chat), media_type="text/event-stream")
        try:
            await asyncio.gather(*[self._drive(c, req, None) for c in choices])
        except Exception as e:
            return error_response(e if isinstance(e, ApiError) else classify(e))
        return JSONResponse(final_response(rid, self.model_name, chat, choices, req, self.tok))

    def _echo_text(self, req: ParsedRequest, i: int) -> str:
        if not req.echo:
            return ""
        text = req.prompt_texts[i]
        return text if text is not None else self.tok.decode(req.prompts[i])

    async def _drive(self, c: Choice, req: ParsedRequest, queue: asyncio.Queue | None) -> None:
        """Runs one choice to its end; with a queue, puts a chunk per step that produced text or finished."""
        p = req.params
        params = dataclasses.replace(p, n=1, seed=None if p.seed is None else p.seed + c.index % p.n)
        gen = self.group.options(stream=True).stream.remote(c.prompt, params, None)
        t0 = last = time.monotonic()
        self.metrics.running += 1
        try:
            async for out in gen:
                now = time.monotonic()
                if out.new_token_ids:
                    if not c.token_ids:
                        self.metrics.ttft.observe(now - t0)
                    else:
                        self.metrics.itl.observe((now - last) / len(out.new_token_ids))
                    last = now
                c.add(out)
                if c.detok.stopped_by is not None and not out.finished:
                    c.finish_reason, c.stop_reason = "stop", c.detok.stopped_by
                    gen.cancel()  # aborts the request on its rank
                if queue is not None:
                    queue.put_nowait(c)
                if c.finish_reason is not None:
                    break
            self.metrics.e2e.observe(time.monotonic() - t0)
            self.metrics.finished(len(c.prompt), len(c.token_ids), c.spec, c.finish_reason)
        except asyncio.CancelledError:
            gen.cancel()
            raise
        finally:
            self.metrics.running -= 1

    async def _stream(self, rid: str, req: ParsedRequest, choices: list[Choice], chat: bool):
        queue: asyncio.Queue = asyncio.Queue()

        async def drive(c: Choice) -> None:
            try:
                await self._drive(c, req, queue)
                queue.put_nowait(("done", c))
            except Exception as e:
                queue.put_nowait(("error", e))

        tasks = [asyncio.create_task(drive(c)) for c in choices]
        created = int(time.time())
        live = len(choices)
        try:
            if chat:
                for c in choices:
                    yield sse_event(chunk(rid, self.model_name, created, chat, c, role=True))
            for c in choices:  # echo: the prompt's text first
                if c.echo:
                    yield sse_event(chunk(rid, self.model_name, created, chat, c, text=c.echo))
            while live:
                item = await queue.get()
                if isinstance(item, tuple):
                    kind, val = item
                    if kind == "error":
                        raise val
                    live -= 1
                    c = val
                else:
                    c = item
                text = c.detok.delta(c.finish_reason is not None)
                lp_due = req.top_logprobs is not None and c.pending_logprobs
                if text or lp_due or (c.finish_reason is not None and not c.sent_finish):
                    yield sse_event(chunk(rid, self.model_name, created, chat, c, text=text, top_n=req.top_logprobs,
                                     tok=self.tok))
            if req.include_usage:
                n_prompt = sum(len(p) for p in req.prompts)
                n_gen = sum(len(c.token_ids) for c in choices)
                yield sse_event({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": created, "model": self.model_name, "choices": [],
                            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen,
                                      "total_tokens": n_prompt + n_gen}})
        except Exception as e:
            err = e if isinstance(e, ApiError) else classify(e)
            yield sse_event(err.body())
        finally:
            for t in tasks:
                t.cancel()
        yield "data: [DONE]\n\n"

    @app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "mtp-ray", "max_model_len": (await self.info())[
                                                "max_model_len"]}]}

    @app.get("/health")
    async def health(self):
        try:
            h = await asyncio.wait_for(self.group.health.remote(), 10)
        except Exception as e:
            return JSONResponse({"healthy": False, "error": str(e)}, status_code=503)
        return JSONResponse(h, status_code=200 if h["healthy"] else 503)

    @app.get("/metrics")
    async def metrics_text(self):
        try:
            group = await asyncio.wait_for(self.group.health.remote(), 5)
        except Exception:
            group = None
        return PlainTextResponse(self.metrics.render(group), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        try:
            body = await self._body(request)
            if "messages" in body:
                ids = parse_chat(body, self.tok).prompts[0]
            elif isinstance(body.get("prompt"), str):
                ids = self.tok.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", False)))
            else:
                raise bad("'prompt' (a string) or 'messages' is required", "prompt")
        except ApiError as e:
            return error_response(e)
        return {"tokens": ids, "count": len(ids), "max_model_len": (await self.info())["max_model_len"]}

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        try:
            body = await self._body(request)
            toks = body.get("tokens")
            vocab = (await self.info())["vocab_size"]
            if not isinstance(toks, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in toks):
                raise bad(f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
        except ApiError as e:
            return error_response(e)
        return {"prompt": self.tok.decode(toks)}
