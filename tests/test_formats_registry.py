"""The format registry: every format declares the :class:`~ckptshim.formats.base.Format`
protocol, and where two formats can claim the same files, which wins is written down
(:data:`~ckptshim.formats.detect.PRECEDENCE`) and checked against the order formats are tried in."""

from __future__ import annotations

import pytest

from ckptshim.errors import InternalError
from ckptshim.formats import deepspeed_pipeline, deepspeed_zero, orbax, t5x
from ckptshim.formats.base import Checkpoint, Format
from ckptshim.formats.detect import FORMATS, PRECEDENCE, detect, ranked
from support.fixtures import FIXTURES


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda fmt: fmt.NAME)
def test_every_format_declares_the_protocol(fmt):
    assert isinstance(fmt, Format)
    assert set(fmt.READERS) <= {"torch", "jax"}  # none: recognised for inspect, named by no load call
    assert all(callable(check) for check in fmt.READERS.values())


def test_names_are_unique():
    names = [fmt.NAME for fmt in FORMATS]
    assert len(names) == len(set(names))


def test_every_precedence_holds_in_the_order_formats_are_tried():
    for winner, loser, why in PRECEDENCE:
        assert FORMATS.index(winner) < FORMATS.index(loser), why


def test_an_order_against_a_declared_precedence_is_refused_naming_it():
    swapped = tuple(deepspeed_pipeline if fmt is deepspeed_zero else deepspeed_zero if fmt is deepspeed_pipeline
                    else fmt for fmt in FORMATS)
    with pytest.raises(InternalError, match="deepspeed-zero must be tried before deepspeed-pipeline.*fp32 masters"):
        ranked(swapped, PRECEDENCE)
    assert ranked(FORMATS, PRECEDENCE) is FORMATS


def test_zero_partitions_win_where_both_claim_the_folder():
    """The declared pair at work: a ZeRO folder is a pipeline folder by its fingerprint too."""
    folder = FIXTURES / "deepspeed_zero" / "ws2" / "zero2_bf16"
    claims = [fmt for fmt in FORMATS if fmt.sniff(folder)]
    assert deepspeed_zero in claims and deepspeed_pipeline in claims
    assert detect(folder) is deepspeed_zero and detect(folder, backend="torch") is deepspeed_zero


def test_orbax_vocabulary_is_orbaxs():
    """Which Orbax restore args read a layout is asked of the Orbax format, not of every checkpoint."""
    assert not hasattr(Checkpoint, "orbax_readers")
    assert orbax.orbax_readers.__module__ == orbax.__name__
    assert (t5x, orbax, "T5X's msgpack aggregate passes for Orbax's legacy aggregate") in PRECEDENCE
