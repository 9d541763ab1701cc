"""fleet.nodeview: the operator's few numbers out of a node's queue-state, 200 or 503."""

from __future__ import annotations

from fleet.nodeview import NodeView, summarize_queue_state

READY = {
    "schema": 1,
    "node": "n1",
    "generated_at": 1_000_000,
    "now": {"status": "ready", "due": 579, "due_sitemap": 500, "in_flight": 35},
    "lateness": {
        "classes": [
            {"route": "product", "oldest_lateness": 0.25, "due": 400},
            {"route": "article", "oldest_lateness": 1.5, "due": 179},
            {"route": "home", "oldest_lateness": None, "due": 0},
        ]
    },
    "trust": {"live": True, "phase": "live", "state_age_ms": 2500},
    "autoscale": {"due_now": 579, "oldest_claimable_age_s": 42.0},
}


def test_ready_node() -> None:
    assert summarize_queue_state(200, READY) == NodeView(
        status="ready",
        http_status=200,
        due=579,
        in_flight=35,
        oldest_due_s=42.0,
        worst_lateness=1.5,
        state_age_s=2.5,
    )


def test_unready_node_shows_no_counts() -> None:
    body = {
        "now": {"status": "unready", "in_flight": 3, "due": 99},
        "trust": {"live": False, "phase": "loading"},
    }
    view = summarize_queue_state(503, body)
    assert (view.status, view.in_flight) == ("unready", 3)
    # a 503's counts are not vouched for: unknown, never shown stale
    assert view.due is None and view.oldest_due_s is None and view.worst_lateness is None


def test_a_body_of_another_shape_is_unknown_not_an_error() -> None:
    view = summarize_queue_state(200, {"now": "???", "lateness": {"classes": "x"}})
    assert view.due is None and view.worst_lateness is None and view.status == "ready"
    assert summarize_queue_state(0, {}).status == "unknown"
