"""A standby router takes over on Kubernetes (``--leader-election --state-store k8s``).

The API server is a stand-in (``tests._k8s_standin``: Leases and ConfigMaps with resourceVersion
compare-and-swap, on loopback); everything else is real: two ``omni-router`` processes, each with its
own kubeconfig and token (so one can be cut off from the API alone) and its own ``POD_NAME``, their
lightkube clients, and ``omni-worker`` processes where an update is involved. Leases are short
(:data:`LEASE_S`) so a failover takes seconds. Covered: a standby refuses every client call with 503
and ``Retry-After`` while the leader serves; the leader killed mid-update leaves its targets fenced
and journaled for the standby that takes over, and an operator resolves it there; a leader cut off
from the API stops serving admin calls before the standby accepts any; the state store refuses a
write that would overwrite another replica's; the trainer client rides through a failover.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import pytest
from lightkube import Client, KubeConfig

from router.gateway.admin.journal import JOURNAL_FILE
from router.gateway.config import RouterConfig
from router.gateway.state.k8s_store import DEFAULT_PREFIX, KubernetesStore, StateConflict, configmap_name
from router.trainer import RouterCallError, RouterClient
from tests._k8s_standin import StandInApiServer
from tests._router_fixtures import ADMIN_KEY, auth, generate_via, start_router, wait_for, workers
from tests._tiers import process_fixture
from tests._weight_sync_fixtures import WORKER_ARGS
from tests.procs import ManagedProcess, free_port, http_json

NS = "omni"
LEASE = "omni-router-leader"
#: Lease duration, renew deadline and retry period: a failover within seconds.
LEASE_S, RENEW_S, RETRY_S = 3.0, 2.0, 0.5
#: A standby takes over within about two lease durations of the leader's last renewal.
TAKEOVER_S = 2 * LEASE_S + 2
ELECTION_ARGS = [
    "--state-store",
    "k8s",
    "--leader-election",
    "--leader-lease-duration-s",
    str(LEASE_S),
    "--leader-renew-deadline-s",
    str(RENEW_S),
    "--leader-retry-period-s",
    str(RETRY_S),
]
STANDBY_MESSAGE = "this omni-router replica is a standby; the leader is {}"


@pytest.fixture
def api() -> Iterator[StandInApiServer]:
    with StandInApiServer() as srv:
        yield srv


@dataclass
class Replicas:
    """The router replicas a test started (all stopped at its end), each with its own kubeconfig and token."""

    api: StandInApiServer
    root: Path
    started: list[ManagedProcess] = field(default_factory=list)

    def start(
        self, name: str, worker_urls: list[str] | None = None, data_planes: int = 1, extra: Sequence[str] = ()
    ) -> tuple[ManagedProcess, str]:
        no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1"]))
        kubeconfig = self.api.write_kubeconfig(self.root / f"kubeconfig-{name}", namespace=NS, token=token_of(name))
        env = {"KUBECONFIG": str(kubeconfig), "NO_PROXY": no_proxy, "POD_NAME": name}
        args = [*ELECTION_ARGS, "--data-plane-processes", str(data_planes), *extra]
        proc, url = start_router(worker_urls or [], admin_key=ADMIN_KEY, extra_args=args, env=env, wait_healthy=0)
        self.started.append(proc)
        return proc, url


@process_fixture()
def replicas(api: StandInApiServer, tmp_path: Path) -> Iterator[Replicas]:
    made = Replicas(api, tmp_path)
    try:
        yield made
    finally:
        for proc in made.started:
            proc.stop()


def token_of(name: str) -> str:
    return f"token-{name}"


def call(url: str, method: str = "GET", body: Any = None, timeout: float = 10) -> tuple[int, Any, dict[str, str]]:
    """(status, JSON body, headers) of one request with the admin key."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={**auth(), "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null"), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null"), dict(err.headers)


def role(url: str) -> str | None:
    try:
        return call(url + "/leader", timeout=3)[1]["role"]
    except OSError:
        return None


def wait_role(url: str, proc: ManagedProcess, wanted: str, timeout: float = TAKEOVER_S) -> None:
    wait_for(lambda: role(url) == wanted, timeout, proc, f"{proc.name} is {wanted}")


def leader_and_standby(
    replicas: Replicas, worker_urls: list[str] | None = None, data_planes: int = 1, extra: Sequence[str] = ()
) -> tuple[tuple[ManagedProcess, str], ...]:
    """router-a leads, router-b stands by (both see the same workers)."""
    a = replicas.start("router-a", worker_urls, data_planes, extra)
    wait_role(a[1], a[0], "leader")
    b = replicas.start("router-b", worker_urls, data_planes, extra)
    wait_for(lambda: call(b[1] + "/health")[1].get("leader", {}).get("holder") == "router-a", 10, b[0], "b sees a")
    return a, b


