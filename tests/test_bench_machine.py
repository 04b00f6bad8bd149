"""`python -m bench.machine` and the floor model beside the one-host figures (issue 48).

The CLI runs as a subprocess with small sizes (its figures are only checked to be positive and
finite: the machine running the tests is shared); the floor model is checked byte for byte
against the passes docs/PERFORMANCE.md counts for each design.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys

import pytest

from bench import exchange
from bench.machine import (
    COLLECTIVE_SIZES,
    Machine,
    Traffic,
    all_reduce_floor_s,
    all_reduce_peer,
    all_reduce_traffic,
    all_reduce_wakes,
    exchange_floor_s,
    exchange_traffic,
    fits_in_cache,
    floor_s,
    one_way_wake_s,
)
from gradserver.common.lane import PEER_REDUCE_MAX_BYTES, supported

from .helpers.processes import ROOT

MIB = 2**20


def _machine(**overrides: object) -> Machine:
    values: dict[str, object] = {
        "cores": 2,
        "cpu_quota_cores": None,
        "cpu_model": "test",
        "l3_bytes": 32 * MIB,
        "load_average": 0.5,
        "copy_bytes": 256 * MIB,
        "copy_gbps": 10.0,
        "copy_all_cores_gbps": 12.0,
        "copy_cached_bytes": 8 * MIB,
        "copy_cached_gbps": 40.0,
        "futex_rtt_s": 40e-6,
        "spin_rtt_s": 2e-6,
        "tcp_rtt_s": 30e-6,
        "grpc_rtt_s": 400e-6,
        "measured_s": 3.0,
    }
    values.update(overrides)
    return Machine(**values)  # type: ignore[arg-type]


def _run(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


# --- the CLI ---------------------------------------------------------------------------------------


def test_quick_json_record_has_every_field_positive() -> None:
    result = _run("bench.machine", "--quick", "--json", "--copy-mib", "8", "--phase-s", "0.1")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    fields = {f.name for f in dataclasses.fields(Machine)}
    assert set(record) == fields | {"floors"}
    assert isinstance(record["cpu_model"], str)
    assert record["cpu_model"]
    # The copy buffer is the size asked for, rounded down to whole cache lines per core.
    assert 8 * MIB - 64 * record["cores"] < record["copy_bytes"] <= 8 * MIB
    optional = {"cpu_quota_cores", "l3_bytes", "futex_rtt_s"}
    for name in fields - {"cpu_model", "load_average"} - optional:
        value = record[name]
        assert isinstance(value, int | float), name
        assert value > 0, name
        assert math.isfinite(value), name
    assert record["load_average"] >= 0
    for name in optional - {"futex_rtt_s"}:
        assert record[name] is None or record[name] > 0, name
    if supported():
        assert record["futex_rtt_s"] > 0
        assert math.isfinite(record["futex_rtt_s"])
    else:
        assert record["futex_rtt_s"] is None
    assert len(record["floors"]) == 2 * (2 + len(COLLECTIVE_SIZES))
    for row in record["floors"]:
        assert row["floor_s"] > 0, row
        assert math.isfinite(row["floor_s"]), row


def test_quick_table_names_each_measure_and_floor() -> None:
    result = _run("bench.machine", "--quick", "--copy-mib", "8", "--phase-s", "0.1")
    assert result.returncode == 0, result.stderr
    for label in (
        "cores available",
        "copy bandwidth, 1 thread (8 MiB; bytes copied / s)",
        "copy bandwidth in cache",
        "futex wake round trip",
        "spin round trip",
        "loopback TCP round trip",
        "loopback gRPC unary round trip",
        "| exchange 360 MiB, plain | 2 |",
        "| all_reduce 4 B | 4 |",
    ):
        assert label in result.stdout, label


def test_non_positive_sizes_are_refused() -> None:
    result = _run("bench.machine", "--copy-mib", "0", timeout=60)
    assert result.returncode == 2
    assert "must be positive" in result.stderr


def test_exchange_and_collectives_offer_the_machine_floor() -> None:
    help_text = _run("bench.exchange", "--help", timeout=60)
    assert help_text.returncode == 0, help_text.stderr
    assert "--machine-floor" in help_text.stdout
    assert "--floor" in help_text.stdout  # the gRPC echo floor is still there
    pytest.importorskip("torch")
    help_text = _run("bench.collectives", "--help", timeout=60)
    assert help_text.returncode == 0, help_text.stderr
    assert "--machine-floor" in help_text.stdout


# --- the floor model -------------------------------------------------------------------------------


def test_exchange_traffic_is_the_passes_the_design_makes() -> None:
    s = 1000
    assert exchange_traffic(s, 2) == Traffic(read=4 * s, written=4 * s, footprint=4 * s)
    assert exchange_traffic(s, 4) == Traffic(read=8 * s, written=8 * s, footprint=8 * s)
    assert exchange_traffic(s, 2, "tuned", zero_copy=True) == Traffic(2 * s, 2 * s, 2 * s)
    assert exchange_traffic(s, 2, "tuned") == Traffic(read=6 * s, written=5 * s, footprint=5 * s)
    # docs/PERFORMANCE.md counts a step at N = 2 in passes over the set: ~8 plain, ~4 tuned with
    # zero copy, ~11 when the average goes through an output slot and is copied out.
    for api, zero_copy, passes in (("plain", False, 8), ("tuned", True, 4), ("tuned", False, 11)):
        traffic = exchange_traffic(s, 2, api, zero_copy)
        assert traffic.read + traffic.written == passes * s, (api, zero_copy)
    assert exchange_traffic(s, 2).copied == 4 * s
    with pytest.raises(ValueError, match="unknown API"):
        exchange_traffic(s, 2, "fast")


def test_all_reduce_traffic_follows_the_lane_peer_rule() -> None:
    peer = PEER_REDUCE_MAX_BYTES // 2  # at 2 ranks: the largest peer operation
    assert all_reduce_peer(peer, 2)
    assert all_reduce_traffic(peer, 2) == Traffic(read=6 * peer, written=4 * peer, footprint=4 * peer)
    assert all_reduce_wakes(peer, 2) == 1
    larger = peer + 4
    assert not all_reduce_peer(larger, 2)
    assert all_reduce_traffic(larger, 2) == Traffic(read=6 * larger, written=5 * larger, footprint=5 * larger)
    assert all_reduce_wakes(larger, 2) == 2
    assert all_reduce_traffic(4, 2) == Traffic(read=24, written=16, footprint=16)
    s = 16 * MIB
    assert all_reduce_traffic(s, 4) == Traffic(read=12 * s, written=9 * s, footprint=9 * s)
    # At least: each rank writes its input once, the N inputs are read once in all, and every
    # rank's result is written once.
    for n in (2, 3, 4, 8):
        for size in (*COLLECTIVE_SIZES, peer, larger):
            traffic = all_reduce_traffic(size, n)
            assert traffic.read >= n * size
            assert traffic.written >= 2 * n * size


def test_floor_is_bytes_copied_over_copy_bandwidth() -> None:
    machine = _machine(copy_gbps=10.0, copy_cached_gbps=40.0)
    assert floor_s(1e9, machine) == pytest.approx(0.1)
    assert floor_s(1e9, machine, cached=True) == pytest.approx(0.025)
    assert not fits_in_cache(16 * MIB + 1, machine)
    assert fits_in_cache(16 * MIB, machine)
    assert not fits_in_cache(1, _machine(l3_bytes=None))
    set_bytes = 4 * exchange._elements(exchange.SLICE)  # 360 MiB: from memory
    assert exchange_floor_s(set_bytes, 2, machine) == pytest.approx(4 * set_bytes / 10e9)
    assert exchange_floor_s(set_bytes, 4, machine, "tuned", True) == pytest.approx(4 * set_bytes / 10e9)
    assert exchange_floor_s(1000, 2, machine) == pytest.approx(4000 / 40e9)  # in cache


def test_a_four_byte_all_reduce_floor_is_its_wake() -> None:
    machine = _machine(cores=2, spin_rtt_s=2e-6, futex_rtt_s=40e-6, copy_cached_gbps=20.0)
    copies = 20 / 20e9  # 24 bytes read and 16 written: 20 copied, in cache
    # Two ranks on two cores: the lane spins first, so the shorter of spin and futex.
    assert all_reduce_floor_s(4, 2, machine) == pytest.approx(copies + 1e-6)
    assert all_reduce_floor_s(
        4, 2, _machine(cores=2, spin_rtt_s=1.0, futex_rtt_s=40e-6, copy_cached_gbps=20.0)
    ) == (pytest.approx(copies + 20e-6))
    # Four ranks on two cores do not spin: a futex wake.
    assert all_reduce_floor_s(4, 4, machine) == pytest.approx(112 / 2 / 20e9 + 20e-6)
    assert all_reduce_floor_s(4, 2, _machine(cores=1)) == pytest.approx(20 / 40e9 + 20e-6)
    assert math.isnan(one_way_wake_s(2, _machine(futex_rtt_s=None)))
    # Through the coordinator (3 processes on 2 cores): a bell and `done`, two futex wakes.
    s = 16 * MIB
    expected = (12 * s + 9 * s) / 2 / 10e9 + 2 * 20e-6
    assert all_reduce_floor_s(s, 4, machine) == pytest.approx(expected)


def test_collective_sizes_are_bench_collectives_defaults() -> None:
    pytest.importorskip("torch")
    from bench import collectives

    assert collectives.DEFAULT_SIZES == COLLECTIVE_SIZES


def test_bench_columns_show_a_floor_only_where_it_is_modelled() -> None:
    machine = _machine()
    shape = dict(exchange.SLICE)
    args = argparse.Namespace(api="plain", zero_copy=False)
    assert exchange._machine_floor_cells(machine, "grpc", 2, shape, args, 0.5) == " - | - |"
    floor = exchange_floor_s(4 * exchange._elements(shape), 2, machine)
    assert (
        exchange._machine_floor_cells(machine, "shm", 2, shape, args, 2 * floor) == f" {floor:.3f} | 2.00 |"
    )
    pytest.importorskip("torch")
    from bench import collectives

    assert collectives._machine_floor_cells(machine, "broadcast", 2, 4, 1e-3) == " - | - |"
    floor = all_reduce_floor_s(4, 2, machine)
    assert collectives._machine_floor_cells(machine, "all_reduce", 2, 4, 3 * floor) == (
        f" {floor * 1e3:.4f} | 3.00 |"
    )
