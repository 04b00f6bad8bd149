"""Training over slow links that survives a lost rank: outer steps (DiLoCo) over `ft`.

    gradserver run --workers 3 --restart-lost 2 -- python examples/diloco_ft.py --sync-every 20

Each rank is a replica training alone with its inner optimizer (AdamW); every 20 steps its
pseudo-gradient is averaged with the others' as one fault-tolerant step of the coordinator, and an
outer optimizer (SGD, Nesterov) steps the global weights, bit-identical on every rank. Kill a rank
(SIGKILL): the others' exchanges are averaged over the ranks that took part (it loses at most its
inner steps since its last exchange), `gradserver run` starts it again, and it takes a live rank's
state (model, inner and outer optimizers, global weights, the step) at that rank's next exchange
and takes part from there. The same model, data and settings as examples/diloco.py: without a
fault the global weights end bit-identical to its run over the process group.

Every rank prints the digest of the global weights after each outer step, and at the end their
sha256 (as examples/_result.py computes it) and the held-out loss of the global weights.
"""

from __future__ import annotations

import argparse

import torch
from _result import parameter_digest

from gradserver.torch import ft
from gradserver.worker import state_digest


def samples(step: int, rank: int, noise: float = 0.0, batch: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(batch, 16, generator=g)
    y = (x.sum(dim=1, keepdim=True) / 4).sin()
    return x, y + noise * torch.randn(y.shape, generator=g) if noise else y


def held_out_loss(model: torch.nn.Module, weights: dict[str, torch.Tensor], noise: float) -> float:
    x, y = samples(10**6, 0, noise, batch=1024)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(torch.func.functional_call(model, weights, (x,)), y))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--delay", type=int, default=0)
    parser.add_argument("--keep-local", type=float, default=0.0)
    parser.add_argument("--quantize", choices=["bf16", "int8", "int4"], default=None)
    parser.add_argument("--noise", type=float, default=0.0, help="the targets' noise (its std)")
    parser.add_argument("--batch", type=int, default=32, help="samples per inner step")
    parser.add_argument(
        "--decay", action="store_true", help="the inner learning rate decays linearly to 0 at --steps"
    )
    args = parser.parse_args()

    torch.manual_seed(0)  # every replica starts from the same weights
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    job = ft.Replica(model, optimizer)
    rank = job.client.worker_id
    outer = job.diloco(
        sync_every=args.sync_every,
        fragments=args.fragments,
        delay=args.delay,
        keep_local=args.keep_local,
        quantize=args.quantize,
    )
    if job.healed is not None:
        print(
            f"rank {rank}: joined the running job at step {job.healed.step} (inner step "
            f"{outer.inner_step}), state from rank {job.healed.donor}",
            flush=True,
        )
    with outer:
        for step in outer.steps(args.steps):  # the inner step is the data position
            if args.decay:  # a function of the step: a replica that joins has it too
                for group in optimizer.param_groups:
                    group["lr"] = 1e-2 * (1 - step / args.steps)
            x, y = samples(step, rank, args.noise, args.batch)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            outer.count(len(x))  # this replica's weight in the next outer average
            applied = outer.outer_steps
            optimizer.step()  # every sync_every-th step is also an outer step
            optimizer.zero_grad()
            if outer.outer_steps > applied:
                print(
                    f"rank {rank} outer {outer.outer_steps} at inner step {outer.inner_step}: global "
                    f"{state_digest(outer.global_tensors()):#018x}, averaged over {job.contributors}, "
                    f"loss {loss.item():.4f}",
                    flush=True,
                )
    # Leaving the block flushed: the fragments exchanged earlier in the last period took one last
    # outer step with the inner steps since, and the model holds the global weights.
    _, sha256 = parameter_digest(outer.global_tensors().items())
    print(
        f"rank {rank}: {outer.inner_step} inner steps, {outer.outer_steps} outer steps "
        f"({outer.discarded} discarded), global sha256 {sha256}, held-out loss "
        f"{held_out_loss(model, outer.global_tensors(), args.noise):.6f}",
        flush=True,
    )
    job.close()


if __name__ == "__main__":
    main()
