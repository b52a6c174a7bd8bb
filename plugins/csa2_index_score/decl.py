from dsflash.plugins.csa2_index_score import reference
from dsflash.plugins.declaration import OpDecl, Port

DECL = OpDecl(
    name="Csa2IndexScore", torch_name="csa2_index_score",
    inputs=(Port("q", "float"), Port("w", "fp32"), Port("k", "float"), Port("visible", "bool")),
    outputs=(Port("scores", "fp32"),), attrs=(),
    reference=reference.csa2_index_score, shape_fn=reference.shape)
