"""The wire codec: protobuf bytes to and from the plain types of `gradserver.common.messages`.

The one place callers import the codec from; each part of it is a module with one job:

| module | what it encodes and decodes |
| --- | --- |
| `codec_fields` | what every message shares: keys, dtypes, shared-memory references, `WireLimits` |
| `codec_join` | JoinRequest, JoinResponse and the link probe |
| `codec_worker` | worker to coordinator: chunks, barriers, point-to-point pieces, step failures, ... |
| `codec_server` | coordinator to worker: averaged chunks and pieces, releases, errors, notices, ... |

These modules are the only ones that touch the generated protobuf classes (besides the
partition notice and the gRPC edge); the hand-written wire reader and writer that keep
multi-MiB payloads out of message objects are in `_wire`. Decoding validates everything that
can be judged from one message alone (well-formed bytes, known enums, allowed dtype, sizes
within limits, chunk offsets and lengths) and raises an error of the project's hierarchy naming
the worker, step and key; checks that need other workers' messages live in the coordinator's
reduction table. The rules of each collective and of host groups, which the codec applies to one
message, are `collective_rules`'.
"""

from __future__ import annotations

from .codec_fields import MAX_NAME_LENGTH, WireLimits
from .codec_join import (
    MAX_FINGERPRINT_FIELDS,
    MAX_PROBE_BYTES,
    PROTOCOL_VERSION,
    decode_join_accepted,
    decode_join_request,
    decode_link_probe,
    encode_join_accepted,
    encode_join_request,
    encode_link_probe,
)
from .codec_server import decode_server_message, encode_server_event
from .codec_worker import PEER_BYTES_PER_ELEMENT, chunk_key, decode_worker_message, encode_worker_event

__all__ = [
    "MAX_FINGERPRINT_FIELDS",
    "MAX_NAME_LENGTH",
    "MAX_PROBE_BYTES",
    "PEER_BYTES_PER_ELEMENT",
    "PROTOCOL_VERSION",
    "WireLimits",
    "chunk_key",
    "decode_join_accepted",
    "decode_join_request",
    "decode_link_probe",
    "decode_server_message",
    "decode_worker_message",
    "encode_join_accepted",
    "encode_join_request",
    "encode_link_probe",
    "encode_server_event",
    "encode_worker_event",
]
