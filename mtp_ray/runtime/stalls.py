"""StallMonitor: what stops a rank's engine thread outside its own code, per process: Python GC pauses and Triton
JIT compiles (a kernel specialization first met while serving, or an autotune). `get_stats` reports both, so an
operator can tell a slow step caused by the host from one caused by the device.

A rank freezes what exists after warmup (`gc.freeze()`, as vLLM does): later collections of the oldest generation
no longer walk the model, the caches and the compiled kernels.
"""

from __future__ import annotations

import gc
import time


class StallMonitor:
    def __init__(self) -> None:
        self.gc_s = 0.0
        self.gc_collections = [0, 0, 0]  # per generation
        self.gc_max_ms = 0.0
        self.compiles = 0
        self.compile_s = 0.0
        self.recent_compiles: list[str] = []  # the last few kernels compiled (name, seconds)
        self._gc_t = self._compile_t = 0.0

    def install(self) -> None:
        gc.callbacks.append(self._on_gc)
        try:
            from triton import knobs
        except ImportError:  # no Triton (CPU): nothing compiles
            return
        rt = knobs.runtime
        if not hasattr(rt, "jit_post_compile_hook"):  # an older Triton
            return
        if rt.jit_cache_hook is None and rt.jit_post_compile_hook is None:  # never displace someone else's hooks
            rt.jit_cache_hook, rt.jit_post_compile_hook = self._before_compile, self._after_compile

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t = time.perf_counter()
            return
        dt = time.perf_counter() - self._gc_t
        self.gc_s += dt
        self.gc_max_ms = max(self.gc_max_ms, 1e3 * dt)
        self.gc_collections[info.get("generation", 0)] += 1

    def _before_compile(self, **kwargs: object) -> bool:
        self._compile_t = time.perf_counter()
        return False  # False: compile as usual

    def _after_compile(self, **kwargs: object) -> bool:
        dt = time.perf_counter() - self._compile_t
        self.compiles += 1
        self.compile_s += dt
        name = getattr(kwargs.get("fn"), "name", "?")  # triton's JitFunctionInfo
        self.recent_compiles = [*self.recent_compiles[-7:], f"{name} {dt:.2f}s"]
        return False

    def snapshot(self) -> dict:
        return {"gc_s": self.gc_s, "gc_collections": list(self.gc_collections), "gc_max_ms": self.gc_max_ms,
                "triton_compiles": self.compiles, "triton_compile_s": self.compile_s,
                "recent_compiles": list(self.recent_compiles)}
