"""A request's beam search (vLLM's `use_beam_search`; n: the beam width), read from its body and sampling parameters.
Fields that change which tokens may follow (stop, penalties, bias, grammars, ...) cannot be honoured by a search that
ranks the model's own log-probs: a 400 names them. The search runs in serve/http/beams.py."""

from __future__ import annotations

from typing import Any

from mtp_ray.beam_search import BeamSearchParams
from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.serve.openai.errors import bad

# SamplingParams fields beam search cannot honour -> their neutral values (a request may send those)
NOT_WITH_BEAMS: dict[str, tuple[Any, ...]] = {
    "stop": (None, []), "stop_token_ids": (None, []), "logit_bias": (None, {}), "allowed_token_ids": (None,),
    "bad_words": (None, []), "bad_words_token_ids": (None, []), "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0), "min_tokens": (0,), "structured_outputs": (None,),
    "prompt_logprobs": (None,), "logprob_token_ids": (None, []),
}


def beam_request(body: dict, params: SamplingParams, defaults: dict[str, Any]) -> BeamSearchParams:
    """The request's beam search (n beams); a 400 naming a field it cannot honour. A value from the server's
    sampling defaults (server.generation_config) is not the request's: it does not apply to the search."""
    for name, neutral in NOT_WITH_BEAMS.items():
        value = getattr(params, name)
        if value not in neutral and not (name in defaults and defaults[name] == value):
            raise bad(f"'{name}' cannot be combined with use_beam_search (beam search ranks the model's own "
                      "log-probabilities)", name)
    if body.get("stop_regex"):
        raise bad("'stop_regex' cannot be combined with use_beam_search", "stop_regex")
    if params.logprobs == -1:
        raise bad("'logprobs' -1 (the whole vocabulary) cannot be combined with use_beam_search", "logprobs")
    length_penalty = body.get("length_penalty", 1.0)
    try:  # (max_tokens: set per prompt by beam_streams, once the ingress capped it and knows the context)
        return BeamSearchParams(params.n, params.max_tokens or 1, params.ignore_eos, params.temperature,
                                1.0 if length_penalty is None else length_penalty, params.include_stop_str_in_output)
    except ValueError as e:
        name = getattr(e, "param", None)
        raise bad(str(e).replace("beam_width", "n"), "n" if name == "beam_width" else name) from None
