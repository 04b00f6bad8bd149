"""What a call raises, for tests that compare several raised errors with each other."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradserver.common.errors import GradServerError


def raised(call: Callable[[], Any]) -> GradServerError:
    """The GradServerError `call` raises (the test fails if it returns)."""
    try:
        call()
    except GradServerError as exc:
        return exc
    raise AssertionError(f"{call} did not raise")
