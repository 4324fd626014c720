"""OpenAI-compatible HTTP ingress (FastAPI on Ray Serve): tokenises, validates, fans requests out to the group
deployment, detokenises and applies stop strings, streams server-sent events, keeps the metrics. The Responses API
and Anthropic's Messages API go through the chat route, SGLang's native /generate through completions (FRONTS)."""


import asyncio
import json
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse
from ray import serve

from mtp_ray import __version__
from mtp_ray.config.server import ServerConfig
from mtp_ray.engine.request import check_request
from mtp_ray.prompts import tokenizer_or_none
from mtp_ray.serve.apis import anthropic, sglang
from mtp_ray.serve.cluster.failures import cause_of, first_line
from mtp_ray.serve.cluster.groups import GroupClient
from mtp_ray.serve.cluster.metrics import Metrics, render
from mtp_ray.serve.cluster.metrics_hub import HubReporter
from mtp_ray.serve.http import admin_api
from mtp_ray.serve.http.answer import Answerer
from mtp_ray.serve.http.choices import ChoiceRunner
from mtp_ray.serve.http.guard import Guard
from mtp_ray.serve.http.health import group_health
from mtp_ray.serve.http.http_app import FRONTS, app, error_response
from mtp_ray.serve.http.intake import off_loop, read_body, read_json_object
from mtp_ray.serve.http.server_load import ServerLoad
from mtp_ray.serve.openai.chat_request import ChatServing, parse_chat, think_ids
from mtp_ray.serve.openai.errors import ApiError
from mtp_ray.serve.openai.fields import check_fields
from mtp_ray.serve.openai.limits import Limits, cap_max_tokens, check_length
from mtp_ray.serve.openai.request import parse_completion
from mtp_ray.serve.openai.tokenize import detokenize, tokenize

log = logging.getLogger("mtp_ray.ingress")


