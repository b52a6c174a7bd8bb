"""The op registry: the declarations of every custom op and `OpSet`, which the model calls.

`OpSet("reference")` runs the PyTorch references (the spec); `OpSet("custom_op")` runs the same
maths through torch.library ops `torch.ops.dsflash.*`, which export as trt.plugins nodes (the
plugin flavor); `OpSet("triton")` runs the Triton kernels (kernel.py beside each reference: CUDA
tensors, or CPU tensors under TRITON_INTERPRET=1; under torch.compile through the
`torch.ops.dsflash_triton.*` ops of plugins/triton_ops.py). The model holds one OpSet instance;
switching it changes no model code.
"""

from __future__ import annotations

import torch

from dsflash.model import csa2_ops
from dsflash.plugins.csa2_index_score.decl import DECL as INDEX_SCORE
from dsflash.plugins.csa2_index_score.decl import FP4_DECL as INDEX_SCORE_FP4
from dsflash.plugins.csa2_index_score.reference import csa2_index_score_fp4_pooled as pooled_fp4_reference
from dsflash.plugins.csa2_index_score.reference import csa2_index_score_pooled as pooled_score_reference
from dsflash.plugins.csa2_sparse_attention import splits
from dsflash.plugins.csa2_sparse_attention.decl import COMBINE_DECL as ATTENTION_COMBINE
from dsflash.plugins.csa2_sparse_attention.decl import DECL as SPARSE_ATTENTION
from dsflash.plugins.csa2_sparse_attention.decl import ENTRIES_FP4_DECL as ENTRIES_FP4
from dsflash.plugins.csa2_sparse_attention.decl import SPLIT_DECL as SPARSE_ATTENTION_SPLIT
from dsflash.plugins.declaration import OpDecl
from dsflash.plugins.engram_hash_gather.decl import DECL as ENGRAM_HASH_GATHER
from dsflash.plugins.mhc_boundary import splits as mhc_splits
from dsflash.plugins.mhc_boundary.decl import DECL as MHC_BOUNDARY
from dsflash.plugins.mhc_boundary.decl import FINISH_DECL as MHC_FINISH
from dsflash.plugins.mhc_boundary.decl import PARTIALS_DECL as MHC_PARTIALS
from dsflash.plugins.mhc_boundary.reference import boundary_with_sinkhorn, finish_with_sinkhorn, sinkhorn
from dsflash.plugins.mhc_boundary.sinkhorn_node import register_sinkhorn_op, sinkhorn_node
from dsflash.plugins.qat_round import reference as qat_reference
from dsflash.plugins.qat_round.node import qat_node, register_qat_ops
from dsflash.plugins.stable_topk.reference import stable_topk as stable_topk_reference

DECLS: tuple[OpDecl, ...] = (ENGRAM_HASH_GATHER, INDEX_SCORE, SPARSE_ATTENTION, MHC_BOUNDARY,
                             SPARSE_ATTENTION_SPLIT, ATTENTION_COMBINE, MHC_PARTIALS, MHC_FINISH,
                             INDEX_SCORE_FP4, ENTRIES_FP4)
BACKENDS = ("reference", "custom_op", "triton")
POOL_FORMS = ("auto", "mask", "list")
ENTRY_FORMS = ("auto", "selected", "all")


QAT_ROUND_TRIPS = ("fp8_e4m3_qat", "fp4_pow2_qat", "fp4_pow2_pack", "fp4_e4m3scale_pack")


def require_qat(name: str) -> None:
    if name not in QAT_ROUND_TRIPS:
        raise ValueError(f"unknown kv_qat round-trip {name!r}; round-trips: {QAT_ROUND_TRIPS}")


def decl_by_name(name: str) -> OpDecl:
    for d in DECLS:
        if d.name == name:
            return d
    raise KeyError(f"no custom op named {name!r}; known: {[d.name for d in DECLS]}")


