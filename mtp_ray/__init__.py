"""mtp-ray: Qwen3.5-MoE serving with MTP speculative decoding under DP attention + EP MoE, on Ray."""

from mtp_ray.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.llm import LLM
from mtp_ray.request_output import CompletionOutput, Logprob, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "BeamSearchParams",
           "BeamSearchOutput", "BeamSearchSequence"]
__version__ = "0.1.0"
