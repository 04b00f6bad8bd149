"""A delaying TCP relay: every byte reaches the other side `delay` seconds after the relay read it.

    python -m bench._wan_relay --listen 10.77.0.200:0 --upstream 127.0.0.1:50051 --delay-ms 25 \
        --port-file /tmp/relay.port

This kernel's tc has tbf and htb but not netem, so bench.wan adds a link's propagation delay here:
the relay accepts connections on `--listen`, opens one to `--upstream` for each, and in each
direction reads whatever bytes arrive, stamps them with the time they were read, and writes them
on when that time plus the delay has come (a FIFO whose entries are due in the order they
arrived: order is kept, and reading goes on while earlier bytes wait, so the delay costs no
throughput). With the relay next to the coordinator and a delay of RTT/2, every request and
every reply waits RTT/2 each way: a round trip through it takes RTT more than without it.

What it does not emulate: loss, reordering, jitter (every byte waits the same delay), and TCP's
own reaction to a long path: the TCP connections on either side of the relay see a short round
trip, so slow start and the receive window open as on a LAN, not as over 50 ms (with a window
too small for the bandwidth-delay product a real path would be slower). Each direction buffers
at most `limit` bytes (default 8 MiB, far above 100 Mbit/s x 50 ms = 625 KB) before it stops
reading, so a slow reader still pushes back on its writer.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import socket
import sys
from pathlib import Path

READ_BYTES = 256 * 1024
DEFAULT_LIMIT = 8 * 2**20


class DelayLine:
    """Chunks of bytes, each due `delay` s after it was put; at most `limit` bytes held (a `put`
    waits for room). `None` marks the end of the stream."""

    def __init__(self, delay: float, limit: int = DEFAULT_LIMIT) -> None:
        self.delay = delay
        self.limit = limit
        self.held = 0
        self._items: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()

    async def put(self, data: bytes | None) -> None:
        """Stamps `data` with now + delay; waits while the line holds `limit` bytes or more."""
        while data is not None and self.held >= self.limit:
            self._room.clear()
            await self._room.wait()
        self._items.append((asyncio.get_running_loop().time() + self.delay, data))
        self.held += len(data or b"")
        self._arrived.set()

    async def get(self) -> bytes | None:
        """The oldest chunk once it is due (the end marker too waits its delay)."""
        while not self._items:
            self._arrived.clear()
            await self._arrived.wait()
        due, data = self._items[0]
        wait = due - asyncio.get_running_loop().time()
        if wait > 0:
            await asyncio.sleep(wait)
        self._items.popleft()
        self.held -= len(data or b"")
        if self.held < self.limit:
            self._room.set()
        return data


async def _read_into(reader: asyncio.StreamReader, line: DelayLine) -> None:
    try:
        while data := await reader.read(READ_BYTES):
            await line.put(data)
    finally:
        await line.put(None)


async def _write_from(line: DelayLine, writer: asyncio.StreamWriter) -> None:
    while (data := await line.get()) is not None:
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()  # a half-close is forwarded as one, after the same delay


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """One direction of a connection, through a delay line, until its end is forwarded."""
    line = DelayLine(delay)
    await asyncio.gather(_read_into(reader, line), _write_from(line, writer))


async def _relay_connection(
    client_reader: asyncio.StreamReader,
    client_writer: asyncio.StreamWriter,
    upstream: tuple[str, int],
    delay: float,
) -> None:
    try:
        up_reader, up_writer = await asyncio.open_connection(*upstream)
    except OSError:
        client_writer.close()
        return
    for writer in (client_writer, up_writer):
        sock = writer.get_extra_info("socket")
        if sock is not None:  # the delay is the relay's: no Nagle wait on top of it
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    directions = [
        asyncio.ensure_future(pump(client_reader, up_writer, delay)),
        asyncio.ensure_future(pump(up_reader, client_writer, delay)),
    ]
    try:
        # A reset on either side ends both: the peer on the other side sees its connection end.
        done, pending = await asyncio.wait(directions, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            task.exception()  # retrieved: a connection reset is how a run ends, not an error here
    finally:
        for writer in (client_writer, up_writer):
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def start_relay(listen: tuple[str, int], upstream: tuple[str, int], delay: float) -> asyncio.Server:
    """A listening relay on `listen` (port 0: any free one) to `upstream`, each way `delay` s."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _relay_connection(reader, writer, upstream, delay)

    return await asyncio.start_server(handle, *listen)


def bound_port(server: asyncio.Server) -> int:
    return int(server.sockets[0].getsockname()[1])


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host, int(port)


async def _serve(args: argparse.Namespace) -> None:
    server = await start_relay(split_address(args.listen), split_address(args.upstream), args.delay_ms / 1e3)
    if args.port_file:
        # Written whole under another name, then renamed: a reader never sees half a number.
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(bound_port(server)))
        tmp.replace(args.port_file)
    async with server:
        await server.serve_forever()  # until SIGTERM: the emulator stops its processes so


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", required=True, help="HOST:PORT to accept on (port 0: any free one)")
    p.add_argument("--upstream", required=True, help="HOST:PORT every connection is relayed to")
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay added in each direction")
    p.add_argument("--port-file", default="", help="write the bound port here once listening")
    args = p.parse_args(argv)
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
