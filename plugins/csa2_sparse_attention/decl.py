from dsflash.plugins.csa2_sparse_attention import reference
from dsflash.plugins.declaration import Attr, OpDecl, Port

DECL = OpDecl(
    name="Csa2SparseAttention", torch_name="csa2_sparse_attention",
    inputs=(Port("q", "float"), Port("kv", "float"), Port("idx", "int64"), Port("win_kv", "float"),
            Port("win_mask", "bool"), Port("sink", "float")),
    outputs=(Port("out", "float"),), attrs=(Attr("scale", "float"),),
    reference=reference.csa2_sparse_attention, shape_fn=reference.shape)
