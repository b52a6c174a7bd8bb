"""dsflash.model: the PyTorch reference of DeepSeek-V4.1-Flash (ARCHITECTURE.md)."""
