"""Who may call which route, checked before any route runs (GuardMiddleware, installed on the app in http_app.py; the
rules come from the ServerConfig of the ingress replica that serves the request).

With server.api_key set, every route but the load balancers' health checks (/health, /ping, /health_generate: a
minimal answer) needs the key (`Authorization: Bearer <key>`, or Anthropic's `x-api-key`). Without a key the server
is open to whoever can reach it, so it keeps web pages out of it:
- a request whose `Host` is a name other than localhost or server.allowed_hosts is refused (403): a page on another
  site that rebinds its own name to 127.0.0.1 (DNS rebinding) sends that name. An IP address, as a client that
  connects by address sends, is allowed; so is a request without a Host (HTTP/1.0 clients);
- the admin routes (sleep, wake_up, cache and memory commands, /admin/health) answer only clients on this machine's
  loopback whose request carries no web page's marks (an `Origin`, `Sec-Fetch-Site` of another site): a page's
  `fetch` or form to http://127.0.0.1:8000/sleep would otherwise put every group to sleep.
CORS preflights (OPTIONS) pass: they carry no key by the standard and change nothing.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mtp_ray.serve.http import admin_api
from mtp_ray.serve.openai.errors import ApiError

HEALTH_ROUTES = frozenset({"/health", "/ping", "/health_generate"})
ADMIN_ROUTES = frozenset(f"/{r}" for r in admin_api.ROUTES) | {"/admin/health"}


def key_error(headers: Mapping[str, str], api_key: str) -> ApiError | None:
    """vLLM's semantics: `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`, which its clients send),
    else 401."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        token = headers.get("x-api-key", "")
    if hmac.compare_digest(token.strip().encode(), api_key.encode()):
        return None
    return ApiError(401, "Unauthorized: a valid API key is required (Authorization: Bearer <key>)", None,
                    "authentication_error", "invalid_api_key")


def host_name(host: str) -> str:
    """A Host header's name: lower case, without the port or an IPv6 address's brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback(address: str | None) -> bool:
    try:
        return address is not None and ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Guard:
    api_key: str | None = None
    # names a client may call this server by when it has no key, besides localhost and IP addresses; ".example.com"
    # also allows its subdomains, "*" any name (server.allowed_hosts)
    allowed_hosts: tuple[str, ...] = ()
    # the replica's metrics counter (Metrics.count): each refusal counts in request_failed_total{status}
    count: Callable[[str], None] | None = field(default=None, compare=False, repr=False)

    def refused(self, refusal: ApiError) -> None:
        if self.count is not None:
            self.count(f'request_failed_total{{status="{refusal.status}"}}')

    def check(self, method: str, path: str, headers: Mapping[str, str], client: str | None) -> ApiError | None:
        """The refusal of a request (method, path, its headers with lower-case names, the client's address), or
        None to let it through."""
        path = path.rstrip("/") or "/"
        if method == "OPTIONS" or path in HEALTH_ROUTES:
            return None
        if self.api_key is not None:
            return key_error(headers, self.api_key)
        host = headers.get("host")
        if host is not None and not self.host_allowed(host_name(host)):
            return ApiError(403, f"Host {host[:100]!r} is not allowed: this server has no API key, so it answers only "
                                 "to localhost, IP addresses and server.allowed_hosts (or set server.api_key)", None,
                            "permission_error", "host_not_allowed")
        if path in ADMIN_ROUTES:
            site = self.cross_site(headers)
            if site is not None:
                return ApiError(403, f"the admin routes of a server without an API key refuse requests from web pages "
                                     f"({site}); set server.api_key to call them from elsewhere", None,
                                "permission_error", "cross_site_request")
            if not is_loopback(client):
                return ApiError(403, f"the admin routes of a server without an API key answer only clients on its own "
                                     f"machine (loopback), not {client}; set server.api_key to call them from "
                                     "elsewhere", None, "permission_error", "admin_needs_api_key")
        return None

    def host_allowed(self, name: str) -> bool:
        if not name or name == "localhost" or is_ip(name) or "*" in self.allowed_hosts:
            return True
        return any(name == h or h.startswith(".") and (name.endswith(h) or name == h[1:]) for h in self.allowed_hosts)

    @staticmethod
    def cross_site(headers: Mapping[str, str]) -> str | None:
        """What marks the request as a web page's, or None: an `Origin` (browsers send it on every POST and every
        cross-origin fetch; a local tool sends none), or `Sec-Fetch-Site` of another site (an image or link's GET
        carries no Origin)."""
        fetch_site = headers.get("sec-fetch-site", "").lower()
        if fetch_site in ("cross-site", "same-site"):
            return f"Sec-Fetch-Site: {fetch_site}"
        origin = headers.get("origin")
        return None if origin is None else f"Origin: {origin[:100]}"
