"""scripts/profile_kernels.py's timeline on the CPU: cutting a profile of several graph replays
into one replay's kernels, and the lines it prints; the profiles themselves run on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def profile(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import profile_kernels
    return profile_kernels


def _replays(n: int, gap: float = 100.0) -> list[tuple[float, float, str]]:
    """n replays of a three-kernel graph (the second starts before the first ends, as under PDL),
    unsorted, each `gap` us after the one before."""
    one = [(0.0, 2.0, "a"), (1.0, 5.0, "b"), (6.0, 7.5, "c")]
    return [(s + r * gap, e + r * gap, name) for r in reversed(range(n)) for s, e, name in one]


def test_middle_replay_cuts_the_profile_into_replays(profile):
    got = profile.middle_replay(_replays(5), 5)
    assert got == [("a", 0.0, 2.0), ("b", 1.0, 4.0), ("c", 6.0, 1.5)]
    with pytest.raises(RuntimeError, match="holds 14 kernels for 5 replays"):
        profile.middle_replay(_replays(5)[:-1], 5)


def test_timeline_lines_count_gaps_and_overlaps(profile):
    lines = profile.timeline_lines([("a", 0.0, 2.0), ("b", 1.0, 4.0), ("c", 6.0, 1.5)])
    assert "gap  -1.00 us  ends     5.00 us (+3.00)  b" in lines[1]
    assert "gap   1.00 us  ends     7.50 us (+2.50)  c" in lines[2] and "(+2.00)  a" in lines[0]
    assert lines[-1] == "replay 7.50 us: kernels 7.50 us, gaps 0.00 us, 3 kernels"