def _triton_kernels() -> dict:
    """Launchers with the references' signatures, imported only when asked for (triton is an
    optional dependency). The mHC and attention launchers keep their workspaces (no allocation
    per call, CUDA-graph safe): an mHC boundary is one launch, a split attention call two (the
    partials and their combine)."""
    from dsflash.plugins.csa2_index_score.kernel import csa2_index_score, csa2_index_score_fp4
    from dsflash.plugins.csa2_index_score.pool_list import listed_picks, pool_entry_list
    from dsflash.plugins.csa2_index_score.pooled import (
        csa2_index_score_pooled,
        csa2_index_score_pooled_maxima,
    )
    from dsflash.plugins.csa2_index_score.pooled_fp4 import listed_fp4_scores, listed_fp4_scores_maxima
    from dsflash.plugins.csa2_sparse_attention.entries_fp4 import csa2_entries_fp4
    from dsflash.plugins.csa2_sparse_attention.kernel import SparseAttentionLauncher
    from dsflash.plugins.engram_hash_gather.kernel import engram_hash_gather
    from dsflash.plugins.mhc_boundary.kernel import MhcBoundaryLauncher
    from dsflash.plugins.qat_round import kernel as qat_round
    from dsflash.plugins.stable_topk.kernel import StableTopkLauncher

    topk = StableTopkLauncher()
    return {"engram_hash_gather": engram_hash_gather, "csa2_index_score": csa2_index_score,
            "csa2_sparse_attention": SparseAttentionLauncher(), "mhc_boundary": MhcBoundaryLauncher(),
            "stable_topk": topk, "listed_topk": topk.listed_ids,
            # the listed pool's top-k over the index launch's block maxima (select_in_listed_pool)
            "listed_maxima_block": topk.maxima_block, "listed_topk_with_maxima": topk.listed_ids_with_maxima,
            "csa2_index_score_pooled": csa2_index_score_pooled,
            "csa2_index_score_pooled_maxima": csa2_index_score_pooled_maxima,
            "csa2_index_score_fp4_pooled_maxima": listed_fp4_scores_maxima,
            "pool_entry_list": pool_entry_list, "listed_picks": listed_picks,
            "csa2_index_score_fp4": csa2_index_score_fp4, "csa2_index_score_fp4_pooled": listed_fp4_scores,
            "csa2_entries_fp4": csa2_entries_fp4,
            **{name: getattr(qat_round, name) for name in QAT_ROUND_TRIPS}}


def _choice(name: str, forms: tuple[str, ...], what: str) -> property:
    """An OpSet setting that must be one of `forms`: any other value is a ValueError naming it
    and the forms."""
    def get(self) -> str:
        return getattr(self, f"_{name}")

    def put(self, value: str) -> None:
        if value not in forms:
            raise ValueError(f"unknown {what} {value!r}; forms: {forms}")
        setattr(self, f"_{name}", value)

    return property(get, put)


def _node_switch(name: str, register) -> property:
    """An OpSet switch to a one-node export form: its torch ops are registered (`register`) when
    it is switched on."""
    def get(self) -> bool:
        return getattr(self, f"_{name}")

    def put(self, value: bool) -> None:
        if value:
            register()
        setattr(self, f"_{name}", bool(value))

    return property(get, put)


