"""Live recovery: a worker that joins a running job takes the job's state from a live member.

Replicas of one model stay identical because each applies the same averages to the same state.
A worker that takes a departed one's place (`--on-worker-loss continue`) holds a stale state or
none, so its JoinAccepted names the step it takes part from and the donors to ask
(server/recovery.py). `recover` asks them in order over point-to-point messages (shared memory
between workers of one host, else relayed by the coordinator in pieces of the job's chunk size:
only members of the job, authenticated as every member's stream is, take part) and returns the
donor's state at that step's boundary, checked byte for byte: a CRC-32 per tensor, and the
state's digest over every tensor, before anything of it is handed back. A donor that leaves, refuses
or sends something that does not check is skipped for the next; when none is left, `recover`
raises naming each donor and why, and the worker holds nothing it could train with.

The donor's side is `StateServer`: a thread that answers requests with a snapshot of the state
the program offers (`WorkerClient.offer_state`). The program marks where its state changes
(`WorkerClient.updating_state()` around the optimizer step): a request for a boundary the donor
has not reached waits for it, and the update waits while a transfer reads the state, so the donor
keeps computing (forward, backward, averaging) while it serves and nothing is copied. It cannot
pass the boundary it serves before the transfer ends anyway: that step waits for the joiner's
contribution.

`state_digest` is the same digest both sides compute; the barrier of `WorkerClient.check_state`
carries it to the coordinator, which evicts any worker whose digest differs from the majority's
(server/digests.py).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import logging
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from gradserver.common.errors import (
    AbortedError,
    ConnectionLost,
    DeadlineExceededError,
    GradServerError,
    InternalError,
    InvalidArgumentError,
)

from .transports import Mailbox, PeerReceive

log = logging.getLogger("gradserver.worker")

# Point-to-point tags reserved for recovery: a program's own tags must not use them
# (`WorkerClient.send_to` refuses them).
RESERVED_TAGS = range(-(2**62), -(2**62) + 16)
_REQUEST_TAG = RESERVED_TAGS[0]
_MANIFEST_TAG = RESERVED_TAGS[1]
_DATA_TAG = RESERVED_TAGS[2]
_MAX_MANIFEST_BYTES = 64 * 2**20
_IDLE_WAIT_S = 5.0  # a donor waits for requests in waits this long (the receive stays posted)


@dataclasses.dataclass(frozen=True)
class StateSnapshot:
    """What a worker offers: `step` steps applied, its `tensors` (numpy arrays or torch
    tensors, any dtype, by name) and `extra` bytes of its own (e.g. its data position or RNG
    state: carried and checksummed, not part of the digest)."""

    step: int
    tensors: Mapping[str, Any]
    extra: bytes = b""


@dataclasses.dataclass(frozen=True)
class RecoveredState:
    """A donor's state at the boundary of `step`: its tensors (numpy arrays, or torch tensors
    where the donor's were torch tensors of a dtype numpy lacks or it offered torch tensors),
    its extra bytes, which worker gave it and the state's digest (checked)."""

    step: int
    tensors: dict[str, Any]
    extra: bytes
    donor: int
    digest: int
    nbytes: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class _Entry:
    name: str
    dtype: str  # numpy's dtype string ("<f4"), or "torch.<name>" for a torch tensor
    shape: tuple[int, ...]
    nbytes: int
    crc: int


def _raw(value: Any) -> tuple[str, tuple[int, ...], np.ndarray]:
    """(dtype, shape, its bytes as a flat uint8 array: a view where it lies on the host)."""
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        return array.dtype.str, tuple(array.shape), array.reshape(-1).view(np.uint8)
    module = type(value).__module__
    if module.startswith("torch"):
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        tensor = tensor.contiguous()
        shape = tuple(int(n) for n in tensor.shape)
        dtype = str(tensor.dtype)
        flat = tensor.reshape(-1)
        if flat.numel() == 0:
            return dtype, shape, np.zeros(0, np.uint8)
        import torch

        return dtype, shape, flat.view(torch.uint8).numpy()
    raise InvalidArgumentError(f"state tensors are numpy arrays or torch tensors, got {type(value).__name__}")


def _entries(tensors: Mapping[str, Any]) -> list[tuple[_Entry, np.ndarray]]:
    out = []
    for name in sorted(tensors):
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"state tensor names are non-empty strings, got {name!r}")
        dtype, shape, data = _raw(tensors[name])
        out.append((_Entry(name, dtype, shape, data.size, _crc(data)), data))
    return out


def _crc(data: np.ndarray) -> int:
    return zlib.crc32(data.data)


def _digest_of(entries: list[_Entry]) -> int:
    """64 bits over every tensor's name, dtype, shape and CRC-32, in name order."""
    h = hashlib.blake2b(digest_size=8)
    for e in entries:
        h.update(json.dumps([e.name, e.dtype, e.shape, e.nbytes, e.crc]).encode())
    return int.from_bytes(h.digest(), "little")