def assert_standby_refusal(status: int, body: Any, headers: dict[str, str], holder: str) -> None:
    assert status == 503, body
    assert body == {"error": {"message": STANDBY_MESSAGE.format(holder)}}
    assert headers["X-Omni-Router-Role"] == "standby"
    assert 1 <= int(headers["Retry-After"]) <= LEASE_S


# -- settings ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"leader_election": True}, "needs --state-store k8s"),
        ({"state_store": "dir"}, "needs --state-dir"),
        ({"state_store": "k8s", "state_dir": Path("/nonexistent")}, "keeps records in ConfigMaps"),
        ({"state_store": "k8s", "state_configmap_prefix": "Not_DNS"}, "must be a DNS label"),
        ({"leader_pod_label": "omni-router.io/role"}, "needs --leader-election"),
        (
            {"state_store": "k8s", "leader_election": True, "leader_pod_label": "not a label/key!"},
            "must be a label key",
        ),
        (
            {"state_store": "k8s", "leader_election": True, "leader_lease_duration_s": 2, "leader_renew_deadline_s": 2},
            "lease duration > renew deadline > retry period",
        ),
    ],
)
def test_high_availability_settings_are_checked_before_start(settings: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        RouterConfig(**settings).validate()


# -- a standby refuses, the leader serves ------------------------------------------------------------------------


def test_standby_refuses_every_client_route_while_the_leader_serves(api, replicas) -> None:
    (_, a_url), (_, b_url) = leader_and_standby(replicas)
    assert api.lease(LEASE, NS)["spec"]["holderIdentity"] == "router-a"

    for method, path, body in (
        ("GET", "/workers", None),
        ("POST", "/pause_generation", {"mode": "retract"}),
        ("POST", "/workers", {"url": "http://127.0.0.9:1"}),
        ("GET", "/weight_update_journal", None),
        ("POST", "/generate", {"text": "hi"}),
        ("GET", "/openapi.json", None),
    ):
        assert_standby_refusal(*call(b_url + path, method, body), holder="router-a")
    status, body, _ = call(b_url + "/readiness")
    assert status == 503 and "standby" in body["reason"]
    assert call(b_url + "/liveness")[0] == 200
    status, body, _ = call(b_url + "/health")
    assert status == 200 and body["leader"] == {"role": "standby", "holder": "router-a", "identity": "router-b"}
    status, body, _ = call(b_url + "/leader")
    assert status == 503 and body["role"] == "standby"
    assert http_json("GET", b_url + "/metrics")[0] == 200  # Prometheus scrapes standbys too

    # The leader's routes are untouched.
    status, body, headers = call(a_url + "/workers")
    assert status == 200 and body == {"workers": []} and "X-Omni-Router-Role" not in headers
    status, body, _ = call(a_url + "/leader")
    assert status == 200 and body == {"role": "leader", "holder": "router-a", "identity": "router-a"}
    assert call(a_url + "/health")[1]["leader"]["role"] == "leader"
    assert call(a_url + "/weight_update_journal")[0] == 200


# -- the leader killed mid-update ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(worker_fleet) -> list[str]:
    return worker_fleet(2, extra_args=["--admin-api-key", ADMIN_KEY, *WORKER_ARGS]).urls


def hanging_init(router_url: str, answer: dict[str, Any], timeout_s: float = 6.0) -> threading.Thread:
    """A group init nobody completes: the workers wait ``timeout_s`` for a trainer that never comes."""
    port = free_port()
    body = {"master_address": "127.0.0.1", "master_port": port, "world_size": 3, "timeout_s": timeout_s,
            "group_name": f"hanging-{port}"}  # fmt: skip

    def send() -> None:
        try:
            answer["r"] = http_json("POST", router_url + "/init_weights_update_group", body, headers=auth(), timeout=60)
        except OSError as exc:  # the router was killed under us
            answer["error"] = exc

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_leader_killed_mid_update_the_standby_takes_over_with_its_targets_fenced(api, replicas, pair) -> None:
    (a, a_url), (b, b_url) = leader_and_standby(replicas, pair)
    wait_for(lambda: all(w["health"] == "healthy" for w in workers(a_url, ADMIN_KEY)), 30, a, "workers healthy")
    answer: dict[str, Any] = {}
    thread = hanging_init(a_url, answer)
    try:
        wait_for(lambda: all(w["disabled"] for w in workers(a_url, ADMIN_KEY)), 10, a, "targets fenced")

        # The fence is written to the store while the data planes acknowledge it (the call goes to the
        # workers once both are done), so the entry may land a moment after the fence shows.
        def journaled() -> bool:
            stored = api.config_map(configmap_name(DEFAULT_PREFIX, JOURNAL_FILE), NS)
            return stored is not None and json.loads(stored["data"][JOURNAL_FILE])["state"] == "in_flight"

        wait_for(journaled, 10, a, "the journal entry in the store")
        killed = time.monotonic()
        a.kill()  # SIGKILL: no cleanup, no lease release
    finally:
        thread.join(30)
    assert "error" in answer and not thread.is_alive()

    wait_role(b_url, b, "leader")
    took_over_s = time.monotonic() - killed
    assert took_over_s < TAKEOVER_S, took_over_s
    assert api.lease(LEASE, NS)["spec"]["holderIdentity"] == "router-b"
    # Healthy, yet fenced: the new leader read the journal the old one wrote.
    fleet = workers(b_url, ADMIN_KEY)
    assert [(w["health"], w["disabled"]) for w in fleet] == [("healthy", True), ("healthy", True)]
    status, journal, _ = call(b_url + "/weight_update_journal")
    pending = journal["pending"]
    assert pending["state"] == "failed" and pending["path"] == "/init_weights_update_group"
    assert "router stopped" in pending["reason"] and sorted(pending["failed"]) == sorted(w["id"] for w in fleet)
    assert journal["storage"]["healthy"] and journal["storage"]["location"].startswith("ConfigMaps omni/")
    stored = api.config_map(configmap_name(DEFAULT_PREFIX, JOURNAL_FILE), NS)
    assert stored is not None and json.loads(stored["data"][JOURNAL_FILE])["state"] == "failed"
    # Nothing routes to the fenced workers; a new update is refused until an operator resolves it.
    assert generate_via(b_url)[0] == 503
    assert call(b_url + "/pause_generation", "POST", {"mode": "retract"})[0] == 409

    status, body, _ = call(b_url + "/weight_update_journal/resolve", "POST", {"acknowledge": True})
    assert status == 200 and body["resolved"]
    assert not any(w["disabled"] for w in workers(b_url, ADMIN_KEY))
    assert generate_via(b_url)[0] == 200
    assert api.config_map(configmap_name(DEFAULT_PREFIX, JOURNAL_FILE), NS) is None


# -- the leader cut off from the API ---------------------------------------------------------------------------


def admin_accepted(url: str) -> bool:
    return call(url + "/workers", timeout=2)[0] == 200


def generation_accepted(url: str) -> bool:
    return generate_via(url, max_new_tokens=1, timeout=5)[0] == 200


@dataclass
class Poller:
    """Asks one replica every 50 ms (an admin route by default); records (sent, answered, accepted) per call."""

    url: str
    accepts: Callable[[str], bool] = admin_accepted
    samples: list[tuple[float, float, bool]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        deadline = time.monotonic() + 60  # a bound only: the test stops it long before
        while not self.stop.is_set() and time.monotonic() < deadline:
            sent = time.monotonic()
            try:
                accepted = self.accepts(self.url)
            except OSError:
                accepted = False
            self.samples.append((sent, time.monotonic(), accepted))
            self.stop.wait(0.05)

    def accepted(self) -> list[tuple[float, float, bool]]:
        return [s for s in self.samples if s[2]]


def cut_off_the_leader(
    api: StandInApiServer,
    leader: tuple[ManagedProcess, str],
    standby: tuple[ManagedProcess, str],
    accepts: Callable[[str], bool],
    what: str,
) -> tuple[float, float, float]:
    """Poll both replicas with ``accepts``, cut router-a (the leader) off from the API server and wait until
    router-b leads and accepts. Returns (the cut, the end of the old leader's last accepted call, the start of
    the new leader's first)."""
    (a, a_url), (b, b_url) = leader, standby
    pollers = [Poller(a_url, accepts), Poller(b_url, accepts)]
    threads = [threading.Thread(target=p.run, daemon=True) for p in pollers]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: bool(pollers[0].accepted()), 10, a, f"the leader {what}")
        cut = time.monotonic()
        api.block_token(token_of("router-a"), hang_s=30)
        wait_role(b_url, b, "leader")
        assert a.proc is not None
        assert a.proc.wait(timeout=10) == 1  # it stepped down and exited, as client-go's controllers do
        wait_for(lambda: bool(pollers[1].accepted()), 10, b, f"the new leader {what}")
    finally:
        for p in pollers:
            p.stop.set()
        for t in threads:
            t.join(10)
    assert not any(t.is_alive() for t in threads)
    last_a = max(answered for _, answered, _ in pollers[0].accepted())
    first_b = min(sent for sent, _, _ in pollers[1].accepted())
    return cut, last_a, first_b


def test_a_leader_cut_off_from_the_api_stops_before_the_standby_serves(api, replicas) -> None:
    a, b = leader_and_standby(replicas)
    cut, last_a, first_b = cut_off_the_leader(api, a, b, admin_accepted, "accepts admin calls")
    assert "lost the leadership" in a[0].log_text()
    # Never a moment when both accepted admin calls: the old leader's last acceptance ended before the new one's first began.
    assert last_a < first_b, (last_a - cut, first_b - cut)
    assert last_a - cut < RENEW_S + 1  # it stopped within its renew deadline of the cut


# -- the standby with data-plane processes ---------------------------------------------------------------------


def data_plane_pids(proc: ManagedProcess) -> set[int]:
    """The processes the router's control process runs as its children: its data planes."""
    assert proc.proc is not None
    pids: set[int] = set()
    for task in Path(f"/proc/{proc.proc.pid}/task").iterdir():
        pids.update(int(p) for p in (task / "children").read_text().split())
    return {pid for pid in pids if running(pid)}


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whoever adopted it, maybe never here)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_data_planes_serve_only_while_their_control_process_leads(api, replicas, pair) -> None:
    (a, a_url), (b, b_url) = leader_and_standby(replicas, pair, data_planes=2)
    wait_for(lambda: len(data_plane_pids(a)) == 2 and len(data_plane_pids(b)) == 2, 30, b, "two data planes each")
    a_planes = data_plane_pids(a)
    wait_for(lambda: all(w["health"] == "healthy" for w in workers(a_url, ADMIN_KEY)), 30, a, "workers healthy")
    assert all(generate_via(a_url)[0] == 200 for _ in range(8))  # spread over both of a's data planes

    # The standby's data planes refuse generation as its control process refuses the rest.
    for _ in range(8):
        assert_standby_refusal(*call(b_url + "/generate", "POST", {"text": "hi"}), holder="router-a")
    status, body, _ = call(b_url + "/readiness")
    assert status == 503 and "standby" in body["reason"]

    # The leader cut off from the API: its data planes stop generating before the standby's start.
    cut, last_a, first_b = cut_off_the_leader(api, (a, a_url), (b, b_url), generation_accepted, "generates")
    assert last_a < first_b, (last_a - cut, first_b - cut)
    assert last_a - cut < RENEW_S + 1
    wait_for(lambda: not any(running(pid) for pid in a_planes), 15, a, "the old leader's data planes exit")

    # One of the new leader's data planes killed: the other serves, the control process starts it again.
    victim = min(data_plane_pids(b))
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: len(data_plane_pids(b) - {victim}) == 2, 30, b, "the data plane restarted")
    assert all(generate_via(b_url)[0] == 200 for _ in range(8))
    assert role(b_url) == "leader"


