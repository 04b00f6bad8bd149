"""Benchmark: one step of averaging a 350M-shaped gradient set, gradserver vs torch.distributed gloo.

    python -m bench.exchange                 # 4 blocks of H=1024, D_kv=256, I=4096 + LM head; N=2, 4
    python -m bench.exchange --full          # all 24 blocks + LM head
    python -m bench.exchange --workers 2 --steps 5
    python -m bench.exchange --transport grpc,shm   # gloo, gradserver over gRPC and over shared memory
    python -m bench.exchange --api tuned --zero-copy --transport shm   # the tuned API
    python -m bench.exchange --transport shm --machine-floor   # and this machine's floor beside each

For each N, the same worker processes' buffers are averaged by (a) a gradserver coordinator
process and N WorkerClient processes, sending every block in reverse order and then the LM head,
pipelined, and (b) N processes calling torch.distributed.all_reduce (gloo) on the same buffers
and dividing by N. The coordinator runs with its defaults (its chunk size chosen by itself)
unless `--chunk-mib` is given. `--api plain` (the default) uses WorkerClient as a user who tunes
nothing would: the gradients are ordinary numpy arrays (the same ones every step, as a
framework's gradient buffers), sent without `into=`, and the averages are the arrays the
receives return, held until the step ends and then dropped. `--api tuned` writes each average
back into the buffer it was sent from (`into=`, in place as gloo does), and with `--zero-copy`
those buffers are `gradient_buffer`s in the shared-memory arena, so nothing is copied on the
way in. Each step starts after a barrier; a step's time is the slowest worker's. The table shows
median step time, algorithmic bandwidth (gradient bytes per worker / step time), the ratio
gradserver/gloo, and the coordinator's peak RSS (VmHWM). With `--transport shm` the workers use
the same-host shared-memory path; the coordinator's private (RssAnon) and shared (RssShmem)
memory at the end are shown separately.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from bench.machine import Machine

SLICE = {"num_blocks": 4, "hidden": 1024, "kv_hidden": 256, "intermediate": 4096, "vocab": 32768}


def _buffers(rank: int, shape: dict[str, int]) -> tuple[list[np.ndarray], tuple[int, ...], np.ndarray]:
    from gradserver.common.components import compute_block_sizes

    sizes = compute_block_sizes(shape["hidden"], shape["kv_hidden"], shape["intermediate"])
    rng = np.random.default_rng(rank)
    blocks = [rng.standard_normal(sum(sizes), dtype=np.float32) for _ in range(shape["num_blocks"])]
    lm_head = rng.standard_normal(shape["vocab"] * shape["hidden"], dtype=np.float32)
    return blocks, sizes, lm_head


def _gradserver_worker(args: argparse.Namespace) -> dict[str, Any]:
    from gradserver.worker import Timeouts, WorkerClient

    shape = json.loads(args.shape)
    client = WorkerClient.connect(
        args.address,
        node_id=f"bench-{os.getpid()}",
        timeout=Timeouts(receive=300.0),
        transport=args.transport,
        shm_arena_mib=args.shm_arena_mib,
    )
    if client.transport != args.transport:
        raise RuntimeError(f"asked for transport {args.transport}, got {client.transport}")
    blocks, sizes, lm_head = _buffers(client.worker_id, shape)
    if args.api == "plain":
        return {"rank": client.worker_id, "times": _plain_steps(client, args, blocks, sizes, lm_head)}
    if args.zero_copy:
        placed = []
        for array in [*blocks, lm_head]:
            buf = client.gradient_buffer(array.size)
            buf[:] = array
            placed.append(buf)
        blocks, lm_head = placed[:-1], placed[-1]
    times = []
    with client:
        for step in range(args.warmup + args.steps):
            client.barrier(step)
            started = time.perf_counter()
            # In place, as gloo's all_reduce: each average lands in the buffer it was sent from.
            for b in reversed(range(len(blocks))):
                client.send_block_gradient(step, b, len(blocks), blocks[b], sizes, into=blocks[b])
            client.send_non_block_gradient(step, "lm_head", lm_head, into=lm_head)
            for _ in blocks:
                client.receive_averaged_block()
            client.receive_averaged_non_block()
            if step >= args.warmup:
                times.append(time.perf_counter() - started)
    return {"rank": client.worker_id, "times": times}


def _plain_steps(
    client: Any,
    args: argparse.Namespace,
    blocks: list[np.ndarray],
    sizes: tuple[int, ...],
    lm_head: np.ndarray,
) -> list[float]:
    """The untuned API: plain arrays, no `into=`; the averages are what the receives return."""
    times = []
    with client:
        for step in range(args.warmup + args.steps):
            client.barrier(step)
            started = time.perf_counter()
            for b in reversed(range(len(blocks))):
                client.send_block_gradient(step, b, len(blocks), blocks[b], sizes)
            client.send_non_block_gradient(step, "lm_head", lm_head)
            averages = [client.receive_averaged_block().gradients for _ in blocks]
            averages.append(client.receive_averaged_non_block().gradients)
            if step >= args.warmup:
                times.append(time.perf_counter() - started)
            # Applied (an optimizer step would read them here), then dropped, as a training loop
            # drops last step's gradients.
            del averages
    return times


def _gloo_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    shape = json.loads(args.shape)
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world)
    blocks, _, lm_head = _buffers(args.rank, shape)
    tensors = [torch.from_numpy(b) for b in blocks] + [torch.from_numpy(lm_head)]
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        started = time.perf_counter()
        for t in [*reversed(tensors[:-1]), tensors[-1]]:
            dist.all_reduce(t)
            t.div_(args.world)
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    dist.destroy_process_group()
    return {"rank": args.rank, "times": times}


def _echo_server() -> None:
    """A bare grpc.aio stream that sends every message straight back: the transport's floor."""
    import asyncio

    import grpc

    async def main() -> None:
        async def echo(_requests: Any, context: Any) -> None:
            while (message := await context.read()) is not grpc.aio.EOF:
                await context.write(message)

        options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
        server = grpc.aio.server(options=options)
        methods = {"Echo": grpc.stream_stream_rpc_method_handler(echo)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("echo", methods),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def _echo_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Sends as many bytes as a gradserver worker, in chunks of the same size, and reads them back."""
    import queue
    import threading

    import grpc

    shape = json.loads(args.shape)
    blocks, _, lm_head = _buffers(0, shape)
    total = sum(b.nbytes for b in blocks) + lm_head.nbytes
    chunk = int(args.chunk_mib * 2**20)
    payload = b"\0" * chunk
    count = -(-total // chunk)
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    channel = grpc.insecure_channel(args.address, options=options)
    outbound: queue.Queue[bytes | None] = queue.Queue(8)

    def requests() -> Any:
        while (item := outbound.get()) is not None:
            yield item

    def feed() -> None:
        for _ in range(count):
            outbound.put(payload)

    call = channel.stream_stream("/echo/Echo")(requests())
    times = []
    for step in range(args.warmup + args.steps):
        started = time.perf_counter()
        feeder = threading.Thread(target=feed)
        feeder.start()
        for _ in range(count):
            next(call)
        feeder.join()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    outbound.put(None)
    return {"rank": 0, "times": times}


def run_echo(
    world: int, shape: dict[str, int], steps: int, warmup: int, chunk_mib: float, timeout: float
) -> list[float]:
    server = subprocess.Popen(_me("--role", "echo-server"), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        address = f"127.0.0.1:{server.stdout.readline().strip()}"
        common = ["--shape", json.dumps(shape), "--steps", str(steps), "--warmup", str(warmup)]
        extra = ["--address", address, "--chunk-mib", str(chunk_mib), *common]
        procs = [
            subprocess.Popen(
                _me("--role", "echo-worker", *extra),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(world)
        ]
        return step_times(_collect(procs, timeout))
    finally:
        server.terminate()
        server.wait(30)


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _collect(procs: list[subprocess.Popen[str]], timeout: float) -> list[dict[str, Any]]:
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"benchmark worker failed ({proc.returncode}):\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def step_times(results: list[dict[str, Any]]) -> list[float]:
    """Each step's time: the slowest worker's (a step lasts until every worker holds every average)."""
    return [max(steps) for steps in zip(*(r["times"] for r in results), strict=True)]


def _me(*extra: str) -> list[str]:
    return [sys.executable, "-m", "bench.exchange", *extra]


def _memory_mib(pid: int) -> tuple[float, float]:
    """The process's private (RssAnon) and shared-memory (RssShmem) resident MiB now."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("RssAnon", "RssShmem"):
            found[name] = int(value.split()[0]) / 1024
    return found.get("RssAnon", float("nan")), found.get("RssShmem", float("nan"))


def run_gradserver(
    world: int,
    shape: dict[str, int],
    steps: int,
    warmup: int,
    chunk_mib: float,
    timeout: float,
    transport: str = "grpc",
    zero_copy: bool = False,
    shm_arena_mib: float | None = None,
    api: str = "plain",
) -> tuple[list[float], float, tuple[float, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        coord = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gradserver.cli",
                "coordinator",
                "--bind",
                "127.0.0.1:0",
                "--world-size",
                str(world),
                "--port-file",
                str(port_file),
                "--log-level",
                "WARNING",
                *_tuning(chunk_mib, shm_arena_mib),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists():
                if coord.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("coordinator did not start")
                time.sleep(0.02)
            address = f"127.0.0.1:{port_file.read_text().strip()}"
            common = ["--shape", json.dumps(shape), "--steps", str(steps), "--warmup", str(warmup)]
            from gradserver.worker.transports import DEFAULT_SHM_ARENA_MIB

            arena = DEFAULT_SHM_ARENA_MIB if shm_arena_mib is None else shm_arena_mib
            common += ["--transport", transport, "--api", api, "--shm-arena-mib", str(arena)]
            if zero_copy:
                set_mib = 4 * _elements(shape) / 2**20
                common += ["--zero-copy", "--shm-arena-mib", str(set_mib + arena)]
            procs = [
                subprocess.Popen(
                    _me("--role", "gradserver-worker", "--address", address, *common),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for _ in range(world)
            ]
            results = _collect(procs, timeout)
            rss = _peak_rss_mib(coord.pid)
            memory = _memory_mib(coord.pid)
        finally:
            coord.terminate()
            coord.wait(30)
    return step_times(results), rss, memory


def _tuning(chunk_mib: float, shm_arena_mib: float | None) -> list[str]:
    """The coordinator's flags: none but those asked for (0: its own chunk size)."""
    flags = []
    if chunk_mib:
        flags += ["--chunk-mib", str(chunk_mib), "--max-message-mib", str(max(16.0, chunk_mib + 1))]
        flags += ["--max-inflight-mib", str(max(64.0, 4 * chunk_mib))]
    if shm_arena_mib is not None:
        flags += ["--shm-arena-mib", str(shm_arena_mib)]
    return flags


def _elements(shape: dict[str, int]) -> int:
    from gradserver.common.components import compute_block_sizes

    block = sum(compute_block_sizes(shape["hidden"], shape["kv_hidden"], shape["intermediate"]))
    return shape["num_blocks"] * block + shape["vocab"] * shape["hidden"]


def run_gloo(world: int, shape: dict[str, int], steps: int, warmup: int, timeout: float) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        common = ["--shape", json.dumps(shape), "--steps", str(steps), "--warmup", str(warmup)]
        procs = [
            subprocess.Popen(
                _me(
                    "--role",
                    "gloo-worker",
                    "--rank",
                    str(r),
                    "--world",
                    str(world),
                    "--store",
                    str(store),
                    *common,
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(world)
        ]
        return step_times(_collect(procs, timeout))


def _machine_floor_cells(
    machine: Machine,
    transport: str,
    world: int,
    shape: dict[str, int],
    args: argparse.Namespace,
    seconds: float,
) -> str:
    """The `--machine-floor` columns of one row: bench.machine's floor for a shared-memory step
    of this shape and API (over gRPC the bytes also cross sockets, which it does not model)."""
    if transport != "shm":
        return " - | - |"
    from bench.machine import exchange_floor_s

    floor = exchange_floor_s(4 * _elements(shape), world, machine, args.api, args.zero_copy)
    return f" {floor:.3f} | {seconds / floor:.2f} |"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    roles = ["driver", "gradserver-worker", "gloo-worker", "echo-server", "echo-worker"]
    parser.add_argument("--role", default="driver", choices=roles)
    parser.add_argument("--full", action="store_true", help="all 24 blocks instead of 4")
    parser.add_argument("--workers", default="2,4", help="comma-separated world sizes")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--chunk-mib", type=float, default=0.0, help="coordinator chunk size (0: the coordinator chooses)"
    )
    parser.add_argument(
        "--api",
        choices=["plain", "tuned"],
        default="plain",
        help="plain: numpy arrays, results from the receives; tuned: into= (and --zero-copy)",
    )
    parser.add_argument("--floor", action="store_true", help="also time a bare gRPC echo of the same bytes")
    parser.add_argument(
        "--machine-floor",
        action="store_true",
        help="measure this machine first (bench.machine) and show each shared-memory step's floor: "
        "the memory traffic its design makes at the measured copy bandwidth, and gradserver/floor",
    )
    parser.add_argument("--no-gloo", action="store_true", help="skip gloo (e.g. for an RSS-only run)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--shape", default=json.dumps(SLICE))
    parser.add_argument("--address", default="")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--store", default="")
    parser.add_argument("--transport", default="grpc", help="comma-separated: grpc, shm")
    parser.add_argument(
        "--zero-copy", action="store_true", help="shm, --api tuned: send from gradient_buffer()s"
    )
    parser.add_argument(
        "--shm-arena-mib",
        type=float,
        default=None,
        help="per-worker and output arena (default: their own defaults)",
    )
    args = parser.parse_args()
    if args.role == "gradserver-worker":
        print(json.dumps(_gradserver_worker(args)))
        return 0
    if args.role == "gloo-worker":
        print(json.dumps(_gloo_worker(args)))
        return 0
    if args.role == "echo-server":
        _echo_server()
        return 0
    if args.role == "echo-worker":
        print(json.dumps(_echo_worker(args)))
        return 0
    if args.zero_copy and args.api != "tuned":
        parser.error("--zero-copy is a tuning: it needs --api tuned")
    shape = dict(SLICE, num_blocks=24) if args.full else json.loads(args.shape)
    elements = _elements(shape)
    gbytes = 4 * elements / 1e9
    transports = args.transport.split(",")
    print(
        f"gradient set: {shape['num_blocks']} blocks + LM head = {4 * elements / 2**20:.0f} MiB per worker; "
        f"chunk {f'{args.chunk_mib:g} MiB' if args.chunk_mib else 'chosen by the coordinator'}; "
        f"API {args.api}; median of {args.steps} steps after {args.warmup} warm-up; "
        f"nproc={os.cpu_count()}; arenas "
        + (f"{args.shm_arena_mib:g} MiB" if args.shm_arena_mib else "of their default sizes")
        + (" + the set (zero copy)" if args.zero_copy else "")
    )
    machine: Machine | None = None
    if args.machine_floor:
        from bench import machine as bench_machine

        # Measured before any worker runs, so that nothing of this bench competes with it.
        machine = bench_machine.measure()
        print(bench_machine.table(machine))
        print()
    print(
        "| N | transport | gradserver s | GB/s | gloo s | gradserver/gloo | gRPC echo floor s "
        "| coordinator peak RSS MiB | RssAnon MiB | RssShmem MiB |"
        + (" memory floor s | gradserver/memory floor |" if machine else "")
    )
    print(
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if machine else "")
    )
    for world in [int(w) for w in args.workers.split(",")]:
        gloo = [] if args.no_gloo else run_gloo(world, shape, args.steps, args.warmup, args.timeout)
        b = statistics.median(gloo) if gloo else float("nan")
        echo = (
            run_echo(world, shape, args.steps, args.warmup, args.chunk_mib or 8.0, args.timeout)
            if args.floor
            else []
        )
        f = statistics.median(echo) if echo else float("nan")
        for transport in transports:
            ours, rss, (anon, shmem) = run_gradserver(
                world,
                shape,
                args.steps,
                args.warmup,
                args.chunk_mib,
                args.timeout,
                transport,
                args.zero_copy and transport == "shm",
                args.shm_arena_mib,
                args.api,
            )
            a = statistics.median(ours)
            floor_cells = _machine_floor_cells(machine, transport, world, shape, args, a) if machine else ""
            print(
                f"| {world} | {transport} | {a:.3f} | {gbytes / a:.2f} | {b:.3f} | {a / b:.2f} | {f:.3f} "
                f"| {rss:.0f} | {anon:.0f} | {shmem:.0f} |" + floor_cells,
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
