"""``omni-router status``: its flags, one look or a refreshing one, and its exit code."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import TextIO
from urllib.parse import urlsplit

from router.contract.web.auth import ADMIN_KEY_ENV, resolve_admin_key
from router.gateway.status.reading import RouterReader, Unreadable
from router.gateway.status.render import StatusReport, build_report, render_text
from router.gateway.status.verdict import ALL_ROUTABLE, NONE_ROUTABLE, SOME_OUT

#: Cursor home and erase the screen: each refresh of ``--watch`` replaces the previous one.
CLEAR_SCREEN = "\x1b[H\x1b[2J"
DEFAULT_WATCH_S = 2.0
DEFAULT_TIMEOUT_S = 5.0


def _url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s)://HOST:PORT URL")
    return text.rstrip("/")


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def build_parser(default_port: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omni-router status",
        description="Show a running router's workers, its weight-update journal and the fleet's recorded weight "
        "versions.",
        epilog=f"Exit status: {ALL_ROUTABLE} every worker is routable; {SOME_OUT} some worker is out of rotation; "
        f"{NONE_ROUTABLE} no worker is routable, or the router could not be read (the reason goes to stderr).",
    )
    p.add_argument(
        "--url", type=_url, default=f"http://127.0.0.1:{default_port}", help="the router's base URL (%(default)s)"
    )
    p.add_argument(
        "--admin-api-key",
        "--admin-key",
        dest="admin_key",
        default=None,
        metavar="KEY",
        help=f"the router's admin key (bearer), as the router's own flag names it (--admin-key: the same); "
        f"default: ${ADMIN_KEY_ENV}, as the router reads it",
    )
    p.add_argument(
        "--timeout-s",
        type=_positive,
        metavar="SECONDS",
        default=DEFAULT_TIMEOUT_S,
        help="seconds each call may wait for the router (%(default)g)",
    )
    p.add_argument(
        "--watch",
        type=_positive,
        nargs="?",
        const=DEFAULT_WATCH_S,
        default=None,
        metavar="SECONDS",
        help=f"refresh every SECONDS (without a value: {DEFAULT_WATCH_S:g}) until Ctrl-C",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (with --watch: one line per refresh) instead of the tables",
    )
    return p


def look(reader: RouterReader) -> StatusReport:
    """One reading of the router, as the router judged it (raises :class:`Unreadable`)."""
    return build_report(reader.url, reader.fleet_status())


def _print(report: StatusReport, as_json: bool, out: TextIO, *, one_line: bool = False) -> None:
    if as_json:
        out.write(report.model_dump_json(indent=None if one_line else 2) + "\n")
    else:
        out.write(render_text(report))
    out.flush()


def watch(reader: RouterReader, every_s: float, as_json: bool, out: TextIO, err: TextIO) -> int:
    """Refresh until Ctrl-C; the exit code is the last reading's. A router that cannot be read is
    said in place and asked again: a watch outlives the router's restarts."""
    code = NONE_ROUTABLE
    try:
        while True:
            started = time.monotonic()
            try:
                report = look(reader)
            except Unreadable as exc:
                code = NONE_ROUTABLE
                stamp = time.strftime("%H:%M:%S")
                if as_json:
                    err.write(f"omni-router status: {exc}\n")
                    err.flush()
                else:
                    out.write(f"{CLEAR_SCREEN}omni-router status: {exc} (at {stamp}; Ctrl-C stops)\n")
                    out.flush()
            else:
                code = report.exit_code
                if not as_json:
                    out.write(f"{CLEAR_SCREEN}every {every_s:g}s; Ctrl-C stops\n")
                _print(report, as_json, out, one_line=True)
            time.sleep(max(0.0, every_s - (time.monotonic() - started)))
    except KeyboardInterrupt:
        return code


def main(argv: Sequence[str] | None, *, default_port: int) -> int:
    """``argv`` without the leading ``status``; ``default_port`` is the router's own default."""
    out, err = sys.stdout, sys.stderr
    args = build_parser(default_port).parse_args(argv)
    reader = RouterReader(args.url, admin_key=resolve_admin_key(args.admin_key), timeout_s=args.timeout_s)
    if args.watch is not None:
        return watch(reader, args.watch, args.json, out, err)
    try:
        report = look(reader)
    except Unreadable as exc:
        err.write(f"omni-router status: {exc}\n")
        return NONE_ROUTABLE
    _print(report, args.json, out)
    return report.exit_code
