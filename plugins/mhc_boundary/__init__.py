"""The mhc_boundary op (PIPELINE.md §4)."""