class OpSet:
    """`split_attention`: the reference and custom_op backends run Csa2SparseAttention as its split
    form (Csa2SparseAttentionSplit + Csa2AttentionCombine, tuned for an H200: splits.py), which is
    how decoder_step graphs export it (a TensorRT plugin runs one kernel, and a decode step needs
    its keys split over the GPU). `split_mhc` likewise runs MhcBoundary as MhcBoundaryPartials +
    MhcBoundaryFinish (mhc_boundary/splits.py: a decode token's channels over the GPU). The Triton
    backend splits inside its launchers either way.

    `pool_form`: how Reindex layers after the candidate source see its pool. "mask" (the graphs'
    form): a [B, S, N] mask over the index scores of all N entries; "list": the pooled entries'
    ids (model/csa2_ops.py:pool_entry_list), whose P scores alone are computed and ranked
    (csa2_index_score_pooled), the same selection; "auto": the list on the Triton backend, where
    it reads 1/8 of the keys at the released sizes, the mask elsewhere.

    `entry_form`: which of kv_qat's FP4 compressed entries the attention gets decoded
    (csa2_entries_fp4). "selected": the S*K its rows select (a decode step); "all": every entry
    once (a prefill, where S*K would outgrow N); "auto": the smaller of the two, by shape (export
    sets the form per graph instead, since a graph's S and N are not known when it is traced).

    `sinkhorn_node`: the PyTorch-side Sinkhorns (the reference boundaries, the op-by-op
    coefficients of model/mhc.py:hc_mixes) as one torch.ops.dsflash_std.sinkhorn node each, which
    the ONNX export writes out as the same standard ops (mhc_boundary/sinkhorn_node.py: it spares
    torch.export tracing 6 ops per iteration). `qat_node` likewise makes each kv_qat round-trip
    (`qat`) one torch.ops.dsflash_std node (qat_round/node.py). Both are set by the export only;
    eager and compiled runs keep the ops."""

    def __init__(self, backend: str = "reference", use_topk_kernel: bool = True,
                 split_attention: bool = False, split_mhc: bool = False, pool_form: str = "auto",
                 entry_form: str = "auto", sinkhorn_node: bool = False, qat_node: bool = False):
        self.backend = backend
        self.use_topk_kernel = use_topk_kernel
        self.split_attention = split_attention
        self.split_mhc = split_mhc
        self.pool_form = pool_form
        self.entry_form = entry_form
        self.sinkhorn_node = sinkhorn_node
        self.qat_node = qat_node

    entry_form = _choice("entry_form", ENTRY_FORMS, "entry form")
    pool_form = _choice("pool_form", POOL_FORMS, "pool form")
    sinkhorn_node = _node_switch("sinkhorn_node", register_sinkhorn_op)
    qat_node = _node_switch("qat_node", register_qat_ops)

    @property
    def lists_pool(self) -> bool:
        """Whether Reindex layers score a listed pool (see `pool_form`)."""
        return self.pool_form == "list" or (self.pool_form == "auto" and self._backend == "triton")

    def sinkhorn(self, logits_BSCC: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        """reference.sinkhorn, as one node where `sinkhorn_node` says so."""
        if self._sinkhorn_node:
            return sinkhorn_node(logits_BSCC, iters, eps)
        return sinkhorn(logits_BSCC, iters, eps)

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        if value not in BACKENDS:
            raise ValueError(f"unknown op backend {value!r}; backends: {BACKENDS}")
        if value == "custom_op":
            from dsflash.plugins.torch_ops import register_torch_ops

            register_torch_ops()
        if value == "triton":
            from dsflash.plugins.triton_ops import register_triton_ops

            self._kernels = _triton_kernels()
            register_triton_ops(DECLS, self._kernels)
        self._backend = value

    def _call(self, decl: OpDecl, *inputs, **attrs):
        if self._backend == "custom_op":
            # in a graph, fp32 ports take fp32 whatever the model's dtype (a Cast node in a bf16
            # graph, nothing in an fp32 one), as the plugins' type combinations declare; the
            # references and the Triton kernels read any float dtype and compute in fp32
            inputs = tuple(x.float() if p.dtype == "fp32" and x.dtype != torch.float32 else x
                           for p, x in zip(decl.inputs, inputs))
        if self._backend == "reference":
            return decl.reference(*inputs, **attrs)
        if self._backend == "triton":
            if torch.compiler.is_compiling():  # a traced graph holds ops, not launcher objects
                op = getattr(torch.ops.dsflash_triton, decl.torch_name)
                return op(*inputs, *(attrs[a.name] for a in decl.attrs))
            return self._kernels[decl.torch_name](*inputs, **attrs)
        op = getattr(torch.ops.dsflash, decl.torch_name)
        return op(*inputs, *(attrs[a.name] for a in decl.attrs))

    def engram_hash_gather(self, cids_BT, table, multipliers, primes, offsets, pad_id, heads):
        return self._call(ENGRAM_HASH_GATHER, cids_BT, table, multipliers=list(multipliers),
                          primes=list(primes), offsets=list(offsets), pad_id=pad_id, heads=heads)

    def csa2_index_score(self, q_BSIJ, w_BSI, k_BNJ, visible_BSN, exps_BNG=None):
        """Keys [B, N, J], or with exps_BNG the FP4 keys of kv_qat models (codes [B, N, J/2] in k_BNJ;
        the Csa2IndexScoreFp4 op)."""
        if exps_BNG is not None:
            return self._call(INDEX_SCORE_FP4, q_BSIJ, w_BSI, k_BNJ, exps_BNG, visible_BSN)
        return self._call(INDEX_SCORE, q_BSIJ, w_BSI, k_BNJ, visible_BSN)

    def csa2_index_score_pooled(self, q_BSIJ, w_BSI, k_BNJ, entries_BSP, exps_BNG=None):
        """Not a plugin op (graphs keep the mask form): the Triton kernel on the Triton backend,
        else the reference; FP4 keys as in csa2_index_score."""
        if exps_BNG is not None:
            return self._launcher_or("csa2_index_score_fp4_pooled", pooled_fp4_reference, q_BSIJ, w_BSI,
                                     k_BNJ, exps_BNG, entries_BSP)
        return self._launcher_or("csa2_index_score_pooled", pooled_score_reference, q_BSIJ, w_BSI, k_BNJ,
                                 entries_BSP)

    def pool_entry_list(self, member_BSN, size: int):
        """The candidate pool listed (model/csa2_ops.py): the Triton kernels on the eager Triton
        backend; a traced graph keeps the PyTorch ops (inductor fuses them; the form the H200's
        compiled-step tests ran in session 20), as do the other backends."""
        return self._launcher_or("pool_entry_list", csa2_ops.pool_entry_list, member_BSN, size,
                                 traced_reference=True)

    def listed_picks(self, vals_BSK, pos_BSK, entries_BSP, width: int):
        """A top-k over the listed pool as entry ids (model/csa2_ops.py), as pool_entry_list."""
        return self._launcher_or("listed_picks", csa2_ops.listed_picks, vals_BSK, pos_BSK, entries_BSP, width,
                                 traced_reference=True)

    def select_listed_topk(self, scores_BSP, entries_BSP, k: int, n: int):
        """model/csa2_ops.py:select_listed_topk with this OpSet's top-k and picks. The eager Triton
        backend with the top-k kernel runs it as one launcher call whose rank launch writes the
        entry ids itself (StableTopkLauncher.listed_ids: no listed_picks launch); a traced graph
        and the other backends keep the two ops."""
        if self._backend == "triton" and self.use_topk_kernel and not torch.compiler.is_compiling():
            return self._kernels["listed_topk"](scores_BSP, entries_BSP, k, n)
        return csa2_ops.select_listed_topk(scores_BSP, entries_BSP, k, n, topk=self.stable_topk,
                                           picks=self.listed_picks)

    def select_in_listed_pool(self, q_BSIJ, w_BSI, k_BNJ, entries_BSP, exps_BNG, k: int, n: int):
        """A Reindex layer's selection in its listed pool: csa2_index_score_pooled, then
        select_listed_topk. The eager Triton backend with the top-k kernel has the index launch
        write its scores' block maxima where the top-k's form takes them
        (StableTopkLauncher.maxima_block, listed_ids_with_maxima): the top-k's first launch, which
        would read the scores back for them, does not run. Same selection either way."""
        if self._backend == "triton" and self.use_topk_kernel and not torch.compiler.is_compiling():
            rows, p = entries_BSP.shape[0] * entries_BSP.shape[1], entries_BSP.shape[2]
            block = self._kernels["listed_maxima_block"](rows, p, k)
            if block:
                if exps_BNG is None:
                    scores, maxima = self._kernels["csa2_index_score_pooled_maxima"](q_BSIJ, w_BSI, k_BNJ,
                                                                                   entries_BSP, block)
                else:
                    scores, maxima = self._kernels["csa2_index_score_fp4_pooled_maxima"](
                        q_BSIJ, w_BSI, k_BNJ, exps_BNG, entries_BSP, block)
                return self._kernels["listed_topk_with_maxima"](scores, maxima, entries_BSP, k, n)
        scores = self.csa2_index_score_pooled(q_BSIJ, w_BSI, k_BNJ, entries_BSP, exps_BNG)
        return self.select_listed_topk(scores, entries_BSP, k, n)

    def _launcher_or(self, name: str, reference, *args, traced_reference: bool = False):
        """A launcher that is not a graph op on the Triton backend, else the reference. Under
        compilation its torch.library op (plugins/triton_ops.py:LAUNCHER_OPS), or with
        `traced_reference` the reference's PyTorch ops."""
        if self._backend != "triton":
            return reference(*args)
        if torch.compiler.is_compiling():
            if traced_reference:
                return reference(*args)
            return getattr(torch.ops.dsflash_triton, name)(*args)
        return self._kernels[name](*args)

    def csa2_sparse_attention(self, q_BSHD, kv_BND, idx_BSK, win_kv_BTD, win_mask_BST, sink_H, scale):
        if self.split_attention and self._backend != "triton":
            acc, ml = self._call(SPARSE_ATTENTION_SPLIT, q_BSHD, kv_BND, idx_BSK, win_kv_BTD, win_mask_BST,
                                 sink_H, scale=float(scale),
                                 **splits.export_attrs(q_BSHD.shape[2], q_BSHD.shape[3]))
            return self._call(ATTENTION_COMBINE, q_BSHD, acc, ml, sink_H)
        return self._call(SPARSE_ATTENTION, q_BSHD, kv_BND, idx_BSK, win_kv_BTD, win_mask_BST, sink_H,
                          scale=float(scale))

    def csa2_entries_fp4(self, q_BSHD, codes_BNC, scales_BNG, idx_BSK):
        """kv_qat's FP4 entries for Csa2SparseAttention: (entries [B, R, D] in q's dtype, the
        selection [B, S, K] renumbered into them). Per `entry_form`: the S*K selected rows
        (R = S*K, ids s*K + k, -1 kept), or all N entries (R = N, the selection as it is)."""
        b, s, k = idx_BSK.shape
        n = codes_BNC.shape[1]
        form = self.entry_form
        if form == "auto":
            form = "selected" if s * k < n else "all"
        if form == "all":
            every = torch.arange(n, device=idx_BSK.device).view(1, 1, n).expand(b, 1, n)
            return self._call(ENTRIES_FP4, q_BSHD, codes_BNC, scales_BNG, every), idx_BSK
        slots = torch.arange(s * k, device=idx_BSK.device).view(1, s, k)
        renumbered = torch.where(idx_BSK >= 0, slots, torch.full_like(idx_BSK, -1))
        return self._call(ENTRIES_FP4, q_BSHD, codes_BNC, scales_BNG, idx_BSK), renumbered

    def csa2_sparse_attention_fp4(self, q_BSHD, codes_BNC, scales_BNG, idx_BSK, win_kv_BTD, win_mask_BST,
                                  sink_H, scale):
        """Csa2SparseAttention over kv_qat's FP4 entries (codes + e4m3 scale bits): csa2_entries_fp4
        decodes the rows the attention then reads, on every backend and in the graphs. (Decoding
        inside the attention kernel instead was slower on the H200 in both forms tried, since each
        of a row's head blocks decodes every key again: docs/benchmarks.md, session 23.)"""
        kv, idx = self.csa2_entries_fp4(q_BSHD, codes_BNC, scales_BNG, idx_BSK)
        return self.csa2_sparse_attention(q_BSHD, kv, idx, win_kv_BTD, win_mask_BST, sink_H, scale)

    def qat(self, name: str, x):
        """A kv_qat round-trip of model/quant.py by name (fp8_e4m3_qat, fp4_pow2_qat, fp4_pow2_pack,
        fp4_e4m3scale_pack): one Triton launch each on the eager Triton backend (plugins/qat_round,
        bit for bit the same), the reference's ops elsewhere: the graphs keep standard ops, and a
        compiled trace keeps them for inductor to fuse; one node each where `qat_node` says so."""
        require_qat(name)
        if self._qat_node:
            return qat_node(name, x)
        return self._launcher_or(name, getattr(qat_reference, name), x, traced_reference=True)

    def stable_topk(self, scores, k: int):
        """Not a plugin op: graphs keep the reference's sort (ONNX TopK). On the Triton backend
        the radix-select kernel (plugins/stable_topk) serves it, bit-exact against the sort on the
        H200 and faster (docs/benchmarks.md); `use_topk_kernel=False` keeps the sort there too."""
        if self._backend == "triton" and self.use_topk_kernel:
            if torch.compiler.is_compiling():
                return torch.ops.dsflash_triton.stable_topk(scores, k)
            return self._kernels["stable_topk"](scores, k)
        return stable_topk_reference(scores, k)

    def mhc_boundary(self, streams, y, post, comb, pre, fn, base, scale, norm_weight, iters,
                     hc_eps, rms_eps):
        attrs = {"iters": int(iters), "hc_eps": float(hc_eps), "rms_eps": float(rms_eps)}
        # the references run this OpSet's Sinkhorn (one node while exporting); the plugin ops and
        # the kernels hold their own
        reference = self._backend == "reference"
        if self.split_mhc and self._backend != "triton":
            new, x_raw, mixes, sums = self._call(MHC_PARTIALS, streams, y, post, comb, pre, fn,
                                                 **mhc_splits.export_attrs(streams.shape[3]))
            if reference:
                return (new, *finish_with_sinkhorn(self.sinkhorn, x_raw, mixes, sums, base, scale,
                                                   norm_weight, **attrs))
            return (new, *self._call(MHC_FINISH, x_raw, mixes, sums, base, scale, norm_weight, **attrs))
        if reference:
            return boundary_with_sinkhorn(self.sinkhorn, streams, y, post, comb, pre, fn, base, scale,
                                          norm_weight, **attrs)
        return self._call(MHC_BOUNDARY, streams, y, post, comb, pre, fn, base, scale, norm_weight, **attrs)
