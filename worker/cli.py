"""``omni-worker``: serve a model, or write a tiny test checkpoint.

    omni-worker --model-path DIR [FLAG ...]    # the flags: omni-worker --help, docs/worker.md
    omni-worker make-tiny OUT_DIR [--arch llama|qwen2] [--seed N] [--chat-template]
    omni-worker --version

The ``omni-worker`` script enters through :mod:`worker.launcher`, which first checks that the
``worker`` extra (torch, safetensors, tokenizers, jinja2) imports.

The admin key falls back to ``SGLANG_OMNI_ADMIN_KEY`` here, when the flags are
read, exactly as in ``omni-router``: a :class:`WorkerConfig` built in code holds
the key it was given.

Logs exactly one "omni-worker ready on http://HOST:PORT ..." line once it accepts requests.
On SIGTERM (or SIGINT) it drains: new generations get 503 and ``/health`` 503 ``draining`` at
once while ``/liveness`` stays 200; running ones may finish for ``--shutdown-grace-s``, then
the rest are aborted (their callers get an ``abort`` answer), every weight-update group is
left, and the process exits 0. A second signal ends the drain at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from router import __version__
from router.contract.settings import add_flags, from_args
from worker.config import WorkerConfig

log = logging.getLogger("omni-worker")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omni-worker",
        description="Serve a Llama/Qwen2 model with the SGLang-compatible RL admin API.",
        epilog="omni-worker make-tiny OUT_DIR [--arch llama|qwen2] [--seed N] [--chat-template] writes a tiny random checkpoint.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_flags(p, WorkerConfig)
    return p


async def serve(config: WorkerConfig) -> int:
    from aiohttp import web

    from worker.http.app import create_app
    from worker.http.keys import COORDINATOR

    app = create_app(config)
    coord = app[COORDINATOR]
    # The drain happens before the runner's cleanup, so aiohttp's own wait for busy handlers
    # only covers what is left then (admin calls; generations have their answers by then).
    runner = web.AppRunner(app, access_log=log if config.log_level == "debug" else None, shutdown_timeout=5.0)
    await runner.setup()
    stop = asyncio.Event()
    hurry = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.info("%s again: aborting what still runs now", sig.name)
            hurry.set()
            return
        coord.start_draining()  # in the handler itself: the very next /generate is refused
        log.info(
            "%s: shutting down; new /generate gets 503 and /health says draining; %d generation(s) in flight "
            "may finish within %gs",
            sig.name,
            coord.num_in_flight,
            config.shutdown_grace_s,
        )
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        worker = coord.worker
        log.info(
            "omni-worker ready on http://%s:%d (model %s, %s %s, weight_version %s)",
            host,
            port,
            worker.model_path,
            worker.device,
            worker.dtype_name,
            worker.weight_version,
        )
        await stop.wait()
        finished, aborted = await coord.drain(config.shutdown_grace_s, cut_short=hurry)
        log.info(
            "shutdown: %d generation(s) finished, %d aborted (shutdown grace %gs)",
            finished,
            aborted,
            config.shutdown_grace_s,
        )
    finally:
        # Stops listening, then leaves every weight-update group (bounded) and stops the scheduler.
        await runner.cleanup()
    log.info("omni-worker stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "make-tiny":
        from worker.model.tiny import main as make_tiny

        return make_tiny(argv[1:])
    parser = build_parser()
    config = from_args(WorkerConfig, parser.parse_args(argv))
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    if config.num_threads is not None:
        import torch

        torch.set_num_threads(config.num_threads)
    try:
        return asyncio.run(serve(config))
    except (OSError, ValueError) as exc:
        # Bad model directory, bad checkpoint, port in use: one clear line, no traceback.
        log.error("omni-worker failed to start: %s", exc)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
