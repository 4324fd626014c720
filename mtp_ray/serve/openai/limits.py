"""What one request may ask for, checked before any engine work (config/server.py's limits, the model's context), and
the server switches that shape its response; a 400 (ApiError) naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.serve.openai.errors import bad
from mtp_ray.serve.openai.fields import unicode_text


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (config/server.py), checked before any engine work, and the server's
    switches for its usage section."""

    max_n: int = 64
    max_stop: int = 64
    max_prompts: int = 256
    max_prompt_chars: int | None = None  # a longer prompt string certainly exceeds max_model_len (not tokenised)
    max_model_len: int | None = None  # truncate_prompt_tokens -1 truncates to it (vLLM)
    # sampling defaults for fields a request leaves out (SamplingParams names; server.generation_config)
    defaults: dict[str, Any] = field(default_factory=dict)
    force_usage: bool = False  # server.enable_force_include_usage: usage in every chunk of every stream
    prompt_details: bool = False  # server.enable_prompt_tokens_details: usage.prompt_tokens_details.cached_tokens
    tokens_as_ids: bool = False  # server.return_tokens_as_token_ids: log-prob tokens as "token_id:<id>"

    def for_translated(self) -> Limits:
        """A request of another API (the Responses API, Anthropic's Messages; serve/http/answer.py): its usage always
        names the cached tokens (as vLLM's), and its stream's usage is what that API's front asks."""
        return replace(self, force_usage=False, prompt_details=True)


def for_body(limits: Limits, body: dict) -> Limits:
    """The limits a request's texts are held to: one that asks for truncate_prompt_tokens is tokenised whole first
    (vLLM truncates any length), so the character bound before tokenising does not apply to it."""
    if body.get("truncate_prompt_tokens") is None or limits.max_prompt_chars is None:
        return limits
    return replace(limits, max_prompt_chars=None)


NO_LIMITS = Limits()


def cap_max_tokens(params: SamplingParams, limits: Limits) -> None:
    """generation_config's max_new_tokens: the default max_tokens and a cap on any request's (vLLM), applied once
    the request's own max_tokens passed the context-length check."""
    cap = limits.defaults.get("max_tokens")
    if cap is None or (params.max_tokens is not None and params.max_tokens <= cap):
        return
    if params.min_tokens > cap:
        raise bad(f"'min_tokens' {params.min_tokens} is more than the server's max_tokens {cap} "
                  "(generation_config.json's max_new_tokens)", "min_tokens")
    params.max_tokens = cap


def prompt_text(s: str, field: str, limits: Limits) -> str:
    if limits.max_prompt_chars is not None and len(s) > limits.max_prompt_chars:
        raise bad(f"'{field}' is too long: {len(s)} characters are more tokens than the model's context length holds",
                  field)
    return unicode_text(s, field)


def check_length(ids: list[int], params: SamplingParams, max_model_len: int) -> None:
    """vLLM's context-length rule: prompt + max_tokens must fit (max_tokens None: whatever is left). The message
    is vLLM's, then SGLang's sentence for the case (clients and tests of either match on their own wording)."""
    want = len(ids) + (params.max_tokens or 1)
    if len(ids) >= max_model_len or want > max_model_len:
        too_long = len(ids) >= max_model_len
        sglang = (f"The input ({len(ids)} tokens) is longer than the model's context length ({max_model_len} "
                  f"tokens)." if too_long else f"Requested token count exceeds the model's maximum context length "
                  f"of {max_model_len} tokens.")
        if (params.max_tokens or 0) > max_model_len:  # SGLang's newer words (clients parse the number out)
            sglang += (f" max_completion_tokens is too large: {params.max_tokens}. This model supports at most "
                       f"{max_model_len} completion tokens.")
        raise bad(f"This model's maximum context length is {max_model_len} tokens. However, you requested {want} "
                  f"tokens ({len(ids)} in the prompt, {params.max_tokens or 1} in the completion). Please reduce "
                  f"the length of the prompt or the completion. {sglang}", "prompt" if too_long else "max_tokens")
