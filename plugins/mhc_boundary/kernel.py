"""MhcBoundary as one Triton launch per sublayer boundary (the single-pass update of
reference.py): the residual update, the projection of the new residual onto the next site's
mixes with its sum of squares, the collapse with the carried pre, and in the epilogue the
sigmoids, Sinkhorn and the RMSNorm of the next input.

Grid: (token blocks of BLOCK_T, channel splits). Each program streams its channels in chunks of
BLOCK_E: R = post y + comb^T R_prev (rounded once to the stream dtype, as the reference),
x = sum_k pre_k R_k (rounded, stored unnormalised), and accumulates R . fn^T on the tensor cores
(tf32 for 16-bit streams, exact for fp32; exact fp32 products below 16 tokens) with sum R^2 and
sum x^2. Where the token blocks alone fill the GPU, one program owns whole rows (SPLIT = 0) and
finishes them itself; this is also the TensorRT plugin's path (no workspace there). Otherwise
(decode, and prefill up to SMs x BLOCK_T tokens) the channels are split over programs
too; each split stores its partial sums in a workspace slot, and the last program of a token
block (a counter) adds them up in a fixed order (so results do not depend on scheduling),
finishes the rows and clears the counter for the next launch, so a boundary stays one launch.
Blocks of 16 rows or more instead meet at a barrier inside the launch (BARRIER, a cooperative
launch); then each split merges and finishes some rows of the block and normalises its own chunks.
The finishing steps are in finish.py.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from dsflash.plugins.aot import cdiv_expr as cdiv
from dsflash.plugins.coresident import arrive_and_wait, resident_programs
from dsflash.plugins.launch import (
    LauncherBase,
    check_device,
    check_dtype,
    check_shape,
    interpreting,
    next_pow2,
    require,
)
from dsflash.plugins.mhc_boundary import splits
from dsflash.plugins.mhc_boundary.finish import (
    cluster_finish,
    finish_block,
    load_site,
    next_coefficients,
    normalise_chunks,
    normalise_rows,
    total_sumsq_x,
)
from dsflash.plugins.mhc_boundary.reference import n_mixes


@triton.jit
def _coefficients(post_ptr, comb_ptr, pre_ptr, t64, tmask, C: tl.constexpr):
    """The rows' post [C], comb [C * C] (row-major j, k) and pre [C] as tuples of [BLOCK_T]
    vectors in fp32."""
    post = ()
    pre = ()
    comb = ()
    for k in tl.static_range(C):
        post = post + (tl.load(post_ptr + t64 * C + k, mask=tmask, other=0.0).to(tl.float32),)
        pre = pre + (tl.load(pre_ptr + t64 * C + k, mask=tmask, other=0.0).to(tl.float32),)
    for jk in tl.static_range(C * C):
        comb = comb + (tl.load(comb_ptr + t64 * (C * C) + jk, mask=tmask, other=0.0).to(tl.float32),)
    return post, comb, pre


@triton.jit
def _computed_once(v):
    """v itself, passed through an identity instruction that Triton may not duplicate (not pure).
    Without it Triton computed R' twice, once in the blocked layout of the stores and sums and
    once more in the dot operand's layout (every stream tile read twice from shared memory, the
    mix done twice, the coefficients held in both layouts: 204 registers); with it R' is computed
    once and moved to the operand layout through shared memory (134 registers). H200, 8,192
    tokens (session 8): 453 -> 443 us at 64 x 16, 425 us at 64 x 32. PTX: no interpreter."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def _mix_chunk(streams_ptr, y_ptr, post, comb, pre, fn_ptr, new_ptr, x_ptr, t64, tmask,
               e0, acc, sumsq_r, sumsq_x, C: tl.constexpr, E: tl.constexpr, M: tl.constexpr,
               MP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, IEEE: tl.constexpr,
               ONCE: tl.constexpr):
    """One chunk of BLOCK_E channels of BLOCK_T tokens: new R, the collapse x and the projection
    onto fn, one output stream at a time so every tile stays 2-D [BLOCK_T, BLOCK_E] (3-D
    [T, C, E] tiles with a reshape for the dot ran 2x slower on the H200). Each input stream tile
    is loaded once per chunk and held (a tuple of C tiles): re-reading it for every output stream
    (C * C tile loads) kept the H200's L1/TEX pipe 82% busy at 20% hit rate (ncu, 8,192 tokens),
    with the pipelined loads' shared memory leaving little L1 to hit in."""
    e = e0 + tl.arange(0, BLOCK_E)
    emask = e < E
    m2 = tmask[:, None] & emask[None, :]
    m = tl.arange(0, MP)
    y = tl.load(y_ptr + t64[:, None] * E + e[None, :], mask=m2, other=0.0).to(tl.float32)
    rs = ()
    for j in tl.static_range(C):
        rs = rs + (tl.load(streams_ptr + (t64[:, None] * C + j) * E + e[None, :], mask=m2, other=0.0),)
    x_acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k in tl.static_range(C):
        # R'_k = post_k y + sum_j comb[j, k] R_j (comb applied transposed), fp32, rounded once
        new_k = post[k][:, None] * y
        for j in tl.static_range(C):
            new_k += comb[j * C + k][:, None] * rs[j].to(tl.float32)
        new_k = new_k.to(new_ptr.dtype.element_ty)
        tl.store(new_ptr + (t64[:, None] * C + k) * E + e[None, :], new_k, mask=m2)
        nf = new_k.to(tl.float32)
        if ONCE:
            nf = _computed_once(nf)
        sumsq_r += tl.sum(nf * nf, axis=1)
        x_acc += pre[k][:, None] * nf
        # fn[:, k*E + e] as [MP, BLOCK_E]: contiguous along the channels (coalesced)
        fn_k = tl.load(fn_ptr + m[:, None] * (C * E) + k * E + e[None, :],
                       mask=(m < M)[:, None] & emask[None, :], other=0.0).to(tl.float32)
        if BLOCK_T < 16:  # too few rows for the tensor cores: exact fp32 products, summed
            acc += tl.sum(nf[:, None, :] * fn_k[None, :, :], axis=2)
        elif IEEE:
            acc += tl.dot(nf, tl.trans(fn_k), input_precision="ieee")
        else:
            acc += tl.dot(nf, tl.trans(fn_k), input_precision="tf32")
    x = x_acc.to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + t64[:, None] * E + e[None, :], x, mask=m2)
    xf = x.to(tl.float32)
    sumsq_x += tl.sum(xf * xf, axis=1)
    return acc, sumsq_r, sumsq_x