def state_digest(tensors: Mapping[str, Any]) -> int:
    """A 64-bit digest of `tensors` (by name, dtype, shape and every byte): equal on two workers
    exactly when their tensors are bit-identical (up to CRC-32 collisions per tensor)."""
    return _digest_of([e for e, _ in _entries(tensors)])


def _restore(entry: _Entry, data: np.ndarray) -> Any:
    if entry.dtype.startswith("torch."):
        import torch

        dtype = getattr(torch, entry.dtype.removeprefix("torch."))
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=dtype)
        return torch.from_numpy(data).view(dtype).reshape(entry.shape)
    return data.view(np.dtype(entry.dtype)).reshape(entry.shape)


def _json_bytes(value: object) -> np.ndarray:
    return np.frombuffer(json.dumps(value).encode(), np.uint8)


class StateServer:
    """Answers recovery requests with the state `snapshot` returns, on a thread of its own."""

    def __init__(self, mailbox: Mailbox, snapshot: Callable[[], StateSnapshot], timeout: float) -> None:
        """`timeout`: how long a request waits for this worker to reach the step it asks for."""
        self._mailbox = mailbox
        self._snapshot = snapshot
        self.timeout = timeout
        self._cond = threading.Condition()
        self._serving = False
        self._updating = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gradserver-state-server", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Held while the program changes its state: waits for a transfer that reads it."""
        with self._cond:
            while self._serving and not self._closed:
                self._cond.wait(0.5)
            self._updating = True
        try:
            yield
        finally:
            with self._cond:
                self._updating = False
                self._cond.notify_all()

    def close(self) -> None:
        """Stops serving (the mailbox's close ends the receive it waits in)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    def _run(self) -> None:
        me = self._mailbox.worker_id
        request: PeerReceive | None = None
        while True:
            try:
                if request is None:
                    request = self._mailbox.receive(None, _REQUEST_TAG)
                raw = request.wait(_IDLE_WAIT_S)
            except DeadlineExceededError:
                continue  # no request yet: it stays posted
            except GradServerError:
                return  # closed, or the link broke: nothing is served any more
            requester, request = request.sender, None
            try:
                step = int(json.loads(bytes(raw))["step"])
            except (ValueError, KeyError, TypeError):
                log.warning("worker %d: a malformed recovery request from worker %d ignored", me, requester)
                continue
            try:
                self._serve(requester, step)
            except GradServerError as exc:
                log.warning(
                    "worker %d: the state of step %d did not reach worker %d: %s",
                    me,
                    step,
                    requester,
                    exc.message,
                )

    def _serve(self, requester: int, step: int) -> None:
        me = self._mailbox.worker_id
        snapshot = self._begin(step)
        if isinstance(snapshot, str):
            self._mailbox.send(requester, _MANIFEST_TAG, _json_bytes({"refused": snapshot})).wait(
                self.timeout
            )
            log.warning("worker %d: refused worker %d its state: %s", me, requester, snapshot)
            return
        try:
            started = time.perf_counter()
            entries = _entries(snapshot.tensors)
            extra = np.frombuffer(snapshot.extra, np.uint8)
            manifest = {
                "step": snapshot.step,
                "tensors": [dataclasses.astuple(e) for e, _ in entries],
                "extra": [extra.size, _crc(extra)],
                "digest": _digest_of([e for e, _ in entries]),
            }
            total = sum(e.nbytes for e, _ in entries) + extra.size
            log.info(
                "worker %d: serving its state of step %d to worker %d (%d tensors, %d bytes)",
                me,
                step,
                requester,
                len(entries),
                total,
            )
            sends = [self._mailbox.send(requester, _MANIFEST_TAG, _json_bytes(manifest))]
            sends += [self._mailbox.send(requester, _DATA_TAG, data) for _, data in entries if data.size]
            if extra.size:
                sends.append(self._mailbox.send(requester, _DATA_TAG, extra))
            for send in sends:
                send.wait(self.timeout)
            log.info(
                "worker %d: worker %d has the state of step %d (%.3f s)",
                me,
                requester,
                step,
                time.perf_counter() - started,
            )
        finally:
            with self._cond:
                self._serving = False
                self._cond.notify_all()

    def _begin(self, step: int) -> StateSnapshot | str:
        """Waits until the offered state is at `step`'s boundary, marks it being read (it stays
        as it is until `_serve` ends) and returns it; else why it cannot be served."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                if self._closed:
                    return f"worker {self._mailbox.worker_id} is closing"
                if not self._updating:
                    snapshot = self._snapshot()
                    have = snapshot.step
                    if have == step:
                        self._serving = True
                        return snapshot
                    if have > step:
                        return (
                            f"worker {self._mailbox.worker_id} has applied {have} steps, past the "
                            f"boundary of step {step} that was asked for"
                        )
                left = deadline - time.monotonic()
                if left <= 0:
                    return (
                        f"worker {self._mailbox.worker_id} did not reach step {step} within "
                        f"{self.timeout:g} s"
                    )
                self._cond.wait(min(left, 0.5))


