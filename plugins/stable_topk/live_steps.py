"""How many live blocks a step of the block-max form's live collect reads (LIVE_BLOCKS of
prefilter.prefilter_collect_live_kernel), from how many of its programs the GPU holds at once.

More blocks a step mean fewer steps a program, and more registers a thread: the sm_90 builds of a
Full layer's collect (128K scores, chunks of 2,048 in blocks of 16, one warp) take 142 / 96 / 64
registers at 32 / 16 / 8 blocks a step, so an H100 holds 14 / 21 / 32 of its programs an SM (1,848
/ 2,772 / 4,224 in all); a listed pool's (blocks of 8) 72 / 64 / 42, 28 / 32 / 32 an SM, though
its grid never needs them: its chunks grow with the rows (batch_chunk: 512 entries to 32 rows,
2,048 at 128), so 16K scores a row make at most 1,024 programs. A grid that needs a second round
of the SM slots waits for its slowest programs twice, so the step that wins is the largest whose
grid fits about one round. H100 sweeps of session 49
(bench_layer_batch.py --topk-sweep "LIVE_BLOCKS=16;LIVE_BLOCKS=8", first of two runs, raw
docs/sweep_topk_widths_h100_2026-12-07.json), us at 32 / 16 / 8 blocks a step (rounds of the
grid):

| scores, rows | programs | 32 | 16 | 8 |
|---|---:|---:|---:|---:|
| Full 128K, 32 | 2,048 | **31.9** (1.11) | 32.7 (0.74) | 32.2 (0.48) |
| Full 128K, 48 | 3,072 | 40.1 (1.66) | **38.6** (1.11) | 38.9 (0.73) |
| Full 128K, 64 | 4,096 | 50.8 (2.22) | 48.4 (1.48) | **48.5** (0.97) |
| Full 128K, 96 | 6,144 | 71.3 (3.32) | 66.6 (2.22) | **65.9** (1.45) |
| Full 128K, 128 | 8,192 | 88.3 (4.43) | 81.9 (2.96) | **80.6** (1.94) |
| listed 16K, 32 | 1,024 | **19.3** (0.28) | 19.2 (0.24) | 20.9 (0.24) |
| listed 16K, 128 | 1,024 | **40.0** (0.28) | 40.6 (0.24) | 43.7 (0.24) |

Bold: what the rule (live_blocks_for) picks from these register counts, within 0.4 us of the
fastest in every row; 32 blocks a step everywhere (the former default) lose up to 7.7 us. At 16
rows of 128K (0.55 rounds) 32 blocks took 24.2 us against 26.0 for 16. The counts come from CPU
sm_90 compiles; the JIT's builds, which the launcher counts, specialize on their arguments and may
take fewer (on the H100 at 64 rows the rule stopped at 16 blocks, session 50's GPU test). The rule
timed against 32 blocks a step everywhere (H100, session 50, two runs): 38.3 / 47.8 / 66.1 / 80.7
against 40.1 / 50.7 / 71.5 / 88.5 us at 48 / 64 / 96 / 128 rows of 128K, equal at 16 and 32.
Both cards of that kind (H100, H200) have 132 SMs of 64K registers, so the same grids take the
same rounds on either.
"""

from __future__ import annotations

from collections.abc import Callable

# the launcher's LIVE_BLOCKS unless overridden: "rounds" (live_blocks_for, from the builds) or a
# power of two for every grid
LIVE_BLOCKS_DEFAULT = "rounds"
# blocks a step the collect chooses among, most first (tl.arange sizes)
LIVE_STEP_CHOICES = (32, 16, 8)
# rounds of the SM slots a grid may take and still count as one: 1.11 rounds won at 32 and at 48
# rows of a Full layer (the module docstring's sweeps)
ROUND_SLACK = 1.15


def live_blocks_for(programs: int, resident_of: Callable[[int], int]) -> int:
    """The most blocks a step (LIVE_STEP_CHOICES) whose grid of `programs` takes at most ROUND_SLACK
    rounds of the GPU's slots, `resident_of(blocks)` being how many programs of that build the GPU
    holds at once (plugins/coresident.py); where none fits, the one with the fewest rounds (ties:
    more blocks). Builds are asked for in order and only as far as needed (each is a compile)."""
    if programs < 1:
        raise ValueError(f"live_blocks_for: needs at least one program, got {programs}")
    rounds = {}
    for blocks in LIVE_STEP_CHOICES:
        resident = resident_of(blocks)
        if resident < 1:
            raise ValueError(f"live_blocks_for: a build of {blocks} blocks a step fits {resident} "
                             "programs on the GPU; at least one must")
        rounds[blocks] = programs / resident
        if rounds[blocks] <= ROUND_SLACK:
            return blocks
    return min(rounds, key=lambda blocks: (rounds[blocks], -blocks))