@triton.jit
def mhc_boundary_kernel(streams_ptr, y_ptr, post_ptr, comb_ptr, pre_ptr, fn_ptr, base_ptr, scale_ptr,
                        nw_ptr, T, chunks_per_split, n_split, new_ptr, x_ptr, pre_out, post_out, comb_out,
                        ws_acc, ws_sq, counter,
                        C: tl.constexpr, E: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
                        ITERS: tl.constexpr, HC_EPS: tl.constexpr, RMS_EPS: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, NSP: tl.constexpr,
                        NORM_E: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, ONCE: tl.constexpr,
                        CLUSTER: tl.constexpr = 1, BARRIER: tl.constexpr = False,
                        PARTIALS_ONLY: tl.constexpr = False):
    # TensorRT's AOT order: inputs, integer scalars, outputs. The workspace comes last: the
    # one-node TensorRT plugin compiles SPLIT = 0, which never touches it. CLUSTER > 1 (TensorRT
    # only, its PTX declaring clusters of that many CTAs): the CTAs of a cluster split one token
    # block's channels and exchange their sums through the outputs (finish.cluster_finish).
    # PARTIALS_ONLY (the split form's first node, split_form.py): SPLIT, and the partial sums in
    # ws_acc / ws_sq are outputs; x stays unnormalised and the coefficients are the second node's.
    pid_t = tl.program_id(0) // CLUSTER
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t64 = t.to(tl.int64)
    acc = tl.zeros([BLOCK_T, MP], dtype=tl.float32)
    sumsq_r = tl.zeros([BLOCK_T], dtype=tl.float32)
    sumsq_x = tl.zeros([BLOCK_T], dtype=tl.float32)
    # A split is a run of whole chunks and the channel mask depends on E alone, so the compiler
    # knows each chunk's channels are aligned and the mask constant along them, and vectorises
    # the masked stores (16 B per thread). With a runtime channel bound it stored one bf16 per
    # thread, kept x's sum in two layouts, and needed 255 registers plus spills (ptxas, sm_90a).
    n_chunks: tl.constexpr = (E + BLOCK_E - 1) // BLOCK_E
    per_cta: tl.constexpr = (n_chunks + CLUSTER - 1) // CLUSTER
    if SPLIT:
        c_lo = tl.program_id(1) * chunks_per_split
        c_hi = tl.minimum(c_lo + chunks_per_split, n_chunks)
    elif CLUSTER > 1:
        c_lo = (tl.program_id(0) % CLUSTER) * per_cta
        c_hi = tl.minimum(c_lo + per_cta, n_chunks)
    else:
        c_lo = 0
        c_hi = n_chunks
    # The C * (C + 2) coefficients of the rows, loaded once and held in registers. Loaded per chunk
    # instead, Triton pipelined them as 4-byte copies into shared memory: 24 of a thread's 37
    # copies per chunk, on the L1/TEX pipe that ncu found 69% busy. H200, 8,192 tokens (session
    # 7): 635 -> 503 us with whole rows of 32 tokens, 537 -> 477 us at 64 x 32 x 4 splits.
    post, comb, pre = _coefficients(post_ptr, comb_ptr, pre_ptr, t64, tmask, C)
    for c in range(c_lo, c_hi):
        acc, sumsq_r, sumsq_x = _mix_chunk(streams_ptr, y_ptr, post, comb, pre, fn_ptr, new_ptr,
                                           x_ptr, t64, tmask, c * BLOCK_E, acc, sumsq_r, sumsq_x, C, E, M,
                                           MP, BLOCK_T, BLOCK_E, IEEE, ONCE)
    if SPLIT:
        m = tl.arange(0, MP)
        slot = tl.program_id(1).to(tl.int64) * T + t64
        tl.store(ws_acc + slot[:, None] * M + m[None, :], acc, mask=tmask[:, None] & (m < M)[None, :])
        tl.store(ws_sq + slot * 2, sumsq_r, mask=tmask)
        tl.store(ws_sq + slot * 2 + 1, sumsq_x, mask=tmask)
    if SPLIT and not PARTIALS_ONLY:  # (the split form's first node stops at its partials)
        tl.debug_barrier()  # every thread's partials and x are written before the counter moves
        if BARRIER:
            # every split of the block waits for the others (a cooperative launch: all programs are
            # resident), then finishes rows of the block: split j merges rows j, j + n_split, ...
            # on its own (one [NSP, M] load per row) and writes their coefficients, and every split
            # normalises its own chunks. Before, the last split merged the whole block split by
            # split (H200, 16 tokens: 19.8 -> 10.5 us); before the barrier, it also normalised the
            # whole block's x alone.
            arrive_and_wait(counter + 2 * pid_t, counter + 2 * pid_t + 1, n_split)
            block_rows = tl.minimum(BLOCK_T, T - pid_t * BLOCK_T)
            for r in range(tl.program_id(1), block_rows, n_split):
                row = pid_t * BLOCK_T + r
                one = (row + tl.arange(0, 1)).to(tl.int64)
                finish_block(row, T, n_split, one, one < T, ws_acc, ws_sq, base_ptr, scale_ptr, pre_out,
                              post_out, comb_out, C, E, M, MP, ITERS, HC_EPS, RMS_EPS, 1, NSP)
            normalise_chunks(total_sumsq_x(T, n_split, t64, tmask, ws_sq, NSP), t64, tmask, x_ptr, x_ptr,
                              nw_ptr, c_lo, c_hi, E, RMS_EPS, BLOCK_E)
        else:
            done = tl.atomic_add(counter + 2 * pid_t, 1)  # acq_rel at GPU scope
            if done == n_split - 1:
                tl.store(counter + 2 * pid_t, 0)  # cleared for the next launch
                sumsq_x = finish_block(pid_t, T, n_split, t64, tmask, ws_acc, ws_sq, base_ptr, scale_ptr,
                                        pre_out, post_out, comb_out, C, E, M, MP, ITERS, HC_EPS, RMS_EPS,
                                        BLOCK_T, NSP)
                normalise_rows(sumsq_x, t64, tmask, x_ptr, nw_ptr, E, RMS_EPS, NORM_E)
    elif CLUSTER > 1:
        cluster_finish(acc, sumsq_r, sumsq_x, tl.program_id(0) % CLUSTER, c_lo, c_hi, t64, tmask, pre,
                        new_ptr, x_ptr, nw_ptr, base_ptr, scale_ptr, pre_out, post_out, comb_out, C, E, M, MP,
                        ITERS, HC_EPS, RMS_EPS, BLOCK_T, BLOCK_E, per_cta, CLUSTER)
    elif not SPLIT:
        tl.debug_barrier()  # this program's unnormalised x rows are written before it rereads them
        base, s_pre, s_post, s_comb = load_site(base_ptr, scale_ptr, M, MP)
        next_coefficients(acc, sumsq_r, t64, tmask, base, s_pre, s_post, s_comb, pre_out, post_out,
                           comb_out, E, ITERS, HC_EPS, RMS_EPS, C, M, MP)
        normalise_rows(sumsq_x, t64, tmask, x_ptr, nw_ptr, E, RMS_EPS, NORM_E)


