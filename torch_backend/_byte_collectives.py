"""The collectives of the process group that move raw bytes: broadcast, allgather (list,
single-tensor and coalesced forms), alltoall, all_to_all_single, gather and scatter.

Any dtype, byte-identical on every rank: allgather and all_gather_into_tensor are an ALL_GATHER;
broadcast a BROADCAST (the root's bytes, once; the others send none); alltoall and
all_to_all_single (uneven split sizes too) an ALL_TO_ALL; gather one toward the root (the others
receive nothing), scatter one from the root. A result is received straight into a contiguous host
output where no input byte still to be sent lies there (`_tensor_bytes.overlaps`), else copied in.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gradserver.common.messages import CollectiveKind

from ._arguments import equal_pieces, pieces_of_each, root_of
from ._group_core import DEFAULT_GROUP, GroupCore
from ._staging import Staging
from ._tensor_bytes import (
    concat_bytes,
    host_bytes,
    nbytes_of,
    overlaps,
    same_memory,
    slice_bytes,
    write_bytes_into,
)


class ByteCollectives(GroupCore):
    """broadcast, allgather, alltoall, gather and scatter in their torch forms, on `GroupCore`."""

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """One ALL_TO_ALL: input j goes to rank j, output j comes from rank j (any sizes)."""
        size = self.size()
        if len(output_tensors) != size or len(input_tensors) != size:
            raise ValueError(
                f"gradserver alltoall: {len(input_tensors)} inputs and {len(output_tensors)} outputs "
                f"for a group of {size}; it takes one of each per rank"
            )
        staging = self._staging("alltoall", [*input_tensors, *output_tensors])
        inputs, outputs = staging.reads(input_tensors), staging.writes(output_tensors)

        def run(sequence: int) -> None:
            splits = tuple(nbytes_of(t) for t in inputs)
            result = self._all_to_all(sequence, concat_bytes(inputs), splits)
            write_bytes_into(outputs, result, what=f"rank {self.rank()}: gradserver alltoall")

        return self._operations.submit("alltoall", staging, run, output_tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """One BROADCAST: the root sends its bytes once, the others only say how many."""
        root = opts.rootRank if isinstance(opts, dist.BroadcastOptions) else 0
        if not 0 <= root < self.size():
            raise ValueError(f"broadcast: root rank {root} is out of range for a group of {self.size()}")
        if self._small_on_host(tensors):
            return self._small_broadcast(tensors[0], root)
        is_root = self.rank() == root
        staging = self._staging("broadcast", tensors)
        hosts = staging.reads(tensors) if is_root else staging.writes(tensors)

        def run(sequence: int) -> None:
            nbytes = sum(nbytes_of(t) for t in hosts)
            data = concat_bytes(hosts) if is_root else np.empty(nbytes, np.uint8)
            into = host_bytes(hosts[0]) if len(hosts) == 1 else None
            result = self._broadcast(sequence, data, root, into=into)
            write_bytes_into(hosts, result, what=f"rank {self.rank()}: gradserver broadcast")

        return self._operations.submit("broadcast", staging, run, tensors)

    def _small_broadcast(self, tensor: torch.Tensor, root: int) -> dist.Work:
        """The same BROADCAST key as the general path, without its staging, concatenation and
        copy back: the tensor's own bytes are the root's payload (a non-root rank sends only
        their count) and the result is received into them (the root's are its input already).
        Queued like every other operation, so it keeps its place among queued async ones."""

        def run(sequence: int) -> None:
            memory = host_bytes(tensor)
            assert memory is not None  # a contiguous host tensor (`_small_on_host`)
            self._broadcast(sequence, memory, root, into=memory)

        return self._operations.submit_host("broadcast", run, [tensor])

    def allgather(  # type: ignore[override]
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """One ALL_GATHER of this rank's inputs (their bytes, concatenated)."""
        size = self.size()
        for i, outputs in enumerate(output_tensors):
            if len(outputs) != size:
                raise ValueError(f"allgather: output list {i} holds {len(outputs)} tensors, the group {size}")
        flat_outputs = [t for outputs in output_tensors for t in outputs]
        staging = self._staging("allgather", [*input_tensors, *flat_outputs])
        inputs = staging.reads(input_tensors)
        hosts = [staging.writes(outputs) for outputs in output_tensors]
        return self._allgather("allgather", staging, hosts, inputs, flat_outputs)

    def _allgather(
        self,
        what: str,
        staging: Staging,
        outputs: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        result: list[torch.Tensor],
    ) -> dist.Work:
        def run(sequence: int) -> None:
            rows = self._gather_rows(sequence, concat_bytes(inputs))
            for r in range(self.size()):
                write_bytes_into(
                    [pieces[r] for pieces in outputs], rows[r], what=f"rank {self.rank()}: gradserver {what}"
                )

        return self._operations.submit(what, staging, run, result)

    # --- the single-tensor and rooted forms, built on the collectives above -------------------
    # torch.distributed calls these by name on the group object (FSDP uses all_gather_single).

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """`all_gather_into_tensor`: `output` holds every rank's `input`, in rank order (one
        ALL_GATHER, written straight into `output` when it is a contiguous host tensor)."""
        equal_pieces("all_gather_into_tensor", output, self.size(), like=input)
        staging = self._staging("all_gather_into_tensor", [input, output])
        host_input, host_output = staging.read(input), staging.write(output)

        def run(sequence: int) -> None:
            data = concat_bytes([host_input])
            # Pieces of the result may arrive while this rank still sends: the output can take
            # them directly unless the input lies in it elsewhere than in this rank's own piece
            # (which receives the very bytes it holds).
            flat = host_output.reshape(-1)
            own = flat.chunk(self.size())[self.rank()] if host_output.numel() else host_output
            into = None
            if not overlaps(host_input, host_output) or same_memory(host_input, own):
                into = host_bytes(host_output)
            result = self._client.run_collective(
                sequence,
                DEFAULT_GROUP,
                data,
                kind=CollectiveKind.ALL_GATHER,
                into=into,
                timeout=self._timeout_s,
            )
            what = f"rank {self.rank()}: gradserver all_gather_into_tensor"
            write_bytes_into([host_output], result, what=what)

        return self._operations.submit("all_gather_into_tensor", staging, run, [output])

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """`all_gather_into_tensor` of several tensors at once (functional collectives, FSDP2)."""
        what = "all_gather_into_tensor_coalesced"
        pieces_of_each(what, outputs, inputs, self.size())
        staging = self._staging(what, [*inputs, *outputs])
        host_inputs, host_outputs = staging.reads(inputs), staging.writes(outputs)
        pieces = pieces_of_each(what, host_outputs, host_inputs, self.size())
        return self._allgather(what, staging, pieces, host_inputs, outputs)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        """One ALL_TO_ALL of slices along dim 0: equal ones, or the (uneven) split sizes given."""
        size, rank = self.size(), self.rank()
        in_splits = slice_bytes("all_to_all_single", "input", input, input_split_sizes, size)
        out_splits = slice_bytes("all_to_all_single", "output", output, output_split_sizes, size)
        staging = self._staging("all_to_all_single", [input, output])
        host_input, host_output = staging.read(input), staging.write(output)

        def run(sequence: int) -> None:
            # Pieces of the result may arrive while this rank still sends its input.
            into = None if overlaps(host_input, host_output) else host_bytes(host_output)
            result = self._all_to_all(sequence, concat_bytes([host_input]), in_splits, into=into)
            if result.size != sum(out_splits):
                raise ValueError(
                    f"rank {rank}: gradserver all_to_all_single received {result.size} bytes, but "
                    f"output_split_sizes {list(output_split_sizes)} hold {sum(out_splits)}"
                )
            write_bytes_into([host_output], result, what=f"rank {rank}: gradserver all_to_all_single")

        return self._operations.submit("all_to_all_single", staging, run, [output])

    def gather(  # type: ignore[override]
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """An ALL_TO_ALL toward the root: every rank sends its bytes to the root only, and the
        other ranks receive nothing."""
        size, rank, root = self.size(), self.rank(), root_of("gather", opts, self.size())
        if len(input_tensors) != 1:
            raise ValueError(f"gradserver gather: expected one input tensor, got {len(input_tensors)}")
        outputs: list[torch.Tensor] = []
        if rank == root:
            if len(output_tensors) != 1 or len(output_tensors[0]) != size:
                raise ValueError(f"gradserver gather: the root needs a gather_list of {size} tensors")
            outputs = output_tensors[0]
        (tensor,) = input_tensors
        staging = self._staging("gather", [tensor, *outputs])
        host, hosts = staging.read(tensor), staging.writes(outputs)

        def run(sequence: int) -> None:
            splits = tuple(nbytes_of(host) if r == root else 0 for r in range(size))
            result = self._all_to_all(sequence, concat_bytes([host]), splits)
            write_bytes_into(hosts, result, what=f"rank {rank}: gradserver gather to rank {root}")

        return self._operations.submit("gather", staging, run, outputs)

    def scatter(  # type: ignore[override]
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        """An ALL_TO_ALL from the root: the root sends piece r to rank r, the others send nothing."""
        size, rank, root = self.size(), self.rank(), root_of("scatter", opts, self.size())
        if len(output_tensors) != 1:
            raise ValueError(f"gradserver scatter: expected one output tensor, got {len(output_tensors)}")
        (output,) = output_tensors
        pieces: list[torch.Tensor] = []
        if rank == root:
            if len(input_tensors) != 1 or len(input_tensors[0]) != size:
                raise ValueError(f"gradserver scatter: the root needs a scatter_list of {size} tensors")
            if any(t.shape != output.shape or t.dtype != output.dtype for t in input_tensors[0]):
                raise ValueError("gradserver scatter: every scatter_list tensor must match the output tensor")
            pieces = list(input_tensors[0])
        staging = self._staging("scatter", [output, *pieces])
        host_pieces, host_output = staging.reads(pieces), staging.write(output)

        def run(sequence: int) -> None:
            splits = tuple(nbytes_of(t) for t in host_pieces) if rank == root else (0,) * size
            into = None if any(overlaps(t, host_output) for t in host_pieces) else host_bytes(host_output)
            result = self._all_to_all(sequence, concat_bytes(host_pieces), splits, into=into)
            write_bytes_into([host_output], result, what=f"rank {rank}: gradserver scatter from rank {root}")

        return self._operations.submit("scatter", staging, run, [output])

    # --- point-to-point ---------------------------------------------------------------------
    # Not operations of the group: only two ranks take part, so they take no sequence number and
