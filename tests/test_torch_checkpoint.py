"""torch.distributed.checkpoint (DCP) with the gradserver backend: FSDP1's sharded state dict is
saved and loaded back exactly.

torch asks the group for its default device there (fsdp/_shard_utils.py
`_create_chunk_sharded_tensor` -> `_get_pg_default_device`, which reads `group._device_types`,
the devices of the group's C++ backends: none for a Python group, so it failed with "Default
device not found, because no backend has been registered with this ProcessGroup").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from .helpers.ranks import rank_results, spawn_and_join

pytestmark = pytest.mark.processes

WORLD = 2


def _checkpoint_rank(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    dist.init_process_group("gradserver", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        layers = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        model = FullyShardedDataParallel(layers, device_id=torch.device("cpu"), use_orig_params=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        torch.manual_seed(1 + rank)
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        trained = [p.detach().clone() for p in model.parameters()]
        checkpoint = str(Path(out_dir) / "checkpoint")
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            dcp.save({"model": model.state_dict()}, checkpoint_id=checkpoint)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict()}
            dcp.load(state, checkpoint_id=checkpoint)
            model.load_state_dict(state["model"])
        loaded = [p.detach().clone() for p in model.parameters()]
        torch.save({"trained": trained, "loaded": loaded}, Path(out_dir) / f"rank{rank}.pt")
    except Exception as exc:
        (Path(out_dir) / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_an_fsdp1_sharded_state_dict_round_trips_through_dcp(tmp_path: Path) -> None:
    spawn_and_join(_checkpoint_rank, [(r, str(tmp_path / "store"), str(tmp_path)) for r in range(WORLD)])
    results = rank_results(tmp_path, WORLD)
    for rank, got in enumerate(results):
        assert len(got["trained"]) == 4, rank
        assert any(t.abs().sum() > 0 for t in got["trained"]), rank  # zeroed before the load
        for before, after in zip(got["trained"], got["loaded"], strict=True):
            assert torch.equal(before, after), rank
