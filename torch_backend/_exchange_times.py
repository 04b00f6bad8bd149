"""How much of DiLoCo's exchanges the training thread waited for, and how much ran beside its
inner steps: the figures that say whether streaming's overlap hides the network.

Each exchange, as the training thread sees it, has three parts:

- sending: the call that hands the payload over (an async collective returns at once; an
  exchange that does not overlap, as over `ft` without a delay, is all sending);
- in flight: from that call's return to the wait for its result, while the training thread does
  other work (the next inner steps: `delay` of them);
- waiting: the wait itself, about nothing when the result was in already.

An exchange counts as *waited for* when its wait took `WAITED_S` or more. For those, the result
came in at the wait's end, so in flight / (in flight + waiting) is the share of the exchange's
time after its send that the inner steps hid (`hidden_share`); one not waited for was hidden
whole (when its result came in is not known, only that it was before the wait).
"""

from __future__ import annotations

import dataclasses

__all__ = ["WAITED_S", "ExchangeTimes"]

# A wait shorter than this found its result in (what it measures is the bookkeeping of taking it).
WAITED_S = 1e-3


@dataclasses.dataclass
class ExchangeTimes:
    """The exchanges of one replica so far: counts, and seconds summed over them."""

    exchanges: int = 0  # exchanges whose result the training thread has taken (or found discarded)
    waited: int = 0  # of them, those it waited `WAITED_S` or more for
    sending_s: float = 0.0  # in the calls that send
    in_flight_s: float = 0.0  # between a send's return and the wait for its result
    waiting_s: float = 0.0  # in the waits
    waited_in_flight_s: float = 0.0  # in_flight_s of the exchanges waited for
    waited_waiting_s: float = 0.0  # waiting_s of the exchanges waited for

    @property
    def exposed_s(self) -> float:
        """The seconds the exchanges held the training thread: sending plus waiting."""
        return self.sending_s + self.waiting_s

    @property
    def hidden_share(self) -> float | None:
        """Of the exchanges waited for, the share of their time from the send's return to the
        result that the training thread spent on other work; None when none was waited for."""
        total = self.waited_in_flight_s + self.waited_waiting_s
        return self.waited_in_flight_s / total if total > 0 else None

    def add(self, sending_s: float, in_flight_s: float, waiting_s: float) -> None:
        """Counts one exchange whose result was taken (or found discarded)."""
        self.exchanges += 1
        self.sending_s += sending_s
        self.in_flight_s += in_flight_s
        self.waiting_s += waiting_s
        if waiting_s >= WAITED_S:
            self.waited += 1
            self.waited_in_flight_s += in_flight_s
            self.waited_waiting_s += waiting_s

    def as_dict(self) -> dict[str, float | int | None]:
        """The counts and sums, and the two figures made of them (for a JSON report)."""
        return {**dataclasses.asdict(self), "exposed_s": self.exposed_s, "hidden_share": self.hidden_share}
