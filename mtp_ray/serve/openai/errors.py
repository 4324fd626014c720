"""The OpenAI error body every refusal of the front door answers with (what an engine-side failure is:
serve/cluster/failures.py)."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None):
        message, param = encodable(message), encodable(param)
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.type = type_ or {400: "invalid_request_error", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
            status, "internal_error")
        self.code = code if code is not None else status

    def body(self) -> dict:
        """OpenAI's {"error": {...}} (what the openai client and vLLM read), and the same keys flat beside it with
        "object": "error" (vLLM's older shape, which lmdeploy's and SGLang's clients and tests still read)."""
        e = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": e, "object": "error", **e}


def encodable(s: str | None) -> str | None:
    """User text a message quotes may hold lone surrogates (JSON carries them, UTF-8 cannot): escaped, so that the
    error body always encodes (Starlette's JSONResponse would fail with a 500 instead)."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8") if s is not None else None


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)
