"""Mixture of experts (ARCHITECTURE.md §4.6, Part B §5 "MoE").

Router (fp32): s = sqrt(softplus(x W_g^T / gate_temp)); pick the top-k of s + bias (selection
only); weights = s_sel / (sum s_sel + 1e-20) * routed_scaling_factor. Experts are SwiGLU with
clamps, silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit); the routing weight multiplies the
hidden activation before w2 (reference model.py order). The shared expert is added unweighted.
`n_routed_experts = 0` gives a dense SwiGLU FFN (ffn.w1/w2/w3).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from dsflash.model.dtypes import cast, f32


def clamp_silu_mul(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """The expert's hidden activation from its fp32 gate and up projections."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def clamped_swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, limit: float) -> torch.Tensor:
    return clamp_silu_mul(f32(F.linear(x, w1)), f32(F.linear(x, w3)), limit)


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        h = clamped_swiglu(x, self.w1.weight, self.w3.weight, self.limit)
        if weight is not None:
            h = h * weight.unsqueeze(-1)
        return self.w2(cast(h, x.dtype))


class Router(nn.Module):
    """Parameters `gate.weight`, `gate.bias` (selection bias) and `gate.bias_vl` (image tokens)."""

    def __init__(self, cfg):
        super().__init__()
        n = cfg.n_routed_experts
        self.top_k, self.scale, self.temp = cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.gate_temp
        self.norm_topk = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(n, cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(n))
        self.bias_vl = nn.Parameter(torch.zeros(n))

    def forward(self, x_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(f32(x_TE), f32(self.weight)) / self.temp
        scores = torch.sqrt(F.softplus(logits))
        idx = torch.topk(scores + f32(self.bias), self.top_k, dim=-1).indices
        w = scores.gather(-1, idx)
        if self.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scale


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        e, limit = cfg.hidden_size, cfg.swiglu_limit
        self.limit = limit
        self.dense = cfg.n_routed_experts == 0
        if self.dense:
            inter = cfg.intermediate_size
            self.w1 = nn.Linear(e, inter, bias=False)
            self.w2 = nn.Linear(inter, e, bias=False)
            self.w3 = nn.Linear(e, inter, bias=False)
            return
        self.n_routed = cfg.n_routed_experts
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(
            Expert(e, cfg.moe_intermediate_size, limit) for _ in range(cfg.n_routed_experts))
        self.shared_experts = (Expert(e, cfg.moe_intermediate_size * cfg.n_shared_experts, limit)
                               if cfg.n_shared_experts else None)
        self._stacked: dict[str, torch.Tensor] = {}
        # set by the ONNX export (export_form below): the graph takes each stack as one parameter
        # (routed_w1 / routed_w3 / routed_w2) and one MatMul over [E*I, H]; a runtime trace
        # (torch.compile) reads the stack where it is. An explicit flag: keyed on
        # torch.compiler.is_exporting(), torch 2.11's torch.compile trace took the export branch
        # (H200, 2026-12-04: inductor's output code stacked all 32 experts' w1, w2, w3 on every
        # step, 1.3 of its 4.0 ms)
        self.for_export = False
        # the export's routed dispatch (MOE_EXPORT_DISPATCH), set by export_form
        self.export_dispatch = "dense"
        self.stack_experts()

    def stack_experts(self) -> None:
        """Keep the routed experts' w1 / w2 / w3 in one [E, ...] tensor each, every expert's
        parameter a view of its row, so the dense dispatch (CUDA graphs, export) reads them as
        they are. Stacking them per call copied every expert each decode step: 2.4 of the 9.4 ms
        of the small model's graphed step on the H200 (scripts/bench_decode.py --profile,
        2026-12-03). Runs at construction and after every device / dtype conversion (`_apply`
        gives each parameter storage of its own; while it re-stacks, one layer's experts are held
        twice); loading copies into the views in place. torch.compile traces the stack without
        checking it (runtime/engine.py calls this first)."""
        with torch.no_grad():
            for name in ("w1", "w2", "w3"):
                params = [getattr(e, name).weight for e in self.experts]
                stacked = self._stacked.get(name)
                if stacked is not None and all(_is_row(p, stacked, i) for i, p in enumerate(params)):
                    continue
                stacked = torch.stack([p.data for p in params])
                for i, p in enumerate(params):
                    p.data = stacked[i]
                self._stacked[name] = stacked

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        if not self.dense:
            self.stack_experts()
        return out

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1 [E, I, H], w3 [E, I, H], w2 [E, H, I]): the experts' own storage where it is still
        stacked, a fresh stack otherwise (a parameter replaced by assignment)."""
        out = []
        for name in ("w1", "w3", "w2"):
            if self.for_export:
                out.append(getattr(self, f"routed_{name}"))  # export_form's stacked parameters
                continue
            params = [getattr(e, name).weight for e in self.experts]
            stacked = self._stacked.get(name)
            if torch.compiler.is_compiling():
                pass  # a trace cannot read addresses: the caller stacked them (stack_experts)
            elif stacked is None or not all(_is_row(p, stacked, i) for i, p in enumerate(params)):
                stacked = torch.stack(params)
            out.append(stacked)
        return tuple(out)

    def forward(self, x_BSE: torch.Tensor) -> torch.Tensor:
        if self.dense:
            h = clamped_swiglu(x_BSE, self.w1.weight, self.w3.weight, self.limit)
            return self.w2(cast(h, x_BSE.dtype))
        x = x_BSE.flatten(0, -2)
        idx, w = self.gate(x)
        out = torch.zeros_like(x, dtype=torch.float32)
        # the per-expert loop sizes its batches on the host (nonzero): neither export nor a CUDA
        # graph capture nor a compile trace can take that, so they use the dense dispatch, or the
        # one-row form (same maths). The capture query comes last: a compile trace cannot take it
        # (dynamo refuses a torch.* call that returns a bool), and is_compiling() skips it there
        if (self.for_export or torch.compiler.is_compiling()
                or (x.is_cuda and torch.cuda.is_current_stream_capturing())):
            # one row (a decode step of one sequence): its k experts are known without a host
            # sync, so read only those; a symbolic batch is >= 2 in a trace, so this adds no guard
            one_row = x.shape[0] == 1 and not self.for_export
            gathered = one_row or (self.for_export and self.export_dispatch == "gathered")
            routed = self._gathered_dispatch(x, idx, w) if gathered else self._dense_dispatch(x, idx, w)
            return cast(self._add_shared(x, routed), x_BSE.dtype).view_as(x_BSE)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            out.index_add_(0, tok, f32(expert(x[tok], w[tok, slot])))
        return cast(self._add_shared(x, out), x_BSE.dtype).view_as(x_BSE)

    def _dense_dispatch(self, x_TE: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Graph-capture form (export, compile): no data-dependent shapes, so every expert runs on
        every row, batched, with routing weight 0 where not selected. 0 * h is exactly 0, so this
        equals the gathered form up to summation order."""
        dense_w = torch.zeros(x_TE.shape[0], self.n_routed, device=x_TE.device).scatter(1, idx, w)
        w1, w3, w2 = self.stacked_weights()  # [E, I, H], [E, I, H], [E, H, I]
        # MatMuls, not einsum: ONNX's Einsum has no bfloat16 type, so a bf16 graph holding one
        # fails the ONNX checker (onnx/defs/math/defs.cc, Einsum's type constraint T)
        gate = f32(torch.matmul(x_TE, w1.transpose(1, 2))).transpose(0, 1)  # [E,T,I] -> [T,E,I]
        up = f32(torch.matmul(x_TE, w3.transpose(1, 2))).transpose(0, 1)
        h = clamp_silu_mul(gate, up, self.limit) * dense_w.unsqueeze(-1)
        h = cast(h, x_TE.dtype)
        if self.for_export:
            # export: one MatMul over [E*I, H] (the weights are initializers, folded at load)
            w2_EI_H = w2.transpose(1, 2).reshape(-1, w2.shape[1])
            return f32(torch.matmul(h.flatten(1), w2_EI_H))
        # CUDA graphs, torch.compile: [E,T,I] @ [E,I,H] summed over E reads the transposed w2
        # where it is (the [E*I, H] reshape above is a strided copy of every expert on each call)
        return f32(torch.matmul(h.transpose(0, 1), w2.transpose(1, 2))).sum(0)

    def _gathered_dispatch(self, x_TE: torch.Tensor, idx_TK: torch.Tensor,
                           w_TK: torch.Tensor) -> torch.Tensor:
        """Graph-capture form that reads only the routed experts: each row gathers its k experts'
        weights ([T, k, I, H], a copy of k/E of each stack per row) and runs them batched; the
        same products as the per-expert loop, summed over the k in fp32. It copies T * k experts
        where the dense form reads all E: fewer bytes while T < E / (3k) (the copies are read,
        written and read again). CUDA graphs take it for one row, the export where asked
        (export_form)."""
        w1, w3, w2 = self.stacked_weights()
        # weights on the left, no transpose: a Transpose of a stack in the graph is of all E
        x_T1E1 = x_TE[:, None, :, None]
        gate = f32(torch.matmul(w1[idx_TK], x_T1E1))  # [T, k, I, H] @ [T, 1, H, 1] -> [T, k, I, 1]
        up = f32(torch.matmul(w3[idx_TK], x_T1E1))
        h = clamp_silu_mul(gate, up, self.limit) * w_TK[:, :, None, None]
        out = f32(torch.matmul(w2[idx_TK], cast(h, x_TE.dtype)))  # [T, k, H, I] @ [T, k, I, 1]
        return out.sum(1).squeeze(-1)

    def _add_shared(self, x_TE: torch.Tensor, out_TE: torch.Tensor) -> torch.Tensor:
        if self.shared_experts is None:
            return out_TE
        return out_TE + f32(self.shared_experts(x_TE))


