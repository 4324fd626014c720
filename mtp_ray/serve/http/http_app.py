"""The ingress's FastAPI app (its routes are the Ingress class's methods, serve/http/ingress.py): the access rules
before any route (serve/http/guard.py), no schema pages, CORS as vLLM's, unknown routes in OpenAI's error shape; and
FRONTS, the other APIs served through the chat or completions
route."""

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from mtp_ray.serve.apis import anthropic, responses_out, sglang
from mtp_ray.serve.http.guard import Guard
from mtp_ray.serve.openai.errors import ApiError


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


# no /docs, /redoc or /openapi.json: the API is OpenAI's, and an open schema browser is one more thing to expose
app = FastAPI(title="mtp-ray", docs_url=None, redoc_url=None, openapi_url=None)


class GuardMiddleware:
    """The replica's access rules (serve/http/guard.py) before any route: `app.state.guard`, set by the Ingress
    replica from its ServerConfig (one ingress per process). A plain ASGI middleware: streamed answers pass through
    untouched."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            guard: Guard = getattr(scope["app"].state, "guard", None) or Guard()
            client = scope.get("client")
            refusal = guard.check(scope["method"], scope["path"], Headers(scope=scope), client[0] if client else None)
            if refusal is not None:
                guard.refused(refusal)
                anthropic_route = scope["path"].rstrip("/").startswith("/v1/messages")
                await (anthropic.error_response if anthropic_route else error_response)(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# the guard inside CORS (middleware added later wraps the earlier): CORS answers a preflight itself, and a refusal
# carries CORS headers, so a browser client reads why (a 401 naming the key)
app.add_middleware(GuardMiddleware)
# browsers' cross-origin calls, as vLLM's server answers them by default (any origin, no credentials: a key still has
# to be sent as a bearer token); the preflight OPTIONS was a 405
app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=False, allow_methods=["*"],
                   allow_headers=["*"])
# other APIs served through the chat route (the first two) or the completions route: name -> ((request, model,
# tokenizer) -> (that route's body, its front), an error's answer)
FRONTS = {"responses": (lambda body, model, _: responses_out.front(body, model), error_response),
          "messages": (lambda body, model, _: anthropic.front(body, model), anthropic.error_response),
          "generate": (sglang.front, error_response)}


@app.exception_handler(StarletteHTTPException)
async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and methods answer in OpenAI's error shape, like every other error here."""
    return error_response(ApiError(exc.status_code, str(exc.detail), None,
                                   "NotFoundError" if exc.status_code == 404 else "invalid_request_error"))
