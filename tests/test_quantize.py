"""The quantized payloads of gradserver.torch.diloco (torch_backend/_quantize.py) on their own:
round-trip error bounds per format, exact 4-bit packing at odd lengths, error feedback keeping
the accumulated error within one quantization step, refusals, and the CUDA path giving the CPU's
bytes (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from gradserver.torch._quantize import BLOCK, FORMATS, ErrorFeedback, decode, encode, encoded_size

LENGTHS = [1, 2, 3, 63, 64, 65, 127, 1001]


def _values(numel: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # Heavy-tailed, with magnitudes spread over blocks, as pseudo-gradients are.
    return torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator).pow(4) * 10


def _block_bound(values: torch.Tensor, levels: int, block: int) -> torch.Tensor:
    """Per value: half a quantization step of its block (the block's largest magnitude / levels)."""
    blocks = -(-values.numel() // block)
    padded = torch.zeros(blocks * block)
    padded[: values.numel()] = values.abs()
    steps = padded.view(blocks, block).amax(dim=1) / levels
    return steps.repeat_interleave(block)[: values.numel()] / 2


@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("format", FORMATS)
def test_the_payload_has_the_size_stated_and_decodes_within_half_a_step(format: str, numel: int) -> None:
    values = _values(numel, seed=numel)
    payload = encode(values, format)
    assert payload.dtype == torch.uint8 and payload.numel() == encoded_size(format, numel)
    decoded = decode(payload, format, numel)
    assert decoded.dtype == torch.float32 and decoded.shape == values.shape
    error = (decoded - values).abs()
    if format == "bf16":
        assert torch.all(error <= values.abs() * 2.0**-8)
    else:
        levels = 127 if format == "int8" else 7
        # Half a step, plus float32 rounding of value / scale and code * scale.
        assert torch.all(error <= _block_bound(values, levels, BLOCK) * (1 + 1e-5) + 1e-30)


@pytest.mark.parametrize("numel", [1, 3, 5, 63, 65, 129])
def test_four_bit_codes_pack_exactly_at_odd_lengths(numel: int) -> None:
    """Values that are whole multiples of their block's step come back exactly: every nibble,
    the last (unpaired) one of an odd length included."""
    codes = torch.arange(numel) % 15 - 7
    codes[::BLOCK] = 7  # each block's largest magnitude: step = 0.25 exactly
    values = codes.to(torch.float32) * 0.25
    assert torch.equal(decode(encode(values, "int4"), "int4", numel), values)
    assert encoded_size("int4", numel) == 4 * (-(-numel // BLOCK)) + (numel + 1) // 2


@pytest.mark.parametrize("format", ["int8", "int4"])
def test_a_block_of_zeros_decodes_to_zeros(format: str) -> None:
    values = torch.zeros(2 * BLOCK + 3)
    values[BLOCK + 1] = -3.0  # the middle block alone holds a value
    decoded = decode(encode(values, format), format, values.numel())
    assert torch.isfinite(decoded).all()
    assert torch.equal(decoded, values)


def test_a_payload_sliced_at_an_unaligned_offset_decodes_the_same() -> None:
    values = _values(65)
    payload = encode(values, "int4")
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), payload])[3:]
    assert shifted.storage_offset() == 3
    assert torch.equal(decode(shifted, "int4", 65), decode(payload, "int4", 65))


@pytest.mark.parametrize("format", FORMATS)
def test_error_feedback_keeps_the_accumulated_error_within_one_step(format: str) -> None:
    """Sending the same vector 200 times: without feedback the sum of what was sent drifts by 200
    times the rounding error; with it, by the last residual alone (at most half a step)."""
    values = _values(1000, seed=7)
    rounds = 200
    once = decode(encode(values, format), format, values.numel())
    drift_without = (rounds * (once - values)).abs().max()
    feedback = ErrorFeedback(format)
    sent = torch.zeros_like(values)
    for _ in range(rounds):
        sent += decode(feedback.encode(values), format, values.numel())
    assert feedback.residual is not None
    accumulated = (sent - rounds * values).abs()
    # What was sent plus the residual kept is what was asked, up to float32 sums of 200 terms.
    assert torch.allclose(sent + feedback.residual, rounds * values, rtol=1e-4, atol=1e-3)
    levels = {"bf16": None, "int8": 127, "int4": 7}[format]
    if levels is None:
        bound = values.abs() * 2.0**-8 + 1e-3
    else:
        bound = _block_bound(values, levels, BLOCK) * 1.01 + 1e-3
    assert torch.all(accumulated <= bound)
    assert accumulated.max() < drift_without / 20


def test_refusals_name_what_is_wrong() -> None:
    values = torch.ones(4)
    with pytest.raises(ValueError, match=r"unknown quantization format 'int3': use one of bf16, int8, int4"):
        encode(values, "int3")
    with pytest.raises(ValueError, match="the quantization block must hold at least 1 value, got 0"):
        encode(values, "int8", block=0)
    with pytest.raises(
        ValueError, match=r"encode takes a 1-D float32 tensor, got torch.float64 of shape \(4,\)"
    ):
        encode(values.double(), "int8")
    with pytest.raises(ValueError, match="a int8 payload of 4 values holds 8 bytes, got 7"):
        decode(torch.zeros(7, dtype=torch.uint8), "int8", 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("format", FORMATS)
def test_cuda_tensors_give_the_cpus_bytes(format: str) -> None:
    """Every replica must decode the same average: a CUDA replica's payload and its decoding are
    the CPU's, byte for byte."""
    values = _values(4099, seed=3)
    payload = encode(values.cuda(), format)
    assert payload.device.type == "cuda"
    assert torch.equal(payload.cpu(), encode(values, format))
    decoded = decode(payload, format, values.numel())
    assert torch.equal(decoded.cpu(), decode(encode(values, format), format, values.numel()))
    feedback = ErrorFeedback(format)
    feedback.encode(values.cuda())
    assert feedback.residual is not None and feedback.residual.device.type == "cuda"
