"""Quantized payloads of a float32 vector, and the error feedback that keeps their error bounded.

Pure torch, on the vector's device (CPU or CUDA). Three formats:

- "bf16": each value rounded to bfloat16 (round to nearest even), 2 bytes a value.
- "int8": one float32 scale per block of `block` values (the block's largest magnitude / 127),
  each value rounded to the nearest of -127..127 times the scale: 1 byte a value + 4 per block.
- "int4": the same with -7..7, two values a byte (low nibble first; an odd length leaves the last
  high nibble 0): half a byte a value + 4 per block.

Payload layout for the block formats: the block scales (float32, little-endian bytes), then the
codes. `decode` is a function of the payload bytes alone (elementwise float32 multiplications,
each correctly rounded), so every replica that decodes the same payload gets the same bits.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "FORMATS", "ErrorFeedback", "check_format", "decode", "encode", "encoded_size"]

FORMATS = ("bf16", "int8", "int4")
# Values per scale, measured (docs/slow-links.md, "Accuracy"): on heavy-tailed values (SGD-like
# pseudo-gradients) int4's error grows fast with the block (18% at 64, 28% at 256), on AdamW's
# flatter ones slowly (6.5% and 7.1%); 64 costs 0.5 bit a value (a ninth of int4's payload), and
# 32 would cut the heavy-tailed error by a fifth for half a bit more.
BLOCK = 64
_LEVELS = {"int8": 127, "int4": 7}
_SCALE_BYTES = 4


def check_format(format: str, block: int) -> None:
    """Refuses an unknown format or a block size below 1, naming the ones there are."""
    if format not in FORMATS:
        raise ValueError(f"unknown quantization format {format!r}: use one of {', '.join(FORMATS)} or None")
    if block < 1:
        raise ValueError(f"the quantization block must hold at least 1 value, got {block}")


def encoded_size(format: str, numel: int, block: int = BLOCK) -> int:
    """Bytes of the payload `encode` makes of `numel` values."""
    check_format(format, block)
    if format == "bf16":
        return 2 * numel
    blocks = -(-numel // block)
    codes = numel if format == "int8" else (numel + 1) // 2
    return _SCALE_BYTES * blocks + codes


def encode(values: torch.Tensor, format: str, block: int = BLOCK) -> torch.Tensor:
    """The payload (uint8, on `values`' device) of a 1-D float32 tensor of finite values."""
    check_format(format, block)
    if values.dim() != 1 or values.dtype != torch.float32:
        raise ValueError(
            f"encode takes a 1-D float32 tensor, got {values.dtype} of shape {tuple(values.shape)}"
        )
    if format == "bf16":
        return values.to(torch.bfloat16).view(torch.uint8)
    levels = _LEVELS[format]
    numel = values.numel()
    blocks = -(-numel // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=values.device)
    padded[:numel] = values
    rows = padded.view(blocks, block)
    scales = rows.abs().amax(dim=1) / levels
    # A block of zeros has scale 0: its codes are 0 whatever it is divided by.
    divisors = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(rows / divisors[:, None]).clamp_(-levels, levels).to(torch.int8).view(-1)[:numel]
    if format == "int8":
        packed = codes.view(torch.uint8)
    else:
        nibbles = (codes + 8).to(torch.uint8)  # 1..15: a nibble each
        if numel % 2:
            nibbles = torch.cat([nibbles, torch.full((1,), 8, dtype=torch.uint8, device=values.device)])
        pairs = nibbles.view(-1, 2)
        packed = pairs[:, 0] | (pairs[:, 1] << 4)
    return torch.cat([scales.view(torch.uint8), packed])


def decode(payload: torch.Tensor, format: str, numel: int, block: int = BLOCK) -> torch.Tensor:
    """The float32 values of a payload `encode` made of `numel` values (on the payload's device)."""
    expected = encoded_size(format, numel, block)
    if payload.dtype != torch.uint8 or payload.numel() != expected:
        raise ValueError(
            f"a {format} payload of {numel} values holds {expected} bytes, got {payload.numel()} "
            f"of {payload.dtype}"
        )
    if payload.storage_offset() % _SCALE_BYTES:
        payload = payload.clone()  # viewing bytes as float32 (or bfloat16) needs aligned storage
    if format == "bf16":
        return payload.view(torch.bfloat16).to(torch.float32)
    blocks = -(-numel // block)
    scales = payload[: _SCALE_BYTES * blocks].view(torch.float32)
    packed = payload[_SCALE_BYTES * blocks :]
    if format == "int8":
        codes = packed.view(torch.int8).to(torch.float32)
    else:
        low = (packed & 0x0F).to(torch.int16) - 8
        high = (packed >> 4).to(torch.int16) - 8
        codes = torch.stack([low, high], dim=1).view(-1)[:numel].to(torch.float32)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=payload.device)
    padded[:numel] = codes
    return (padded.view(blocks, block) * scales[:, None]).view(-1)[:numel]


class ErrorFeedback:
    """One replica's quantization error, added to the next vector it quantizes.

    Each call quantizes `values + residual` and keeps what the payload lost as the next residual,
    so what was lost is sent later instead of never: the sum of what was sent trails the sum of
    the values by one residual, which stays within one quantization step per value."""

    def __init__(self, format: str, block: int = BLOCK) -> None:
        check_format(format, block)
        self.format = format
        self.block = block
        self.residual: torch.Tensor | None = None

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """The payload of `values` plus the error left by the previous call; keeps the new error."""
        compensated = values if self.residual is None else values + self.residual
        payload = encode(compensated, self.format, self.block)
        self.residual = compensated - decode(payload, self.format, values.numel(), self.block)
        return payload
