"""Engram n-gram addressing (ARCHITECTURE.md §4.7, Part B §3): tokenizer compression, odd
multipliers, distinct primes, rolling XOR hash and per-head table offsets. All integer maths is
int64 and exact: c < V' and m <= (2^63-1)//V', so no product overflows and `%` is an ordinary
modulus.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

INT63_MAX = 2**63 - 1


def normalize_token_text(text: str) -> str:
    """NFKC -> NFD -> strip accents -> lowercase -> whitespace runs to ' ' -> strip, where a lone
    space survives (the release's HF normaliser chain with its U+E000 sentinel)."""
    t = unicodedata.normalize("NFKC", text)
    t = unicodedata.normalize("NFD", t)
    t = "".join(ch for ch in t if unicodedata.category(ch) != "Mn")
    t = t.lower()
    t = re.sub(r"[ \t\r\n]+", " ", t)
    t = re.sub(r"^ $", "\ue000", t)
    t = t.strip(" ")
    return t.replace("\ue000", " ")


def build_compression_map(vocab_size: int, decode: Callable[[int], str],
                          raw_token: Callable[[int], str]) -> np.ndarray:
    """Map every token id to a compressed id, merging ids whose normalised text is equal.

    `decode(id)` is the tokenizer's decode of the single id (no clean-up); ids whose text contains
    U+FFFD (partial UTF-8) keep their raw token string as key. Ids are numbered first-seen.
    """
    keys: dict[str, int] = {}
    out = np.empty(vocab_size, dtype=np.int64)
    for tid in range(vocab_size):
        text = decode(tid)
        if "\ufffd" in text:
            key = "raw:" + raw_token(tid)
        else:
            key = "txt:" + (normalize_token_text(text) or text)
        out[tid] = keys.setdefault(key, len(keys))
    return out


def synthetic_compression_map(vocab_size: int, compressed_size: int) -> np.ndarray:
    """The test configs' map P(x) = floor(x * V' / V) (tiny: floor(x / 2))."""
    return (np.arange(vocab_size, dtype=np.int64) * compressed_size) // vocab_size


def engram_multipliers(layer: int, compressed_vocab: int, max_ngram: int) -> list[int]:
    """Odd per-shift multipliers: numpy default_rng(10007*layer) integers in [0, bound) * 2 + 1."""
    bound = max(1, (INT63_MAX // compressed_vocab) // 2)
    draws = np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,), dtype=np.int64)
    return [int(r) * 2 + 1 for r in draws]


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):  # deterministic below 3.3e24
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(layers: Sequence[int], orders: Sequence[int], heads: int,
                  vocab_size: int) -> dict[int, list[list[int]]]:
    """Per layer, per order, per head: the smallest prime above the previous one not yet used.

    The walk restarts at engram_vocab_size - 1 for every order; the used set is global across
    layers, so every (layer, order, head) gets a distinct prime.
    """
    seen: set[int] = set()
    out: dict[int, list[list[int]]] = {}
    for layer in layers:
        per_order = []
        for _ in orders:
            cur, row = vocab_size - 1, []
            for _ in range(heads):
                p = cur + 1
                while not _is_prime(p) or p in seen:
                    p += 1
                seen.add(p)
                row.append(p)
                cur = p
            per_order.append(row)
        out[layer] = per_order
    return out


@dataclass(frozen=True)
class EngramAddressing:
    """Everything needed to turn compressed ids into table rows for one Engram layer."""

    multipliers: tuple[int, ...]  # per shift k = 0 .. max_ngram-1
    primes: tuple[int, ...]       # order-major: order 2 heads 0..H-1, then order 3, ...
    offsets: tuple[int, ...]      # exclusive running sum of primes
    pad_id: int                   # compressed id of the pad token

    @property
    def rows(self) -> int:
        return self.offsets[-1] + self.primes[-1]


def layer_addressing(cfg, vocab_map: np.ndarray) -> dict[int, EngramAddressing]:
    primes = engram_primes(cfg.engram_layer_ids, cfg.engram_orders, cfg.engram_n_heads,
                           cfg.engram_vocab_size)
    out = {}
    for i, layer in enumerate(cfg.engram_layer_ids):
        flat = [p for row in primes[layer] for p in row]
        offsets = np.concatenate([[0], np.cumsum(flat)[:-1]]).tolist()
        addr = EngramAddressing(
            multipliers=tuple(engram_multipliers(layer, cfg.engram_compressed_vocab_size,
                                                 cfg.engram_max_ngram_size)),
            primes=tuple(flat), offsets=tuple(int(o) for o in offsets),
            pad_id=int(vocab_map[cfg.engram_pad_token_id]))
        if cfg.engram_num_embeddings is not None and cfg.engram_num_embeddings[i] != addr.rows:
            raise ValueError(f"engram_num_embeddings[{i}]={cfg.engram_num_embeddings[i]} for layer "
                             f"{layer}, but its primes sum to {addr.rows}")
        out[layer] = addr
    return out
