"""Request intake for the HTTP routes: the body read under its size limit, and a large body's JSON
(and prompt) parsed off the event loop, so that one large or hostile request cannot stall the requests beside it."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request

from mtp_ray.serve.openai.errors import ApiError, bad
from mtp_ray.serve.openai.fields import unicode_text

T = TypeVar("T")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused with 413 as soon as it is known to be larger than max_bytes (declared or as read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(int(declared), max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(size, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(size: int, max_bytes: int) -> ApiError:
    return ApiError(413, f"Payload Too Large: the request body ({size} bytes or more) is larger than the server's "
                         f"limit of {max_bytes} bytes", None, "invalid_request_error", "request_too_large")


# bodies up to this size are parsed (and their prompts tokenised) on the event loop: two thread hops cost more
# than the work (ingress_parse_seconds at 16 streams); larger ones go to a thread so other requests go on
INLINE_BYTES = 4096


async def off_loop(fn: Callable[[], T], size: int) -> T:
    """fn() for an input of `size` bytes: on the event loop up to INLINE_BYTES, else in a thread."""
    return fn() if size <= INLINE_BYTES else await asyncio.to_thread(fn)


def check_content_type(request: Request) -> None:
    """A body declared as anything but JSON is refused (415, as vLLM), not parsed anyway: a web page can POST a form
    or text/plain to a local server without asking first (no CORS preflight), but not application/json. A body
    without a Content-Type is read as JSON (raw HTTP clients)."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media = declared.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise ApiError(415, f"Unsupported Media Type: the body must be JSON (Content-Type: application/json), got "
                            f"{declared[:80]!r}", None, "invalid_request_error", "unsupported_media_type")


async def read_json_object(request: Request, max_bytes: int, optional: bool = False) -> tuple[dict, int]:
    """The body as a JSON object, and its size in bytes (what later work on it is sized by: `off_loop`). optional:
    an empty body is {} (the admin routes' bodies)."""
    check_content_type(request)
    raw = await read_body(request, max_bytes)
    if optional and not raw.strip():
        return {}, len(raw)
    try:
        body = await off_loop(lambda: _parse(raw), len(raw))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"malformed JSON body: {e}") from e
    except RecursionError:
        raise bad("malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body, len(raw)


def _parse(raw: bytes) -> object:
    """json.loads, and where the text may escape a surrogate (a pair: an emoji; or a lone one) the Unicode check: both
    off the event loop for a large body. (A UTF-16 / 32 body is always checked: its escapes are not these bytes.)"""
    body = json.loads(raw, parse_constant=_not_json, parse_float=_finite)
    escapes = b"\\ud" in raw or b"\\uD" in raw or not json.detect_encoding(raw).startswith("utf-8")
    if isinstance(body, dict) and escapes:
        check_unicode(body)
    return body


def _not_json(name: str) -> float:
    """NaN / Infinity: Python's json reads them, JSON has no such numbers, and an answer echoing one (a Response's
    tools, metadata) could not be written as JSON."""
    raise bad(f"malformed JSON body: {name} is not a JSON number")


def _finite(text: str) -> float:
    x = float(text)
    if math.isinf(x):  # 1e999: past the largest double
        raise bad(f"malformed JSON body: the number {text[:40]} is out of range")
    return x


def check_unicode(body: dict) -> None:
    """Every string of the body, keys included, is valid Unicode text: JSON can carry a lone surrogate, UTF-8 cannot,
    so a tokenizer, a template or a response echoing it would fail later (a 500). 400 naming the top-level field."""
    stack: list[tuple[object, str]] = [(v, k) for k, v in body.items()] + [(k, k) for k in body]
    while stack:
        v, field = stack.pop()
        if isinstance(v, str):
            unicode_text(v, field)
        elif isinstance(v, dict):
            stack += [(x, field) for x in v.values()] + [(x, field) for x in v]
        elif isinstance(v, list):
            stack += [(x, field) for x in v]