# -- the role label on each replica's pod ----------------------------------------------------------------------

ROLE = "omni-router.io/role"


def role_label(api: StandInApiServer, pod: str) -> str | None:
    return (api.pod(pod, NS) or {}).get("metadata", {}).get("labels", {}).get(ROLE)


def test_each_replica_labels_its_own_pod_with_its_role(api, replicas) -> None:
    """What lets a Service select the leader while both replicas are Ready (and a PodDisruptionBudget hold)."""
    for name, ip in (("router-a", "127.0.0.2"), ("router-b", "127.0.0.3")):  # b's label is stale: an earlier life
        api.add_pod(name, namespace=NS, ip=ip, labels={"app": "omni-router", ROLE: "leader"})
    (a, _), (b, b_url) = leader_and_standby(replicas, extra=["--leader-pod-label", ROLE])
    wait_for(lambda: role_label(api, "router-b") == "standby", 10, b, "the standby relabels its pod")
    assert role_label(api, "router-a") == "leader"
    assert api.pod("router-a", NS)["metadata"]["labels"]["app"] == "omni-router"  # a merge: other labels kept

    a.kill()
    wait_role(b_url, b, "leader")
    wait_for(lambda: role_label(api, "router-b") == "leader", 10, b, "the new leader labels its pod")
    a2, _ = replicas.start("router-a", extra=["--leader-pod-label", ROLE])  # the container restarted
    wait_for(lambda: role_label(api, "router-a") == "standby", 10, a2, "the restarted replica relabels its pod")


