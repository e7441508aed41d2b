"""What the router itself costs per weight-update transaction, phase by phase, from 1 to 1,024 workers.

    .venv/bin/python -m benchmarks.bench_update_transaction                      # 1 8 64 1024 workers
    .venv/bin/python -m benchmarks.bench_update_transaction --workers 1 8 64 --steps 100

One transaction is a trainer's step as SGLang's flow sends it through the router: ``POST
/pause_generation`` (locked, fenced, journaled), ``POST /update_weights_from_disk`` with the step's
``weight_version`` (locked, fenced, journaled; the router reads each target's version back and records
the fleet's), ``POST /continue_generation``. The router is the real ``omni-router`` process (its default:
a control process and one data plane per core, which every fence waits for). The workers are
STAND-INS: one process serving the worker contract's routes on N ports, every admin call answered after
a fixed ``--worker-ms`` (20 ms) and nothing else done, so what is left is the router's own cost.

Each answer says where its operation spent its time (``timings``: lock_wait, fence_barrier,
journal_write, fan_out, slowest_worker, settle, verification, total; router/gateway/admin/timings.py).
The router's time in an operation is its total minus the slowest stand-in's own time (a stand-in's
time includes its process's queueing at 1,024 workers, so this is the router's cost, not more).
Printed: one JSON line per step (``--json-steps``), then per worker count the router-added time per
transaction (the three operations summed) and per phase, p50 and p99 over the steps, and the
ratio of each count's p99 to one worker's. Targets: router-added time per transaction ≤ 25 ms p99 and
flat from 1 to 64 workers (≤ +10 %); ≤ 250 ms p99 at 1,024.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import aiohttp
from aiohttp import web

from benchmarks.bench_router import free_ports, pct, serve_standins, start_router
from demo.launch import ManagedProcess

#: One step's calls, in order.
CALLS = (
    ("pause", "/pause_generation", {"mode": "in_place"}),
    ("update", "/update_weights_from_disk", {"model_path": "/checkpoints/step"}),
    ("resume", "/continue_generation", {}),
)
#: The phases of an answer's ``timings`` that are the router's alone (``fan_out`` less the slowest worker).
ROUTER_PHASES = ("lock_wait", "fence_barrier", "journal_write", "fan_out", "settle", "verification")


def standin_app(worker_s: float) -> web.Application:
    """Stand-in workers (benchmark only): every admin call answers after ``worker_s``; each port keeps the
    weight version its last update set, as ``/model_info`` and ``/health`` report it."""
    versions: dict[int, str] = {}

    def port_of(request: web.Request) -> int:
        sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
        return int(sockname[1]) if sockname else 0

    def identity(request: web.Request) -> dict[str, Any]:
        return {"weight_version": versions.get(port_of(request), "default"), "instance_id": "standin"}

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "weight_state": "serving", **identity(request)})

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "standin", "tp_size": 1, **identity(request)})

    async def admin(request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(worker_s)
        if request.path == "/update_weights_from_disk":
            versions[port_of(request)] = body.get("weight_version") or "default"
        return web.json_response({"success": True, "message": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/model_info", model_info)
    for path in ("/pause_generation", "/update_weights_from_disk", "/continue_generation"):
        app.router.add_post(path, admin)
    return app


def router_ms(timings: dict[str, float]) -> float:
    """The router's time in one operation: its total less the slowest worker's own."""
    return timings["total"] - timings.get("slowest_worker", 0.0)


async def one_step(session: aiohttp.ClientSession, url: str, step: int) -> dict[str, Any]:
    """One transaction; each call's answer ``timings`` and client-observed time (ms)."""
    record: dict[str, Any] = {"step": step}
    for name, path, body in CALLS:
        if name == "update":
            body = {**body, "weight_version": f"step-{step}"}
        started = time.perf_counter()
        async with session.post(url + path, json=body) as resp:
            answer = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"{path} -> {resp.status}: {json.dumps(answer)[:300]}")
        record[name] = {"client_ms": round((time.perf_counter() - started) * 1000.0, 3), **answer["timings"]}
    record["router_ms"] = round(sum(router_ms(record[name]) for name, _, _ in CALLS), 3)
    return record


async def until_every_process_fences(session: aiohttp.ClientSession, url: str, within_s: float = 120.0) -> None:
    """Wait until a fenced call succeeds: every data-plane process is up and acknowledges the router's fences
    (a freshly started router answers readiness from its first data plane while another may still start)."""
    deadline = time.monotonic() + within_s
    while True:
        async with session.post(url + "/pause_generation", json={"mode": "in_place"}) as resp:
            if resp.status == 200:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"no fenced call succeeded within {within_s:g}s: {resp.status} {await resp.text()}")
        await asyncio.sleep(1.0)
    async with session.post(url + "/continue_generation", json={}) as resp:
        resp.raise_for_status()


