"""The csa2_index_score op (PIPELINE.md §4)."""