# -- the state store -------------------------------------------------------------------------------------------


def store_for(api: StandInApiServer, tmp_path: Path, name: str, client_type: type[Client] = Client) -> KubernetesStore:
    config = KubeConfig.from_file(api.write_kubeconfig(tmp_path / f"kc-{name}", namespace=NS, token=token_of(name)))
    return KubernetesStore(prefix="test-state", client=client_type(config=config, trust_env=False))


def test_the_state_store_shares_records_and_refuses_to_overwrite_another_replicas(api, tmp_path) -> None:
    one, other = store_for(api, tmp_path, "one"), store_for(api, tmp_path, "other")
    assert configmap_name("omni-router-state", "update_journal.json") == "omni-router-state-update-journal-json"
    assert one.read("r.json") is None
    one.write("r.json", b'{"v": 1}')
    assert other.read("r.json") == b'{"v": 1}'  # what one replica wrote, another reads
    cm = api.config_map("test-state-r-json", NS)
    assert cm is not None and cm["data"] == {"r.json": '{"v": 1}'}
    other.write("r.json", b'{"v": 2}')
    with pytest.raises(StateConflict, match="written by another router replica"):
        one.write("r.json", b'{"v": 3}')
    with pytest.raises(StateConflict):
        one.remove("r.json")
    assert api.config_map("test-state-r-json", NS)["data"] == {"r.json": '{"v": 2}'}
    # A replica that never saw the record does not create it over another's either.
    with pytest.raises(StateConflict):
        store_for(api, tmp_path, "third").write("r.json", b'{"v": 4}')
    # Read again (as a new leader does), it writes and removes; a record already gone is removed.
    assert one.read("r.json") == b'{"v": 2}'
    one.write("r.json", b'{"v": 5}')
    one.remove("r.json")
    one.remove("r.json")
    assert api.config_maps(NS) == []
    one.write("bin", b"\xff\x00")  # not UTF-8: binaryData
    assert other.read("bin") == b"\xff\x00"


