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
