from dsflash.plugins.csa2_index_score import reference
from dsflash.plugins.declaration import OpDecl, Port

DECL = OpDecl(
    name="Csa2IndexScore", torch_name="csa2_index_score",
    inputs=(Port("q", "float"), Port("w", "fp32"), Port("k", "float"), Port("visible", "bool")),
    outputs=(Port("scores", "fp32"),), attrs=(),
    reference=reference.csa2_index_score, shape_fn=reference.shape)
# The same scores over the keys as kv_qat models store them (the release's FP4 index keys: codes
# [B, N, J/2] uint8, one power-of-two exponent per 32 channels [B, N, J/32] int8)
FP4_DECL = OpDecl(
    name="Csa2IndexScoreFp4", torch_name="csa2_index_score_fp4",
    inputs=(Port("q", "float"), Port("w", "fp32"), Port("codes", "uint8"), Port("exps", "int8"),
            Port("visible", "bool")),
    outputs=(Port("scores", "fp32"),), attrs=(),
    reference=reference.csa2_index_score_fp4, shape_fn=reference.shape_fp4)