def recover(
    mailbox: Mailbox,
    step: int,
    donors: tuple[int, ...],
    timeout: float,
    progress: Callable[[int, int], None] | None = None,
) -> RecoveredState:
    """The state at the boundary of `step`, from the first of `donors` that gives one that
    checks. `timeout`: seconds each donor has to answer and to send each tensor. `progress(done,
    total)`: called after each tensor arrived, with bytes. Raises `AbortedError` naming each
    donor and why when none could, and the link's error when it broke."""
    me = mailbox.worker_id
    if not donors:
        raise AbortedError(
            f"worker {me} joined a running job at step {step}, but no live member can give it the "
            "job's state",
            worker_id=me,
        )
    why: list[str] = []
    for donor in donors:
        try:
            return _recover_from(mailbox, donor, step, timeout, progress)
        except ConnectionLost:
            raise
        except GradServerError as exc:
            log.warning("worker %d: recovery from worker %d failed: %s", me, donor, exc.message)
            why.append(f"worker {donor}: {exc.message}")
    raise AbortedError(
        f"worker {me} could not take the state of step {step} from any donor ({'; '.join(why)}); it "
        "holds no state it could train with: join again to retry",
        worker_id=me,
    )


def _recover_from(
    mailbox: Mailbox,
    donor: int,
    step: int,
    timeout: float,
    progress: Callable[[int, int], None] | None,
) -> RecoveredState:
    started = time.perf_counter()
    answer = mailbox.receive(donor, _MANIFEST_TAG)
    mailbox.send(donor, _REQUEST_TAG, _json_bytes({"step": step})).wait(timeout)
    try:
        raw = answer.wait(timeout)
    except DeadlineExceededError:
        raise DeadlineExceededError(
            f"worker {donor} sent no state within {timeout:g} s (does it offer one? "
            "WorkerClient.offer_state)",
            worker_id=donor,
        ) from None
    if raw.size > _MAX_MANIFEST_BYTES:
        raise InternalError(f"worker {donor} sent a state manifest of {raw.size} bytes", worker_id=donor)
    manifest = json.loads(bytes(raw))
    if "refused" in manifest:
        raise AbortedError(f"it refused: {manifest['refused']}", worker_id=donor)
    try:
        entries = [
            _Entry(str(n), str(d), tuple(int(x) for x in s), int(b), int(c))
            for n, d, s, b, c in manifest["tensors"]
        ]
        extra_size, extra_crc = (int(x) for x in manifest["extra"])
        digest, sent_step = int(manifest["digest"]), int(manifest["step"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InternalError(
            f"worker {donor} sent a malformed state manifest: {exc}", worker_id=donor
        ) from None
    if sent_step != step:
        raise InternalError(f"worker {donor} sent its state of step {sent_step}, not {step}", worker_id=donor)
    if _digest_of(entries) != digest:
        raise InternalError(
            f"worker {donor} sent a state manifest that does not match its digest", worker_id=donor
        )
    total = sum(e.nbytes for e in entries) + extra_size
    # Every receive is posted before any is waited for: the donor sends them back to back.
    buffers = [np.empty(e.nbytes, np.uint8) for e in entries]
    receives: list[tuple[_Entry | None, PeerReceive]] = [
        (e, mailbox.receive(donor, _DATA_TAG, into=buf))
        for e, buf in zip(entries, buffers, strict=True)
        if e.nbytes
    ]
    extra = np.empty(extra_size, np.uint8)
    if extra_size:
        receives.append((None, mailbox.receive(donor, _DATA_TAG, into=extra)))
    done = 0
    for entry, receive in receives:
        data = receive.wait(timeout)
        crc, name = (entry.crc, entry.name) if entry is not None else (extra_crc, "extra bytes")
        if _crc(data) != crc:
            raise InternalError(
                f"the state's {name} from worker {donor} fails its CRC-32 check", worker_id=donor
            )
        done += data.size
        if progress is not None:
            progress(done, total)
    tensors = {e.name: _restore(e, buf) for e, buf in zip(entries, buffers, strict=True)}
    seconds = time.perf_counter() - started
    log.info(
        "worker %d: took the state of step %d from worker %d (%d tensors, %d bytes, %.3f s)",
        mailbox.worker_id,
        step,
        donor,
        len(entries),
        total,
        seconds,
    )
    return RecoveredState(step, tensors, extra.tobytes(), donor, digest, total, seconds)


def encode_extra(value: Mapping[str, Any]) -> bytes:
    """JSON bytes for `StateSnapshot.extra`, with `bytes` values as base64 (e.g. RNG state)."""
    return json.dumps(
        {k: {"base64": base64.b64encode(v).decode()} if isinstance(v, bytes) else v for k, v in value.items()}
    ).encode()


def decode_extra(raw: bytes) -> dict[str, Any]:
    """The mapping `encode_extra` made."""
    if not raw:
        return {}
    value = json.loads(raw)
    return {
        k: base64.b64decode(v["base64"]) if isinstance(v, dict) and set(v) == {"base64"} else v
        for k, v in value.items()
    }
