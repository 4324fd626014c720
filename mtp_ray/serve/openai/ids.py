"""Ids of the objects the APIs answer with (responses, messages, tool calls): a prefix and random hex."""

from __future__ import annotations

import uuid


def new_id(prefix: str, hex_len: int = 24) -> str:
    """prefix_<hex_len random hex digits> (OpenAI's call_ / resp_ ids, Anthropic's msg_ / toolu_ ids)."""
    return f"{prefix}_{uuid.uuid4().hex[:hex_len]}"