def summarize(n: int, steps: list[dict[str, Any]]) -> dict[str, Any]:
    """p50/p99 over the steps: the router's time per transaction, and each phase's (summed over the calls)."""
    per_phase: dict[str, list[float]] = {}
    for record in steps:
        for phase in ROUTER_PHASES:
            values = [record[name].get(phase, 0.0) for name, _, _ in CALLS]
            if phase == "fan_out":  # the router's part of it
                values = [
                    v - record[name].get("slowest_worker", 0.0) for v, (name, _, _) in zip(values, CALLS, strict=True)
                ]
            per_phase.setdefault(phase, []).append(sum(values))
    added = [r["router_ms"] for r in steps]
    client = [sum(r[name]["client_ms"] for name, _, _ in CALLS) for r in steps]
    return {
        "workers": n,
        "steps": len(steps),
        "router_ms": {"p50": pct(added, 50), "p99": pct(added, 99), "mean": statistics.mean(added)},
        "client_ms": {"p50": pct(client, 50), "p99": pct(client, 99)},
        "phases_ms": {p: {"p50": pct(v, 50), "p99": pct(v, 99)} for p, v in per_phase.items()},
    }


async def bench(args: argparse.Namespace) -> None:
    n_max = max(args.workers)
    ports = free_ports(n_max)
    argv = [
        sys.executable,
        "-m",
        "benchmarks.bench_update_transaction",
        "--worker-ms",
        str(args.worker_ms),
        "--serve-standins",
        *map(str, ports),
    ]
    standins = ManagedProcess("bench-standins", argv).start()
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    standins.wait_http_ready(urls[-1] + "/health", timeout=120)  # the sites start in port order
    print(
        f"# machine: {len(os.sched_getaffinity(0))} usable cores; {platform.machine()}; python "
        f"{sys.version.split()[0]}; stand-in workers (one process) answer admin calls after {args.worker_ms:g} ms; "
        f"router --data-plane-processes {args.data_plane_processes}",
        flush=True,
    )
    summaries = []
    connector = aiohttp.TCPConnector(limit=4)
    timeout = aiohttp.ClientTimeout(total=600)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            for n in args.workers:
                with tempfile.TemporaryDirectory() as state:
                    router, url = start_router(urls[:n], state, args.data_plane_processes)
                    try:
                        steps = args.steps if n < 1024 else args.steps_at_1024
                        await until_every_process_fences(session, url)
                        for step in range(args.warmup):
                            await one_step(session, url, -1 - step)
                        records = []
                        for step in range(steps):
                            record = await one_step(session, url, step)
                            records.append(record)
                            if args.json_steps:
                                print(json.dumps({"workers": n, **record}), flush=True)
                    finally:
                        router.stop()
                summary = summarize(n, records)
                summaries.append(summary)
                print(json.dumps({"summary": summary}), flush=True)
    finally:
        standins.stop()
    print_table(summaries)


def print_table(summaries: list[dict[str, Any]]) -> None:
    base = summaries[0]["router_ms"]["p99"]
    print("\n| workers | router-added per transaction p50 / p99 | ÷ first p99 | client-observed p50 / p99 |")
    print("|---|---|---|---|")
    for s in summaries:
        r, c = s["router_ms"], s["client_ms"]
        ratio = r["p99"] / base if base else float("nan")
        print(
            f"| {s['workers']} | {r['p50']:.1f} / {r['p99']:.1f} ms | {ratio:.2f}× | {c['p50']:.1f} / {c['p99']:.1f} ms |"
        )
    print("\n| workers | " + " | ".join(f"{p} p50 / p99" for p in ROUTER_PHASES) + " |")
    print("|---|" + "---|" * len(ROUTER_PHASES))
    for s in summaries:
        cells = [f"{s['phases_ms'][p]['p50']:.1f} / {s['phases_ms'][p]['p99']:.1f}" for p in ROUTER_PHASES]
        print(f"| {s['workers']} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 8, 64, 1024])
    p.add_argument("--steps", type=int, default=100, help="measured transactions per worker count")
    p.add_argument("--steps-at-1024", type=int, default=30, help="measured transactions at 1,024 workers or more")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured transactions first")
    p.add_argument("--worker-ms", type=float, default=20.0, help="each stand-in's answer time for an admin call")
    p.add_argument("--data-plane-processes", default="auto", help="omni-router --data-plane-processes")
    p.add_argument("--json-steps", action="store_true", help="print every step's timings as a JSON line")
    p.add_argument("--serve-standins", type=int, nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_standins:
        asyncio.run(serve_standins(args.serve_standins, standin_app(args.worker_ms / 1000.0)))
    else:
        asyncio.run(bench(args))


if __name__ == "__main__":
    main()
