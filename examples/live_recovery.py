"""A custom training loop that survives a lost worker: the replacement takes the live state.

Start a coordinator that lets the job go on without a lost worker, then the workers:

    gradserver coordinator --world-size 3 --on-worker-loss continue &
    python examples/live_recovery.py --coordinator 127.0.0.1:50051 --steps 300 &   # three times

Kill one worker (SIGKILL) and start it again with the same command: it joins the running job in
the lost worker's place, takes the model, the optimizer state and the step from a live worker,
and trains on. Every worker prints the digest of its final state: they are equal.

What the loop needs from gradserver (besides sending gradients):
- `client.offer_state(snapshot)`: what this worker serves to a worker that joins;
- `with client.updating_state():` around every change of that state (the optimizer step);
- `client.recovery_step` and `client.recover()`: set when this worker joined a running job;
- `client.check_state(step, state_digest(...))`: every worker compares its state with the others'
  at agreed steps (a diverged worker is evicted, never averaged with).
"""

from __future__ import annotations

import argparse
import os

import torch

from gradserver.torch.ft import load_state, state_tensors
from gradserver.worker import StateSnapshot, WorkerClient, decode_extra, encode_extra, state_digest

CHECK_EVERY = 25


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # every worker starts from the same weights
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's samples of `step`: a function of both, so a rank's data position is its step."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--coordinator", default=os.environ.get("GRADSERVER_COORDINATOR", "127.0.0.1:50051"))
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    model, optimizer = make_model()
    params = list(model.parameters())
    step = 0
    with WorkerClient.connect(args.coordinator, timeout=60.0) as client:
        if client.recovery_step is not None:
            got = client.recover()
            load_state(model, optimizer, got.tensors)
            step = int(decode_extra(got.extra)["step"])
            assert state_digest(state_tensors(model, optimizer)) == got.digest
            print(
                f"worker {client.worker_id}: joined at step {step}, state from worker {got.donor}", flush=True
            )
        client.offer_state(
            lambda: StateSnapshot(step, state_tensors(model, optimizer), encode_extra({"step": step}))
        )
        joined = {s + 1 for _, s in client.replacements()}
        while step < args.steps:
            joined |= {s + 1 for _, s in client.replacements()}
            if step % CHECK_EVERY == 0 or step in joined or step == (client.recovery_step or -2) + 1:
                client.check_state(step, state_digest(state_tensors(model, optimizer)))
            x, y = batch(step, client.worker_id)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
            client.send_gradients(step, flat, loss.item(), 0, len(x), into=flat.numpy())
            global_loss = client.receive_averaged().global_loss  # the average is in `flat`
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))  # type: ignore[union-attr]
                offset += p.numel()
            with client.updating_state():  # a joining worker may be reading the state
                optimizer.step()
                step += 1
            if step % 100 == 0:
                print(f"worker {client.worker_id} step {step}: loss {global_loss:.4f}", flush=True)
        digest = state_digest(state_tensors(model, optimizer))
        print(
            f"worker {client.worker_id}: {step} steps, loss {global_loss:.4f}, digest {digest:#018x}",
            flush=True,
        )


if __name__ == "__main__":
    main()
