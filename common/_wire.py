"""The protobuf wire format by hand, for the two payload-carrying messages only.

A gradient chunk's payload is several MiB; building or parsing it through a message object would
copy it twice. `with_payload` appends the payload field to a separately serialised header (one
copy), and `split_payload` finds the payload in received bytes and returns a zero-copy view of
it, with the rest of the message for the protobuf parser. Anything unexpected makes
`split_payload` return None, so the caller falls back to the parser, which reports the problem.
Field numbers come from the caller (gradserver.common.codec reads them from the descriptors).
"""

from __future__ import annotations

LENGTH_DELIMITED = 2


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def with_payload(outer_field: int, header: bytes, data_field: int, data: bytes | memoryview) -> bytes:
    """Serialises {outer_field: header + {data_field: data}} with a single copy of `data`.

    Protobuf parsers accept fields in any order, so appending the payload field to the
    separately serialised header yields the same message as setting it on the header; this
    avoids copying multi-MiB payloads into and back out of a message object.
    """
    length = len(data) if isinstance(data, bytes) else data.nbytes
    inner = [header, varint(data_field << 3 | LENGTH_DELIMITED), varint(length), data]
    inner_len = len(header) + len(inner[1]) + len(inner[2]) + length
    return b"".join([varint(outer_field << 3 | LENGTH_DELIMITED), varint(inner_len), *inner])


def read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def split_payload(raw: bytes, outer_field: int, data_field: int) -> tuple[bytes, memoryview | None] | None:
    """Counterpart of `with_payload`: for a message {outer_field: {...}}, the inner message's
    bytes without its `data_field`, and a zero-copy view of that field's payload.

    Returns None when `raw` is not such a message or is malformed, so the caller falls back to
    the protobuf parser (which then reports the problem).
    """
    view = memoryview(raw)
    try:
        tag, pos = read_varint(view, 0)
        if tag != (outer_field << 3 | LENGTH_DELIMITED):
            return None
        length, pos = read_varint(view, pos)
        if pos + length != len(view):
            return None
        header: list[memoryview] = []
        data: memoryview | None = None
        while pos < len(view):
            start = pos
            tag, pos = read_varint(view, pos)
            wire = tag & 7
            if wire == 0:
                _, pos = read_varint(view, pos)
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            elif wire == LENGTH_DELIMITED:
                size, pos = read_varint(view, pos)
                if tag >> 3 == data_field:
                    data = view[pos : pos + size]
                    pos += size
                    if pos > len(view):
                        return None
                    continue
                pos += size
            else:
                return None
            if pos > len(view):
                return None
            header.append(view[start:pos])
    except ValueError:
        return None
    return b"".join(header), data
