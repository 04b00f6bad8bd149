"""A TCP proxy for fault tests (netem is not available): it forwards 127.0.0.1:port to a target
and can slice the bytes into small pieces, delay them, blackhole them (connections stay open,
nothing moves) or reset every connection (RST)."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading


class FaultProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.slice_bytes = 0  # 0: forward what arrives as it arrives
        self.delay_s = 0.0
        self.blackhole = False
        self.port = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._stopped: asyncio.Event
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)

    def start(self) -> FaultProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("proxy did not start")
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self._stopped = asyncio.Event()
            self._ready.set()
            async with server:
                await self._stopped.wait()
            pending = asyncio.all_tasks() - {asyncio.current_task()}
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        self._loop.run_until_complete(main())
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers.update({writer, up_writer})
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                while self.blackhole:
                    await asyncio.sleep(0.01)
                pieces = [data]
                if self.slice_bytes:
                    pieces = [data[i : i + self.slice_bytes] for i in range(0, len(data), self.slice_bytes)]
                for piece in pieces:
                    if self.delay_s:
                        await asyncio.sleep(self.delay_s)
                    writer.write(piece)
                    await writer.drain()
        finally:
            writer.close()

    def reset(self) -> None:
        """Aborts every connection with a TCP reset."""

        def abort_all() -> None:
            for writer in list(self._writers):
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    except OSError:  # the peer already closed it: nothing left to reset
                        pass
                writer.transport.abort()
            self._writers.clear()

        self._loop.call_soon_threadsafe(abort_all)

    def stop(self) -> None:
        if not self._thread.is_alive():  # stopped already (a test and its fixture may both stop it)
            return
        self.blackhole = False
        self.reset()
        self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(10)
