"""dsflash.export (see PIPELINE.md §1)."""
