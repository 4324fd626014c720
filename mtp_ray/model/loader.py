"""Load HF-format checkpoints (config.json + safetensors) into Qwen3_5MoeForCausalLM.

Handles: one or many safetensors files (or pytorch_model*.bin shards: model/files.py); experts fused
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) or one module per expert, chosen per tensor
(trunk and MTP may differ); multimodal checkpoints (text under `model.language_model.`, vision skipped);
qwen3_next's grouped GDN projections; `mtp.*` into the MTP head; an expert range, reading only the owned experts'
slices from disk; FP8 block-quantized weights, kept in FP8 by the projections and experts that can, dequantized
on load elsewhere (model/fp8.py); bf16 / fp32 tensors (updates) into FP8-resident weights are quantized. Every
missing or mis-shaped tensor is an error that names it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch

from mtp_ray.config.model import ModelConfig
from mtp_ray.layers.fp8 import quantize, row_scales
from mtp_ray.layers.moe import ExpertDispatcher, local_dispatch
from mtp_ray.model.dummy import init_dummy_weights
from mtp_ray.model.files import open_tensors
from mtp_ray.model.fp8 import (
    FP8_DTYPES,
    SCALE_SUFFIX,
    Fp8Reader,
    checkpoint_dtypes,
    checkpoint_fp8,
    config_fp8,
    fp8_format,
    fp8_weights,
    make_fp8,
)
from mtp_ray.model.qwen3_5 import Qwen3_5MoeForCausalLM

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
log = logging.getLogger(__name__)
_SHARED = re.compile(r"\.mlp\.shared_expert(_gate)?\.")
_TIED = {"lm_head.weight", "model.embed_tokens.weight"}
_NOT_FLOAT = {"I64", "I32", "I16", "I8", "U8", "BOOL"}  # safetensors dtype names no weight may have
_SKIP = re.compile(r"(^|\.)(visual|vision_tower|rotary_emb)\.|\.inv_freq$")

# A lazily read tensor: called with an optional row slice of dim 0, returns the (sliced) tensor.
Reader = Callable[[slice | None], torch.Tensor]


def canonical_name(name: str) -> str:
    """Checkpoint name -> our parameter name (multimodal prefixes folded into the text model's)."""
    for prefix, repl in (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.", "")):
        if name.startswith(prefix):
            return repl + name[len(prefix):]
    return name


class WeightLoader:
    """Copies named checkpoint tensors into a model and tracks what was filled (also used by update_weights)."""

    def __init__(self, model: Qwen3_5MoeForCausalLM):
        self.model = model
        self.cfg = model.config
        self.start, self.end = model.expert_range
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.fp8 = fp8_weights(model)  # FP8-resident weight -> (its scale parameter, block)
        # expert params are filled piecewise: (param name, local expert, part) -> done
        self.filled: set[tuple[str, int, str]] = set()

    def wants(self, name: str) -> bool:
        name = canonical_name(name)
        if _SKIP.search(name) or (self.cfg.shared_expert_intermediate_size == 0 and _SHARED.search(name)):
            return False  # (transformers builds a zero-width shared expert + its gate: they add nothing)
        return not (name.startswith("mtp.") and self.model.mtp is None)

    def load(self, name: str, shape: list[int], read: Reader) -> None:
        self.check(name, shape)  # names and shapes are validated in one place; the branches below only copy
        name = canonical_name(name)
        if not self.wants(name):
            return
        if m := _PER_EXPERT.match(name):
            return self._load_expert(m.group(1), int(m.group(2)), m.group(3), read)
        if m := _FUSED.match(name):
            return self._load_fused(m.group(1), m.group(2), read)
        if self.cfg.gdn_grouped_projections and name.endswith(("linear_attn.in_proj_qkvz.weight",
                                                               "linear_attn.in_proj_ba.weight")):
            return self._load_grouped_gdn(name, read)
        self._copy(name, read)

    def owns(self, name: str) -> bool:
        """False for one expert's tensor that another EP rank owns (an update need not even fetch it here)."""
        m = _PER_EXPERT.match(canonical_name(name))
        return m is None or self.start <= int(m.group(2)) < self.end

    def check(self, name: str, shape: list[int] | None, dtype: torch.dtype | None = None) -> None:
        """Validate one named tensor without touching the model (so a bad update leaves the old weights); shape
        None: the name only (a tensor this rank does not fetch). A name that matches nothing is an error, never
        skipped: an unused tensor means an unsupported feature (biases, quantisation scales, ...) and serving
        without it would change the output."""
        raw = name
        name = canonical_name(name)
        if shape is not None and "shared_expert." in name and self.cfg.shared_expert_intermediate_size == 0 \
                and 0 not in shape:  # a real shared expert the config leaves out: serving without it is wrong
            raise ValueError(f"weight {raw!r} has shape {list(shape)} but shared_expert_intermediate_size is 0")
        if not self.wants(name):
            return
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"weight {raw!r} has dtype {dtype}; expected a floating-point tensor")
        if dtype in FP8_DTYPES:  # an update without its scales cannot be dequantized
            raise ValueError(f"weight {raw!r} has dtype {dtype}; send bf16 / fp32 weights")
        if name.endswith(SCALE_SUFFIX):
            raise ValueError(f"weight {raw!r} is an FP8 scale; send bf16 / fp32 weights (FP8-resident weights are "
                             "quantized on load)")
        c = self.cfg
        shape = list(shape) if shape is not None else None
        h, inter = c.hidden_size, c.moe_intermediate_size
        if m := _PER_EXPERT.match(name):
            e = int(m.group(2))
            want = [h, inter] if m.group(3) == "down_proj" else [inter, h]
            if f"{m.group(1)}.gate_up_proj" not in self.params or e >= c.num_experts:
                raise ValueError(f"unknown weight name {raw!r}: no such expert in the model")
        elif m := _FUSED.match(name):
            if f"{m.group(1)}.{m.group(2)}" not in self.params:
                raise ValueError(f"unknown weight name {raw!r}: no MoE layer there")
            want = [c.num_experts, h, inter] if m.group(2) == "down_proj" else [c.num_experts, 2 * inter, h]
        elif c.gdn_grouped_projections and name.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight")):
            rep = c.linear_num_value_heads // c.linear_num_key_heads
            per = 2 * c.linear_key_head_dim + 2 * rep * c.linear_value_head_dim if "qkvz" in name else 2 * rep
            want = [c.linear_num_key_heads * per, h]
        elif name in self.params:
            want = list(self.params[name].shape)
        else:
            raise ValueError(f"unknown weight name {raw!r}: no such parameter in the model")
        if shape is not None and shape != want:
            raise ValueError(f"weight {raw!r} has shape {shape}, expected {want}")

    def _put(self, pname: str, read: Reader, rows: slice | None = None, at: tuple = (), scale_at: tuple = ()
             ) -> None:
        """Copy read(rows) into param[at]; an FP8-resident param takes e4m3 + scales (scale_at into its scales):
        an FP8 checkpoint tensor as stored (scales re-laid one per row where the param needs that), anything
        else quantized with the param's block."""
        dst = self.params[pname][at]
        with torch.no_grad():
            if pname not in self.fp8:
                src = read(rows)
                assert src.shape == dst.shape, (pname, src.shape, dst.shape)  # check() has validated the shape
                dst.copy_(src.to(dst.dtype))
                return
            sname, block = self.fp8[pname]
            src_block = read.block if isinstance(read, Fp8Reader) else None
            if src_block is not None and src_block.cols == block.cols and block.rows in (src_block.rows, 1):
                q, scale = read.raw(rows)
                if block.rows != src_block.rows:
                    scale = row_scales(scale, q.shape[-2], src_block.rows)
            else:
                q, scale = quantize(read(rows), block)
            assert q.shape == dst.shape, (pname, q.shape, dst.shape)
            dst.copy_(q)
            self.params[sname][scale_at].copy_(scale)

    def _copy(self, name: str, read: Reader) -> None:
        self._put(name, read)
        self.filled.add((name, -1, "all"))

    def _load_expert(self, prefix: str, e: int, proj: str, read: Reader) -> None:
        if not self.start <= e < self.end:
            return  # another EP rank owns it
        i, inter = e - self.start, self.cfg.moe_intermediate_size
        pname = f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        if proj == "down_proj":
            self._put(pname, read, at=(i,), scale_at=(i,))
        else:
            half = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
            srows = inter // self.fp8[pname][1].rows if pname in self.fp8 else 0  # gate's scale rows (aligned)
            shalf = slice(0, srows) if proj == "gate_proj" else slice(srows, 2 * srows)
            self._put(pname, read, at=(i, half), scale_at=(i, shalf))
        self.filled.add((pname, i, proj))

    def _load_fused(self, prefix: str, which: str, read: Reader) -> None:
        self._put(f"{prefix}.{which}", read, slice(self.start, self.end))  # only the owned experts leave disk
        parts = ("down_proj",) if which == "down_proj" else ("gate_proj", "up_proj")
        self.filled.update((f"{prefix}.{which}", i, p) for i in range(self.end - self.start) for p in parts)

    def _load_grouped_gdn(self, name: str, read: Reader) -> None:
        """qwen3_next packs [q, k, v, z] (and [b, a]) per key head; regroup into the split projections."""
        c = self.cfg
        hk, dk, dv, rep = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim, \
            c.linear_num_value_heads // c.linear_num_key_heads
        base = name.rsplit(".", 2)[0]
        w = read(None)
        h = w.shape[-1]
        if name.endswith("in_proj_qkvz.weight"):
            q, k, v, z = w.view(hk, -1, h).split([dk, dk, rep * dv, rep * dv], dim=1)
            qkv = torch.cat([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)])
            for sub, t in (("in_proj_qkv", qkv), ("in_proj_z", z.reshape(-1, h))):
                self._copy(f"{base}.{sub}.weight", lambda rows, t=t: t)
        else:
            b, a = w.view(hk, 2 * rep, h).split([rep, rep], dim=1)
            for sub, t in (("in_proj_b", b.reshape(-1, h)), ("in_proj_a", a.reshape(-1, h))):
                self._copy(f"{base}.{sub}.weight", lambda rows, t=t: t)

    def missing(self) -> list[str]:
        """Checkpoint-style names of every tensor the model needs and did not get."""
        done_plain = {n for n, i, _ in self.filled if i == -1}
        out = []
        for name, p in self.params.items():
            if name.endswith(SCALE_SUFFIX):
                continue  # filled with its weight
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                prefix, which = name.rsplit(".", 1)
                parts = ("down_proj",) if which == "down_proj" else ("gate_proj", "up_proj")
                for i in range(p.shape[0]):
                    out += [f"{prefix}.{i + self.start}.{pt}.weight" for pt in parts
                            if (name, i, pt) not in self.filled]
            elif name not in done_plain:
                if self.cfg.tie_word_embeddings and name in _TIED and done_plain & _TIED:
                    continue  # one tensor fills both (transformers ties from whichever the checkpoint has)
                out.append(name)
        return out


