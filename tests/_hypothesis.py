"""The one way the suite's fuzzers run Hypothesis: generate only, repeatable, every problem collected."""

from __future__ import annotations

import hypothesis
from hypothesis import HealthCheck, Phase, settings


def generate_only(examples: int) -> settings:
    """Up to ``examples`` drawn cases, the same ones every run (derandomized, no example database), without
    shrinking or health checks: the test collects what each case shows and reports them all at the end."""
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        verbosity=hypothesis.Verbosity.quiet,
    )
