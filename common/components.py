"""Gradient component identifiers shared by the wire protocol, the coordinator and the workers.

A transformer block's gradient is one flat float buffer holding nine components in a fixed order
(the reference `BLOCK_GRAD_COMPONENTS`); three more tensors belong to no block. The integer values
are the wire values of the `BlockComponent` and `NonBlockComponent` enums in the proto.
"""

from __future__ import annotations

import enum

BLOCK_GRAD_COMPONENTS = 9


class BlockComponent(enum.IntEnum):
    """The nine per-block components, in the order a block's flat buffer holds them."""

    W_Q = 0
    W_K = 1
    W_V = 2
    W_O = 3
    GATE = 4
    UP = 5
    DOWN = 6
    INPUT_NORM = 7
    POST_ATTN_NORM = 8


class NonBlockComponent(enum.IntEnum):
    """Gradients outside the transformer blocks (reference wire ids)."""

    LM_HEAD = 0
    FINAL_NORM = 1
    EMBEDDING = 2


def parse_non_block_component(value: int | str | NonBlockComponent) -> NonBlockComponent:
    """Accepts a member, its wire id or its name (any case); raises ValueError naming the value."""
    from .errors import InvalidArgumentError

    if isinstance(value, NonBlockComponent):
        return value
    if isinstance(value, str):
        try:
            return NonBlockComponent[value.strip().upper()]
        except KeyError:
            pass
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            return NonBlockComponent(value)
        except ValueError:
            pass
    names = ", ".join(f"{c.name}={c.value}" for c in NonBlockComponent)
    raise InvalidArgumentError(f"unknown non-block component {value!r}; expected one of {names}")


def compute_block_sizes(hidden: int, kv_hidden: int, intermediate: int) -> tuple[int, ...]:
    """Element counts of the nine block components for a LLaMA-style block.

    w_q and w_o are hidden x hidden, w_k and w_v are kv_hidden x hidden, the three MLP matrices are
    intermediate x hidden and the two norms are vectors of length hidden.
    """
    for name, value in (("hidden", hidden), ("kv_hidden", kv_hidden), ("intermediate", intermediate)):
        if value <= 0:
            from .errors import InvalidArgumentError

            raise InvalidArgumentError(f"{name} must be positive, got {value}")
    h, kv, i = hidden, kv_hidden, intermediate
    return (h * h, kv * h, kv * h, h * h, i * h, i * h, h * i, h, h)
