"""A worker process for fault tests: runs full synthetic steps, then stops partway through a step.

    python -m tests.helpers.scripted_worker --coordinator ADDR --full-steps 2 --send-blocks 3

prints "JOINED worker W", one "worker W step S ..." line per full step, and after sending
`--send-blocks` blocks of the next step, "STALLED worker W step S"; then it waits (at most
--hold seconds) without reading, as a process that is about to be killed or stopped would. With
--then-receive it then tries to receive and prints "RESULT ..." with what happened.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from gradserver.train.synthetic import SHAPES, run_exchange, synthetic_gradient
from gradserver.worker import Timeouts, WorkerClient


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--full-steps", type=int, default=0)
    parser.add_argument("--send-blocks", type=int, default=1)
    parser.add_argument("--hold", type=float, default=120.0)
    parser.add_argument("--num-blocks", type=int, default=0, help="override the preset's blocks")
    parser.add_argument(
        "--then-receive", action="store_true", help="after --hold, try to receive and print what happens"
    )
    args = parser.parse_args()
    shape = SHAPES[args.model]
    if args.num_blocks:
        shape = dataclasses.replace(shape, num_blocks=args.num_blocks)
    client = WorkerClient.connect(args.coordinator, node_id="scripted", timeout=Timeouts(receive=60.0))
    me = client.worker_id
    print(f"JOINED worker {me}", flush=True)
    run_exchange(
        client,
        shape,
        args.full_steps,
        on_step=lambda r: print(f"worker {me} step {r.step} checksum {r.checksum:08x}", flush=True),
    )
    step = args.full_steps
    sizes = shape.block_sizes
    for block_idx in list(reversed(range(shape.num_blocks)))[: args.send_blocks]:
        grads = synthetic_gradient(0, step, me, 1000 + block_idx, sum(sizes))
        client.send_block_gradient(step, block_idx, shape.num_blocks, grads, sizes)
    print(f"STALLED worker {me} step {step}", flush=True)
    time.sleep(args.hold)
    if args.then_receive:
        try:
            client.receive_averaged_block()
            print("RESULT ok", flush=True)
        except Exception as exc:
            print(f"RESULT {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    main()
