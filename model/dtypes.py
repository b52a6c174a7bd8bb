"""Dtype helpers shared with the op references (see dsflash.plugins.dtypes)."""

from dsflash.plugins.dtypes import cast, f32

__all__ = ["cast", "f32"]
