from dsflash.plugins.declaration import Attr, OpDecl, Port
from dsflash.plugins.mhc_boundary import reference

DECL = OpDecl(
    name="MhcBoundary", torch_name="mhc_boundary",
    # the coefficients and the mHC parameters are fp32 whatever the model's dtype (ARCHITECTURE.md §5)
    inputs=(Port("streams", "float"), Port("y", "float"),
            *(Port(n, "fp32") for n in ("post", "comb", "pre", "fn", "base", "scale")),
            Port("norm_weight", "float")),
    outputs=(Port("new_streams", "float"), Port("x", "float"),
             *(Port(n, "fp32") for n in ("next_pre", "next_post", "next_comb"))),
    attrs=(Attr("iters", "int"), Attr("hc_eps", "float"), Attr("rms_eps", "float")),
    reference=reference.mhc_boundary, shape_fn=reference.shape)

# The split form (decoder_step graphs): an AOT plugin is one kernel with no workspace, so the
# channel split of a decode token and the finish that needs every split's sums are two nodes,
# with the partial sums as tensors between them (splits.py).
PARTIALS_DECL = OpDecl(
    name="MhcBoundaryPartials", torch_name="mhc_boundary_partials",
    inputs=(Port("streams", "float"), Port("y", "float"),
            *(Port(n, "fp32") for n in ("post", "comb", "pre", "fn"))),
    outputs=(Port("new_streams", "float"), Port("x_raw", "float"), Port("mixes", "fp32"),
             Port("sums", "fp32")),
    attrs=(Attr("block_e", "int"), Attr("split_target", "int")),
    reference=reference.mhc_boundary_partials, shape_fn=reference.partials_shape)

FINISH_DECL = OpDecl(
    name="MhcBoundaryFinish", torch_name="mhc_boundary_finish",
    inputs=(Port("x_raw", "float"), Port("mixes", "fp32"), Port("sums", "fp32"), Port("base", "fp32"),
            Port("scale", "fp32"), Port("norm_weight", "float")),
    outputs=(Port("x", "float"), *(Port(n, "fp32") for n in ("next_pre", "next_post", "next_comb"))),
    attrs=(Attr("iters", "int"), Attr("hc_eps", "float"), Attr("rms_eps", "float")),
    reference=reference.mhc_boundary_finish, shape_fn=reference.finish_shape)
