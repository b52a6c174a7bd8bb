from dsflash.plugins.declaration import Attr, OpDecl, Port
from dsflash.plugins.mhc_boundary import reference

DECL = OpDecl(
    name="MhcBoundary", torch_name="mhc_boundary",
    inputs=tuple(Port(n, "float") for n in ("streams", "y", "post", "comb", "pre", "fn", "base",
                                             "scale", "norm_weight")),
    outputs=tuple(Port(n, "float") for n in ("new_streams", "x", "next_pre", "next_post", "next_comb")),
    attrs=(Attr("iters", "int"), Attr("hc_eps", "float"), Attr("rms_eps", "float")),
    reference=reference.mhc_boundary, shape_fn=reference.shape)
