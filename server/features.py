"""The coordinator's features, assembled: each built from the configuration and subscribed to the
coordinator's lifecycle (server/lifecycle.py) by its own module's `subscribe`.

A new feature is one module with a `subscribe(lifecycle, shell)` and one line in `FEATURES`.
The order of `FEATURES` is the order in which the features hear each event (see
server/lifecycle.py for when each event comes); today's order is that of the outboxes they
once were: the partitions, the relay, then the shared-memory transport (which subscribes as it
opens, once the coordinator serves).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from . import host_groups, peers, recovery, relay, shm_transport
from .lifecycle import Lifecycle, Shell

Subscribe = Callable[[Lifecycle, Shell], Any]

FEATURES: Mapping[str, Subscribe] = {
    "partition": peers.subscribe,  # --partition-map: one partition of several coordinators
    "relay": relay.subscribe,  # point-to-point messages between workers
    "host_groups": host_groups.subscribe,  # workers sharing another host sum there
    "recovery": recovery.subscribe,  # a joiner of a running job gets the job's state
    "shm": shm_transport.subscribe,  # same-host shared memory and the collective lane
}


def assemble(lifecycle: Lifecycle, shell: Shell) -> dict[str, Any]:
    """Every feature, subscribed in `FEATURES` order; by name, what each `subscribe` returned
    (None: not offered by this configuration), for tests and inspection."""
    return {name: subscribe(lifecycle, shell) for name, subscribe in FEATURES.items()}
