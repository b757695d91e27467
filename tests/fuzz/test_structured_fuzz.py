"""Structure-aware fuzzing (``structured.py``): inputs built the way attacks are built, each
under its harness's own time and memory limits; only a ``ShimError`` may come out, and a torch
file ckptshim reads must read the same in ``torch.load(weights_only=True)``.

A bounded, derandomized number of examples per harness keeps this reproducible and quick;
``bench/fuzz.py`` runs the same harnesses for minutes each.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

import structured

_SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("harness", structured.HARNESSES, ids=lambda h: h.name)
def test_only_shim_errors_within_limits(harness, tmp_path):
    target = harness.target(tmp_path)

    @settings(max_examples=harness.examples, **_SETTINGS)
    @given(harness.inputs())
    def fuzz(example) -> None:
        structured.call(target, example)

    fuzz()
