"""Train the bundled tiny Qwen3.5-MoE + MTP model from scratch on Python standard-library source.

    python -m scripts.train_tiny --device cuda --stdlib /path/to/lib/python3.11   # as bundled (README)

The trunk is transformers' own `Qwen3_5MoeForCausalLM` (pure-PyTorch path); the MTP head is built from
transformers' modules (one full-attention decoder layer, three zero-centred norms, fc), so the saved
checkpoint is exactly what a real Qwen3.5 checkpoint looks like: HF config.json, per-expert trunk tensors
(as `save_pretrained` writes them), fused `mtp.layers.0.mlp.experts.*` tensors, and a BPE tokenizer.

The MTP head at position i sees (embed(token[i+1]), h[i]) and is trained to reproduce the trunk's own
prediction at i+1 (soft-label distillation), i.e. the token after next. Everything is seeded; data is the
running interpreter's stdlib, split into train / held-out by a hash of the file path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

from scripts.hf_reference import HFMTPHead

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY = dict(
    vocab_size=2048, hidden_size=128, num_hidden_layers=4, full_attention_interval=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
    shared_expert_intermediate_size=128, max_position_embeddings=4096, rms_norm_eps=1e-6,
    bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
)


def stdlib_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """Standard-library .py files, its test suite included (no site-packages, no codec tables, nothing over 200 kB),
    split ~95/5 into train / held-out by a hash of the path relative to the stdlib root."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__", "encodings"}
    files = sorted(f for f in root.rglob("*.py")
                   if not skip & set(f.relative_to(root).parts) and f.stat().st_size <= 200_000)
    held = {f for f in files if int(hashlib.sha1(str(f.relative_to(root)).encode()).hexdigest(), 16) % 20 == 0}
    return [f for f in files if f not in held], sorted(held)


def read(f: Path) -> str:
    return f.read_text(encoding="utf-8", errors="replace")


