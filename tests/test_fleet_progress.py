"""fleet.progress: one line redrawn in place on a TTY, plain lines otherwise."""

from __future__ import annotations

import io

from fleet.client import ClientStatistics
from fleet.nodeview import NodeView
from fleet.progress import ProgressPrinter, progress_line
from fleet.runner import FleetStatistics

CLIENT = ClientStatistics(
    requests=0, retries=0, unready_waits=0, transport_errors=0, server_errors=0, slept_s=0
)


def stats(**changes: object) -> FleetStatistics:
    base: dict[str, object] = {
        "claimed": 0,
        "rendered": 1200,
        "failed": 7,
        "gone": 0,
        "aborted": 0,
        "refused": 0,
        "completions_lost": 0,
        "leases_lost": 0,
        "renewed": 0,
        "in_flight": 16,
        "rendered_per_min": 480.4,
        "failed_per_min": 2.0,
        "uptime_s": 150.0,
        "stopping": False,
        "fatal": None,
        "client": CLIENT,
    }
    base.update(changes)
    return FleetStatistics(**base)  # type: ignore[arg-type]


def test_line_has_rate_failures_in_flight_and_the_nodes_lateness() -> None:
    node = NodeView(status="ready", http_status=200, due=5321, oldest_due_s=754, worst_lateness=0.5)
    line = progress_line(stats(), node)
    assert line == (
        "rendered 1200 (480/min) | failed 7 | in flight 16 | "
        "node ready: due 5321, oldest late 13m / 0.50 cadences"
    )


def test_line_when_the_node_is_unready_or_unknown() -> None:
    assert progress_line(stats(), NodeView(status="unready", http_status=503)).endswith(
        "node unready: due ?, oldest late ?"
    )
    assert "node" not in progress_line(stats(), NodeView())
    line = progress_line(stats(refused=2, leases_lost=1, stopping=True), None)
    assert "refused 2 lost 1" in line and line.endswith("stopping")


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_tty_redraws_in_place_and_logs_above() -> None:
    out = FakeTty()
    printer = ProgressPrinter(out)
    assert printer.every_s == 1.0
    printer.show("rendered 1")
    printer.show("rendered 2")
    printer.log("stopping")
    printer.finish("stopped")
    text = out.getvalue()
    assert text == ("\r\x1b[2Krendered 1\r\x1b[2Krendered 2\r\x1b[2Kstopping\nstopped\n")


def test_plain_lines_when_not_a_tty() -> None:
    out = io.StringIO()
    printer = ProgressPrinter(out)
    assert printer.every_s == 10.0
    printer.show("rendered 1")
    printer.log("stopping")
    printer.finish("stopped")
    assert out.getvalue() == "rendered 1\nstopping\nstopped\n"
    assert "\x1b" not in out.getvalue()
