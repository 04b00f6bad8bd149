"""The shipped text corpus and its byte-level tokenizer.

Tokens are bytes (vocabulary 256), so no tokenizer or data is ever downloaded. The corpus is cut
into non-overlapping windows of `seq_len + 1` bytes; sample i is window i, its input the first
`seq_len` bytes and its target the same shifted by one.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
from importlib import resources

import torch

from gradserver.common.errors import InvalidArgumentError

VOCAB_SIZE = 256
CORPUS_NAME = "kjv"


@functools.cache
def corpus_bytes() -> bytes:
    """The shipped corpus (public-domain King James Bible text, see data/README.md)."""
    with resources.files("gradserver.train").joinpath("data/kjv.txt.gz").open("rb") as handle:
        return gzip.decompress(handle.read())


@functools.cache
def corpus_digest() -> str:
    """SHA-256 of the corpus text: workers agree on the data set, not only on its size."""
    return hashlib.sha256(corpus_bytes()).hexdigest()


def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: torch.Tensor) -> str:
    return bytes(int(t) for t in tokens.flatten()).decode("utf-8", errors="replace")


class TokenWindows:
    """Fixed-length training samples over a byte string."""

    def __init__(self, data: bytes, seq_len: int) -> None:
        if seq_len < 1:
            raise InvalidArgumentError(f"seq_len must be positive, got {seq_len}")
        self.seq_len = seq_len
        self._tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.num_samples = (len(data) - 1) // seq_len
        if self.num_samples < 1:
            raise InvalidArgumentError(f"a corpus of {len(data)} bytes has no window of {seq_len + 1}")

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, both [len(indices), seq_len] int64."""
        if not indices:
            raise InvalidArgumentError("a batch needs at least one sample")
        rows = []
        for i in indices:
            if not 0 <= i < self.num_samples:
                raise InvalidArgumentError(f"sample {i} is outside 0..{self.num_samples - 1}")
            start = i * self.seq_len
            rows.append(self._tokens[start : start + self.seq_len + 1])
        stacked = torch.stack(rows).long()
        return stacked[:, :-1], stacked[:, 1:]
