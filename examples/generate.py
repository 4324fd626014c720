"""Greedy generation with MTP speculative decoding on the bundled tiny model (CPU is fine).

    python examples/generate.py
"""

from mtp_ray import LLM, SamplingParams

llm = LLM(num_speculative_tokens=3)  # the bundled tiny Qwen3.5-MoE + MTP model
prompts = ["import os\n\n\ndef ", "class Stack:\n    def __init__(self):\n        "]
for out in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48)):
    o = out.outputs[0]
    print(f"--- {out.prompt!r}\n{out.prompt}{o.text}")
    print(f"[{len(o.token_ids)} tokens, finish={o.finish_reason}, mean acceptance length "
          f"{o.spec['mean_acceptance_length']:.2f}]")
