"""The lease ceiling: how far ahead of now a clustered node lets its leases end.

A node that dies silent (SIGKILL, a lost machine) cannot hand its leases over, so the
others must wait until every lease it granted has surely ended. Without more to go on
that is its last heartbeat + the TTL + the grant window + `max_lease_s`. Instead the
node publishes a ceiling in its row: no lease it grants or renews ends after it, and
the workers cap each lease at the ceiling the keeper last saw committed. The others
then wait for the lesser of the worst case and the dead node's ceiling.

The ceiling is kept a lead ahead of now: the longest lease asked for in the last minute
(at most `max_lease_s`) plus a margin for the keeper's next read, and it is raised a
step past that so it is written every few seconds, not at every read. A lease longer
than the ceiling allows is granted shorter, never refused, and says its term (the fleet
renews it in time): so it goes for the first claims of a node, until the keeper has
seen what they ask. Pure: the keeper's runner reads the asks and the clock, and writes
what this says.
"""

from __future__ import annotations

from collections import deque

# A lease ends at least this long before the published ceiling: the clock offset the
# others convert the ceiling with is measured over a round trip, so it may be off by
# about the time a member read takes.
CEILING_SLACK_MS = 1_000
ASKS_WINDOW_MS = 60_000
MIN_STEP_MS, MAX_STEP_MS = 2_000, 60_000


class LeaseCeiling:
    def __init__(self, *, max_lease_ms: int, poll_ms: int) -> None:
        """`poll_ms`: how often the keeper reads the member list (and raises this)."""
        self.max_lease_ms = max_lease_ms
        self.margin_ms = 2 * poll_ms + CEILING_SLACK_MS
        self.published_ms = 0  # the ceiling the node's row carries (this node's clock)
        self._asks: deque[tuple[int, int]] = deque()  # (when, longest asked), by when
        self._last_asked = 0

    def asked(self, lease_ms: int, now: int) -> None:
        """The longest lease asked for since the last call (0: none was)."""
        if lease_ms > 0:
            self._asks.append((now, min(lease_ms, self.max_lease_ms)))
        while self._asks and self._asks[0][0] <= now - ASKS_WINDOW_MS:
            self._asks.popleft()
        if self._asks:
            self._last_asked = max(asked for _, asked in self._asks)

    def lead_ms(self) -> int:
        """How far past now a lease asked for now may need to end (with the margin)."""
        return self._last_asked + self.margin_ms

    def due(self, now: int) -> bool:
        """Whether the ceiling must be raised before the keeper's next read."""
        return self.published_ms - now < self.lead_ms()

    def target(self, now: int, leases_end_ms: int) -> int:
        """The ceiling to publish: a step past the lead, and never below the end of a
        lease the node already holds (adopted from its previous run, or granted under a
        longer lead)."""
        step = min(max(self._last_asked // 4, MIN_STEP_MS), MAX_STEP_MS)
        return max(now + self.lead_ms() + step, leases_end_ms, self.published_ms)

    def published(self, ceiling_ms: int) -> None:
        self.published_ms = max(self.published_ms, ceiling_ms)


def capped_term_ms(asked_ms: int, ceiling_ms: int, now: int) -> int:
    """The term a lease asked for now may have under `ceiling_ms` (<= 0: none)."""
    return min(asked_ms, ceiling_ms - CEILING_SLACK_MS - now)
