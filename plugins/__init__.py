"""dsflash.plugins (see PIPELINE.md §1)."""