def check_mix_inputs(op: str, streams, y, post, comb, pre, fn) -> None:
    """The residual update's inputs (the one-node op and the split form's first node)."""
    check_shape(op, "streams", streams, (None, None, None, None))
    b, s, c, e = streams.shape
    require(c in (1, 2, 4, 8), f"{op}: hc_mult {c} is not one of 1, 2, 4, 8 (the kernel tiles streams)")
    for name, t, shp in (("y", y, (b, s, e)), ("post", post, (b, s, c)), ("comb", comb, (b, s, c, c)),
                         ("pre", pre, (b, s, c)), ("fn", fn, (n_mixes(c), c * e))):
        check_shape(op, name, t, shp)
    check_dtype(op, "streams", streams, (torch.float32, torch.bfloat16, torch.float16))
    require(y.dtype == streams.dtype, f"{op}: y is {y.dtype}, streams are {streams.dtype}")
    check_device(op, streams=streams, y=y, post=post, comb=comb, pre=pre, fn=fn)


def check_site(op: str, n_mix: int, hidden: int, base, scale, norm_weight, iters: int) -> None:
    """The next site's parameters and the next norm's weight (the one-node op and the split form's
    second node)."""
    for name, t, shp in (("base", base, (n_mix,)), ("scale", scale, (3,)),
                         ("norm_weight", norm_weight, (hidden,))):
        check_shape(op, name, t, shp)
    require(iters >= 1, f"{op}: sinkhorn iters {iters} < 1")
    check_device(op, base=base, scale=scale, norm_weight=norm_weight)


