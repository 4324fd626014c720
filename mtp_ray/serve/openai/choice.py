"""One choice of a response: its accumulated tokens, log-probs, text (detokenizer, stop strings) and chat read-back,
what the bodies (serve/openai/bodies.py) and log-prob sections are built from."""

from __future__ import annotations

from dataclasses import dataclass, field

from mtp_ray.engine.detok import Detokenizer
from mtp_ray.engine.outputs import StepOutput
from mtp_ray.serve.openai.chat_output import ChatOutput
from mtp_ray.serve.openai.request import ParsedRequest
from mtp_ray.serve.parsers.reasoning import reasoning_token_count


@dataclass
class Choice:
    index: int
    prompt: list[int]
    detok: Detokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list] = field(default_factory=list)  # per token: [[token id, logprob], ...]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    spec: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)  # the engine's queue / prefill / decode / inference seconds
    sent_lp: int = 0  # logprob entries already streamed
    lp_offset: int = 0  # text_offset of the next streamed logprob entry: the streamed tokens' strings so far
    sent_ids: int = 0  # token ids already streamed (return_token_ids)
    sent_finish: bool = False
    echo: str = ""  # the prompt's text, sent before the completion's (completions with echo)
    prompt_logprobs: list | None = None  # from the engine: None | [logprob, {token: logprob}, rank] per position
    chat: ChatOutput | None = None  # reads the text back as an assistant message (chat completions)
    calls_sent: int = 0  # streamed tool calls
    cached_tokens: int | None = None  # prompt tokens the engine took from its prefix cache (None: caching off)
    ended_on_token: bool = False  # its last token is the end or stop token that ended it

    def add(self, out: StepOutput) -> None:
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.num_cached_tokens is not None:
            self.cached_tokens = out.num_cached_tokens
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.top += [list(t.items()) for t in out.new_top_logprobs]
        self.detok.add(out.new_token_ids, out.stop_token)
        self.detok.cut(self.token_ids, self.logprobs, self.top)
        if out.finished and self.finish_reason is None:
            stopped = self.detok.stopped_by
            self.finish_reason = "stop" if stopped is not None else out.finish_reason
            self.stop_reason = stopped if stopped is not None else out.stop_reason
            self.ended_on_token = out.stop_token
            self.spec = out.spec or {}
            self.timings = out.timings or {}

    @property
    def cut(self) -> str | None:
        """How its text was cut short of the model's own end: "length" (max_tokens), "stop" (a stop string or
        stop_regex), None."""
        if self.finish_reason == "length":
            return "length"
        return "stop" if self.detok.stopped_by is not None else None

    def reasoning_tokens(self) -> int:
        """This chat choice's reasoning tokens so far (0 where its reasoning is not split off)."""
        assert self.chat is not None
        if self.chat.reasoning is None or self.detok.tokenizer is None:
            return 0
        return reasoning_token_count(self.token_ids, self.chat.opts.opens_reasoning, self.chat.think_ids,
                                     lambda n: self.detok.decode(self.token_ids[:n]), self.chat.tool_open)

    @property
    def matched_stop(self) -> int | str | None:
        """SGLang's matched_stop: the stop string or stop_regex pattern that ended the text, else the token that
        ended it (a stop token id, or the end-of-sequence token); None when it did not stop (length, abort)."""
        if self.finish_reason != "stop":
            return None
        if self.detok.stopped_on is not None:
            return self.detok.stopped_on
        if isinstance(self.stop_reason, int):
            return self.stop_reason
        if self.ended_on_token or self.detok.tokenizer is None:
            return self.token_ids[-1] if self.token_ids else None
        return self.detok.tokenizer.eos_token_id  # a finished constraint ended it, as the end token would have

    @property
    def pending_logprobs(self) -> bool:
        return len(self.logprobs) > self.sent_lp


def new_choices(req: ParsedRequest, tok, serving) -> list[Choice]:
    """One Choice per (prompt, n): its detokenizer (stop strings and regexes), echoed text and chat read-back."""
    sp = req.params

    def echo(i: int) -> str:
        if not req.echo:
            return ""
        if req.chat is not None:  # chat echo: the final assistant message's content, which the reply continues
            return req.chat.echo
        text = req.prompt_texts[i]
        if text is not None:
            return text
        return tok.decode(req.prompts[i]) if tok is not None else ""  # no tokenizer: ids only

    return [Choice(i * sp.n + j, p, Detokenizer(tok, sp.stop, sp.skip_special_tokens, sp.include_stop_str_in_output,
                                                stop_regex=req.stop_regex, min_tokens=sp.min_tokens), echo=echo(i),
                   chat=ChatOutput(req.chat, serving.reasoning_parser, serving.tool_call_parser, serving.think_ids)
                   if req.chat is not None else None)
            for i, p in enumerate(req.prompts) for j in range(sp.n)]
