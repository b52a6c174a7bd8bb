"""The engram_hash_gather op (PIPELINE.md §4)."""
