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
def wait_at_least(ptr, target, POLL_NS: tl.constexpr):
    """Spin until *ptr >= target: polls are volatile loads (served by L2, no read-modify-write
    traffic on a word other programs are adding to), then one acquire, so that what the counted
    programs wrote before their release is visible to the loads that follow (read those with
    cache_modifier=".cg"). POLL_NS > 0 sleeps that long between polls (PTX nanosleep: fewer
    polls on the word, issue slots left to the programs being waited for); 0 under the
    interpreter, which runs no PTX."""
    seen = tl.load(ptr, volatile=True)
    while seen < target:
        if POLL_NS > 0:
            tl.inline_asm_elementwise("nanosleep.u32 $1;\n mov.u32 $0, $1;", "=r,r",
                                      [tl.full([], POLL_NS, tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
        seen = tl.load(ptr, volatile=True)
    return tl.atomic_add(ptr, 0, sem="acquire")
