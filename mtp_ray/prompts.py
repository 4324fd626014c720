"""The offline API's prompts (mtp_ray/llm.py): vLLM's prompt forms and chat conversations -> (text, token ids), and
the per-request work only the tokenising side can do (bad_words) before the engine sees it;
and the tokenizer itself (the server's ingress and the RL handle load it here too). Every problem is a ValueError
naming what was wrong."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mtp_ray.engine.chat_content import content_text
from mtp_ray.engine.sampling_params import SamplingParams

BAD_WORDS_NEED_TOKENIZER = "bad_words: this model has no tokenizer files; pass bad_words_token_ids"


def shown(x: Any) -> str:
    """What a refused prompt was, in a few words (the types inside a list: a bool or a float among the ids)."""
    if isinstance(x, list):
        return f"a list of {sorted({type(t).__name__ for t in x}) or 'nothing'}"
    return type(x).__name__


def is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def encode_prompt(prompt: Any, tokenizer: Any) -> tuple[str | None, list[int]]:
    """One prompt (a string, a token-id list, vLLM's {"prompt": ...} TextPrompt or {"prompt_token_ids": ...}
    TokensPrompt) -> (its text, if any, for RequestOutput.prompt; its token ids)."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:  # vLLM's TokensPrompt: the ids count, a
        ids, text = prompt["prompt_token_ids"], prompt.get("prompt")  # "prompt" beside them is only echoed
        if not is_ids(ids):
            raise ValueError(f"prompt_token_ids must be a list of int token ids, got {shown(ids)}")
        return (text if isinstance(text, str) else None), list(ids)
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):  # vLLM's TextPrompt
        prompt = prompt["prompt"]
    if isinstance(prompt, str):  # emptiness (here and for id lists) is check_request's, in generate()
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer files; pass token ids (or tokenizer=...)")
        return prompt, tokenizer.encode(prompt, add_special_tokens=False)
    if is_ids(prompt):
        return None, list(prompt)
    raise ValueError("prompt must be a string, a list of int token ids, or {\"prompt\": ...} / "
                     f"{{\"prompt_token_ids\": ...}}, got {shown(prompt)}")


def salted(prompt: Any, sp: SamplingParams) -> SamplingParams:
    """vLLM's prompt-dict cache_salt ({"prompt" or "prompt_token_ids", "cache_salt"}) as the request's
    SamplingParams.cache_salt (cached prefixes shared only under the same salt); sp itself without one."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is None:
        return sp
    if sp.cache_salt is not None and sp.cache_salt != salt:
        raise ValueError("cache_salt: the prompt's and its SamplingParams' differ")
    out = replace(sp, cache_salt=salt)
    out.validate()  # (a salt must be a non-empty string)
    return out


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def tokenizer_or_none(path: str):
    """The tokenizer at `path`, or None when a model directory holds no tokenizer files (transformers would make an
    empty tokenizer of the model type, which encodes text to nothing and decodes to \"\"): such a model serves token
    ids only."""
    from pathlib import Path

    p = Path(path)
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if p.is_dir() and not any((p / f).exists() for f in files):
        return None
    return load_tokenizer(path)


def tokenize_bad_words(sp: SamplingParams, tokenizer: Any) -> None:
    """What vLLM does where it tokenises a request: bad_words turned into token sequences (sp.update_from_tokenizer;
    once per SamplingParams, however many prompts share it)."""
    if sp.bad_words:
        if tokenizer is None:
            raise ValueError(BAD_WORDS_NEED_TOKENIZER)
        sp.update_from_tokenizer(tokenizer)


def chat_message(m: Any, i: int) -> dict:
    """A chat message for the template: text content parts joined (as the server does), the rest as given."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"messages[{i}] must be a dict with a string 'role', got {shown(m)}")
    c = m.get("content")
    try:
        text = content_text(c, f"messages[{i}].content")
    except ValueError as e:
        raise ValueError(f"{e}, got {shown(c)}") from None
    return m if text is c else {**m, "content": text}


def render_chats(tokenizer: Any, messages: list[dict] | list[list[dict]], **template: Any) -> list[str]:
    """One conversation (a list of {"role", "content"} messages) or a list of them -> each rendered by the chat
    template; `template`: apply_chat_template's arguments (tools, chat_template, add_generation_prompt, ...)."""
    if tokenizer is None:
        raise ValueError("messages: this model has no tokenizer files, so no chat template; use generate()")
    if template.get("continue_final_message") and template.get("add_generation_prompt"):
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    convs = [messages] if messages and isinstance(messages[0], dict) else messages
    if not isinstance(convs, list) or not convs or not all(isinstance(c, list) and c for c in convs):
        raise ValueError("messages must be a non-empty list of {\"role\", \"content\"} messages, or a list of "
                         "such conversations")
    texts = []
    for conv in convs:
        msgs = [chat_message(m, i) for i, m in enumerate(conv)]
        try:
            texts.append(tokenizer.apply_chat_template(msgs, tokenize=False, **template))
        except Exception as e:  # a template that rejects the roles / order, or kwargs it cannot take
            raise ValueError(f"messages: the chat template failed: {type(e).__name__}: {e}") from e
    return texts
