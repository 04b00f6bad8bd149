"""GRADSERVER_WIRE_DTYPE for the torch backend: floating-point reductions travel as 16 bits,
what must stay exact does.

The worker CLI has had `--wire-dtype` for a while; torch scripts had no way to ask for it (the WAN
bench patched the backend's client). Now the same variable means the same for a rank: a float32
or bfloat16 all_reduce goes up and comes back as bfloat16 (the coordinator still sums in float64
and rounds once), while integers (carried as 16-bit limbs whose sums need float32's 24 bits),
MIN/MAX and the byte-moving collectives are untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gradserver.common.errors import InvalidArgumentError
from gradserver.torch._settings import rank_settings

from .helpers.ranks import gradserver_rank, rank_results, spawn_and_join

WORLD = 2
_INTEGERS = [123_456_789_012, -987_654_321, 65_537, 3]


def _body(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(rank)
    floats = torch.randn(4096, generator=generator, dtype=torch.float32)
    summed = floats.clone()
    dist.all_reduce(summed)
    averaged = floats.to(torch.bfloat16)
    dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
    integers = torch.tensor(_INTEGERS, dtype=torch.int64) * (rank + 1)
    dist.all_reduce(integers)
    largest = floats.clone()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    gathered = [torch.empty_like(floats) for _ in range(WORLD)]
    dist.all_gather(gathered, floats)
    return {
        "floats": floats,
        "summed": summed,
        "averaged": averaged,
        "integers": integers,
        "largest": largest,
        "gathered": torch.stack(gathered),
    }


def _rank_main(rank: int, store_path: str, out_dir: str) -> None:
    gradserver_rank(rank, WORLD, store_path, out_dir, _body)


@pytest.fixture(scope="module")
def bf16_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("wire-bf16")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRADSERVER_WIRE_DTYPE", "bfloat16")  # the spawned ranks read it
        spawn_and_join(_rank_main, [(r, str(out / "store"), str(out)) for r in range(WORLD)], timeout_s=180)
    return rank_results(Path(out), WORLD)


def test_a_float32_all_reduce_travels_as_bfloat16(bf16_ranks: list[dict[str, Any]]) -> None:
    exact = sum(rank["floats"].double() for rank in bf16_ranks)
    summed = bf16_ranks[0]["summed"]
    torch.testing.assert_close(summed, bf16_ranks[1]["summed"], rtol=0, atol=0)
    # Every value came back as a bfloat16 (the wire), within bfloat16's rounding of the exact sum
    # of the rounded inputs.
    assert torch.equal(summed, summed.bfloat16().float())
    assert not torch.equal(summed, exact.float()), "the result is float32's: the wire was not 16-bit"
    rounded_inputs = sum(rank["floats"].bfloat16().double() for rank in bf16_ranks)
    torch.testing.assert_close(summed.double(), rounded_inputs, rtol=2**-8, atol=1e-6)


def test_a_bfloat16_average_is_identical_on_every_rank(bf16_ranks: list[dict[str, Any]]) -> None:
    averaged = bf16_ranks[0]["averaged"]
    assert averaged.dtype == torch.bfloat16
    torch.testing.assert_close(averaged, bf16_ranks[1]["averaged"], rtol=0, atol=0)
    mean = sum(rank["floats"].bfloat16().double() for rank in bf16_ranks) / WORLD
    torch.testing.assert_close(averaged.double(), mean, rtol=2**-7, atol=1e-6)


def test_integers_and_other_ops_stay_exact_on_a_16_bit_wire(bf16_ranks: list[dict[str, Any]]) -> None:
    expected = torch.tensor(_INTEGERS, dtype=torch.int64) * sum(r + 1 for r in range(WORLD))
    floats = torch.stack([rank["floats"] for rank in bf16_ranks])
    for rank in bf16_ranks:
        assert torch.equal(rank["integers"], expected)
        assert torch.equal(rank["largest"], floats.max(dim=0).values)
        assert torch.equal(rank["gathered"], floats)


def test_an_unknown_wire_dtype_is_refused_naming_the_variable() -> None:
    with pytest.raises(InvalidArgumentError, match=r"GRADSERVER_WIRE_DTYPE: wire dtype 'int16' is not one"):
        rank_settings({"GRADSERVER_WIRE_DTYPE": "int16"})


@pytest.mark.parametrize("quantized", ["int8", "int4"])
def test_a_quantized_wire_dtype_is_refused_for_a_rank_naming_the_variable(quantized: str) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"GRADSERVER_WIRE_DTYPE={quantized}: a process group"):
        rank_settings({"GRADSERVER_WIRE_DTYPE": quantized})
    assert rank_settings({"GRADSERVER_WIRE_DTYPE": "BFloat16"}).wire_dtype == "BFloat16"
    assert rank_settings({}).wire_dtype == "float32"
