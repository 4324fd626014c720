"""The ingress's FastAPI app (its routes are the Ingress class's methods, serve/http/ingress.py): no schema pages, CORS
as vLLM's, unknown routes in OpenAI's error shape; and FRONTS, the other APIs served through the chat or completions
route."""

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mtp_ray.serve.apis import anthropic, responses_out, sglang
from mtp_ray.serve.openai.errors import ApiError


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


# no /docs, /redoc or /openapi.json: the API is OpenAI's, and an open schema browser is one more thing to expose
app = FastAPI(title="mtp-ray", docs_url=None, redoc_url=None, openapi_url=None)
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
