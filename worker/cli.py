"""``omni-worker``: serve a model, or write a tiny test checkpoint.

    omni-worker --model-path DIR [--host H] [--port P] [--device cpu|cuda|cuda:N] [--dtype float32|bfloat16]
                [--admin-api-key K] [--api-key K] [--max-running-requests N] [--num-threads N]
                [--served-model-name NAME] [--log-level debug|info|warning|error] [--step-delay-ms MS]
                [--tp-size N] [--shutdown-grace-s 30] [--allow-pickled-tensors]
                [--snapshot-lease-wait-s 10] [--snapshot-send-delay-ms MS]
                [--weight-transfer-config '{"backend": "torch"|"nccl"}']
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
import json
import logging
import signal
import sys
from collections.abc import Sequence

from router import __version__
from router.contract.web.auth import ADMIN_KEY_ENV, resolve_admin_key
from worker.config import WorkerConfig

log = logging.getLogger("omni-worker")


def build_parser() -> argparse.ArgumentParser:
    d = WorkerConfig(model_path="")
    p = argparse.ArgumentParser(
        prog="omni-worker",
        description="Serve a Llama/Qwen2 model with the SGLang-compatible RL admin API.",
        epilog="omni-worker make-tiny OUT_DIR [--arch llama|qwen2] [--seed N] [--chat-template] writes a tiny random checkpoint.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--model-path", required=True, help="Hugging Face model directory (config.json + *.safetensors)")
    p.add_argument("--host", default=d.host, help="address to listen on")
    p.add_argument("--port", type=int, default=d.port, help="TCP port to listen on; 0 picks a free one")
    p.add_argument("--device", default=d.device, help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=d.dtype, help="dtype the weights are served in")
    p.add_argument(
        "--admin-api-key", default=None, help=f"bearer key for admin routes; when unset, ${ADMIN_KEY_ENV} is used"
    )
    p.add_argument("--api-key", default=None, help="bearer key for /generate (the admin key is accepted too)")
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=d.max_running_requests,
        help="requests decoded together in one batch; more wait in the queue",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch intra-op CPU threads (torch.set_num_threads); default: torch's choice, one per core. On a small "
        "CPU machine shared with a trainer or other workers, 1 keeps PyTorch's spinning OpenMP threads from "
        "starving the gloo transport of weight sync",
    )
    p.add_argument(
        "--served-model-name", default=None, help="model name reported by /model_info; default: the model path"
    )
    p.add_argument(
        "--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"], help="log verbosity"
    )
    p.add_argument(
        "--step-delay-ms",
        type=float,
        default=0.0,
        help="testing aid: milliseconds to sleep after every forward step, so requests stay in flight",
    )
    p.add_argument(
        "--snapshot-lease-wait-s",
        type=float,
        default=d.snapshot_lease_wait_s,
        help="how long a weight update waits for /weights_snapshot streams in flight before cutting them",
    )
    p.add_argument(
        "--snapshot-send-delay-ms",
        type=float,
        default=0.0,
        help="testing aid: milliseconds to sleep after each tensor a /weights_snapshot stream sends",
    )
    p.add_argument(
        "--tp-size",
        type=int,
        default=d.tp_size,
        help="tensor-parallel ranks on this host: this process is rank 0 and starts the others (one GPU each "
        "on CUDA, gloo on CPU); the router gives the worker tp-size consecutive ranks in a weight-update group",
    )
    p.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=d.shutdown_grace_s,
        help="seconds that generations in flight may run to completion after SIGTERM (new ones get 503, "
        "/health says draining) before the rest are aborted; keep it below Kubernetes' "
        "terminationGracePeriodSeconds minus about 15 s (leaving a weight-update group, stopping)",
    )
    p.add_argument(
        "--allow-pickled-tensors",
        action="store_true",
        help="accept SGLang's pickled serialized_named_tensors on /update_weights_from_tensor (decoded by a "
        "restricted unpickler that still opens the shared memory the caller names); off by default",
    )
    p.add_argument(
        "--weight-transfer-config",
        type=_weight_transfer_config,
        default=d.weight_transfer_backend,
        metavar="JSON",
        dest="weight_transfer_backend",
        help='vLLM\'s spelling, e.g. \'{"backend": "nccl"}\': the group /init_weight_transfer_engine builds. '
        '"torch" (default): a torch.distributed group (gloo on CPU, NCCL on CUDA), as for '
        "/init_weights_update_group; \"nccl\": vLLM's own NCCL engine rendezvous, which vLLM's trainer-side "
        "engine (TRL, SkyRL) joins; CUDA only",
    )
    return p


WEIGHT_TRANSFER_BACKENDS = ("torch", "nccl")


def _weight_transfer_config(text: str) -> str:
    """``--weight-transfer-config``: vLLM's JSON form, or a bare backend name."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = {"backend": text}
    backend = data.get("backend") if isinstance(data, dict) else None
    if backend not in WEIGHT_TRANSFER_BACKENDS:
        raise argparse.ArgumentTypeError(
            f"expected a JSON object with backend one of {', '.join(WEIGHT_TRANSFER_BACKENDS)}, got {text!r}"
        )
    return str(backend)


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(
        model_path=args.model_path,
        host=args.host,
        port=args.port,
        device=args.device,
        dtype=args.dtype,
        admin_api_key=resolve_admin_key(args.admin_api_key),
        api_key=args.api_key or None,
        max_running_requests=args.max_running_requests,
        served_model_name=args.served_model_name,
        log_level=args.log_level,
        step_delay_s=args.step_delay_ms / 1000.0,
        snapshot_lease_wait_s=args.snapshot_lease_wait_s,
        snapshot_send_delay_s=args.snapshot_send_delay_ms / 1000.0,
        num_threads=args.num_threads,
        shutdown_grace_s=args.shutdown_grace_s,
        tp_size=args.tp_size,
        allow_pickled_tensors=args.allow_pickled_tensors,
        weight_transfer_backend=args.weight_transfer_backend,
    )


def _check_device(parser: argparse.ArgumentParser, device: str) -> None:
    if device == "cpu":
        return
    if not (device == "cuda" or device.startswith("cuda:")):
        parser.error(f"--device must be cpu, cuda or cuda:N, not {device!r}")
    import torch

    if not torch.cuda.is_available():
        parser.error("--device cuda requested but no CUDA device is available")


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
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_running_requests < 1:
        parser.error("--max-running-requests must be at least 1")
    if args.num_threads is not None and args.num_threads < 1:
        parser.error("--num-threads must be at least 1")
    if args.tp_size < 1:
        parser.error("--tp-size must be at least 1")
    if not args.shutdown_grace_s >= 0:
        parser.error("--shutdown-grace-s must be >= 0")
    _check_device(parser, args.device)
    if args.weight_transfer_backend == "nccl" and args.device == "cpu":
        parser.error('--weight-transfer-config {"backend": "nccl"} needs a CUDA device (--device cuda)')
    config = config_from_args(args)
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
