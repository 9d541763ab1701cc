"""Live progress for a terminal: one line redrawn in place on a TTY, plain lines otherwise.

Log lines (failures, stops) go above the progress line, so the line stays last.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import TextIO

from fleet.nodeview import NodeView
from fleet.runner import FleetStatistics


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def progress_line(stats: FleetStatistics, node: NodeView | None) -> str:
    parts = [
        f"rendered {stats.rendered} ({stats.rendered_per_min:.0f}/min)",
        f"failed {stats.failed}",
        f"in flight {stats.in_flight}",
    ]
    if stats.refused or stats.leases_lost:
        parts.append(f"refused {stats.refused} lost {stats.leases_lost}")
    if len(stats.nodes) > 1:
        # Where the claims came from: a node that gives none stands out.
        parts.append(
            "claimed "
            + " ".join(
                f"{name}:{counts.claimed}{'' if counts.live else '(gone)'}"
                for name, counts in stats.nodes.items()
            )
        )
    if node is not None and node.http_status:
        due = "?" if node.due is None else str(node.due)
        late = _duration(node.oldest_due_s)
        if node.worst_lateness is not None:
            late += f" / {node.worst_lateness:.2f} cadences"
        parts.append(f"node {node.status}: due {due}, oldest late {late}")
    elif node is not None and node.status != "unknown":
        parts.append(f"node {node.status}")
    if stats.stopping:
        parts.append("stopping")
    return " | ".join(parts)


class ProgressPrinter:
    def __init__(self, stream: TextIO | None = None, *, every_s: float | None = None) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.every_s = every_s if every_s is not None else (1.0 if self.tty else 10.0)
        self._drawn = 0

    def log(self, message: str) -> None:
        if self.tty and self._drawn:
            self.stream.write("\r\x1b[2K")
        self.stream.write(message + "\n")
        self.stream.flush()
        self._drawn = 0

    def show(self, line: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
            self._drawn = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self, line: str) -> None:
        if self.tty and self._drawn:
            self.stream.write("\r\x1b[2K")
        self.stream.write(line + "\n")
        self.stream.flush()
        self._drawn = 0

    async def run(self, current: Callable[[], str]) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            self.show(current())
