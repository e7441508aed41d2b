"""The router's policy classes, driven directly (no HTTP): registry, health
thresholds, load-balancing policies, the update gate, the journal, rank
planning, fencing. Plus: importing the router never imports torch."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from router.contract.errors import BadRequest, Conflict, NotFound, Unavailable
from router.gateway.admin.journal import UpdateJournal
from router.gateway.admin.operations import OPERATIONS
from router.gateway.routing.policy import LeastInflight, Random, RoundRobin, make_policy
from router.contract.fleet import BroadcastResponse, WorkerResult
from router.gateway.routing.proxy import prepare_payload
from router.gateway.admin.ranks import plan_ranks
from router.gateway.fleet.registry import HealthThresholds, WorkerRegistry, normalize_url, worker_id_for
from router.gateway.admin.update_gate import UpdateGate
from tests.procs import free_port


def test_router_import_leaves_torch_out():
    code = (
        "import sys, router, router.gateway.app, router.gateway.cli, router.trainer, router.contract.fleet;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


class TestUrls:
    def test_normalizes(self):
        assert normalize_url("HTTP://LocalHost:8000/") == "http://localhost:8000"
        assert normalize_url("http://[::1]:9") == "http://[::1]:9"

    @pytest.mark.parametrize(
        "bad",
        ["ftp://h:1", "http://user:pw@h:1", "http://h:1/path", "http://h:1?x=1", "http://169.254.169.254", "http://[fe80::1]:80", "nonsense", "http://h:99999"],
    )
    def test_rejects(self, bad):
        with pytest.raises(BadRequest):
            normalize_url(bad)

    def test_ids_are_stable(self):
        assert worker_id_for("http://a:1") == worker_id_for(normalize_url("http://a:1/"))
        assert worker_id_for("http://a:1") != worker_id_for("http://a:2")


class TestRegistry:
    def test_add_find_remove(self):
        reg = WorkerRegistry()
        w = reg.add("http://127.0.0.1:8001")
        assert reg.find(w.id) is w
        assert reg.find("http%3A%2F%2F127.0.0.1%3A8001") is w
        assert reg.find("http://127.0.0.1:8001/") is w
        with pytest.raises(Conflict):
            reg.add("http://127.0.0.1:8001/")
        reg.remove(w.id)
        assert w.removed and len(reg) == 0
        with pytest.raises(NotFound):
            reg.get(w.id)

    def test_routable_and_live(self):
        reg = WorkerRegistry()
        a, b, c = (reg.add(f"http://h:{p}") for p in (1, 2, 3))
        for w in (a, b, c):
            reg.observe_probe(w, True)
        b.disabled = True
        c.health = "dead"
        assert reg.routable() == [a]
        assert reg.live() == [a, b]

    def test_health_thresholds(self):
        reg = WorkerRegistry(thresholds=HealthThresholds(failure=2, dead=4, success=2))
        w = reg.add("http://h:1")
        assert w.health == "unhealthy"
        assert reg.observe_probe(w, True) and w.health == "healthy"  # first contact: at once
        reg.observe_probe(w, False)
        assert w.health == "healthy"  # one miss is not enough
        reg.observe_probe(w, False)
        assert w.health == "unhealthy"
        reg.observe_probe(w, False)
        reg.observe_probe(w, False)
        assert w.health == "dead"
        reg.observe_probe(w, True)
        assert w.health == "dead"  # needs the success threshold now
        reg.observe_probe(w, True)
        assert w.health == "healthy"

    def test_failures_ignored_while_in_update(self):
        reg = WorkerRegistry(thresholds=HealthThresholds(failure=1, dead=2, success=1))
        w = reg.add("http://h:1")
        reg.observe_probe(w, True)
        w.update_holds = 1
        for _ in range(5):
            reg.observe_probe(w, False)
        assert w.health == "healthy"
        w.update_holds = 0
        reg.observe_probe(w, False)
        reg.observe_probe(w, False)
        assert w.health == "dead"


class TestPolicies:
    def _workers(self, n):
        reg = WorkerRegistry()
        return [reg.add(f"http://h:{i + 1}") for i in range(n)]

    def test_least_inflight(self):
        ws = self._workers(3)
        ws[0].inflight, ws[1].inflight, ws[2].inflight = 3, 1, 2
        assert LeastInflight().choose(ws) is ws[1]
        ws[1].inflight = 0
        ws[2].inflight = 0
        p = LeastInflight()
        assert {p.choose(ws).id for _ in range(4)} == {ws[1].id, ws[2].id}  # ties rotate

    def test_round_robin_and_random(self):
        ws = self._workers(3)
        rr = RoundRobin()
        assert [rr.choose(ws) for _ in range(6)] == ws + ws
        rnd = Random(seed=1)
        assert {rnd.choose(ws).id for _ in range(50)} == {w.id for w in ws}
        with pytest.raises(ValueError):
            make_policy("cache_aware")


class TestUpdateGate:
    async def test_timeout_is_503_and_busy_while_waiting(self):
        waits = []
        gate = UpdateGate(0.2, on_wait=lambda op, s, ok: waits.append((op, ok)))
        await gate.acquire("first")
        assert gate.is_busy and gate.holder.operation == "first"
        with pytest.raises(Unavailable) as err:
            await gate.acquire("second")
        assert err.value.status == 503 and "first" in err.value.message
        waiter = asyncio.ensure_future(gate.acquire("third", timeout_s=5))
        await asyncio.sleep(0.05)
        assert gate.is_busy
        gate.release()
        await waiter
        assert gate.holder.operation == "third"
        gate.release()
        assert not gate.is_busy
        assert waits == [("first", True), ("second", False), ("third", True)]

    async def test_hold_releases_on_error(self):
        gate = UpdateGate(1.0)
        with pytest.raises(RuntimeError):
            async with gate.hold("x"):
                raise RuntimeError("boom")
        assert not gate.is_busy


class TestJournal:
    def test_round_trip_and_crash_recovery(self, tmp_path):
        j = UpdateJournal(tmp_path)
        j.begin("/update_weights_from_disk", [("w-a", "http://a:1", False), ("w-b", "http://b:1", True)])
        assert json.loads((tmp_path / "update_journal.json").read_text())["state"] == "in_flight"
        assert (tmp_path / "update_journal.json").stat().st_mode & 0o777 == 0o600
        # A new process finds the in-flight entry: it becomes a failure naming every target.
        again = UpdateJournal(tmp_path)
        state = again.load()
        assert state.state == "failed" and set(state.failed) == {"w-a", "w-b"}
        assert "router stopped" in state.reason
        assert again.names("w-a") and not again.names("w-c")
        assert again.discard_target("w-a")
        assert again.pending is not None
        assert again.discard_target("w-b")
        assert again.pending is None and not (tmp_path / "update_journal.json").exists()

    def test_clear_on_success(self, tmp_path):
        j = UpdateJournal(tmp_path)
        j.begin("/pause_generation", [("w-a", "http://a:1", False)])
        j.clear()
        assert UpdateJournal(tmp_path).load() is None

    def test_unreadable_fences_everyone(self, tmp_path):
        (tmp_path / "update_journal.json").write_text("{not json")
        state = UpdateJournal(tmp_path).load_or_unreadable([("w-a", "http://a:1"), ("w-b", "http://b:1")])
        assert state.state == "failed" and {t.id for t in state.targets} == {"w-a", "w-b"}

    def test_unwritable_refuses_update(self, tmp_path):
        blocker = tmp_path / "file"
        blocker.write_text("x")
        j = UpdateJournal(blocker / "sub")
        with pytest.raises(Unavailable):
            j.begin("/pause_generation", [("w-a", "http://a:1", False)])
        assert j.pending is None


class TestRanks:
    def test_offsets_follow_tp_sizes(self):
        slots = plan_ranks([("a", "u1", 2), ("b", "u2", 1), ("c", "u3", 4)], world_size=8)
        assert [(s.worker_id, s.rank_offset) for s in slots] == [("a", 1), ("b", 3), ("c", 4)]
        slots = plan_ranks([("a", "u1", 1), ("b", "u2", 1)], world_size=4, rank_offset=2)
        assert [s.rank_offset for s in slots] == [2, 3]

    def test_wrong_world_size_names_the_right_one(self):
        with pytest.raises(BadRequest) as err:
            plan_ranks([("a", "u1", 1), ("b", "u2", 1)], world_size=2)
        assert "must be 3" in err.value.message and err.value.extra["expected_world_size"] == 3

    def test_unknown_tp_is_503(self):
        with pytest.raises(Unavailable):
            plan_ranks([("a", "u1", None)], world_size=2)


class TestWire:
    def test_operations_table(self):
        locked = {p for p, op in OPERATIONS.items() if op.locked}
        assert {"/pause_generation", "/init_weights_update_group", "/destroy_weights_update_group",
                "/update_weights_from_disk", "/update_weights_from_distributed", "/prepare_weights_update",
                "/complete_weights_update"} <= locked  # fmt: skip
        assert OPERATIONS["/update_weights_from_disk"].timeout_s >= 600
        assert OPERATIONS["/init_weights_update_group"].timeout_for({"timeout_s": 2000}) == 2030

    def test_broadcast_response_keeps_extra_fields(self):
        r = BroadcastResponse(success=True, message="ok", path="/x", worker_count=0, results=[])
        r.ranks = [{"worker": "a"}]  # type: ignore[attr-defined]
        assert r.model_dump()["ranks"] == [{"worker": "a"}]
        res = WorkerResult(worker="a", url="u", success=False, error="boom", elapsed_ms=1.0)
        assert res.model_dump()["error"] == "boom"

    def test_rid_injection(self):
        body, rid, stream = prepare_payload(b'{"text": "hi", "stream": true}')
        assert stream and json.loads(body)["rid"] == rid
        body, rid, _ = prepare_payload(b'{"input_ids": [[1, 2], [3]]}')
        assert json.loads(body)["rid"] == [f"{rid}-0", f"{rid}-1"]
        body, rid, _ = prepare_payload(b'{"input_ids": [1, 2]}')
        assert json.loads(body)["rid"] == rid
        assert prepare_payload(b'{"text": "x", "rid": "mine"}')[1] == "mine"
        assert prepare_payload(b"not json") == (b"not json", None, False)


class TestAdminHttp:
    """The lean fan-out client against a real aiohttp server: every framing, keep-alive, timeouts."""

    async def _server(self, aiohttp_server):
        from aiohttp import web

        async def sized(request):
            return web.json_response({"echo": (await request.read()).decode(), "auth": request.headers.get("Authorization")})

        async def chunked(request):
            resp = web.StreamResponse()
            await resp.prepare(request)
            for part in (b'{"parts": ', b"[1, 2, ", b"3]}"):
                await resp.write(part)
            await resp.write_eof()
            return resp

        async def closing(request):
            return web.Response(body=b"bye", headers={"Connection": "close"})

        async def slow(request):
            await asyncio.sleep(5)
            return web.Response(text="late")

        app = web.Application()
        app.router.add_routes([web.post("/sized", sized), web.get("/chunked", chunked), web.get("/close", closing), web.get("/slow", slow)])
        return await aiohttp_server(app)

    async def test_framings_keepalive_and_timeout(self, aiohttp_server):
        from router.gateway.admin.admin_http import AdminHttpClient

        server = await self._server(aiohttp_server)
        base = f"http://127.0.0.1:{server.port}"
        client = AdminHttpClient()
        kw = dict(timeout_s=5.0, connect_timeout_s=2.0)
        status, body = await client.request("POST", base, "/sized", body=b"hi", headers={"Authorization": "Bearer k"}, **kw)
        assert status == 200 and json.loads(body) == {"echo": "hi", "auth": "Bearer k"}
        # The connection went back to the pool and is reused.
        assert len(client._idle[("127.0.0.1", server.port)]) == 1
        status, body = await client.request("GET", base, "/chunked", body=None, headers={}, **kw)
        assert status == 200 and json.loads(body) == {"parts": [1, 2, 3]}
        status, body = await client.request("GET", base, "/close", body=None, headers={}, **kw)
        assert (status, body) == (200, b"bye")
        status, _ = await client.request("GET", base, "/missing", body=None, headers={}, **kw)
        assert status == 404
        with pytest.raises(TimeoutError):
            await client.request("GET", base, "/slow", body=None, headers={}, timeout_s=0.2, connect_timeout_s=1.0)
        with pytest.raises(ValueError):
            await client.request("GET", base, "/sized", body=None, headers={"X": "a\r\nb"}, **kw)
        client.close()
        with pytest.raises(OSError):
            await AdminHttpClient().request("GET", f"http://127.0.0.1:{free_port()}", "/", body=None, headers={}, **kw)
