"""``GET /metrics`` of a router with data-plane processes: one exposition for the whole router.

The control process asks every live data plane for its metrics (over the hub) and adds them to
its own, sample by sample: counters and histograms (requests, latencies, retries, upstream
errors, aborts) are summed across processes, and a ``_created`` timestamp keeps the earliest.
The per-worker gauges come from the control process alone (it sums every process's load into
its registry); data planes do not export them. A data plane that does not answer within
:data:`SCRAPE_S` is left out of that scrape.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

#: How long a scrape waits for the data planes' metrics.
SCRAPE_S = 2.0


class _Merged(Collector):
    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def merge(own: Iterable[Metric], others: Iterable[str]) -> bytes:
    """The Prometheus text of ``own`` families plus every text in ``others``, summed sample by sample."""
    merged: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}

    def add(families: Iterable[Metric]) -> None:
        for family in families:
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                values[family.name] = {}
            samples = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key not in samples:
                    samples[key] = sample.value
                elif sample.name.endswith("_created"):
                    samples[key] = min(samples[key], sample.value)
                else:
                    samples[key] += sample.value

    add(own)
    for text in others:
        add(text_string_to_metric_families(text))
    for name, family in merged.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(merged.values())))
    return generate_latest(registry)
