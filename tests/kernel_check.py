"""Compile check of every Triton kernel a CPU interpreter run launches, for a real GPU target (no GPU needed).

`TRITON_INTERPRET=1` runs kernels in numpy, which accepts programs the GPU compiler rejects (types that differ
between the branches of an `if`, pointer arithmetic with a float, ...). With `KERNEL_COMPILE_CHECK=sm90` (or
sm80, sm100) each distinct launch (kernel, argument types, constexprs, warps, stages) is recorded, and at the end
of the session one fresh process (no interpreter) compiles them all to cubins for that target; a failure fails the
session. So such errors show up in the CPU pre-flight, not as a failed device run:

    TRITON_INTERPRET=1 KERNEL_DEVICE=cpu KERNEL_COMPILE_CHECK=sm90 pytest -m gpu tests/test_kernels.py
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import torch

_TYPES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "i1"}
launches: dict[str, dict] = {}  # key -> one launch to compile


def _arg_type(v) -> str | None:
    if isinstance(v, torch.Tensor):
        return "*" + _TYPES[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -(2**31) <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    return None  # None and the like: a constexpr


def install() -> None:
    """Wrap InterpretedFunction.run: record each distinct launch, then interpret it as before."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    run = InterpretedFunction.run
    constexpr_names: dict = {}

    def recording_run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        values = dict(zip(self.arg_names, args))
        values.update({k: v for k, v in kwargs.items() if k not in options})
        if self.fn not in constexpr_names:
            constexpr_names[self.fn] = {p.name for p in JITFunction(self.fn).params if p.is_constexpr}
        consts = {k: v for k, v in values.items() if _arg_type(v) is None or k in constexpr_names[self.fn]}
        # the GPU launcher specializes an int equal to 1 into a constexpr too
        consts.update({k: v for k, v in values.items() if type(v) is int and v == 1})
        sig = {k: ("constexpr" if k in consts else _arg_type(v)) for k, v in values.items()}
        item = {"module": self.fn.__module__, "name": self.fn.__name__, "signature": sig, "constexprs": consts,
                "options": options}
        launches.setdefault(json.dumps(item, sort_keys=True, default=repr), item)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run


def compile_all(target: str) -> list[str]:
    """In a fresh process (the interpreter patches triton.language while it runs): compile every recorded launch.
    Returns one line per failure."""
    if not launches:
        return []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.kernel_check", target], capture_output=True, text=True,
                          input=json.dumps(list(launches.values())), env=env)
    if proc.returncode not in (0, 3):
        return [f"compile check crashed: {proc.stderr[-2000:]}"]
    return [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "compiled"))]


def _main(target: str) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    gpu = GPUTarget("cuda", int(target.removeprefix("sm")), 32)
    failed = 0
    items = json.load(sys.stdin)
    if gpu.arch >= 90:  # the interpreter launches without PDL (layers/triton/pdl.py): compile the PDL variants too
        items += [{**i, "constexprs": {**i["constexprs"], "PDL": True}, "options": {**i["options"], "launch_pdl": True}}
                  for i in items if "PDL" in i["constexprs"]]
    for item in items:
        fn = getattr(importlib.import_module(item["module"]), item["name"])
        try:
            triton.compile(ASTSource(fn=fn, signature=item["signature"], constexprs=item["constexprs"]), target=gpu,
                           options=item["options"])
        except Exception as e:  # every failure is reported, not just the first
            failed += 1
            msg = " ".join(str(e).split())[-600:]
            print(f"FAILED {item['name']} constexprs={item['constexprs']}: {msg}")
    print(f"compiled {len(items) - failed} of {len(items)} launches for {target}")
    sys.exit(3 if failed else 0)


if __name__ == "__main__":
    _main(sys.argv[1])
