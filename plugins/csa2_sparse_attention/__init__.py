"""The csa2_sparse_attention op (PIPELINE.md §4)."""
