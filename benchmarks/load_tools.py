"""The fixed-answer upstream and the load of the peer benchmarks: one nginx on 127.0.0.1 answering
``POST /generate`` from memory with SGLang's shape (and the read-only worker routes routers ask at
start-up), and ``wrk`` driving it with one small Lua script that prints its own percentiles."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: One prompt as a trainer sends it (no rid: the routers assign one where they need it).
REQUEST_BODY = json.dumps(
    {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
)

#: What the upstream answers, SGLang's shape (one prompt).
GENERATE_REPLY = json.dumps(
    {
        "text": " Paris. It is also the largest city",
        "output_ids": [12366, 13, 1084, 374, 1083, 279, 7772, 3283],
        "meta_info": {
            "id": "bench",
            "finish_reason": {"type": "length", "length": 8},
            "prompt_tokens": 5,
            "completion_tokens": 8,
            "cached_tokens": 0,
            "weight_version": "default",
            "e2e_latency": 0.001,
        },
    }
)

#: Read-only worker routes, answered so that the routers take the upstream as a healthy SGLang server.
WORKER_INFO = {
    "/health": {"status": "ok", "weight_version": "default"},
    "/model_info": {
        "model_path": "bench/fixed-answer",
        "tokenizer_path": None,
        "is_generation": True,
        "weight_version": "default",
        "tp_size": 1,
    },
    "/server_info": {"tp_size": 1, "dp_size": 1, "weight_version": "default", "version": "bench"},
}
WORKER_INFO["/get_model_info"] = WORKER_INFO["/model_info"]
WORKER_INFO["/get_server_info"] = WORKER_INFO["/server_info"]

LUA_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = os.getenv("BENCH_BODY")
for line in string.gmatch(os.getenv("BENCH_HEADERS") or "", "[^\\n]+") do
  local name, value = string.match(line, "^([^:]+):%s*(.*)$")
  wrk.headers[name] = value
end
local session_keys = tonumber(os.getenv("BENCH_SESSION_KEYS") or "0")
if session_keys > 0 then
  request = function()
    wrk.headers["X-Session-Id"] = "session-" .. math.random(1, session_keys)
    return wrk.format()
  end
end

done = function(summary, latency, requests)
  io.write(string.format(
    "BENCH_RESULT {\\"requests\\": %d, \\"duration_us\\": %d, \\"p50_us\\": %d, \\"p99_us\\": %d, " ..
    "\\"non2xx\\": %d, \\"socket_errors\\": %d}\\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    summary.errors.status, summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout))
end
"""


def _nginx_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def nginx_config(root: Path, port: int) -> str:
    locations = "\n".join(
        f"    location = {path} {{ return 200 {_nginx_string(json.dumps(body))}; }}"
        for path, body in WORKER_INFO.items()
    )
    temp = " ".join(f"{kind}_temp_path {root / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return f"""daemon off;
worker_processes 1;
pid {root / "nginx.pid"};
error_log {root / "error.log"} warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  {temp}
  keepalive_requests 100000000;
  keepalive_timeout 120s;
  default_type application/json;
  server {{
    listen 127.0.0.1:{port} reuseport backlog=4096;
    location = /generate {{ return 200 {_nginx_string(GENERATE_REPLY)}; }}
{locations}
    location / {{ return 404 '{{"error": {{"message": "not served by the benchmark upstream"}}}}'; }}
  }}
}}
"""


@dataclass
class Sample:
    rps: float
    p50_ms: float
    p99_ms: float


def run_wrk(
    wrk: str,
    lua: Path,
    url: str,
    *,
    seconds: float,
    concurrency: int,
    threads: int,
    headers: Sequence[str] = (),
    session_keys: int = 0,
) -> Sample:
    argv = [
        wrk,
        f"-t{min(threads, concurrency)}",
        f"-c{concurrency}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "10s",
        "-s",
        str(lua),
        url + "/generate",
    ]
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=seconds + 60,
        env={
            **os.environ,
            "BENCH_BODY": REQUEST_BODY,
            "BENCH_HEADERS": "\n".join(headers),
            "BENCH_SESSION_KEYS": str(session_keys),
        },
    )
    match = re.search(r"^BENCH_RESULT (\{.*\})$", done.stdout, re.MULTILINE)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"wrk against {url} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    r = json.loads(match.group(1))
    if r["non2xx"] or r["socket_errors"] or not r["requests"]:
        raise RuntimeError(f"{url}: {r['non2xx']} non-2xx answers, {r['socket_errors']} socket errors: {r}")
    return Sample(r["requests"] / (r["duration_us"] / 1e6), r["p50_us"] / 1000.0, r["p99_us"] / 1000.0)
