"""Which device types a new gradserver group serves: those the backend string gave it.

torch builds a group from a backend string, one backend per device type ("gradserver" is
"cpu:gradserver,cuda:gradserver", from the devices it was registered for). It calls a
registered creator once per device type, but a creator that returns a Python process group (as
gradserver's does) replaces the whole group and ends that loop (`_new_process_group_helper` in
torch/distributed/distributed_c10d.py): whatever the string gave another backend would be served
by gradserver without a word. So the creator reads the string's device map from torch's frame
that calls it: the devices given to gradserver are the group's device types, and a string that
gives another backend a device is refused, naming it. Where that frame cannot be read (a torch
that builds groups otherwise), the group serves every device type it was registered for.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

BACKEND_NAME = "gradserver"
DEVICE_TYPES = ("cpu", "cuda")
_HELPER = "_new_process_group_helper"


def device_backends(frame: types.FrameType | None) -> dict[str, str] | None:
    """The device type -> backend map of the group torch is creating in `frame` (the creator's
    caller), or None when `frame` is not torch's group builder."""
    if frame is None or frame.f_code.co_name != _HELPER:
        return None
    config = frame.f_locals.get("backend_config")
    get_map = getattr(config, "get_device_backend_map", None)
    if get_map is None:
        return None
    mapping = get_map()
    if not isinstance(mapping, Mapping):
        return None
    return {str(device): str(backend).lower() for device, backend in mapping.items()}


def served_devices(backends: Mapping[str, str] | None) -> tuple[str, ...]:
    """The device types a gradserver group serves for `backends` (None: all it was registered
    for); raises ValueError when `backends` gives a device type to another backend."""
    if backends is None:
        return DEVICE_TYPES
    others = {device: backend for device, backend in backends.items() if backend != BACKEND_NAME}
    if others:
        asked = ",".join(f"{device}:{backend}" for device, backend in backends.items())
        given = ", ".join(f"{backend} for {device} tensors" for device, backend in others.items())
        raise ValueError(
            f'gradserver cannot share a process group with another backend: "{asked}" asks for '
            f"{given}. torch hands the whole group to gradserver's (a Python process group, which "
            f"has no per-device backends), so {', '.join(sorted(set(others.values())))} would "
            'never run. Use "gradserver" (it serves cpu and cuda tensors), or a group of its own '
            "(dist.new_group(backend=...)) for the other backend."
        )
    return tuple(backends) or DEVICE_TYPES
