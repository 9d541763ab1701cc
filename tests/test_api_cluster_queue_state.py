"""The cluster's queue-state made from the nodes' answers (api.cluster_queue_state): pure,
so tested on documents; asking real nodes is tests/test_api_cluster.py's."""

from __future__ import annotations

from typing import Any

from api.cluster_queue_state import NodeAnswer, judge, summary, sums
from store.rows import NodeRecord


def member(name: str) -> NodeRecord:
    return NodeRecord(
        node=name,
        url=f"http://{name}",
        instance=name,
        started_at_ms=0,
        heartbeat_age_ms=0,
        left=False,
        live=True,
        lease_horizon_ms=0,
        max_lease_ms=10_000,
    )


def vouching(name: str, due: int) -> dict[str, Any]:
    return {
        "node": name,
        "now": {"status": "ready", "due": due, "claimable": due},
        "trust": {"live": True, "exact": True, "state_age_ms": 10},
        "autoscale": {"due_now": due, "oldest_claimable_age_s": 1.0},
        "cluster": {"view": ["a", "b"]},
    }


def test_the_cluster_sums_count_fenced_keys_apart_and_autoscale_on_the_claimable() -> None:
    """Each node's due_now is its claimable (due less fenced): the sum is the cluster's, and
    the fenced keys are summed beside it with the last fence's end."""

    def document(name: str, due: int, fenced: int, until: int) -> dict[str, Any]:
        return {
            "node": name,
            "now": {"status": "ready", "due": due, "claimable": due - fenced, "held": 2 * due},
            "trust": {"live": True, "exact": True, "state_age_ms": 10},
            "autoscale": {"due_now": due - fenced, "oldest_claimable_age_s": 1.0},
            "fenced": {"due": fenced, "until_ms": until, "reasons": []},
            "cluster": {"view": ["a", "b"]},
        }

    documents = [document("a", 100, 40, 5_000), document("b", 50, 0, 0)]
    summed = sums(documents)
    assert summed["now"]["due"] == 150 and summed["now"]["claimable"] == 110
    assert summed["autoscale"]["due_now"] == 110 == summed["now"]["claimable"]
    assert summed["fenced"] == {"due": 40, "until_ms": 5_000}
    single = {k: v for k, v in document("a", 10, 0, 0).items() if k != "fenced"}
    assert sums([single])["fenced"] is None
    record = member("a")
    line = judge(
        NodeAnswer(record=record, http_status=200, document=documents[0]), ["a", "b"], True, "a"
    )
    assert line.problem is None and line.fenced == documents[0]["fenced"]
    assert line.now is not None and line.now["claimable"] == 60


def test_the_cluster_sums_retired_rows_per_route() -> None:
    """Each row is one node's: their retired rows per route add up to the cluster's."""
    documents: list[dict[str, Any]] = [
        {"retired": {"total": 3, "by_route": {"shop": 2, "blog": 1}}},
        {"retired": {"total": 1, "by_route": {"shop": 1}}},
        {},  # a node of an older build counts none
    ]
    assert sums(documents)["retired"] == {"total": 4, "by_route": {"blog": 1, "shop": 3}}


def test_every_node_vouching_answers_the_sums() -> None:
    answers = [
        NodeAnswer(record=member(name), http_status=200, document=vouching(name, due))
        for name, due in (("a", 3), ("b", 4))
    ]
    status, body = summary(answers, ["a", "b"], True, "a", 1_000)
    assert status == 200 and body["exact"] is True and body["now"]["due"] == 7
    assert [n["node"] for n in body["nodes"]] == ["a", "b"] and body["generated_at"] == 1_000
    assert all("document" not in n for n in body["nodes"])


def test_one_node_missing_withholds_the_sums_and_names_it() -> None:
    answers = [
        NodeAnswer(record=member("a"), http_status=200, document=vouching("a", 3)),
        NodeAnswer(record=member("b"), error="ConnectTimeout"),
    ]
    status, body = summary(answers, ["a", "b"], True, "a", 1_000)
    assert status == 503 and body["withheld"] == ["b"] and "now" not in body
    assert "node 'b' (http://b) is missing: ConnectTimeout" in body["detail"]


def test_no_live_node_withholds_the_sums() -> None:
    status, body = summary([], [], True, "a", 1_000)
    assert status == 503 and body["withheld"] == [] and "no live node" in body["detail"]