def checkpoint_tensors(path: str | Path) -> Iterator[tuple[str, list[int], Reader]]:
    """(name, shape, reader) for every tensor in the directory's files (model/files.py), read lazily. An FP8 weight
    (model/fp8.py) is read together with its scale (an Fp8Reader: dequantized, or raw for an FP8-resident
    weight); its scale is not listed."""
    fp8 = fp8_format(path) if (Path(path) / "config.json").is_file() else None
    with ExitStack() as stack:  # every shard open: a weight and its scale may live in different files
        index = open_tensors(path, stack)

        def is_fp8(name: str) -> bool:
            return name in index and index[name].get_slice(name).get_dtype().startswith("F8")

        for name, h in index.items():
            sl = h.get_slice(name)
            if fp8 is not None and name.endswith(SCALE_SUFFIX) and is_fp8(name[: -len(SCALE_SUFFIX)]):
                continue  # read with its weight
            if sl.get_dtype().startswith("F8"):
                read = Fp8Reader(name, sl, index, fp8, path)
            else:
                def read(rows: slice | None, sl=sl) -> torch.Tensor:
                    return sl[...] if rows is None else sl[rows]  # (...: a 0-dim tensor too)

            yield name, list(sl.get_shape()), read


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    expert_range: tuple[int, int] | None = None,
    with_mtp: bool = True,
    dispatch: ExpertDispatcher = local_dispatch,
    dummy_seed: int | None = None,
) -> Qwen3_5MoeForCausalLM:
    """dummy_seed: random weights (init_dummy_weights) instead of the checkpoint; only config.json is read."""
    cfg = ModelConfig.from_pretrained(path)
    dtypes = checkpoint_dtypes(path) if dummy_seed is None else {}  # every tensor's name and dtype, listed once
    names = {canonical_name(n) for n in dtypes}
    # tied by the config but both stored: loaded apart and tied only if equal (transformers unties them otherwise)
    both = cfg.tie_word_embeddings and _TIED <= names
    if both:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(cfg, expert_range, with_mtp, dispatch)
    model = model.to(dtype)  # cast on meta: never a full-precision copy on the device
    fmt = fp8_format(path)
    if fmt is not None:  # FP8-resident weights where the checkpoint (or, for random weights, its config) has them
        make_fp8(model, fmt, config_fp8(fmt) if dummy_seed is not None else checkpoint_fp8(dtypes, canonical_name))
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty unties; tie again before filling
        model.lm_head.weight = model.model.embed_tokens.weight
    if dummy_seed is not None:
        init_dummy_weights(model, dummy_seed)
        return model.eval()
    if with_mtp and cfg.mtp_num_hidden_layers > 0:
        if not any(n.startswith("mtp.") for n in names):
            raise ValueError(f"{path}: with_mtp=True but the checkpoint has no mtp.* tensors")
    loader = WeightLoader(model)
    for name, shape, read in checkpoint_tensors(path):
        if dtypes[name] in _NOT_FLOAT and loader.wants(name):
            raise ValueError(f"checkpoint {path}: tensor {name!r} is {dtypes[name]}; weights are floating-point")
        loader.load(name, shape, read)
    missing = loader.missing()
    if missing:
        more = f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""
        raise ValueError(f"checkpoint {path} is missing tensor(s): {', '.join(missing[:10])}{more}")
    if both and torch.equal(model.lm_head.weight, model.model.embed_tokens.weight):
        model.lm_head.weight = model.model.embed_tokens.weight  # (a .bin of a tied model stores both names)
        model.config = dataclasses.replace(cfg, tie_word_embeddings=True)
    elif both:
        log.warning("%s: config.json ties the embeddings but the checkpoint stores a different lm_head.weight; "
                    "serving them untied, as transformers does", path)
    return model.eval()
