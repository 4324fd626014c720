"""vLLM's /tokenize and /detokenize bodies -> their answers (ApiError on a bad body); the routes are in ingress.py."""

from __future__ import annotations

from mtp_ray.serve.openai.chat_request import render_chat
from mtp_ray.serve.openai.errors import bad
from mtp_ray.serve.openai.fields import flag
from mtp_ray.serve.openai.request import NO_TOKENIZER


def tokenize(body: dict, tok, max_model_len: int) -> dict:
    """A prompt, or chat messages through the chat template (with tools and its options) -> token ids, their count
    and the context length (with return_token_strs: each id's token string)."""
    if tok is None:
        raise bad(NO_TOKENIZER, "prompt")
    special = flag(body, "add_special_tokens", "messages" not in body)
    if "messages" in body:
        ids = tok.encode(render_chat(body, tok)[0], add_special_tokens=special)
    elif isinstance(body.get("prompt"), str):
        ids = tok.encode(body["prompt"], add_special_tokens=special)
    else:
        raise bad("'prompt' (a string) or 'messages' is required", "prompt")
    out = {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}
    out["token_strs"] = tok.convert_ids_to_tokens(ids) if flag(body, "return_token_strs") else None  # (vLLM: null)
    return out


def detokenize(body: dict, tok, vocab_size: int) -> dict:
    """Token ids -> their text."""
    toks = body.get("tokens")
    if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                                             for t in toks):
        raise bad(f"'tokens' must be a list of token ids in [0, {vocab_size})", "tokens")
    if tok is None:
        raise bad(NO_TOKENIZER, "tokens")
    return {"prompt": tok.decode(toks)}