def _is_row(p: torch.Tensor, stacked: torch.Tensor, i: int) -> bool:
    """Whether parameter p is row i of `stacked` (the same memory, shape and dtype)."""
    row = stacked[i]
    return (p.device == stacked.device and p.dtype == stacked.dtype and p.shape == row.shape
            and p.data_ptr() == row.data_ptr() and p.stride() == row.stride())


ROUTED_STACKS = ("w1", "w3", "w2")  # exported as `<moe>.routed_<w>`, [E, I, H] / [E, H, I]
MOE_EXPORT_DISPATCH = ("dense", "gathered")  # MoE._dense_dispatch, MoE._gathered_dispatch


@contextmanager
def export_form(model: nn.Module, dispatch: str = "dense"):
    """Within: every routed MoE of `model` traces its export form (MoE.for_export) and holds its
    experts' weights as three stacked parameters, `routed_w1` / `routed_w3` [E, I, H] and
    `routed_w2` [E, H, I] (the experts' own storage, no copy), with the per-expert modules taken
    out. Why: torch.export lifts every parameter of the module, used or not, and its decomposition
    step looks each one up in a list of all of them (torch 2.13, torch/_export/utils.py
    `_populate_param_buffer_metadata_to_new_gm`), quadratic in the count: the `flash` decode
    step's 46,080 expert weights did not export within an hour on a 2-core machine. The graph
    also reads one initializer per stack instead of a Concat of E. `dispatch`: how the graph
    runs the routed experts (MOE_EXPORT_DISPATCH): every expert on every row, or each row's k
    gathered from the stacks."""
    if dispatch not in MOE_EXPORT_DISPATCH:
        raise ValueError(f"unknown MoE export dispatch {dispatch!r}; forms: {MOE_EXPORT_DISPATCH}")
    moes = [m for m in model.modules() if isinstance(m, MoE) and not m.dense]
    saved = [list(m._modules.items()) for m in moes]
    try:
        for m in moes:
            for name, stack in zip(ROUTED_STACKS, m.stacked_weights()):
                m.register_parameter(f"routed_{name}", nn.Parameter(stack, requires_grad=False))
            del m._modules["experts"]
            m.for_export, m.export_dispatch = True, dispatch
        yield
    finally:
        for m, modules in zip(moes, saved):
            m.for_export, m.export_dispatch = False, "dense"
            for name in ROUTED_STACKS:
                m._parameters.pop(f"routed_{name}", None)
            m._modules.clear()
            m._modules.update(modules)  # the same order: named_parameters() is unchanged


def routed_stacks(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """{exported stack name (`layers.3.ffn.routed_w1`): the experts' parameters, row by row}, to
    load an exported stack back into the reference (runtime/weights.py)."""
    return {f"{prefix}.routed_{name}": [getattr(e, name).weight for e in m.experts]
            for prefix, m in model.named_modules() if isinstance(m, MoE) and not m.dense
            for name in ROUTED_STACKS}
