"""Every byte parser, fuzzed from real fixtures: nothing but ``ShimError`` may come out.

A bounded, derandomized number of examples per harness (see ``harnesses.HARNESSES``) keeps this
reproducible and within the suite's time budget; ``make fuzz`` runs the same harnesses for
minutes each. Each bug the long runs found is pinned in ``test_fuzz_regressions.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

import harnesses

_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    return harnesses.targets(tmp_path_factory.mktemp("fuzz"))


@pytest.mark.parametrize("harness", harnesses.HARNESSES, ids=lambda h: h.name)
def test_only_shim_errors(harness, targets):
    target = targets[harness.name]
    target.load(target.seed)  # the unmutated seed loads without a refusal: the harness reaches it

    @settings(max_examples=harness.examples, **_SETTINGS)
    @given(harnesses.inputs(target.seed))
    def fuzz(data: bytes) -> None:
        target(data)

    fuzz()
