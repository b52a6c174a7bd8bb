"""dsflash.runtime (see PIPELINE.md §1)."""