def _check(streams, y, post, comb, pre, fn, base, scale, norm_weight, iters):
    check_mix_inputs("MhcBoundary", streams, y, post, comb, pre, fn)
    c, e = streams.shape[2], streams.shape[3]
    check_site("MhcBoundary", n_mixes(c), e, base, scale, norm_weight, iters)


class MhcBoundaryLauncher(LauncherBase):
    """Holds the self-clearing workspace of the split (few-token) path, so each call is exactly
    one kernel launch. One instance per device/stream; calls on it must not overlap."""

    def __init__(self, sm_count: int | None = None, overrides: dict | None = None):
        super().__init__(sm_count, overrides)
        self._fits: dict = {}

    def _workspace(self, device, slots: int, n_mix: int, blocks: int):
        """(partials [slots, M], sums of squares [slots, 2], counters [blocks, 2]), at least that
        large: per token block an arrival count (back at 0 after every launch) and, for the
        barrier, a generation (any value)."""
        n_slots, n_blocks = next_pow2(slots), next_pow2(blocks)
        return self._reuse_or_make(
            (device, n_mix), lambda ws: ws[0].shape[0] >= slots and ws[2].shape[0] >= blocks,
            lambda: (torch.empty(n_slots, n_mix, dtype=torch.float32, device=device),
                     torch.empty(n_slots, 2, dtype=torch.float32, device=device),
                     torch.zeros(n_blocks, 2, dtype=torch.int32, device=device)))

    def _barrier_fits(self, key: tuple, args: list, grid: tuple, consts: dict) -> bool:
        """Whether the barrier form of this launch fits a cooperative launch: every program resident
        at once (plugins/coresident.py). Compiled once per configuration (`key`) and remembered."""
        if key not in self._fits:
            compiled = mhc_boundary_kernel.warmup(*args, grid=grid, BARRIER=True,
                                                  launch_cooperative_grid=True, **consts)
            self._fits[key] = grid[0] * grid[1] <= resident_programs(compiled, args[0].device)
        return self._fits[key]

    def __call__(self, streams_BSCE, y_BSE, post_BSC, comb_BSCC, pre_BSC, fn_next, base_next,
                 scale_next, norm_weight, iters: int, hc_eps: float, rms_eps: float,
                 n_split: int | None = None):
        _check(streams_BSCE, y_BSE, post_BSC, comb_BSCC, pre_BSC, fn_next, base_next, scale_next,
               norm_weight, iters)
        b, s, c, e = streams_BSCE.shape
        tokens, n_mix = b * s, n_mixes(c)
        dev = streams_BSCE.device
        new = torch.empty_like(streams_BSCE)
        x = torch.empty(b, s, e, dtype=streams_BSCE.dtype, device=dev)
        pre = torch.empty(b, s, c, dtype=torch.float32, device=dev)
        post = torch.empty_like(pre)
        comb = torch.empty(b, s, c, c, dtype=torch.float32, device=dev)
        if tokens == 0:
            return new, x, pre, post, comb
        cfg = launch_config(tokens, c, e, streams_BSCE.dtype)
        cfg = cfg | self._overrides
        # the barrier form of the split path: programs wait for each other (never in the
        # interpreter, which runs them one after another). For blocks of 16 rows or more, whose
        # x the last program normalised alone: H200 (session 13) 16 tokens 24.3 -> 19.8 us, 64
        # tokens 20.3 -> 16.9, 300 tokens 44.9 -> 33.1; with each split finishing rows itself
        # (session 14, the counter path in the same run 28.4 / 19.4 / 44.9 us): 10.5 / 13.0 / 31.1.
        # Blocks of 1 or 4 rows have a small tail, and the wait cost more than it saved (1 token
        # 8.5 -> 8.9 us, 4 tokens 17.4 -> 18.1; since session 14, 2-4 tokens run one-row blocks)
        barrier = cfg.pop("BARRIER", cfg["BLOCK_T"] >= 16) and not interpreting()
        if interpreting():  # the identity of _computed_once is inline PTX
            cfg["ONCE"] = False
        block_e, block_t = cfg["BLOCK_E"], cfg["BLOCK_T"]
        t_blocks = cdiv(tokens, block_t)
        per, n_split = channel_splits(tokens, t_blocks, cdiv(e, block_e), self._sms(dev), n_split)
        split = n_split > 1
        ws_acc, ws_sq, counter = self._workspace(dev, n_split * tokens if split else 1, n_mix,
                                                 t_blocks if split else 1)
        f = [t.contiguous() for t in (streams_BSCE, y_BSE, post_BSC, comb_BSCC, pre_BSC, fn_next,
                                      base_next, scale_next, norm_weight)]
        args = [*f, tokens, per, n_split, new, x, pre, post, comb, ws_acc, ws_sq, counter]
        consts = dict(C=c, E=e, M=n_mix, ITERS=int(iters), HC_EPS=float(hc_eps), RMS_EPS=float(rms_eps),
                      NSP=next_pow2(n_split), SPLIT=split, **cfg)
        grid = (t_blocks, n_split)
        key = (grid, args[0].dtype, tuple(consts.values()))  # consts are built in one order
        if split and barrier and self._barrier_fits(key, args, grid, consts):
            try:
                mhc_boundary_kernel[grid](*args, BARRIER=True, launch_cooperative_grid=True, **consts)
                return new, x, pre, post, comb
            except RuntimeError as err:
                # the driver refused the grid: fewer SMs than the device reports (an MPS client
                # limited to a share of the GPU, a green context). Nothing ran; from now on this
                # configuration takes the counter path, which needs no co-resident programs.
                if "cooperative" not in str(err).lower():
                    raise
                self._fits[key] = False
                logging.getLogger(__name__).warning(
                    "MhcBoundary: cooperative launch of %s programs refused (%s); using the counter path",
                    grid[0] * grid[1], err)
        mhc_boundary_kernel[grid](*args, **consts)
        return new, x, pre, post, comb


