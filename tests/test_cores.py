"""common.cores: the cores a process may use, its affinity bounded by a cgroup CPU quota."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradserver.common import cores


@pytest.fixture
def cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cgroup files read from `tmp_path` instead (none there until a test writes one)."""
    monkeypatch.setattr(cores, "_CGROUP_V2_MAX", tmp_path / "cpu.max")
    monkeypatch.setattr(cores, "_CGROUP_V1_QUOTA", tmp_path / "cpu.cfs_quota_us")
    monkeypatch.setattr(cores, "_CGROUP_V1_PERIOD", tmp_path / "cpu.cfs_period_us")
    monkeypatch.setattr(cores, "affinity_cores", lambda: 16)
    return tmp_path


def test_without_a_quota_the_affinity_counts(cgroup: Path) -> None:
    assert cores.cpu_quota_cores() is None
    assert cores.available_cores() == 16
    (cgroup / "cpu.max").write_text("max 100000\n")
    assert cores.cpu_quota_cores() is None
    assert cores.available_cores() == 16


@pytest.mark.parametrize(
    ("cpu_max", "quota", "available"),
    [
        ("200000 100000", 2.0, 2),
        ("150000 100000", 1.5, 2),
        ("50000 100000", 0.5, 1),
        ("3200000 100000", 32.0, 16),
    ],
)
def test_a_v2_quota_bounds_the_affinity(cgroup: Path, cpu_max: str, quota: float, available: int) -> None:
    (cgroup / "cpu.max").write_text(cpu_max + "\n")
    assert cores.cpu_quota_cores() == quota
    assert cores.available_cores() == available


def test_a_v1_quota_counts_where_there_is_no_v2_file(cgroup: Path) -> None:
    (cgroup / "cpu.cfs_quota_us").write_text("300000\n")
    (cgroup / "cpu.cfs_period_us").write_text("100000\n")
    assert cores.available_cores() == 3
    (cgroup / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no limit"
    assert cores.available_cores() == 16


def test_an_unreadable_quota_is_no_quota(cgroup: Path) -> None:
    (cgroup / "cpu.max").write_text("garbage\n")
    assert cores.available_cores() == 16


def test_this_process_has_at_least_one_core() -> None:
    assert 1 <= cores.available_cores() <= cores.affinity_cores()
