"""dsflash.runtime: engines, cache manager, generator and the Runtime facade (PIPELINE.md §5)."""
