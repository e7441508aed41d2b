"""The fleet's LoRA adapters as Prometheus series: what the control process's adapter table says.

Exported by the control process only (as the per-worker gauges are): it owns the table
(:mod:`router.gateway.fleet.adapters`) and sums every data plane's requests in flight per adapter.
The requests each process routed naming an adapter are a counter of :class:`~router.gateway.metrics.RouterMetrics`
(``omni_router_adapter_requests_total``), summed across processes like every counter. The ``adapter``
label takes only names the table holds: a request naming another is refused before it is counted.
Versioned adapters (``name@version``) are counted by their name without the version (a counter's labels live
as long as the process), and ``omni_router_lora_resident_versions`` says how many versions of each one every
worker holds, which ``--lora-keep-versions`` bounds.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.gateway.fleet.adapter_versions import family_of
from router.gateway.fleet.registry import WorkerRegistry


class AdapterCollector(Collector):
    """Per adapter: its fleet version, whether it is routed, how many workers hold that version, requests in flight."""

    def __init__(self, registry: WorkerRegistry):
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        version = GaugeMetricFamily(
            "omni_router_adapter_fleet_version",
            "The fleet version of each LoRA adapter (a load or update that every worker took adds one)",
            labels=["adapter"],
        )
        serving = GaugeMetricFamily(
            "omni_router_adapter_serving",
            "1 while requests naming the adapter are routed (0: being unloaded)",
            labels=["adapter"],
        )
        holders = GaugeMetricFamily(
            "omni_router_adapter_holders",
            "Workers that hold the adapter at its fleet version, in the process it was loaded into",
            labels=["adapter"],
        )
        inflight = GaugeMetricFamily(
            "omni_router_adapter_inflight_requests",
            "Requests naming the adapter in flight through this router (every data plane)",
            labels=["adapter"],
        )
        resident = GaugeMetricFamily(
            "omni_router_lora_resident_versions",
            "Versions of each LoRA adapter a worker holds (name@version loads; an adapter loaded without one: 1), "
            "being dropped included: at most --lora-keep-versions + 1",
            labels=["worker", "adapter"],
        )
        adapters = self._registry.adapters
        workers = list(self._registry)
        counts: dict[tuple[str, str], int] = {(w.id, family_of(n)): 0 for w in workers for n in adapters.names()}
        for entry in adapters.table().adapters:
            name = entry.name
            version.add_metric([name], entry.version)
            serving.add_metric([name], 1.0 if entry.serving else 0.0)
            holders.add_metric([name], sum(adapters.holds(w, name) for w in workers))
            inflight.add_metric([name], adapters.in_flight(name))
            for w in workers:
                if adapters.holding(w, name) is not None:
                    counts[(w.id, family_of(name))] += 1
        for (worker, family), count in sorted(counts.items()):
            resident.add_metric([worker, family], count)
        yield from (version, serving, holders, inflight, resident)
