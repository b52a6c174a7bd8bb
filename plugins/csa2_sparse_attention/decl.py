from dsflash.plugins.csa2_sparse_attention import reference
from dsflash.plugins.declaration import Attr, OpDecl, Port

_INPUTS = (Port("q", "float"), Port("kv", "float"), Port("idx", "int64"), Port("win_kv", "float"),
           Port("win_mask", "bool"), Port("sink", "fp32"))

DECL = OpDecl(
    name="Csa2SparseAttention", torch_name="csa2_sparse_attention", inputs=_INPUTS,
    outputs=(Port("out", "float"),), attrs=(Attr("scale", "float"),),
    reference=reference.csa2_sparse_attention, shape_fn=reference.shape)

# The split form (decoder_step graphs): TensorRT gives an AOT plugin one kernel and no workspace,
# so the key split of a decode step and its combine are two nodes, with the partials between them.
SPLIT_DECL = OpDecl(
    name="Csa2SparseAttentionSplit", torch_name="csa2_sparse_attention_split", inputs=_INPUTS,
    outputs=(Port("acc", "fp32"), Port("ml", "fp32")),
    attrs=(Attr("scale", "float"), Attr("block_keys", "int"), Attr("split_target", "int")),
    reference=reference.csa2_sparse_attention_split, shape_fn=reference.split_shape)

COMBINE_DECL = OpDecl(
    name="Csa2AttentionCombine", torch_name="csa2_attention_combine",
    inputs=(Port("q", "float"), Port("acc", "fp32"), Port("ml", "fp32"), Port("sink", "fp32")),
    outputs=(Port("out", "float"),), attrs=(),
    reference=reference.csa2_attention_combine, shape_fn=reference.combine_shape)

# kv_qat models keep their compressed entries in FP4 (codes [B, N, D/2], e4m3 scale bits per 16
# channels [B, N, D/16], both uint8): the selected ones decoded into S*K rows for the attention
ENTRIES_FP4_DECL = OpDecl(
    name="Csa2EntriesFp4", torch_name="csa2_entries_fp4",
    inputs=(Port("q", "float"), Port("codes", "uint8"), Port("scales", "uint8"), Port("idx", "int64")),
    outputs=(Port("kv", "float"),), attrs=(),
    reference=reference.csa2_entries_fp4, shape_fn=reference.entries_fp4_shape)
