"""Where the front door's CPU goes (CPU host, no GPU needed): one `serve run` (bench/serve.py's micro model: random
weights at tiny shapes, dp1 k0, 1 group, 1 ingress, through Serve's proxy or --direct), a closed-loop client of C
streams per phase, and measurement windows: per-process / per-thread CPU from /proc, the client's requests and
chunks in the window, and (with py-spy on PATH or in the venv) profiles of the ingress / proxy / group / rank.

    python bench/front_door.py --max-seqs 256 --phases 32:128 32:4 64:128 --windows cpu raw:ingress+proxy
        [--direct] [--server '{"stream_interval_ms": 20}'] [--out /tmp/front_door]

Writes <out>/probe.json (and the raw profiles under <out>/c<C>_t<max_tokens>/). Run alone on the machine: the
windows read every process's CPU.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import aiohttp  # noqa: E402
import serve as sb  # noqa: E402  (bench/serve.py, read only)
import yaml  # noqa: E402

HERE = Path(os.environ.get("FRONT_DOOR_DIR", "/tmp/front_door"))
REPO = Path(__file__).resolve().parents[1]
PYSPY = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
TCK = os.sysconf("SC_CLK_TCK")
PROCS = {"ingress": "ray::ServeReplica:mtp-ray:OpenAIIngress", "proxy": "ray::ProxyActor",
         "group": "ray::ServeReplica:mtp-ray:EngineGroup", "rank": "ray::RankWorker"}


SESSION: int | None = None  # the `serve run` process's session: this probe's Ray processes, not others'


def session_of(p: str) -> int:
    return int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[3])


def pid_of(pat: str) -> str | None:
    out = subprocess.run(["pgrep", "-f", pat], capture_output=True, text=True).stdout.split()
    mine = [p for p in out if SESSION is None or session_of(p) == SESSION]
    return mine[0] if mine else None


def cpu_snapshot() -> dict:
    """pid -> (name, total ticks, {tid: (comm, ticks)}) for every process."""
    snap = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            st = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total = int(st[11]) + int(st[12])
            threads = {}
            for t in os.listdir(f"/proc/{p}/task"):
                try:
                    tst = Path(f"/proc/{p}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()
                    comm = Path(f"/proc/{p}/task/{t}/comm").read_text().strip()
                    threads[t] = (comm, int(tst[11]) + int(tst[12]))
                except OSError:
                    pass
            snap[p] = (("" if int(st[3]) == SESSION or int(p) == os.getpid() else "OTHER ") + cmd[:90], total, threads)
        except OSError:
            pass
    return snap


def cpu_delta(a: dict, b: dict, secs: float) -> dict:
    rows = []
    for p, (cmd, tot, th) in b.items():
        t0 = a.get(p, (cmd, 0, {}))
        d = (tot - t0[1]) / TCK
        if d <= 0.02:
            continue
        per_thread: dict[str, float] = {}
        for t, (comm, ticks) in th.items():
            dt = (ticks - t0[2].get(t, (comm, 0))[1]) / TCK
            if dt > 0:
                key = f"{comm}/{t}"
                per_thread[key] = per_thread.get(key, 0) + dt
        rows.append({"pid": p, "cmd": cmd, "cpu_s": round(d, 2), "core_pct": round(100 * d / secs, 1),
                     "threads_core_pct": {k: round(100 * v / secs, 1) for k, v in
                                          sorted(per_thread.items(), key=lambda kv: -kv[1]) if v / secs > 0.004}})
    rows.sort(key=lambda r: -r["cpu_s"])
    return {"secs": round(secs, 2), "procs": rows, "total_core_pct": round(sum(r["core_pct"] for r in rows), 1),
            "other_core_pct": round(sum(r["core_pct"] for r in rows if r["cmd"].startswith("OTHER")), 1)}


class Load:
    """c closed-loop streams until stopped; keeps every request's t0 and chunk times."""

    def __init__(self, url: str, model: str, c: int, max_tokens: int, prompt_tokens: int = 32):
        self.url, self.model, self.c, self.max_tokens, self.pt = url, model, c, max_tokens, prompt_tokens
        self.results: list[dict] = []
        self.stop = False
        self.i = 0

    async def run(self) -> None:
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
            async def stream() -> None:
                while not self.stop:
                    self.i += 1
                    prompt = [(7 * self.i + j) % 2000 + 3 for j in range(self.pt)]
                    r = await sb.one_request(s, self.url, self.model, prompt, self.max_tokens)
                    r["t_end"] = time.perf_counter()
                    self.results.append(r)
            await asyncio.gather(*[stream() for _ in range(self.c)])

    def window(self, t0: float, t1: float) -> dict:
        ok = [r for r in self.results if "chunks" in r]
        chunks = sum(1 for r in ok for (t, _) in r["chunks"] if t0 <= t < t1)
        tokens = sum(n for r in ok for (t, n) in r["chunks"] if t0 <= t < t1)
        started = sum(1 for r in ok if t0 <= r["t0"] < t1)
        ended = sum(1 for r in ok if t0 <= r["t_end"] < t1)
        ttft = sorted(1e3 * (r["chunks"][0][0] - r["t0"]) for r in ok if r["chunks"] and t0 <= r["t0"] < t1)
        errors = [r["error"] for r in self.results if "error" in r][:3]
        secs = t1 - t0
        return {"secs": round(secs, 2), "chunks": chunks, "tokens": tokens, "req_started": started,
                "req_ended": ended, "req_s": round(ended / secs, 2), "chunks_s": round(chunks / secs, 1),
                "tok_s": round(tokens / secs, 1), "tokens_per_chunk": round(tokens / max(chunks, 1), 2),
                "ttft_p50_ms": round(ttft[len(ttft) // 2], 1) if ttft else None, "errors": errors}


def pyspy(names: list[str], secs: int, out: Path, fmt: str, rate: int, mode: str = "") -> list[tuple]:
    procs = []
    for n in names:
        pid = pid_of(PROCS[n])
        if pid is None:
            continue
        ext = {"raw": "txt", "flamegraph": "svg", "speedscope": "json"}[fmt]
        f = out / f"pyspy_{n}.{mode or fmt}.{ext}"
        extra = {"": ["--nonblocking"], "gil": ["--nonblocking", "--gil"], "native": ["--native"],
                 "idle": ["--nonblocking", "--idle"]}[mode]
        cmd = [PYSPY, "record", "-p", pid, "-d", str(secs), "-r", str(rate), "-f", fmt, "-o", str(f),
               "--threads", *extra]
        procs.append((n, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), f))
    return procs


async def measure(load: Load, url: str, secs: float, tag: str, out: Path, spy: tuple | None) -> dict:
    hist0, eng0 = await sb.histogram_sums(url), await sb.engine_counters(url)
    procs = pyspy(spy[0], int(secs), out, *spy[1:]) if spy else []
    a, t0, w0 = cpu_snapshot(), time.perf_counter(), time.monotonic()
    await asyncio.sleep(secs)
    b, t1 = cpu_snapshot(), time.perf_counter()
    res = {"tag": tag, "client": load.window(t0, t1), "cpu": cpu_delta(a, b, time.monotonic() - w0)}
    for n, p, f in procs:
        _, err = await asyncio.to_thread(p.communicate)
        res.setdefault("pyspy", {})[n] = str(f) if f.exists() else err.decode()[-300:]
    await asyncio.sleep(1.2)
    res["ttft_parts_ms"] = sb.ttft_parts(hist0, await sb.histogram_sums(url))
    res["engine"] = sb.engine_delta(eng0, await sb.engine_counters(url))
    print(json.dumps({k: res[k] for k in ("tag", "client", "ttft_parts_ms")}), "other%", res["cpu"]["other_core_pct"],
          "running_batch", res["engine"].get("mean_running_batch"), flush=True)
    for r in res["cpu"]["procs"][:9]:
        print(f"   {r['core_pct']:6.1f}%  {r['cmd'][:60]}  {list(r['threads_core_pct'].items())[:5]}", flush=True)
    return res


async def main_async(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = sb.model_micro(False)
    model = {"model": str(tmp), "load_format": "dummy", "tokenizer": str(tmp)}
    base = yaml.safe_load((REPO / "deployments/qwen35_mtp.yaml").read_text())
    path, port, served = sb.variant_yaml(base, 1, 0, model, out / "variant.yaml", groups=1, ingress=1,
                                         port=args.port + (100 if args.direct else 0),
                                         server=json.loads(args.server) if args.server else None,
                                         access_log=None, mixed=False)
    port = args.port
    if args.max_seqs:
        cfg = yaml.safe_load(path.read_text())
        sch = cfg["applications"][0]["args"]["engine"].setdefault("scheduler", {})
        sch["max_num_seqs"] = args.max_seqs
        sch["max_num_batched_tokens"] = max(sch.get("max_num_batched_tokens", 512), 32 * args.max_seqs)
        path.write_text(yaml.safe_dump(cfg))
    server = sb.Server(path, port, out / "serve_run.log", direct=args.direct)
    global SESSION
    SESSION = server.proc.pid
    result = {"yaml": str(path), "phases": []}
    try:
        up = await server.wait_ready(600)
        print(f"server up in {up:.0f}s", flush=True)
        if args.idle_secs:
            await asyncio.sleep(5)
            idle = Load(server.url, served, 0, 1)
            result["idle"] = await measure(idle, server.url, args.idle_secs, "idle", out, None)
        for ph in args.phases:
            c, mt = map(int, ph.split(":"))
            d = out / f"c{c}_t{mt}"
            d.mkdir(exist_ok=True)
            load = Load(server.url, served, c, mt)
            task = asyncio.ensure_future(load.run())
            await asyncio.sleep(args.warm)
            r = {"c": c, "max_tokens": mt, "windows": []}
            for spec in args.windows:  # cpu | mode:proc+proc[:fmt[:rate]]  (mode: raw, gil, native, idle)
                if spec == "cpu":
                    r["windows"].append(await measure(load, server.url, args.secs, "cpu-only", d, None))
                    continue
                mode, procs, *rest = spec.split(":")
                fmt = rest[0] if rest else "raw"
                rate = int(rest[1]) if len(rest) > 1 else args.rate
                r["windows"].append(await measure(load, server.url, args.secs, spec, d,
                                                  (procs.split("+"), fmt, rate, "" if mode == "raw" else mode)))
            load.stop = True
            await task
            result["phases"].append(r)
            (out / "probe.json").write_text(json.dumps(result, indent=1))
            await asyncio.sleep(2)
    finally:
        server.stop()
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    (out / "probe.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phases", nargs="+", default=["32:128"])
    ap.add_argument("--secs", type=float, default=15)
    ap.add_argument("--warm", type=float, default=8)
    ap.add_argument("--rate", type=int, default=100)
    ap.add_argument("--port", type=int, default=8377)
    ap.add_argument("--windows", nargs="+", default=["cpu"])
    ap.add_argument("--direct", action="store_true")
    ap.add_argument("--max-seqs", type=int, default=0)
    ap.add_argument("--idle-secs", type=float, default=0)
    ap.add_argument("--server", default="", help='JSON server overrides, e.g. {"stream_interval_ms": 20}')
    ap.add_argument("--out", default=str(HERE))
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
