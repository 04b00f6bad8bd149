"""The `train` extra (torch, tqdm, matplotlib): checked before a training command does anything.

A training job that found torch missing only once it had started a coordinator or workers would
fail halfway; `require_training_extra` fails first, with the ModuleNotFoundError that the
`gradserver` dispatcher turns into one line naming the extra to install. `find_spec` looks the
modules up without importing them.
"""

from __future__ import annotations

import importlib.util

TRAINING_MODULES = ("torch", "tqdm", "matplotlib")


def require_training_extra() -> None:
    """Raises ModuleNotFoundError naming the first module of the `train` extra that is missing."""
    for name in TRAINING_MODULES:
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
