"""Model architecture config: a frozen view of an HF config.json for the Qwen3.5-MoE / Qwen3-Next family."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TEXT_TYPES = ("qwen3_5_moe_text", "qwen3_next")
MULTIMODAL_TYPES = ("qwen3_5_moe",)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention" per layer
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MoE
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()  # qwen3_next mlp_only_layers / decoder_sparse_step: plain MLP there
    intermediate_size: int = 0  # width of those dense MLPs
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    mtp_num_hidden_layers: int = 1
    eos_token_ids: tuple[int, ...] = ()
    # qwen3_next stores GDN projections grouped per key head (in_proj_qkvz / in_proj_ba)
    gdn_grouped_projections: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """An HF config.json's fields -> ModelConfig; a missing or null required field is a ValueError naming it."""
        try:
            return cls._from_hf(raw)
        except KeyError as e:
            raise ValueError(f"invalid model config: the required field {e.args[0]!r} is missing") from e
        except TypeError as e:  # e.g. int(None): a required field given as null / of the wrong type
            raise ValueError(f"invalid model config: a field has the wrong type or is null ({e})") from e

    @classmethod
    def _from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        mt = raw.get("model_type", "")
        if mt in MULTIMODAL_TYPES or "text_config" in raw:
            text = dict(raw.get("text_config") or {})
            # the wrapper model ties by its own flag (default False), whatever text_config says (save_pretrained
            # writes text_config's too, False): as transformers' ForConditionalGeneration
            text["tie_word_embeddings"] = raw.get("tie_word_embeddings", False)
            text.setdefault("model_type", "qwen3_5_moe_text")
            raw = text
            mt = raw["model_type"]
        if mt not in TEXT_TYPES:
            raise ValueError(f"model_type {mt!r} is not supported (expected one of {TEXT_TYPES + MULTIMODAL_TYPES})")
        n = int(raw["num_hidden_layers"])
        layer_types = raw.get("layer_types")
        if layer_types is None:
            interval = int(raw.get("full_attention_interval", 4))
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
        if len(layer_types) != n or set(layer_types) - {"full_attention", "linear_attention"}:
            raise ValueError(f"layer_types must name {n} layers of full_attention / linear_attention: {layer_types}")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ValueError(f"rope_parameters.rope_type {rope.get('rope_type')!r} is not supported")
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
        heads = int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or raw["hidden_size"] // heads)
        dense: tuple[int, ...] = ()  # dense-MLP layers: Qwen3-Next only (every Qwen3.5-MoE layer is sparse)
        if mt == "qwen3_next":
            sparse_step = int(raw.get("decoder_sparse_step", 1) or 1)
            mlp_only = set(raw.get("mlp_only_layers") or [])
            dense = tuple(i for i in range(n) if i in mlp_only or (i + 1) % sparse_step != 0)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        cfg = cls(
            model_type=mt,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_hidden_layers=n,
            layer_types=tuple(layer_types),
            num_attention_heads=heads,
            num_key_value_heads=int(raw["num_key_value_heads"]),
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            rope_theta=theta,
            linear_num_key_heads=int(raw["linear_num_key_heads"]),
            linear_num_value_heads=int(raw["linear_num_value_heads"]),
            linear_key_head_dim=int(raw["linear_key_head_dim"]),
            linear_value_head_dim=int(raw["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(raw.get("linear_conv_kernel_dim", 4)),
            num_experts=int(raw["num_experts"]),
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size", 0)),
            # Qwen3-Next reads the flag; Qwen3.5-MoE always renormalises the top-k (as transformers does)
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)) if mt == "qwen3_next" else True,
            dense_layers=dense,
            intermediate_size=int(raw.get("intermediate_size", 0) or 0),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(raw.get("attention_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            mtp_num_hidden_layers=int(raw.get("mtp_num_hidden_layers", raw.get("num_nextn_predict_layers", 1)) or 0),
            eos_token_ids=eos_ids,
            gdn_grouped_projections=mt == "qwen3_next",
            extra={"dtype": raw.get("dtype", raw.get("torch_dtype")), "hidden_act": raw.get("hidden_act", "silu")},
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        cfg = cls.from_hf_dict(_json_object(p))
        gen = Path(path) / "generation_config.json"
        if gen.is_file():  # generation_config may add end tokens (e.g. the chat end token)
            eos = _json_object(gen).get("eos_token_id")
            ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            merged = tuple(dict.fromkeys(cfg.eos_token_ids + ids))
            cfg = dataclasses.replace(cfg, eos_token_ids=merged)
        return cfg

    def validate(self) -> None:
        def need(cond: bool, what: str) -> None:
            if not cond:
                raise ValueError(f"invalid model config: {what}")

        need(self.num_key_value_heads > 0 and self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
             f"({self.num_key_value_heads})")
        need(self.linear_num_key_heads > 0 and self.linear_num_value_heads % self.linear_num_key_heads == 0,
             f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of linear_num_key_heads "
             f"({self.linear_num_key_heads})")
        need(0 < self.num_experts_per_tok <= self.num_experts,
             f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})")
        need(self.rotary_dim % 2 == 0 and self.rotary_dim <= self.head_dim,
             f"the rotary dimension (head_dim {self.head_dim} x partial_rotary_factor = {self.rotary_dim}) must be "
             "even and <= head_dim")
        need(not self.dense_layers or self.intermediate_size > 0, "intermediate_size for dense layers")
        act = self.extra.get("hidden_act", "silu")
        need(act in ("silu", "swish"), f"hidden_act {act!r} is not supported (silu)")


def _json_object(p: Path) -> dict[str, Any]:
    try:
        raw = json.loads(p.read_text())
    except ValueError as e:  # (JSONDecodeError, UnicodeDecodeError): the message alone does not say which file
        raise ValueError(f"{p}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{p}: expected a JSON object, got {type(raw).__name__}")
    return raw


def tokenizer_eos_id(path: str | Path) -> int | None:
    """The id of the tokenizer's own end token (tokenizer_config.json's eos_token, named in its added tokens), or
    None where the files do not say. vLLM reports no stop_reason for this token and the token id for the other end
    tokens generation_config.json adds (e.g. <|endoftext|> after a chat's <|im_end|>). Read from the files, not by
    loading the tokenizer: the engine needs only this id."""
    p = Path(path)
    try:
        cfg = _json_object(p / "tokenizer_config.json")
    except (OSError, ValueError):
        return None
    eos = cfg.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return None
    added = cfg.get("added_tokens_decoder")
    if isinstance(added, dict):
        for i, tok in added.items():
            if isinstance(tok, dict) and tok.get("content") == eos and str(i).isdigit():
                return int(i)
    try:
        tokens = _json_object(p / "tokenizer.json").get("added_tokens")
    except (OSError, ValueError):
        return None
    for tok in tokens if isinstance(tokens, list) else []:
        if isinstance(tok, dict) and tok.get("content") == eos and isinstance(tok.get("id"), int):
            return tok["id"]
    return None


# generation_config.json key -> SamplingParams field: the sampling defaults vLLM takes from it (--generation-config
# auto, its default); max_new_tokens is also a cap on every request's max_tokens there
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(generation_config: str, model: str | Path) -> dict[str, float | int]:
    """vLLM's --generation-config: "auto", the model's generation_config.json; "vllm", none; else a directory
    holding a generation_config.json."""
    if generation_config == "vllm":
        return {}
    return generation_defaults(model if generation_config == "auto" else generation_config)


def generation_defaults(path: str | Path) -> dict[str, float | int]:
    """The sampling defaults a checkpoint's generation_config.json sets (e.g. Qwen's temperature 0.6, top_p 0.95,
    top_k 20), as SamplingParams fields: what a request that leaves them out samples with, as in vLLM and SGLang.
    {} without the file; a value that is not a number is an error naming the file and key."""
    p = Path(path) / "generation_config.json"
    if not p.is_file():
        return {}
    raw, out = _json_object(p), {}
    for key, name in GENERATION_DEFAULTS.items():
        v = raw.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{p}: {key} must be a number, got {v!r}")
        out[name] = v
    return out
