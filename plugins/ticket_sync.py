"""Waiting between programs of one launch, safely (Triton jit helpers).

A kernel that needs a grid-wide step (every split done before a combine, every histogram pass
before the next) can stay one launch if each program takes a start ticket from an atomic
counter and picks its role by ticket, not by program id: a program waits only for work of lower
tickets, whose programs had started (they took their tickets) and so finish whatever else the
GPU keeps resident. This is the forward-progress argument of decoupled look-back scans
(Merrill and Garland, "Single-pass Parallel Prefix Scan with Decoupled Look-back", 2016).
Under the Triton interpreter programs run one after another in id order, tickets equal ids, and
no wait ever spins.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_at_least(ptr, target):
    """Spin until *ptr >= target: polls are volatile loads (served by L2, no read-modify-write
    traffic on a word other programs are adding to), then one acquire, so that what the counted
    programs wrote before their release is visible to the loads that follow (read those with
    cache_modifier=".cg")."""
    seen = tl.load(ptr, volatile=True)
    while seen < target:
        seen = tl.load(ptr, volatile=True)
    return tl.atomic_add(ptr, 0, sem="acquire")
