"""The stand-in Kubernetes API server against the real lightkube AsyncClient (and raw HTTP where lightkube
cannot express a request): if lightkube is happy with it, discovery tests built on it mean something."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import pytest
from lightkube import ApiError, AsyncClient, KubeConfig, operators
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import ConfigMap, Pod
from lightkube.types import on_error_retry

from tests._k8s_standin import LabelRequirement, StandInApiServer, parse_label_selector

NS = "workers"


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StandInApiServer]:
    with StandInApiServer() as srv:
        monkeypatch.setenv("KUBECONFIG", str(srv.write_kubeconfig(tmp_path, namespace=NS)))
        # lightkube honours proxy variables; loopback must bypass any the environment sets.
        monkeypatch.setenv("NO_PROXY", ",".join(filter(None, [os.environ.get("NO_PROXY"), srv.host])))
        yield srv


@pytest.fixture
async def client(standin: StandInApiServer) -> AsyncIterator[AsyncClient]:
    c = AsyncClient(config=KubeConfig.from_file(os.environ["KUBECONFIG"]))
    yield c
    await c.close()


@pytest.fixture
async def raw(standin: StandInApiServer) -> AsyncIterator[httpx2.AsyncClient]:
    headers = {"Authorization": f"Bearer {standin.token}"}
    async with httpx2.AsyncClient(base_url=standin.url, headers=headers, trust_env=False) as c:
        yield c


def names(pods: list[Any]) -> list[str]:
    return [p.metadata.name for p in pods]


async def listed(client: AsyncClient, **kwargs: Any) -> tuple[list[str], str]:
    it = client.list(Pod, **kwargs)
    pods = [p async for p in it]
    return names(pods), it.resourceVersion


def start_watch(client: AsyncClient, **kwargs: Any) -> tuple[asyncio.Task[None], asyncio.Queue[Any]]:
    """Consume client.watch(...) in a task; events, then the exception or "END" that stopped it, go to a queue."""
    out: asyncio.Queue[Any] = asyncio.Queue()

    async def run() -> None:
        try:
            async for kind, pod in client.watch(Pod, **kwargs):
                await out.put((kind, pod))
        except Exception as e:
            await out.put(e)
        else:
            await out.put("END")

    return asyncio.create_task(run()), out


async def take(out: asyncio.Queue[Any], n: int) -> list[tuple[str, str, int]]:
    """The next n events as (type, name, resourceVersion)."""
    got = []
    for _ in range(n):
        item = await out.get()
        assert isinstance(item, tuple), f"watch stopped early: {item!r}"
        kind, pod = item
        got.append((kind, pod.metadata.name, int(pod.metadata.resourceVersion)))
    return got


async def cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


async def until(srv: StandInApiServer, predicate: Callable[[], bool]) -> None:
    await asyncio.to_thread(srv.wait_until, predicate, 3.0)


async def watching(srv: StandInApiServer, n: int = 1) -> None:
    await asyncio.to_thread(srv.wait_for_watchers, n, 3.0)


# ---------------------------------------------------------------------------------------------------------------


async def test_kubeconfig_reaches_the_standin_over_plain_http(
    standin: StandInApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with asyncio.timeout(5):
        path = Path(os.environ["KUBECONFIG"])
        single = KubeConfig.from_file(path).get()
        assert single.cluster.server == standin.url
        assert standin.url.startswith("http://127.0.0.1:")
        assert single.namespace == NS
        assert single.user is not None and single.user.token == standin.token
        # from_env() prefers an in-cluster service account; point it somewhere empty to reach KUBECONFIG.
        config = KubeConfig.from_env(service_account=tmp_path / "no-service-account")
        async with AsyncClient(config=config) as client:
            assert client.namespace == NS
            assert await listed(client) == ([], standin.resource_version)
        last = standin.requests[-1]
        assert (last.method, last.path, last.is_watch) == ("GET", f"/api/v1/namespaces/{NS}/pods", False)
        assert last.authorization == f"Bearer {standin.token}"
        assert standin.list_count == 1


async def test_wrong_token_is_a_401_api_error(standin: StandInApiServer) -> None:
    async with asyncio.timeout(5):
        conf = KubeConfig.from_file(os.environ["KUBECONFIG"])
        conf.users = {name: msgspec.structs.replace(user, token="wrong") for name, user in conf.users.items()}
        async with AsyncClient(config=conf) as client:
            with pytest.raises(ApiError) as err:
                await listed(client)
        assert (err.value.status.code, err.value.status.reason) == (401, "Unauthorized")
        assert standin.requests[-1].authorization == "Bearer wrong"


async def test_list_filters_by_label_and_field_selectors(standin: StandInApiServer, client: AsyncClient) -> None:
    async with asyncio.timeout(5):
        standin.add_pod("a", ip="127.0.0.11", labels={"app": "w", "tier": "gpu"}, namespace=NS)
        standin.add_pod("b", ip="127.0.0.12", labels={"app": "w", "tier": "cpu"}, namespace=NS, ready=False)
        standin.add_pod("c", ip="127.0.0.13", labels={"app": "other"}, namespace=NS, phase="Pending")
        standin.add_pod("d", ip="127.0.0.14", namespace=NS)
        standin.add_pod("e", ip="127.0.0.15", labels={"app": "w"}, namespace="elsewhere")
        rv = standin.resource_version
        cases: list[tuple[dict[str, Any], list[str]]] = [
            ({"app": "w"}, ["a", "b"]),
            ({"app": "w", "tier": "gpu"}, ["a"]),
            ({"tier": operators.in_(["gpu", "cpu"])}, ["a", "b"]),
            ({"app": operators.not_in(["w"])}, ["c", "d"]),
            ({"app": operators.not_equal("w")}, ["c", "d"]),
            ({"tier": None}, ["a", "b"]),
            ({"tier": operators.not_exists()}, ["c", "d"]),
            ({"app": "nobody"}, []),
        ]
        for labels, want in cases:
            assert await listed(client, labels=labels) == (want, rv), labels
        assert await listed(client) == (["a", "b", "c", "d"], rv)
        assert await listed(client, fields={"metadata.name": "b"}) == (["b"], rv)
        assert await listed(client, fields={"status.phase": "Pending"}) == (["c"], rv)
        assert await listed(client, fields={"status.phase": operators.not_equal("Pending")}, labels={"app": "w"}) == (
            ["a", "b"],
            rv,
        )
        assert await listed(client, namespace="*", labels={"app": "w"}) == (["e", "a", "b"], rv)
        assert standin.requests[-1].path == "/api/v1/pods"


async def test_selector_syntax_and_errors_over_raw_http(standin: StandInApiServer, raw: httpx2.AsyncClient) -> None:
    async with asyncio.timeout(5):
        standin.add_pod("a", ip="127.0.0.11", labels={"app": "w", "tier": "gpu", "gen": "3"})
        standin.add_pod("b", ip="127.0.0.12", labels={"app": "w", "tier": "cpu"})
        standin.add_pod("c", ip="127.0.0.13", labels={"app": "other"})

        async def select(selector: str, fields: str = "") -> list[str]:
            params = {"labelSelector": selector, "fieldSelector": fields}
            r = await raw.get("/api/v1/namespaces/default/pods", params=params)
            assert r.status_code == 200, r.text
            body = r.json()
            assert (body["kind"], body["apiVersion"]) == ("PodList", "v1")
            assert body["metadata"]["resourceVersion"] == standin.resource_version
            return [p["metadata"]["name"] for p in body["items"]]

        assert await select("app==w") == ["a", "b"]
        assert await select("app = w , tier != gpu") == ["b"]
        assert await select("app in (w, other),!tier") == ["c"]
        assert await select("tier notin (gpu)") == ["b", "c"]
        assert await select("tier,app") == ["a", "b"]
        assert await select("gen>2") == ["a"]
        assert await select("", "metadata.name=c") == ["c"]
        assert await select("app=w", "metadata.name!=a,status.podIP=127.0.0.12") == ["b"]

        for selector, fields in [("app in (w", ""), ("app=w,", ""), ("=w", ""), ("", "spec.bogus=1")]:
            r = await raw.get(
                "/api/v1/namespaces/default/pods", params={"labelSelector": selector, "fieldSelector": fields}
            )
            assert r.status_code == 400, (selector, fields)
            assert r.headers["content-type"] == "application/json"
            assert (r.json()["kind"], r.json()["reason"]) == ("Status", "BadRequest")

        assert parse_label_selector("k in (a,b), !x") == [
            LabelRequirement("k", "in", ("a", "b")),
            LabelRequirement("x", "!exists"),
        ]
        r = await raw.get("/api/v1/namespaces/default/services")
        assert (r.status_code, r.json()["reason"]) == (404, "NotFound")


async def test_paginated_list_is_a_consistent_snapshot(standin: StandInApiServer, client: AsyncClient) -> None:
    async with asyncio.timeout(5):
        for i in range(5):
            standin.add_pod(f"w{i}", ip=f"127.0.0.{20 + i}", labels={"app": "w"}, namespace=NS)
        rv = standin.resource_version
        it = client.list(Pod, chunk_size=2, labels={"app": "w"})
        seen = []
        async for pod in it:
            seen.append(pod.metadata.name)
            if len(seen) == 1:
                # Changes after the first page must not leak into the later ones.
                standin.add_pod("w9", ip="127.0.0.29", labels={"app": "w"}, namespace=NS)
                standin.delete_pod("w4", namespace=NS)
        assert seen == ["w0", "w1", "w2", "w3", "w4"]
        assert it.resourceVersion == rv
        pages = standin.requests[-3:]
        assert [r.query.get("limit") for r in pages] == ["2", "2", "2"]
        assert "continue" not in pages[0].query and all(r.query.get("continue") for r in pages[1:])

        # A continue token from before a compaction has expired, like one older than etcd's compaction.
        it = client.list(Pod, chunk_size=2)
        with pytest.raises(ApiError) as err:
            async for _ in it:
                standin.compact()
        assert err.value.status.code == 410


async def test_lightkube_decodes_the_pods(standin: StandInApiServer, client: AsyncClient) -> None:
    async with asyncio.timeout(5):
        standin.add_pod("w0", ip="127.0.0.7", port=31000, labels={"app": "w"}, namespace=NS)
        for phase in ("Pending", "Succeeded", "Failed", "Unknown"):
            standin.add_pod(f"p-{phase.lower()}", ip="127.0.0.8", phase=phase, namespace=NS)
        assert len([p async for p in client.list(Pod)]) == 5

        pod = await client.get(Pod, "w0")
        assert pod.metadata.namespace == NS and pod.metadata.labels == {"app": "w"}
        assert isinstance(pod.metadata.creationTimestamp, datetime) and pod.metadata.uid
        assert pod.metadata.deletionTimestamp is None
        assert pod.status.phase == "Running"
        assert pod.status.podIP == "127.0.0.7" and [i.ip for i in pod.status.podIPs] == ["127.0.0.7"]
        ready = {c.type: c.status for c in pod.status.conditions}
        assert ready["Ready"] == "True" and ready["ContainersReady"] == "True"
        assert pod.status.containerStatuses[0].ready is True
        (container,) = pod.spec.containers
        assert container.name == "worker"
        assert [(p.name, p.containerPort, p.protocol) for p in container.ports] == [("http", 31000, "TCP")]

        standin.set_ready("w0", False, namespace=NS)
        standin.mark_terminating("w0", namespace=NS)
        pod = await client.get(Pod, "w0")
        assert {c.type: c.status for c in pod.status.conditions}["Ready"] == "False"
        assert pod.status.containerStatuses[0].ready is False
        assert isinstance(pod.metadata.deletionTimestamp, datetime)
        assert pod.metadata.resourceVersion == standin.resource_version

        pending = await client.get(Pod, "p-pending")
        assert {c.type: c.status for c in pending.status.conditions}["Ready"] == "False"

        with pytest.raises(ApiError) as err:
            await client.get(Pod, "missing")
        assert (err.value.status.code, err.value.status.reason) == (404, "NotFound")


async def test_watch_from_list_version_streams_changes_in_order(standin: StandInApiServer, client: AsyncClient) -> None:
    async with asyncio.timeout(5):
        standin.add_pod("w0", ip="127.0.0.10", labels={"app": "w"}, namespace=NS)
        pods, rv = await listed(client, labels={"app": "w"})
        assert pods == ["w0"]
        task, out = start_watch(client, labels={"app": "w"}, resource_version=rv)
        await watching(standin)
        standin.add_pod("w1", ip="127.0.0.11", labels={"app": "w"}, namespace=NS, ready=False)
        standin.add_pod("x", ip="127.0.0.12", labels={"app": "other"}, namespace=NS)  # not selected
        standin.set_ready("w1", True, namespace=NS)
        standin.mark_terminating("w0", namespace=NS)
        final = standin.delete_pod("w0", namespace=NS)
        events = await take(out, 4)
        assert [(kind, name) for kind, name, _ in events] == [
            ("ADDED", "w1"),
            ("MODIFIED", "w1"),
            ("MODIFIED", "w0"),
            ("DELETED", "w0"),
        ]
        versions = [int(rv)] + [v for _, _, v in events]
        assert versions == sorted(set(versions))
        assert events[-1][2] == int(final["metadata"]["resourceVersion"]) == int(standin.resource_version)
        assert standin.requests[-1].query == {"resourceVersion": rv, "labelSelector": "app=w", "watch": "true"}
        await cancel(task)


async def test_watch_replays_history_with_selector_transitions(standin: StandInApiServer, client: AsyncClient) -> None:
    async with asyncio.timeout(5):
        standin.add_pod("w0", ip="127.0.0.10", labels={"app": "w"}, namespace=NS)
        _, rv = await listed(client, labels={"app": "w"})
        # Everything below happens before the watch opens: it must come from history.
        standin.set_labels("w0", {"app": "drained"}, namespace=NS)
        standin.set_ready("w0", False, namespace=NS)  # invisible: matches neither before nor after
        standin.set_labels("w0", {"app": "w"}, namespace=NS)
        standin.add_pod("w1", ip="127.0.0.11", labels={"app": "w"}, namespace="elsewhere")
        task, out = start_watch(client, labels={"app": "w"}, resource_version=rv)
        events = await take(out, 2)
        assert [(kind, name) for kind, name, _ in events] == [("DELETED", "w0"), ("ADDED", "w0")]
        standin.set_labels("w0", {"app": "w", "extra": "1"}, namespace=NS)
        assert [(k, n) for k, n, _ in await take(out, 1)] == [("MODIFIED", "w0")]
        await cancel(task)


async def test_watch_without_version_starts_with_current_pods(standin: StandInApiServer, client: AsyncClient) -> None:
    async with asyncio.timeout(5):
        a = standin.add_pod("a", ip="127.0.0.10", labels={"app": "w"}, namespace=NS)
        standin.add_pod("b", ip="127.0.0.11", labels={"app": "w"}, namespace=NS)
        standin.set_ready("a", False, namespace=NS)
        standin.add_pod("c", ip="127.0.0.12", labels={"app": "other"}, namespace=NS)
        task, out = start_watch(client, labels={"app": "w"})
        first = await take(out, 2)
        assert [(kind, name) for kind, name, _ in first] == [("ADDED", "a"), ("ADDED", "b")]
        assert first[0][2] > int(a["metadata"]["resourceVersion"])  # current state, not the creation
        standin.delete_pod("b", namespace=NS)
        assert [(k, n) for k, n, _ in await take(out, 1)] == [("DELETED", "b")]
        await cancel(task)


async def test_watch_from_compacted_version_raises_410(standin: StandInApiServer, client: AsyncClient) -> None:
    async with asyncio.timeout(5):
        standin.add_pod("a", ip="127.0.0.10", namespace=NS)
        _, rv = await listed(client)
        standin.set_ready("a", False, namespace=NS)
        compacted = standin.compact()
        with pytest.raises(ApiError) as err:
            async for _ in client.watch(Pod, resource_version=rv):
                pytest.fail("no event may precede the error")
        assert err.value.status.code == 410
        assert err.value.status.reason == "Expired"
        assert err.value.status.message == f"too old resource version: {rv} ({compacted})"
        # lightkube's on_error_retry re-watches without a version after a 410: current pods come as ADDED.
        task, out = start_watch(client, resource_version=rv, on_error=on_error_retry)
        assert [(k, n) for k, n, _ in await take(out, 1)] == [("ADDED", "a")]
        assert "resourceVersion" not in standin.requests[-1].query
        await cancel(task)
        # The version the compaction left is still watchable.
        task, out = start_watch(client, resource_version=str(compacted))
        await watching(standin)
        standin.set_ready("a", True, namespace=NS)
        assert [(k, n) for k, n, _ in await take(out, 1)] == [("MODIFIED", "a")]
        await cancel(task)


async def test_dropped_watch_raises_remote_protocol_error(standin: StandInApiServer, client: AsyncClient) -> None:
    async with asyncio.timeout(5):
        task, out = start_watch(client)
        await watching(standin)
        standin.add_pod("a", ip="127.0.0.10", namespace=NS)
        assert [(k, n) for k, n, _ in await take(out, 1)] == [("ADDED", "a")]
        assert standin.drop_watches() == 1
        assert isinstance(await out.get(), httpx2.RemoteProtocolError)
        await task
        assert standin.watch_count == 1  # with on_error_raise lightkube does not retry by itself


async def test_cleanly_ended_watch_is_resumed_by_lightkube(standin: StandInApiServer, client: AsyncClient) -> None:
    async with asyncio.timeout(5):
        _, rv = await listed(client)
        task, out = start_watch(client, resource_version=rv, server_timeout=1)
        await watching(standin)
        standin.add_pod("a", ip="127.0.0.10", namespace=NS)
        (added,) = await take(out, 1)
        # A stream that ends cleanly is re-requested by lightkube from the last version it yielded:
        # first a graceful drop, then the timeoutSeconds expiry of the stream that replaced it.
        assert standin.drop_watches(graceful=True) == 1
        await until(standin, lambda: standin.watch_count == 2)
        await until(standin, lambda: standin.watch_count == 3)
        for again in standin.requests[-2:]:
            assert again.query["resourceVersion"] == str(added[2]) and again.query["timeoutSeconds"] == "1"
        standin.set_ready("a", False, namespace=NS)
        assert [(k, n) for k, n, _ in await take(out, 1)] == [("MODIFIED", "a")]
        assert out.empty()  # nothing replayed twice
        await cancel(task)


async def test_suspend_refuses_connections_and_resume_serves_the_same_url(
    standin: StandInApiServer, client: AsyncClient
) -> None:
    async with asyncio.timeout(5):
        url = standin.url
        standin.add_pod("a", ip="127.0.0.10", namespace=NS)
        _, rv = await listed(client)  # leaves a keep-alive connection in lightkube's pool
        task, out = start_watch(client, resource_version=rv)
        await watching(standin)

        standin.suspend()
        assert isinstance(await out.get(), httpx2.RemoteProtocolError)
        await task
        with pytest.raises(httpx2.ConnectError):
            async with asyncio.timeout(2):
                await listed(client)
        standin.set_ready("a", False, namespace=NS)  # the cluster moves on while the API is unreachable

        standin.resume()
        assert standin.url == url
        assert await listed(client) == (["a"], standin.resource_version)
        task, out = start_watch(client, resource_version=rv)
        assert [(k, n) for k, n, _ in await take(out, 1)] == [("MODIFIED", "a")]
        await cancel(task)


async def test_mutations_from_other_threads_arrive_in_order(standin: StandInApiServer, client: AsyncClient) -> None:
    async with asyncio.timeout(5):
        for i in range(4):
            standin.add_pod(f"w{i}", ip=f"127.0.0.{10 + i}", namespace=NS)
        _, rv = await listed(client)
        task, out = start_watch(client, resource_version=rv)
        await watching(standin)

        def flip(name: str) -> None:
            for n in range(25):
                standin.set_ready(name, n % 2 == 0, namespace=NS)

        threads = [threading.Thread(target=flip, args=(f"w{i}",)) for i in range(4)]
        for t in threads:
            t.start()
        await asyncio.to_thread(lambda: [t.join() for t in threads])
        events = await take(out, 100)
        assert all(kind == "MODIFIED" for kind, _, _ in events)
        assert [v for _, _, v in events] == list(range(int(rv) + 1, int(rv) + 101))
        assert all(
            {c["type"]: c["status"] for c in p["status"]["conditions"]}["Ready"] == "True" for p in standin.pods(NS)
        )
        await cancel(task)


async def test_bookmarks_only_reach_streams_that_asked(standin: StandInApiServer, raw: httpx2.AsyncClient) -> None:
    async with asyncio.timeout(5):
        path = "/api/v1/namespaces/default/pods"
        params = {"watch": "1", "resourceVersion": standin.resource_version, "timeoutSeconds": "2"}
        async with (
            raw.stream("GET", path, params={**params, "allowWatchBookmarks": "true"}) as marked,
            raw.stream("GET", path, params=params) as plain,
        ):
            assert marked.status_code == plain.status_code == 200
            assert marked.headers["transfer-encoding"] == "chunked"
            await watching(standin, 2)
            rv = standin.send_bookmark()
            standin.add_pod("a", ip="127.0.0.10")
            marked_lines, plain_lines = marked.aiter_lines(), plain.aiter_lines()
            bookmark = json.loads(await anext(marked_lines))
            assert bookmark == {
                "type": "BOOKMARK",
                "object": {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": rv}},
            }
            assert json.loads(await anext(marked_lines))["type"] == "ADDED"
            assert json.loads(await anext(plain_lines))["type"] == "ADDED"
        # lightkube decodes every watch object as the watched kind; a bookmark must survive that.
        assert Pod.from_dict(bookmark["object"]).metadata.resourceVersion == rv


async def test_leases_are_replaced_by_compare_and_swap(standin: StandInApiServer, client: AsyncClient) -> None:
    spec = LeaseSpec(holderIdentity="a", leaseDurationSeconds=15, renewTime=datetime.now(UTC))
    created = await client.create(Lease(metadata=ObjectMeta(name="leader", namespace=NS), spec=spec))
    assert created.metadata.resourceVersion == standin.resource_version
    with pytest.raises(ApiError) as taken:
        await client.create(Lease(metadata=ObjectMeta(name="leader", namespace=NS), spec=spec))
    assert taken.value.status.code == 409 and taken.value.status.reason == "AlreadyExists"
    mine, theirs = await client.get(Lease, "leader", namespace=NS), await client.get(Lease, "leader", namespace=NS)
    mine.spec.holderIdentity = "b"
    renewed = await client.replace(mine)
    assert renewed.spec.holderIdentity == "b" and renewed.metadata.uid == created.metadata.uid
    assert int(renewed.metadata.resourceVersion) > int(created.metadata.resourceVersion)
    theirs.spec.holderIdentity = "c"  # carries the version read before b's write
    with pytest.raises(ApiError) as stale:
        await client.replace(theirs)
    assert stale.value.status.code == 409 and stale.value.status.reason == "Conflict"
    assert "the object has been modified" in stale.value.status.message
    assert standin.lease("leader", NS)["spec"]["holderIdentity"] == "b"
    with pytest.raises(ApiError) as absent:
        await client.get(Lease, "nobody", namespace=NS)
    assert absent.value.status.code == 404


async def test_config_maps_are_deleted_only_at_the_version_given(
    standin: StandInApiServer, client: AsyncClient, raw: httpx2.AsyncClient
) -> None:
    await client.create(ConfigMap(metadata=ObjectMeta(name="state", namespace=NS), data={"r.json": "{}"}))
    version = (await client.get(ConfigMap, "state", namespace=NS)).metadata.resourceVersion
    path = f"/api/v1/namespaces/{NS}/configmaps/state"

    def delete_at(rv: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"resourceVersion": rv}}

    stale = await raw.request("DELETE", path, json=delete_at(str(int(version) - 1)))
    assert stale.status_code == 409 and "Precondition failed" in stale.json()["message"]
    assert standin.config_maps(NS) == ["state"]
    done = await raw.request("DELETE", path, json=delete_at(version))
    assert done.status_code == 200 and done.json()["status"] == "Success"
    assert standin.config_maps(NS) == [] and (await raw.request("DELETE", path)).status_code == 404


async def test_a_blocked_token_hangs_then_is_cut_while_others_pass(standin: StandInApiServer, tmp_path: Path) -> None:
    cut_off = AsyncClient(config=KubeConfig.from_file(standin.write_kubeconfig(tmp_path / "cut", NS, token="cut")))
    other = AsyncClient(config=KubeConfig.from_file(standin.write_kubeconfig(tmp_path / "other", NS, token="other")))
    try:
        standin.block_token("cut", hang_s=0.5)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(httpx2.TransportError):
            await cut_off.get(Lease, "leader", namespace=NS)
        assert loop.time() - started >= 0.5
        with pytest.raises(ApiError):  # the other client is not partitioned: an answer (404)
            await other.get(Lease, "leader", namespace=NS)
        standin.unblock_token("cut")
        with pytest.raises(ApiError):
            await cut_off.get(Lease, "leader", namespace=NS)
    finally:
        await cut_off.close()
        await other.close()


def test_only_loopback_addresses() -> None:
    with pytest.raises(ValueError):
        StandInApiServer(host="localhost")
    srv = StandInApiServer(host="127.0.0.2")
    with pytest.raises(ValueError):
        srv.add_pod("a", ip="not-an-address")
    with pytest.raises(ValueError):
        srv.add_pod("a", ip="127.0.0.10", labels={"bad key!": "x"})
    # State can be prepared before the server starts.
    assert srv.add_pod("a", ip="127.0.0.10")["metadata"]["resourceVersion"] == srv.resource_version
