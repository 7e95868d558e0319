"""Compute shared with a collective: Calculon's ``processor_usage`` convention (`timing.overlapped`), one
for every row and every collective a stack overlaps."""
import dataclasses

import pytest

from labs.formulas.planning import software, timing


def test_a_hidden_collective_slows_the_compute_it_hides_under():
    """The named wrong model: a collective hidden under compute costs nothing. Calculon (calculon-ai/calculon
    at caa4b11, calculon/llm/llm.py): hidden, u times the collective; exposed, the excess plus u times the
    compute."""
    u = 0.15
    assert timing.overlapped(1.0, 4.0, u) == pytest.approx(0.15)          # hidden
    assert timing.overlapped(4.0, 1.0, u) == pytest.approx(3.0 + 0.15)    # exposed
    assert timing.overlapped(1.0, 4.0, 0.0) == 0.0                        # the wrong model
    # a collective the stack does not overlap (no window) waits in full and slows nothing
    assert timing.overlapped(2.0, 0.0, u) == 2.0


def test_usage_by_link_tier_as_calculons_system_files():
    """systems/a100_80g.json and h100_80g_nvl8.json: 0.15 on the 8-GPU NVLink network, 0.02 across nodes."""
    assert timing.usage(1) == 0.15 and timing.usage(2) == 0.02 and timing.usage(64) == 0.02


def test_no_stack_switches_it():
    """The named wrong implementation: a per-row (per-stack) switch that turns the slowdown on where it
    helps. No `software.Software` field names it."""
    assert not [f.name for f in dataclasses.fields(software.Software) if "usage" in f.name]


def test_chunked_overlap_keeps_its_fill():
    """`timing.exposed` is `overlapped` plus one chunk's fill."""
    assert timing.exposed(1.0, 4.0, 4, 0.15) == pytest.approx(0.15 + 0.25)
    assert timing.exposed(1.0, 4.0, 4) == pytest.approx(0.25)
    # a collective longer than its compute: the overhang plus one chunk of the compute, the shorter;
    # a fill of one chunk of the collective (comm / chunks) would give 3 + 1 = 4.0
    assert timing.exposed(4.0, 1.0, 4) == pytest.approx(3.0 + 0.25)
