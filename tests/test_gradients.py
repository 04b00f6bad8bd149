"""Gradient buffers in the wire layout and sync-free clipping."""

from __future__ import annotations

import pytest
import torch

from gradserver.common import compute_block_sizes
from gradserver.common.components import NonBlockComponent
from gradserver.common.errors import InvalidArgumentError
from gradserver.train.clipping import clip_by_global_norm_, global_norm
from gradserver.train.gradient_buffers import (
    BlockGradientSet,
    PerBlockGradientAccumulator,
    ShapeMismatchError,
)

SIZES = compute_block_sizes(8, 4, 16)


def test_block_set_is_views_into_one_buffer() -> None:
    grads = BlockGradientSet.zeroed(SIZES)
    assert grads.total_elements() == sum(SIZES) and grads.component_sizes() == SIZES
    assert torch.count_nonzero(grads.flatten()) == 0
    grads.components[8].fill_(2.0)
    assert grads.flatten()[-8:].tolist() == [2.0] * 8
    assert grads.flatten().data_ptr() == grads.flatten().data_ptr()  # reused, not rebuilt


def test_from_flat_round_trip_and_length_errors() -> None:
    flat = torch.arange(sum(SIZES), dtype=torch.float32)
    grads = BlockGradientSet.from_flat(flat, SIZES)
    assert torch.equal(torch.cat(grads.components), flat)
    with pytest.raises(ShapeMismatchError, match=r"does not match component sizes"):
        BlockGradientSet.from_flat(flat[:-1], SIZES)
    with pytest.raises(InvalidArgumentError, match="9 non-negative component sizes"):
        BlockGradientSet.from_flat(flat, SIZES[:8])


def test_accumulate_scale_and_non_finite() -> None:
    a, b = BlockGradientSet.zeroed(SIZES), BlockGradientSet.zeroed(SIZES)
    b.flatten().fill_(3.0)
    a.accumulate(b)
    a.accumulate([torch.ones(s) for s in SIZES])
    a.scale(2.0)
    assert torch.all(a.flatten() == 2.0)
    assert not a.has_non_finite()
    a.components[3][0] = float("nan")
    assert a.has_non_finite()
    with pytest.raises(ShapeMismatchError, match="component sizes"):
        a.accumulate(BlockGradientSet.zeroed(compute_block_sizes(4, 4, 4)))
    with pytest.raises(ShapeMismatchError, match="component 0 has 64 elements, the gradient 3"):
        a.accumulate([torch.ones(3)] + [torch.ones(s) for s in SIZES[1:]])
    with pytest.raises(ShapeMismatchError, match="expected 9 tensors, got 2"):
        a.accumulate([torch.ones(1), torch.ones(1)])
    with pytest.raises(InvalidArgumentError, match="1/0"):
        a.scale(0)


def test_per_block_accumulator() -> None:
    acc = PerBlockGradientAccumulator(3, SIZES, vocab_size=10, hidden_size=8)
    assert acc.num_blocks == 3 and set(acc.non_block) == set(NonBlockComponent)
    assert PerBlockGradientAccumulator.compute_block_sizes(8, 4, 16) == SIZES
    for _ in range(4):
        for block in acc.block_grads:
            block.accumulate([torch.full((s,), 2.0) for s in SIZES])
        acc.accumulate_non_block(NonBlockComponent.EMBEDDING, torch.ones(10, 8))
        acc.accumulated_count += 1
    acc.average()
    assert acc.accumulated_count == 1
    assert torch.all(acc.block_grads[2].flatten() == 2.0)
    assert torch.all(acc.non_block[NonBlockComponent.EMBEDDING] == 1.0)
    assert not acc.has_non_finite()
    acc.non_block[NonBlockComponent.FINAL_NORM][0] = float("inf")
    assert acc.has_non_finite()
    acc.zero_all()
    assert acc.accumulated_count == 0 and not acc.has_non_finite()
    with pytest.raises(ShapeMismatchError, match="EMBEDDING: expected 80 elements, got 5"):
        acc.accumulate_non_block(NonBlockComponent.EMBEDDING, torch.ones(5))
    tied = PerBlockGradientAccumulator(1, SIZES, 10, 8, tied=True)
    with pytest.raises(InvalidArgumentError, match="no LM_HEAD gradient"):
        tied.accumulate_non_block(NonBlockComponent.LM_HEAD, torch.ones(80))


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 1e6])
def test_clipping_matches_a_float64_reference(max_norm: float) -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) for n in (7, 100, 3000)]
    reference = [g.double() for g in grads]
    norm64 = torch.sqrt(sum((g * g).sum() for g in reference))
    scale = min(1.0, max_norm / (float(norm64) + 1e-6))
    total = clip_by_global_norm_(grads, max_norm)
    assert total.dim() == 0 and float(total) == pytest.approx(float(norm64), rel=1e-6)
    for got, want in zip(grads, reference, strict=True):
        torch.testing.assert_close(got.double(), want * scale, rtol=1e-6, atol=1e-12)
    assert float(global_norm(grads)) <= max_norm * (1 + 1e-6)


def test_clipping_rejects_bad_limits() -> None:
    with pytest.raises(InvalidArgumentError, match="max_norm must be positive"):
        clip_by_global_norm_([torch.ones(2)], 0.0)
    with pytest.raises(InvalidArgumentError, match="at least one tensor"):
        global_norm([])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_accumulation_and_clipping_do_not_synchronise() -> None:
    device = torch.device("cuda")
    acc = PerBlockGradientAccumulator(4, SIZES, 16, 8, device)
    grads = [torch.randn(s, device=device) for s in SIZES]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):  # the micro-batch loop
            for block in acc.block_grads:
                block.accumulate(grads)
        acc.accumulated_count = 8
        acc.average()
        clip_by_global_norm_(acc.buffers(), 1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not acc.has_non_finite()  # the one synchronisation, after the loop