def build_tokenizer(files: list[Path], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator((read(f) for f in files), trainer=trainer)
    return tok


def encode(tok: Tokenizer, files: list[Path]) -> torch.Tensor:
    eos = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch([read(f) for f in files]):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def losses(model, mtp, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    # ids: [B, T+1]; the trunk sees ids[:, :T]
    x = ids[:, :-1]
    out = model.model(input_ids=x, use_cache=False)
    hidden = out.last_hidden_state  # [B, T, H], final-normed
    logits = model.lm_head(hidden)  # [B, T, V]
    main = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    # MTP at i: (embed(x[i+1]), h[i]) -> trunk's distribution at i+1
    b, t = x.shape
    pos = torch.arange(t - 1, device=ids.device)[None].expand(b, -1)
    m_hidden = mtp(model.model.embed_tokens(x[:, 1:]), hidden[:, :-1], pos)
    m_logits = model.lm_head(m_hidden)
    target = logits[:, 1:].detach().softmax(-1)
    mtp_loss = -(target * m_logits.log_softmax(-1)).sum(-1).mean()
    stats = {
        "acc": (logits.argmax(-1) == ids[:, 1:]).float().mean().item(),
        "agree": (m_logits.argmax(-1) == logits[:, 1:].argmax(-1)).float().mean().item(),
    }
    return main, mtp_loss, stats


@torch.no_grad()
def evaluate(model, mtp, data: torch.Tensor, seq: int, max_windows: int = 64) -> dict:
    model.eval()
    mtp.eval()
    dev = next(model.parameters()).device
    n = min(max_windows, (len(data) - 1) // seq)
    acc = agree = floor = 0.0
    for i in range(n):
        ids = data[i * seq : (i + 1) * seq + 1][None].to(dev)
        out = model.model(input_ids=ids[:, :-1], use_cache=False).last_hidden_state
        logits = model.lm_head(out)
        pred = logits.argmax(-1)[0]
        m = model.lm_head(mtp(model.model.embed_tokens(ids[:, 1:-1]), out[:, :-1],
                              torch.arange(seq - 1, device=dev)[None]))
        acc += (pred == ids[0, 1:]).float().mean().item()
        agree += (m.argmax(-1)[0] == pred[1:]).float().mean().item()
        floor += (pred[1:] == pred.mode().values).float().mean().item()
    model.train()
    mtp.train()
    return {"next_token_acc": acc / n, "mtp_agreement": agree / n, "constant_guess_floor": floor / n}


def save(out: Path, model, mtp, tok: Tokenizer, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.config.dtype = "bfloat16"
    model.config.mtp_num_hidden_layers = 1
    model.cpu().save_pretrained(out)  # trunk: per-expert tensors (fused, with older transformers)
    sd = load_file(out / "model.safetensors")
    for k, v in mtp.cpu().state_dict().items():
        if "rotary" in k:
            continue
        sd[f"mtp.{k}"] = v  # MTP layer keeps transformers' fused expert layout
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL[0], "eos_token": SPECIAL[0],
        "pad_token": SPECIAL[0], "model_max_length": TINY["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE, "additional_special_tokens": SPECIAL[1:],
    }, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2], "bos_token_id": 0}))
    (out / "train_report.json").write_text(json.dumps(report, indent=1, default=str))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="mtp_ray/assets/tiny-qwen35-mtp")
    ap.add_argument("--steps", type=int, default=2600)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heldout-sample", default="tests/data/heldout.py.txt")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--stdlib", type=Path, default=None, help="stdlib root to train on (default: this Python's)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--time-budget-min", type=float, default=0.0,
                    help="if set, cut --steps to what fits in this many minutes (measured over the first steps); "
                         "the report records the steps actually used, so --steps N reproduces the run")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    train_files, held_files = stdlib_files(args.stdlib)
    tok = build_tokenizer(train_files, TINY["vocab_size"])
    train, held = encode(tok, train_files), encode(tok, held_files)
    print(f"tokens train={len(train)} held={len(held)} tokenizer {time.time() - t0:.0f}s", flush=True)
    held_text = "\n".join(read(f) for f in held_files)
    Path(args.heldout_sample).parent.mkdir(parents=True, exist_ok=True)
    Path(args.heldout_sample).write_text(held_text[:40000])

    cfg = Qwen3_5MoeTextConfig(**TINY)
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # plain fp32, reproducible
    model = Qwen3_5MoeForCausalLM(cfg)
    mtp = HFMTPHead(cfg)
    with torch.no_grad():  # exercise 1 + w: start the zero-centred norms off zero
        for mod in [*model.modules(), *mtp.modules()]:
            if isinstance(mod, Qwen3_5MoeRMSNorm):
                mod.weight.normal_(0, 0.02)
    model, mtp = model.to(dev), mtp.to(dev)
    params = [*model.parameters(), *mtp.parameters()]
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    warm, calib = 50, 20
    steps = args.steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    )
    g = torch.Generator().manual_seed(0)
    t_train = time.time()
    step = 0
    while step < steps:
        if step == calib and args.time_budget_min > 0:
            per = (time.time() - t_train) / calib
            steps = min(steps, max(calib + 1, int(args.time_budget_min * 60 / per) // 100 * 100))
            print(f"{per * 1000:.0f} ms/step -> {steps} steps", flush=True)
        starts = torch.randint(0, len(train) - args.seq - 1, (args.batch,), generator=g)
        ids = torch.stack([train[s : s + args.seq + 1] for s in starts.tolist()]).to(dev)
        main_loss, mtp_loss, st = losses(model, mtp, ids)
        loss = main_loss + mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step} loss {main_loss.item():.3f} mtp {mtp_loss.item():.3f} acc {st['acc']:.3f} "
                  f"agree {st['agree']:.3f} {time.time() - t_train:.0f}s", flush=True)
        step += 1
    train_s = time.time() - t_train
    report = {
        "params": n_params, "steps": steps, "train_tokens_seen": steps * args.batch * args.seq,
        "corpus_tokens": len(train), "train_seconds": round(train_s, 1), "threads": args.threads, "device": str(dev),
        "machine": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{os.cpu_count()} CPU cores",
        "python": sys.version.split()[0], "torch": torch.__version__,
        "args": vars(args), **evaluate(model, mtp, held, args.seq),
    }
    print(json.dumps(report, indent=1, default=str))
    save(Path(args.out), model, mtp, tok, report)


if __name__ == "__main__":
    main()
