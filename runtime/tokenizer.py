"""Tokenizers: HF `tokenizers` (a tokenizer.json) and a byte-level one for tests and the tiny
demo. Both expose encode / decode / vocab_size and `compression_map`, the Engram
tokenizer-compression map built from this tokenizer's decoded strings."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dsflash.model.engram_hash import build_compression_map


def _checked_map(vocab_size, decode, raw_token, compressed_size: int | None) -> np.ndarray:
    """The compression map, checked against the config's compressed vocabulary size."""
    m = build_compression_map(vocab_size, decode, raw_token)
    if compressed_size is not None and int(m.max()) + 1 != compressed_size:
        raise ValueError(f"the tokenizer compresses to {int(m.max()) + 1} ids, the config says "
                         f"{compressed_size}")
    return m


class ByteTokenizer:
    """ids 0 bos, 1 eos, 2 pad, then byte b -> b + 3; ids past 258 decode to nothing."""

    SPECIALS = 3

    def __init__(self, vocab_size: int = 512):
        if vocab_size < 256 + self.SPECIALS:
            raise ValueError(f"vocab_size={vocab_size} is below the {256 + self.SPECIALS} byte ids")
        self.vocab_size = vocab_size
        self.bos_token_id, self.eos_token_id, self.pad_token_id = 0, 1, 2

    def encode(self, text: str) -> list[int]:
        return [b + self.SPECIALS for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - self.SPECIALS for i in ids if self.SPECIALS <= i < 256 + self.SPECIALS)
        return data.decode("utf-8", errors="replace")

    def raw_token(self, tid: int) -> str:
        return f"<{tid}>" if not self.SPECIALS <= tid < 256 + self.SPECIALS else f"<0x{tid - 3:02X}>"

    def compression_map(self, compressed_size: int | None = None) -> np.ndarray:
        return _checked_map(self.vocab_size, lambda t: self.decode([t]) or self.raw_token(t),
                            self.raw_token, compressed_size)


class HFTokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        if not Path(path).is_file():  # the tokenizers library's own error names no path
            raise FileNotFoundError(f"tokenizer file {path} does not exist")
        self.tok = Tokenizer.from_file(str(path))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def compression_map(self, compressed_size: int | None = None) -> np.ndarray:
        return _checked_map(self.vocab_size, lambda t: self.tok.decode([t], skip_special_tokens=False),
                            lambda t: self.tok.id_to_token(t) or "", compressed_size)
