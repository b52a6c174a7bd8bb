from dsflash.plugins.declaration import Attr, OpDecl, Port
from dsflash.plugins.engram_hash_gather import reference

DECL = OpDecl(
    name="EngramHashGather", torch_name="engram_hash_gather",
    inputs=(Port("cids", "int64"), Port("table", "float")),
    outputs=(Port("rows", "float"),),
    attrs=(Attr("multipliers", "ints"), Attr("primes", "ints"), Attr("offsets", "ints"),
           Attr("pad_id", "int"), Attr("heads", "int")),
    reference=reference.engram_hash_gather, shape_fn=reference.shape)
