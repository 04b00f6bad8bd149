"""One coordinator per port: a second coordinator on a bound port fails to start, and its CLI
exits 2 with one line naming the address."""

from __future__ import annotations

import asyncio

import pytest

from gradserver.common.errors import UnavailableError
from gradserver.server import GradientServer
from gradserver.server import binding as binding_module
from gradserver.server.config import CoordinatorConfig


def test_a_second_coordinator_on_a_bound_port_fails_to_start(coordinator) -> None:
    first = coordinator(world_size=1)

    async def start_second() -> None:
        second = GradientServer(CoordinatorConfig(bind=first.address, world_size=1))
        try:
            await second.start()
        finally:
            await second.stop()

    with pytest.raises(UnavailableError, match=f"cannot bind {first.address}") as info:
        asyncio.run(start_second())
    assert isinstance(info.value, binding_module.AddressInUseError)


@pytest.mark.processes
def test_the_second_coordinator_cli_exits_2_with_one_line(processes) -> None:
    _coord, address = processes.coordinator("--world-size", "1")
    second = processes.gradserver("coordinator", "--bind", address, name="second")
    assert second.wait(60) == 2, second.output
    lines = [line for line in second.output.splitlines() if line.strip()]
    assert len(lines) == 1 and f"cannot bind {address}" in lines[0], second.output