def channel_splits(tokens: int, t_blocks: int, chunks: int, sms: int, n_split: int | None = None) -> tuple:
    """(chunks per split, splits) for a grid of t_blocks row blocks: the channels are split only
    until the grid covers the GPU, twice for decode (tokens <= 64). Prefill's row blocks run one
    program per SM (their shared memory), so more than `sms` programs would run as a second,
    partial wave: rounded down (8,192 tokens: whole rows). At most 256 splits (the merge reads
    every split's partials in one [NSP, MP] load), and no empty split."""
    if n_split is None:
        want = cdiv(2 * sms, t_blocks) if tokens <= 64 else sms // t_blocks
        n_split = max(1, min(chunks, want))
    per = cdiv(chunks, min(n_split, 256))
    return per, cdiv(chunks, per)


def launch_config(tokens: int, hc: int, hidden: int, dtype: torch.dtype) -> dict:
    """Block sizes and warps, shared by the JIT launch and the AOT compile (trt.py, which runs
    the same blocks as whole rows: no workspace, so no channel splits). Few tokens (decode) split
    the channels over programs; many tokens take 64 rows per program, split over channels only
    until there is one program per SM (the launcher). H200 runs (docs/benchmarks.md): one token
    8.3 us with 32-channel chunks (64: 9.8 us); 8,192 tokens (session 8, R' computed once) 382.6 us
    as whole rows of 64 x 32 with 4 stages and RMSNorm tiles of 16K values: one program per SM
    (132 KB of shared memory), against 408 us split in two, 393 us with 3 stages in two splits
    (two programs per SM), 411 us for whole rows of 32 x 32, 420 us at 64 x 16; earlier: 8 warps
    slower, the projection as two bf16 dots over fn's hi and lo parts slower than one tf32 dot."""
    few = tokens <= 64
    fp32 = dtype == torch.float32  # fp32 tiles: twice the registers and shared memory (not swept)
    # one to four tokens: one row per program and the projection as fp32 products (the tensor
    # cores need 16 rows), so each token's splits finish in a last program of their own. H200
    # (session 14, 4 tokens): 17.0 us as one block of 4 rows, 13.5 us as 4 blocks of one row; at 16
    # tokens one row per program was slower (31.8 against 19.2 us as one block behind the barrier)
    block_t = 1 if tokens <= 4 else 16 if few else 32 if fp32 else 64
    block_e = splits.chunk_width(hidden)
    # the RMSNorm pass of x: tiles of 4K values at decode; 16K for row blocks, where that pass is
    # each program's tail (8,192 tokens, session 8: 453 us at 4K, 446 at 8K, 430 at 16K)
    norm_e = min(next_pow2(hidden), max(block_e, (4096 if few else 16384) // block_t))
    cfg = dict(BLOCK_T=block_t, BLOCK_E=block_e, NORM_E=norm_e, MP=next_pow2(n_mixes(hc), 16),
               IEEE=fp32, ONCE=block_t >= 16, num_warps=4)
    if not (few or fp32):  # four buffers of the pipelined loads (Triton's default: three)
        cfg["num_stages"] = 4
    return cfg


def mhc_boundary(streams_BSCE, y_BSE, post_BSC, comb_BSCC, pre_BSC, fn_next, base_next, scale_next,
                 norm_weight, iters: int, hc_eps: float, rms_eps: float):
    """-> (new streams, next sublayer input, next pre, next post, next comb), as the reference.
    A fresh workspace per call (zeroed counters, so two launches when the channels are split); hold
    an MhcBoundaryLauncher for one launch per call."""
    return MhcBoundaryLauncher()(streams_BSCE, y_BSE, post_BSC, comb_BSCC, pre_BSC, fn_next, base_next,
                                 scale_next, norm_weight, iters, hc_eps, rms_eps)
