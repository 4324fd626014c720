"""ServerConfig: the HTTP front door's settings (the YAML's `args.server`): authentication, request limits, and the
chat output parsers (vLLM's --reasoning-parser / --tool-call-parser / --chat-template)."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

REASONING_PARSER_NAMES = frozenset({"qwen3", "deepseek_r1"})  # serve/parsers/reasoning.py
TOOL_PARSER_NAMES = frozenset({"qwen3_coder", "hermes"})  # serve/parsers/tool_calls.py
API_KEY_ENV = "MTP_RAY_API_KEY"  # as vLLM's VLLM_API_KEY: used when the YAML sets no api_key


@dataclass(frozen=True)
class ServerConfig:
    # clients must send `Authorization: Bearer <api_key>` on every route but /health, /ping and /health_generate
    # (401 otherwise); None: open to whoever reaches the server, web pages kept out (serve/http/guard.py)
    api_key: str | None = None
    # without an api_key: the host names clients may call the server by, besides localhost and IP addresses (a
    # request with another `Host` is a 403: DNS rebinding); ".example.com" also allows its subdomains, "*" any name
    allowed_hosts: tuple[str, ...] = ()
    max_body_bytes: int = 16 << 20  # a larger request body is a 413, refused before it is read whole
    max_n: int = 64  # choices per request (n); each is a request of its own on the engine
    max_stop: int = 64  # stop strings per request (and bad words)
    max_prompts: int = 256  # prompts in one completions request (a batch)
    reasoning_parser: str | None = None  # "qwen3" (alias "deepseek_r1"): <think> ... </think> -> reasoning_content
    tool_call_parser: str | None = None  # "qwen3_coder" (Qwen3.5's XML calls) or "hermes" (JSON in <tool_call>)
    chat_template: str | None = None  # a Jinja file or the template itself; None: the tokenizer's
    # an ingress replica holding many streams on one rank pulls that rank's tokens at most this often (0: after every
    # step): each pull costs the rank, the ingress and Serve's proxy per call and per chunk, whatever it carries
    # (serve/cluster/delivery.py, docs/performance.md); a few streams always get every step at once
    stream_interval_ms: float = 5.0
    # an ingress replica's admission calls to the groups leave this far apart at most often, each carrying every
    # request that arrived meanwhile (a quiet spell's first at once); 0: the next leaves when the one in flight
    # answered (serve/cluster/admissions.py: Admissions; a Serve call costs ~1.5 ms of routing, docs/performance.md)
    admission_gap_ms: float = 20.0
    # the sampling defaults of requests that leave them out (vLLM's --generation-config): "auto", the model's
    # generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens caps max_tokens);
    # "vllm", none (temperature 1, ...); else a directory holding a generation_config.json
    generation_config: str = "auto"
    # as vLLM's --enable-force-include-usage: every streamed chunk carries the usage so far and a last chunk the
    # whole usage, whatever the request's stream_options say
    enable_force_include_usage: bool = False
    # as vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens (prefix-cache hits; 0 with
    # caching off) in every response; off, as vLLM's default, usage holds only the three counts (the Responses API's
    # input_tokens_details always has it)
    enable_prompt_tokens_details: bool = False
    # as vLLM's --return-tokens-as-token-ids: every response's log-prob tokens as "token_id:<id>" (a request may also
    # ask, with return_tokens_as_token_ids)
    return_tokens_as_token_ids: bool = False
    # the routes that act on every engine group (serve/http/admin_api.py): vLLM's /sleep, /wake_up, /is_sleeping,
    # /reset_prefix_cache, SGLang's /flush_cache and memory release / resume; behind api_key when it is set, else
    # only for clients on the loopback that are not web pages (serve/http/guard.py)
    admin_routes: bool = True

    def __post_init__(self) -> None:
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("server.api_key must be a non-empty string")
        if not isinstance(self.allowed_hosts, tuple) or not all(isinstance(h, str) and h and h == h.strip()
                                                                 for h in self.allowed_hosts):
            raise ValueError(f"server.allowed_hosts must be a list of host names, got {self.allowed_hosts!r}")
        for name, known in (("reasoning_parser", REASONING_PARSER_NAMES), ("tool_call_parser", TOOL_PARSER_NAMES)):
            v = getattr(self, name)
            if v is not None and v not in known:
                raise ValueError(f"server.{name} must be one of {sorted(known)}, got {v!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError('server.generation_config must be "auto", "vllm" or a directory, '
                             f"got {self.generation_config!r}")
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template):
            raise ValueError("server.chat_template must be a file path or a Jinja template")
        for name in ("stream_interval_ms", "admission_gap_ms"):
            iv = getattr(self, name)
            if isinstance(iv, bool) or not isinstance(iv, (int, float)) or not 0 <= iv <= 1000:
                raise ValueError(f"server.{name} must be a number in [0, 1000], got {iv!r}")
        for f in fields(self):
            if isinstance(f.default, bool):
                if not isinstance(getattr(self, f.name), bool):
                    raise ValueError(f"server.{f.name} must be true or false, got {getattr(self, f.name)!r}")
            elif isinstance(f.default, int):
                v = getattr(self, f.name)
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"server.{f.name} must be an integer >= 1, got {v!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> ServerConfig:
        raw = dict(raw or {})
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(f'server.{u}' for u in unknown)}")
        if raw.get("api_key") is None and os.environ.get(API_KEY_ENV):
            raw["api_key"] = os.environ[API_KEY_ENV]
        hosts = raw.get("allowed_hosts")
        if isinstance(hosts, list):  # (YAML's lists; names compared in lower case)
            raw["allowed_hosts"] = tuple(h.lower() if isinstance(h, str) else h for h in hosts)
        elif isinstance(hosts, str):
            raise ValueError(f"server.allowed_hosts must be a list of host names, got the string {hosts!r}")
        return cls(**raw)

    def template(self) -> str | None:
        """The chat template's text: a path is read, anything else is the template."""
        from pathlib import Path

        t = self.chat_template
        if t is not None and "{" not in t and Path(t).is_file():
            return Path(t).read_text()
        return t