class LosesAnswers(Client):
    """A client whose next replace reaches the API server but whose answer is lost (a timeout after sending)."""

    lose_next = False

    def replace(self, *args: Any, **kwargs: Any) -> Any:
        answer = super().replace(*args, **kwargs)
        if self.lose_next:
            self.lose_next = False
            raise httpx2.ReadTimeout("the answer was lost")
        return answer


def test_the_state_store_recognises_its_own_write_whose_answer_was_lost(api, tmp_path) -> None:
    store = store_for(api, tmp_path, "lossy", LosesAnswers)
    store.write("r.json", b"one")
    assert isinstance(store._client, LosesAnswers)
    store._client.lose_next = True
    with pytest.raises(OSError, match="ReadTimeout"):
        store.write("r.json", b"two")  # applied, but this replica does not know it
    store.write("r.json", b"three")  # the conflict is its own write: adopted, not refused
    assert api.config_map("test-state-r-json", NS)["data"] == {"r.json": "three"}


# -- the trainer client through a failover ------------------------------------------------------------------


def standby_refusals(url: str) -> float:
    """How many 503s the replica answered on ``/workers`` (its own metrics)."""
    status, text = http_json("GET", url + "/metrics", timeout=10)
    assert status == 200
    total = 0.0
    for line in str(text).splitlines():
        if line.startswith("omni_router_requests_total{") and 'route="/workers"' in line and 'status="503"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_the_trainer_client_rides_through_a_failover(replicas) -> None:
    (a, _), (b, b_url) = leader_and_standby(replicas)
    with pytest.raises(RouterCallError) as refused:  # no budget: the standby's refusal is the answer at once
        RouterClient(b_url, admin_key=ADMIN_KEY, failover_budget_s=0).list_workers()
    assert refused.value.status == 503 and "standby" in refused.value.message

    client = RouterClient(b_url, admin_key=ADMIN_KEY, failover_budget_s=TAKEOVER_S + 10)
    answer: dict[str, Any] = {}

    def list_workers() -> None:
        try:
            answer["workers"] = client.list_workers()
        except RouterCallError as exc:
            answer["error"] = exc

    thread = threading.Thread(target=list_workers, daemon=True)
    thread.start()
    try:
        seen = standby_refusals(b_url)
        wait_for(lambda: standby_refusals(b_url) >= seen + 2, 10, b, "the client retries on the standby")
        a.kill()
    finally:
        thread.join(TAKEOVER_S + 15)
    assert not thread.is_alive()
    assert "error" not in answer, answer.get("error")
    assert answer["workers"].workers == []
    assert role(b_url) == "leader"
