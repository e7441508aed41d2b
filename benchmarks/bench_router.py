"""Router benchmark: admin broadcast latency to N workers, and /generate proxy overhead.

    .venv/bin/python -m benchmarks.bench_router            # default run, < 2 min on 2 cores
    .venv/bin/python -m benchmarks.bench_router --workers 1 16 64 256 --iters 300

The router is the real ``omni-router`` process. The workers are STAND-INS:
one lightweight process serving the worker contract's routes (``/health``,
``/model_info``, the admin routes, a fixed-reply ``/generate``) on N ports.
They do no model work, so the figures isolate the router's own cost. Stand-ins
are used only here; tests use real ``omni-worker`` processes.

Printed figures (no pass/fail; targets: p99 broadcast to 256 workers <= 50 ms,
p50 added proxy latency <= 1 ms; with ``--peer``, ``/flush_cache`` p50 no more than sglang-router's
and ``/pause_generation`` p50 <= 5 ms at 64 workers):
- broadcast: client-observed latency of ``POST /flush_cache`` (plain fan-out)
  and ``POST /pause_generation`` (locked, fenced, journaled) per N;
- proxy: p50/p99 of ``/generate`` direct to a stand-in vs through the router,
  the added latency, and throughput at a fixed concurrency both ways;
- ``--peer``: ``POST /flush_cache`` through SGLang's Rust router (``sglang-router`` 0.3.2, installed
  into its own virtualenv as ``bench_peer_router`` does) over the same stand-ins, in rounds
  interleaved with the router's, and the ratio of the p50s (medians over ``--rounds``).

    .venv/bin/python -m benchmarks.bench_router --workers 64 --peer --rounds 5 --iters 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import time

import aiohttp
from aiohttp import web

from demo.launch import ManagedProcess, cli

# ----------------------------------------------------------------------------- stand-in workers

GENERATE_REPLY = json.dumps(
    {
        "text": " world",
        "output_ids": [1, 2, 3],
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "length", "length": 3},
            "prompt_tokens": 2,
            "completion_tokens": 3,
            "weight_version": "default",
        },
    }
).encode()


def standin_app() -> web.Application:
    """A contract-speaking stand-in worker (benchmark only): fixed, instant answers."""
    ok = json.dumps({"success": True, "message": "ok"}).encode()
    # An omni-worker's process identity, so that the router detects the stand-ins as omni-workers.
    instance = {"instance_id": "standin"}
    info = json.dumps({"model_path": "standin", "weight_version": "default", "tp_size": 1, **instance}).encode()
    health = json.dumps({"status": "ok", "weight_version": "default", "weight_state": "serving", **instance}).encode()

    async def reply_ok(_: web.Request) -> web.Response:
        return web.Response(body=ok, content_type="application/json")

    async def reply_health(_: web.Request) -> web.Response:
        return web.Response(body=health, content_type="application/json")

    async def model_info(_: web.Request) -> web.Response:
        return web.Response(body=info, content_type="application/json")

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=GENERATE_REPLY, content_type="application/json")

    app = web.Application()
    app.router.add_routes(
        [
            web.get("/health", reply_health),
            web.get("/model_info", model_info),
            web.post("/generate", generate),
            *(
                web.post(p, reply_ok)
                for p in ("/flush_cache", "/pause_generation", "/continue_generation", "/abort_request")
            ),
        ]
    )
    return app


async def serve_standins(ports: list[int], app: web.Application | None = None) -> None:
    """``app`` (by default :func:`standin_app`) on every port, until SIGTERM."""
    runner = web.AppRunner(app if app is not None else standin_app(), access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await runner.cleanup()


# ----------------------------------------------------------------------------- process helpers


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def start_router(urls: list[str], state_dir: str, processes: str = "auto") -> tuple[ManagedProcess, str]:
    port = free_ports(1)[0]
    argv = [
        cli("omni-router"),
        "--port",
        str(port),
        "--data-plane-processes",
        processes,
        "--health-check-interval-s",
        "3600",
        "--log-level",
        "warning",
        "--state-dir",
        state_dir,
        "--worker-urls",
        *urls,
    ]
    proc = ManagedProcess(f"bench-router-{port}", argv).start()
    url = f"http://127.0.0.1:{port}"
    proc.wait_http_ready(url + "/readiness", timeout=60)
    return proc, url


# ----------------------------------------------------------------------------- measurements


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, round(q / 100.0 * (len(s) - 1)))]


async def timed_posts(
    session: aiohttp.ClientSession, url: str, body: bytes, iters: int, warmup: int = 10
) -> list[float]:
    out: list[float] = []
    for i in range(warmup + iters):
        t = time.perf_counter()
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"{url} -> {r.status}: {(await r.read())[:300]!r}")
        if i >= warmup:
            out.append((time.perf_counter() - t) * 1000.0)
    return out


async def throughput(session: aiohttp.ClientSession, url: str, seconds: float, concurrency: int) -> float:
    done = 0
    deadline = time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            async with session.post(url, data=b'{"text": "hi"}', headers={"Content-Type": "application/json"}) as r:
                await r.read()
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


async def bench(args: argparse.Namespace) -> None:
    n_max = max(args.workers)
    ports = free_ports(n_max)
    # As a module, from the repository root (as this script is run), so that the project imports resolve.
    argv = [sys.executable, "-m", "benchmarks.bench_router", "--serve-standins", *map(str, ports)]
    standins = ManagedProcess("bench-standins", argv).start()
    all_urls = [f"http://127.0.0.1:{p}" for p in ports]
    # The sites start in port order: once the last one answers, every one does.
    standins.wait_http_ready(all_urls[-1] + "/health", timeout=60)
    print(f"# stand-in workers: {n_max} (one process); cpus: {os.cpu_count()}; python {sys.version.split()[0]}")
    connector = aiohttp.TCPConnector(limit=256)
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            if args.peer:
                for n in args.workers:
                    await beside_peer(session, all_urls[:n], args)
                return
            print("\n## Admin broadcast latency (client-observed, ms)")
            print(f"{'workers':>8} {'route':<20} {'p50':>8} {'p99':>8} {'mean':>8}")
            for n in args.workers:
                with tempfile.TemporaryDirectory() as state:
                    router, rurl = start_router(all_urls[:n], state, args.data_plane_processes)
                    try:
                        for route, body in (("/flush_cache", b"{}"), ("/pause_generation", b'{"mode": "retract"}')):
                            xs = await timed_posts(session, rurl + route, body, args.iters)
                            print(
                                f"{n:>8} {route:<20} {pct(xs, 50):>8.2f} {pct(xs, 99):>8.2f} {statistics.mean(xs):>8.2f}"
                            )
                    finally:
                        router.stop()

            print("\n## /generate proxy overhead (sequential, ms)")
            with tempfile.TemporaryDirectory() as state:
                router, rurl = start_router(all_urls[:1], state, args.data_plane_processes)
                try:
                    body = b'{"text": "hello", "sampling_params": {"max_new_tokens": 3}}'
                    direct = await timed_posts(session, all_urls[0] + "/generate", body, args.proxy_iters, warmup=50)
                    routed = await timed_posts(session, rurl + "/generate", body, args.proxy_iters, warmup=50)
                    d50, r50 = pct(direct, 50), pct(routed, 50)
                    print(f"{'direct':<10} p50 {d50:.3f}  p99 {pct(direct, 99):.3f}")
                    print(f"{'router':<10} p50 {r50:.3f}  p99 {pct(routed, 99):.3f}")
                    print(
                        f"added p50 {r50 - d50:.3f} ms   added p99 {pct(routed, 99) - pct(direct, 99):.3f} ms   ratio p50 {r50 / d50:.2f}x"
                    )
                    print(f"\n## /generate throughput, concurrency {args.concurrency}, {args.seconds:g}s each (req/s)")
                    t_direct = await throughput(session, all_urls[0] + "/generate", args.seconds, args.concurrency)
                    t_router = await throughput(session, rurl + "/generate", args.seconds, args.concurrency)
                    print(f"direct {t_direct:.0f}   router {t_router:.0f}   ratio {t_router / t_direct:.2f}")
                finally:
                    router.stop()
    finally:
        standins.stop()


def start_peer(urls: list[str]) -> tuple[ManagedProcess, str, str]:
    """sglang-router 0.3.2 over ``urls``, from its own virtualenv (installed from PyPI when missing)."""
    from benchmarks.peer_tools import DEFAULT_SGLANG_VENV, PEERS, ensure_peer, peer_argv

    peer = PEERS["sglang-router"]
    version = ensure_peer(peer, DEFAULT_SGLANG_VENV)
    port, metrics = free_ports(2)
    argv = peer_argv(peer, DEFAULT_SGLANG_VENV, upstream=urls[0], port=port, metrics_port=metrics, policy="round_robin")
    at = argv.index("--worker-urls")
    argv[at + 1 : at + 2] = urls
    proc = ManagedProcess(f"bench-sglang-router-{port}", argv).start()
    url = f"http://127.0.0.1:{port}"
    proc.wait_http_ready(url + "/health", timeout=60)
    return proc, url, f"sglang-router {version}"


async def beside_peer(session: aiohttp.ClientSession, urls: list[str], args: argparse.Namespace) -> None:
    """``/flush_cache`` through omni-router and sglang-router, rounds interleaved; ``/pause_generation`` through ours."""
    n = len(urls)
    with tempfile.TemporaryDirectory() as state:
        router, rurl = start_router(urls, state, args.data_plane_processes)
        peer, purl, peer_name = start_peer(urls)
        try:
            print(f"\n## {n} workers: admin calls, client-observed ms, {args.rounds} rounds x {args.iters}")
            print(f"{'round':>5} {'target':<36} {'p50':>8} {'p99':>8}")
            ours: list[float] = []
            theirs: list[float] = []
            pauses: list[float] = []
            for rnd in range(1, args.rounds + 1):
                for name, url, route, body, into in (
                    (f"omni-router ({args.data_plane_processes})", rurl, "/flush_cache", b"{}", ours),
                    (peer_name, purl, "/flush_cache", b"{}", theirs),
                    (
                        f"omni-router ({args.data_plane_processes})",
                        rurl,
                        "/pause_generation",
                        b'{"mode": "in_place"}',
                        pauses,
                    ),
                ):
                    xs = await timed_posts(session, url + route, body, args.iters)
                    into.append(pct(xs, 50))
                    print(f"{rnd:>5} {name + ' ' + route:<36} {pct(xs, 50):>8.2f} {pct(xs, 99):>8.2f}", flush=True)
            o, t, pz = statistics.median(ours), statistics.median(theirs), statistics.median(pauses)
            print(
                f"/flush_cache p50 (median of rounds): omni-router {o:.2f} ms, {peer_name} {t:.2f} ms, ratio {o / t:.2f}"
            )
            print(f"/pause_generation p50 (locked, fenced, journaled): omni-router {pz:.2f} ms")
        finally:
            peer.stop()
            router.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--proxy-iters", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--data-plane-processes", default="auto", help="omni-router --data-plane-processes (1: one process)")
    p.add_argument("--peer", action="store_true", help="measure /flush_cache beside sglang-router 0.3.2 instead")
    p.add_argument("--rounds", type=int, default=5, help="with --peer: interleaved rounds")
    p.add_argument("--serve-standins", type=int, nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_standins:
        asyncio.run(serve_standins(args.serve_standins))
    else:
        asyncio.run(bench(args))


if __name__ == "__main__":
    main()
