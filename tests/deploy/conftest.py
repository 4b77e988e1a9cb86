"""Renders shared by the chart tests: each ci/ values file, once per session."""

from __future__ import annotations

import helm_python
import pytest

from tests.deploy.chart import ALL_APIS, CI_VALUES, Rendered, load_chart, load_values, render


@pytest.fixture(scope="session")
def chart() -> helm_python.Chart:
    helm_python.disable_logging()
    with load_chart() as loaded:
        yield loaded


@pytest.fixture(scope="session")
def renders(chart) -> dict[str, Rendered]:
    """Each ci/ values file rendered for a cluster that serves the Prometheus Operator and LWS APIs."""
    return {p.stem: render(chart, load_values(p), api_versions=ALL_APIS) for p in CI_VALUES}


@pytest.fixture(params=[p.stem for p in CI_VALUES])
def rendered(request, renders) -> Rendered:
    return renders[request.param]