@serve.ingress(app)  # at import time, so that the driver and every replica see the same class-based routes
class Ingress:
    """FastAPI routes on a Serve ingress class."""

    def __init__(self, group, model_names: list[str], tokenizer: str, server: ServerConfig | None = None,
                 queue_s: float = 5.0, deploy: int = 0, defaults: dict[str, float | int] | None = None):
        self.group = group
        self.server = server or ServerConfig()
        # sampling defaults of requests that leave them out (server.generation_config; read by build_app)
        self.defaults = dict(defaults or {})
        if self.defaults:
            log.info("sampling defaults from generation_config.json (server.generation_config: %s): %s",
                     self.server.generation_config, self.defaults)
        self.metrics = Metrics()
        self.load = ServerLoad()  # GET /load
        self.groups = GroupClient(group, queue_s, retry_after_s=max(1, round(queue_s)), count=self.metrics.count,
                                  stream_interval_s=self.server.stream_interval_ms / 1e3,
                                  admission_gap_s=self.server.admission_gap_ms / 1e3)
        # (MTP_RAY_API_KEY is read where the app is built, on the cluster: `serve deploy` does not pass the CLI's
        # environment, so say which it is)
        log.info("API key: %s", "required on every route but /health" if self.server.api_key else
                 "none set, the server is open (args.server.api_key, or MTP_RAY_API_KEY on the cluster)")
        # the access rules of this replica's routes (serve/http/guard.py: GuardMiddleware reads them per request)
        app.state.guard = Guard(self.server.api_key, self.server.allowed_hosts, self.metrics.count)
        self.reporter_id = uuid.uuid4().hex[:8]
        self.reporter = HubReporter("ingress", self.reporter_id, self.metrics.snapshot, deploy)
        self.model_name, self.model_names = model_names[0], model_names  # any is taken; responses name the first
        # None: a checkpoint without tokenizer files serves token ids in and out (NO_TOKENIZER says how)
        self.tok, self.tokenizer_path = tokenizer_or_none(tokenizer), tokenizer
        if self.tok is not None and self.server.template() is not None:
            self.tok.chat_template = self.server.template()
        self.serving = ChatServing(self.server.reasoning_parser, self.server.tool_call_parser, think_ids(self.tok))
        self.runner = ChoiceRunner(self.metrics, self.groups.classify)
        self.answer = Answerer(self.groups, self.runner, self.metrics, self.tok, self.serving, self.model_name)
        # the longest token's text, once here: over a 248k vocabulary it takes ~0.1 s, and a cold server's first
        # burst used to compute it per request, on the event loop (a 64-request burst waited ~7 s for it)
        self.longest_token = (max(max((len(t) for t in self.tok.get_vocab()), default=1), 1)
                              if self.tok is not None else 1)
        self._limits: Limits | None = None

    def no_model(self, model) -> ApiError:
        return ApiError(404, f"The model `{model}` does not exist. The served model name is `{self.model_name}`.",
                        "model", "NotFoundError", "model_not_found")  # (vLLM's sentence, then SGLang's)

    def refused(self, e: ApiError, api: str | None = None) -> JSONResponse:
        """An error's answer, counted; api: in that API's shape."""
        gone = e.status == 499  # (its client went away: an abort, not a failure)
        self.metrics.count("request_aborted_total" if gone else f'request_failed_total{{status="{e.status}"}}')
        return (FRONTS[api][1] if api else error_response)(e)

    async def limits(self) -> Limits:
        """Per-request limits; a prompt string longer than the context could hold even at the vocabulary's longest
        token is refused before tokenisation."""
        if self._limits is None:
            s = self.server
            max_len = (await self.info())["max_model_len"]
            self._limits = Limits(s.max_n, s.max_stop, s.max_prompts, max_len * self.longest_token, max_len,
                                  self.defaults, s.enable_force_include_usage, s.enable_prompt_tokens_details,
                                  s.return_tokens_as_token_ids)
        return self._limits

    async def info(self) -> dict:
        """The group's model facts (GroupClient.info: asked once, 503 while no group is up)."""
        return await self.groups.info()

    async def _body(self, request: Request, route: str | None) -> tuple[dict, int]:
        """The request's JSON object (checked: the route's fields unless None, model; the API key was checked before
        any route, serve/http/guard.py) and its size in bytes."""
        body, size = await read_json_object(request, self.server.max_body_bytes)
        if route is not None:
            check_fields(body, route)
        model = body.get("model")
        if model not in (None, "") and model not in self.model_names:  # ("": the served model, as vLLM)
            raise self.no_model(model)
        return body, size

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self.load.count(self.generate(request, chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self.load.count(self.generate(request, chat=True))

    @app.post("/invocations")
    async def invocations(self, request: Request):
        """SageMaker's route (as vLLM): chat completions for a body with messages, else completions."""
        try:
            raw = await read_body(request, self.server.max_body_bytes)
        except ApiError as e:
            return self.refused(e)
        request._body = raw  # Starlette's stream() replays a read body: generate() reads it again
        try:
            chat = "messages" in json.loads(raw)
        except (ValueError, TypeError, RecursionError):
            chat = False  # generate() answers the malformed body
        return await self.load.count(self.generate(request, chat=chat))

    @app.post("/v1/responses")  # OpenAI's Responses API (serve/apis/responses_out.py)
    @app.post("/v1/messages")  # Anthropic's Messages API (serve/apis/anthropic.py)
    @app.post("/generate")  # SGLang's native API (serve/apis/sglang.py)
    async def other_api(self, request: Request):
        """Another API's request (FRONTS, named by the path's last part), answered through the chat or (/generate)
        the completions path in its own shape."""
        api = request.url.path.rstrip("/").rsplit("/", 1)[-1]
        return await self.load.count(self.generate(request, chat=api != "generate", api=api))

    async def generate(self, request: Request, chat: bool, api: str | None = None):
        """A completion or chat completion; api: another API's request (FRONTS), answered in its own shape."""
        self.reporter.start()
        t_in = time.monotonic()
        front = None
        try:
            route = "chat" if chat else "completions"
            body, size = await self._body(request, None if api else route)  # (another API's adapter checks its own)
            if api is not None:
                body, front = FRONTS[api][0](body, self.model_name, self.tok)
                check_fields(body, route)
            # tokenising / templating a large prompt off the event loop (a small one: here, see INLINE_BYTES)
            limits = (await self.limits()).for_translated() if api else await self.limits()
            req = await off_loop(lambda: parse_chat(body, self.tok, limits, self.serving) if chat
                                 else parse_completion(body, self.tok, limits), size)
            info = await self.info()
            for ids in req.prompts:  # here, not only at the group: an echo decodes the prompt before admission
                check_length(ids, req.params, info["max_model_len"])
                check_request(ids, req.params, info["vocab_size"], info["max_model_len"], info["max_logprobs"])
            cap_max_tokens(req.params, limits)
        except ApiError as e:
            return self.refused(e, api)
        except asyncio.CancelledError:  # the client went away while its request was read
            self.metrics.count("request_aborted_total")
            raise
        except Exception as e:  # (a client gone while its body was read: classify's 499, counted as an abort)
            return self.refused(self.groups.classify(e), api)
        return await self.answer.respond(req, chat, info, t_in, front, lambda e: self.refused(e, api))

    def _model_card(self, name: str, max_len: int) -> dict:
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "mtp-ray",
                "root": self.model_name, "parent": None, "max_model_len": max_len}  # (created: now, as vLLM's)

    @app.get("/v1/models")
    @app.get("/v1/models/{model_id:path}")
    async def models(self, request: Request, model_id: str | None = None):
        """The served names (OpenAI's list), or the one named."""
        try:
            if model_id is not None and model_id not in self.model_names:
                raise self.no_model(model_id)
            max_len = (await self.info())["max_model_len"]
        except ApiError as e:
            return error_response(e)
        names = self.model_names if model_id is None else [model_id]
        cards = [self._model_card(n, max_len) for n in names]
        return {"object": "list", "data": cards} if model_id is None else cards[0]

    @app.get("/version")
    async def version(self):
        return {"version": __version__}

    @app.get("/get_model_info")  # SGLang's (serve/apis/sglang.py)
    @app.get("/get_server_info")
    async def sglang_info(self, request: Request):
        try:
            info = await self.info()
        except ApiError as e:
            return error_response(e)
        if request.url.path.endswith("/get_model_info"):
            return sglang.model_info(info, self.tokenizer_path)
        return sglang.server_info(info, self.tokenizer_path, self.model_name, self.metrics.totals)

    @app.post("/sleep")  # the admin routes, for every group of the server (serve/http/admin_api.py)
    @app.post("/wake_up")
    @app.get("/is_sleeping")
    @app.post("/reset_prefix_cache")
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    @app.post("/release_memory_occupation")
    @app.post("/resume_memory_occupation")
    async def admin_command(self, request: Request):
        try:
            if not self.server.admin_routes:
                raise ApiError(404, "the admin routes are off (server.admin_routes: false)")
            self.reporter.start()
            return await admin_api.answer(request.url.path.rstrip("/").rsplit("/", 1)[-1], request, self.reporter.hub)
        except ApiError as e:
            return error_response(e)

    @app.get("/load")
    async def server_load(self):
        """vLLM's: the generation requests this replica answers now (serve/http/server_load.py)."""
        return {"server_load": self.load.n}

    @app.get("/health")
    @app.get("/health_generate")  # SGLang's (its router and test harness wait on it)
    @app.api_route("/ping", methods=["GET", "POST"])  # SageMaker's, beside /invocations (as vLLM's)
    async def health(self):
        """Open to load balancers: healthy or not, and the group's state; the details are at /admin/health."""
        return await group_health(self.group)

    @app.get("/admin/health")
    async def admin_health(self, request: Request):
        """For operators (behind the API key, or from the loopback when there is none: serve/http/guard.py): a
        group's full health, its last failure report included; with ?stats=1 also each rank's engine counters as
        they are now (bench/serve.py reads them)."""
        return await group_health(self.group, live=request.query_params.get("stats") in ("1", "true"))

    @app.get("/metrics")
    async def metrics_text(self):
        """Every ingress replica and every group of the application, from the hub (this replica's own counters as
        they are now); without the hub, this replica's alone."""
        self.reporter.start()
        await self.metrics.spec_counters(self.info)
        try:
            view = await asyncio.wait_for(self.reporter.hub.view.remote(), 5)
        except Exception as e:
            log.warning("metrics hub unreachable: %s", first_line(cause_of(e)))
            view = {"live": {"ingress": {}, "group": {}}, "retired": {}}
        view["live"]["ingress"][self.reporter_id] = self.metrics.snapshot()
        return PlainTextResponse(render(view, self.model_name), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    @app.post("/v1/tokenize")  # (SGLang's name)
    async def tokenize(self, request: Request):
        """vLLM's /tokenize (serve/openai/tokenize.py)."""
        try:
            body, size = await self._body(request, "tokenize")
            max_len = (await self.info())["max_model_len"]
            # a large text tokenises in a thread (as a completion's does): 14 MB held this replica's loop ~27 s
            return await off_loop(lambda: tokenize(body, self.tok, max_len), size)
        except ApiError as e:
            return error_response(e)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(self, request: Request):
        """Anthropic's: the prompt tokens a Messages request would take (its messages, system and tools through the
        chat template)."""
        try:
            body, size = await self._body(request, None)
            chat = anthropic.chat_body(body, count_only=True)
            chat = {k: chat[k] for k in ("messages", "tools", "chat_template_kwargs") if k in chat}
            max_len = (await self.info())["max_model_len"]
            return {"input_tokens": (await off_loop(lambda: tokenize(chat, self.tok, max_len), size))["count"]}
        except ApiError as e:
            return anthropic.error_response(e)

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(self, request: Request):
        """vLLM's /detokenize (serve/openai/tokenize.py)."""
        try:
            body, size = await self._body(request, "detokenize")
            vocab = (await self.info())["vocab_size"]
            return await off_loop(lambda: detokenize(body, self.tok, vocab), size)
        except ApiError as e:
            return error_response(e)
