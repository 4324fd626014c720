"""A chat message's content as the template gets it, for the offline `LLM.chat` and the server's chat requests."""

from __future__ import annotations

from typing import Any


def content_text(c: Any, where: str) -> str | None:
    """A string, None, or a list of text parts joined into one string; anything else is a ValueError naming `where`
    (e.g. "messages[2].content"). Images and audio are not supported: the models served are text-only."""
    if isinstance(c, list):
        if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in c):
            raise ValueError(f"{where}: only text parts are supported")
        return "".join(x["text"] for x in c)
    if c is not None and not isinstance(c, str):
        raise ValueError(f"{where} must be a string or a list of text parts")
    return c
