"""The console in a real browser: Playwright for Python driving Debian's chromium against a
real node (`renderqueue serve`, two workers) with rows.

Without chromium or Playwright these tests skip and say why; under CI=true they fail
(`.ci/run` installs chromium where it is missing). A screenshot of each state is saved in
the directory the run prints (RENDERQUEUE_SCREENSHOTS, or pytest's temporary directory).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import IN_CI
from node_harness import (
    ADMIN_TOKEN,
    FLEET_TOKEN,
    NodeProcess,
    ThreadNode,
    node_db,
    now_ms,
    seed_rows,
    thread_node,
    wait_for,
)

CHROMIUM = os.environ.get("RENDERQUEUE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
READ_TOKEN = "test-read-token-" + "r" * 16
HOSTILE = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'
HOSTILE_KEY = "https://shop.example/p/<img src=x onerror=window.__pwned=3>"
DEAD = ("https://shop.example/dead/1", "https://shop.example/dead/2")


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"{reason}; CI runs the browser tests (.ci/run installs chromium)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("Playwright is not installed (pip install -e '.[test]')")
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        _unavailable(f"no chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    chosen = os.environ.get("RENDERQUEUE_SCREENSHOTS")
    directory = Path(chosen) if chosen else tmp_path_factory.mktemp("console-screenshots")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, browser: Any) -> Iterator[NodeProcess]:
    directory = tmp_path_factory.mktemp("console-node")
    db = directory / "node.sqlite"
    now = now_ms()
    seed_rows(db, 240, due_share=0.5, route="product", now=now)
    seed_rows(
        db,
        90,
        due_share=0.8,
        route="blog",
        cadence_s=None,
        prefix="https://shop.example/b/",
        now=now,
    )
    from store import open_store
    from store.rows import Completion, RowWrite

    store = open_store(str(db))
    try:
        store.write(upsert=[RowWrite(key=HOSTILE_KEY, route="product", next_render_at=now - 5000)])
        store.set_route("blog", default_cadence_s=7200)
        # Two rows whose origin answered 404 three times: retired, counted apart.
        store.write(upsert=[RowWrite(key=key, route="product", next_render_at=now) for key in DEAD])
        for _ in range(3):
            store.complete([Completion(key=key, outcome="not_found", now=now) for key in DEAD])
    finally:
        store.close()
    process = NodeProcess(
        directory,
        workers=2,
        tokens=True,
        env={"RENDERQUEUE_METRICS_TOKEN": READ_TOKEN},
        # Worker 0 gets one listener in nine: most connections survive its SIGSTOP.
        extra_args=("--listeners-per-worker", "8"),
    )
    process.start()
    try:
        with process.client() as client:
            wait_for(
                lambda: client.get("/prerender_admin/queue-state").status_code == 200,
                60,
                "an exact queue-state",
                0.2,
            )
        yield process
    finally:
        process.stop()


@contextlib.contextmanager
def console(
    browser: Any,
    node: NodeProcess | ThreadNode,
    token: str | None,
    on_dialog: Callable[[Any], None] = lambda dialog: dialog.accept(),
) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 1900})
    page = context.new_page()
    page.on("dialog", on_dialog)
    try:
        page.goto(f"{node.url}/console")
        if token is not None:
            page.fill("#token", token)
            page.dispatch_event("#token", "change")
        yield page
    finally:
        # A route handler a test installed may be inside its fetch as the context closes:
        # Playwright would raise that in whatever call comes next, the next test's.
        page.unroute_all(behavior="ignoreErrors")
        context.close()


def ticks(page: Any) -> int:
    return int(page.get_attribute("body", "data-ticks") or 0)


def wait_ticks(page: Any, more: int = 1, timeout_s: float = 30) -> None:
    start = ticks(page)
    wait_for(lambda: ticks(page) >= start + more, timeout_s, "the console to refresh", 0.1)


def shot(page: Any, shots: Path, name: str) -> None:
    path = shots / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 0


def admin_get(node: NodeProcess, path: str, **params: str) -> httpx.Response:
    """A fresh connection each time, and a short timeout: worker 0 may be stopped."""
    for _ in range(20):
        try:
            with httpx.Client(
                base_url=node.url,
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                timeout=2,
            ) as client:
                return client.get(path, params=params)
        except httpx.TimeoutException:
            continue
    raise AssertionError(f"{path}: no answer from any worker")


def test_screenshots_directory_is_reported(shots: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        print(f"\nconsole screenshots: {shots}")


NOW_FIELDS = ("due", "due_sitemap", "due_discovered", "unclaimed_estimate", "paused", "in_flight")
COMING_FIELDS = ("due_15m", "due_60m", "due_24h")


def test_numbers_equal_queue_state(browser: Any, node: NodeProcess, shots: Path) -> None:
    with console(browser, node, ADMIN_TOKEN) as page:
        wait_ticks(page, 2)
        # The page shows the queue-state of its last refresh; the keeper's first full
        # report can land between that refresh and this test's read, so the numbers are
        # compared until one read matches.
        fields = [f"now-{f}" for f in NOW_FIELDS] + [f"coming-{f}" for f in COMING_FIELDS]
        matched: list[dict[str, Any]] = []

        def page_shows_queue_state() -> bool:
            state = admin_get(node, "/prerender_admin/queue-state").json()
            expected = [str(state["now"][f]) for f in NOW_FIELDS]
            expected += [str(state["coming"][f]) for f in COMING_FIELDS]
            shown = [page.get_attribute(f"#{field}", "data-value") for field in fields]
            if shown != expected:
                return False
            matched.append(state)
            return True

        wait_for(page_shows_queue_state, 60, "the console's numbers to equal queue-state's", 0.2)
        state = matched[-1]
        now = state["now"]
        assert now["due"] == 120 + 72 + 1
        # Due by route, in the routes table as in the lateness table.
        by_route = {r: sum(bins) for r, bins in state["lateness"]["by_route"].items()}
        for route, due in by_route.items():
            cells = page.locator(f'#routes tr[data-route="{route}"] td')
            assert cells.nth(3).inner_text() == f"{due:,}"
        # Retired rows per route beside them, apart from the held ones.
        assert state["retired"] == {"total": 2, "by_route": {"product": 2}}
        for route in by_route:
            cells = page.locator(f'#routes tr[data-route="{route}"] td')
            assert cells.nth(4).inner_text() == str(state["retired"]["by_route"].get(route, 0))
        assert "rows retired\t2" in page.inner_text("#node-table")
        assert page.locator("#classes tr").count() == len(state["lateness"]["classes"]) + 1
        assert page.inner_text("#status") == "ready"
        assert "Single node" in page.inner_text("#cluster")
        workers = page.locator("#workers tr")
        assert workers.count() == 3  # a header and two workers
        assert "ready" in workers.nth(1).inner_text()
        # Each worker's own counts, from its report to the supervisor.
        headers = page.locator("#workers th").all_inner_texts()
        column = headers.index("refused 503 / 507")
        wait_for(
            lambda: (
                [workers.nth(i).locator("td").all_inner_texts()[column] for i in (1, 2)]
                == ["0 / 0", "0 / 0"]
            ),
            30,
            "both workers' reports",
        )
        # The SQLite store's WAL, as the supervisor read it.
        wal = admin_get(node, "/prerender_admin/overview").json()["supervisor"]["wal"]
        assert wal["file_bytes"] > 0 and 0 <= wal["checkpointed"] <= wal["frames"]
        assert re.search(
            r"WAL [\d,]+ pages, [\d,]+ not checkpointed", page.inner_text("#workers-note")
        )
        # In flight comes from the supervisor's census of the lease table.
        view = admin_get(node, "/prerender_admin/overview").json()["lease_view"]
        assert view["source"] == "supervisor"
        assert "supervisor" in page.inner_text("#leases")
        shot(page, shots, "01-ready")


def route_action(page: Any, route: str, action: str) -> str:
    """Clicks a route's button and waits for the console's own word on how the request ended,
    so a refusal or a node that did not answer fails here with what the page said."""
    # The message of an earlier action must not be read as this one's.
    page.evaluate('document.getElementById("routes-msg").textContent = ""')
    page.click(f'button[data-route="{route}"][data-action="{action}"]')
    message = wait_for(
        lambda: (
            (text := page.inner_text("#routes-msg"))
            and ("done" in text or "Failed" in text or "Refused" in text)
            and text
        ),
        60,
        f"the console to report {action} {route}",
    )
    assert "done" in message, message
    return str(message)


def route_cell(page: Any, route: str, column: int) -> str:
    """A cell of a route's row, or "" while the table is being redrawn."""
    cells = page.locator(f'#routes tr[data-route="{route}"] td').all_inner_texts()
    return str(cells[column]) if len(cells) > column else ""


def test_a_poll_keeps_the_route_buttons_it_shows(browser: Any, node: NodeProcess) -> None:
    """A button replaced between a click's press and release loses the click: the poll
    rewrites the due counts in place and redraws the buttons only when a route changes."""
    pause = 'button[data-route="blog"][data-action="pause"]'
    with console(browser, node, ADMIN_TOKEN) as page:
        wait_ticks(page)
        page.evaluate(f"document.querySelector('{pause}').dataset.mark = 'kept'")
        due_cell = '#routes tr[data-route="blog"] td:nth-child(4)'
        page.evaluate(f"document.querySelector('{due_cell}').textContent = 'stale'")
        wait_ticks(page, 3)
        assert page.get_attribute(pause, "data-mark") == "kept"

        def due_cell_rewritten() -> bool:
            # Against a fresh read each time: the keeper's first full report may land
            # between the page's last refresh and this read (see the test above).
            state = admin_get(node, "/prerender_admin/queue-state").json()
            due = sum(state["lateness"]["by_route"]["blog"])
            return bool(page.inner_text(due_cell) == f"{due:,}")

        wait_for(due_cell_rewritten, 60, "blog's due count rewritten from queue-state", 0.2)
        assert page.get_attribute(pause, "data-mark") == "kept"  # still the same button


def test_pause_and_resume_a_route(browser: Any, node: NodeProcess, shots: Path) -> None:
    with console(browser, node, ADMIN_TOKEN) as page:
        wait_ticks(page)
        assert "blog" in route_action(page, "blog", "pause")
        wait_for(
            lambda: route_cell(page, "blog", 2) == "paused", 30, "the page to show blog paused"
        )
        routes = admin_get(node, "/v1/routes").json()["routes"]
        assert {r["route"]: r["paused"] for r in routes}["blog"] is True
        shot(page, shots, "02-route-paused")
        route_action(page, "blog", "resume")
        wait_for(lambda: route_cell(page, "blog", 2) == "no", 30, "the page to show blog resumed")
        routes = admin_get(node, "/v1/routes").json()["routes"]
        assert {r["route"]: r["paused"] for r in routes}["blog"] is False
        # Clear the route's default: it follows the global default again.
        route_action(page, "blog", "clear-default")
        wait_for(
            lambda: "global" in route_cell(page, "blog", 1),
            30,
            "the page to show blog on the global default",
        )
        routes = admin_get(node, "/v1/routes").json()["routes"]
        assert {r["route"]: r["default_cadence_s"] for r in routes}.get("blog") is None


def test_an_unanswered_action_says_so(browser: Any, node: NodeProcess) -> None:
    with console(browser, node, ADMIN_TOKEN) as page:
        wait_ticks(page)
        # The browser drops the request as a lost connection would; the node never sees it.
        page.route("**/v1/routes/blog", lambda route: route.abort("connectionreset"))
        page.click('button[data-route="blog"][data-action="pause"]')
        message = wait_for(
            lambda: "Failed" in (text := page.inner_text("#routes-msg")) and text,
            30,
            "the console to report the lost request",
        )
        assert "no answer" in message and "may still land" in message, message
        routes = admin_get(node, "/v1/routes").json()["routes"]
        assert {r["route"]: r["paused"] for r in routes}["blog"] is False


def test_a_cluster_view_that_does_not_answer_leaves_the_node_shown(
    browser: Any, node: NodeProcess
) -> None:
    """The cluster view asks every peer and may be slow; its failure is its section's
    alone, never the node's "did not answer" banner over counts that did answer."""
    with console(browser, node, ADMIN_TOKEN) as page:
        page.route("**/prerender_admin/cluster/queue-state", lambda route: route.abort("timedout"))
        wait_ticks(page, 2)
        assert "did not answer" in page.inner_text("#cluster-note")
        assert not page.is_visible("#banner")

        def shows_the_node_counts() -> bool:
            # The page and this read see the queue at different moments: keys fall due
            # between them, so wait for a refresh that matches a fresh read.
            state = admin_get(node, "/prerender_admin/queue-state").json()
            shown: str | None = page.get_attribute("#now-due", "data-value")
            return shown == str(state["now"]["due"])

        wait_for(shows_the_node_counts, 30, "the page to show the node's due count", 0.2)
        assert "did not answer" in page.inner_text("#cluster-note")
        assert not page.is_visible("#banner")


def test_a_stopped_keeper_withholds_the_counts(
    browser: Any, node: NodeProcess, shots: Path
) -> None:
    worker0 = node.worker_pid(0)
    with console(browser, node, ADMIN_TOKEN) as page:
        wait_ticks(page)
        assert page.get_attribute("#now-due", "data-value") not in ("", None)
        os.kill(worker0, signal.SIGSTOP)
        try:
            # A tick that reaches the stopped worker 0 times out ("did not answer"), one that
            # reaches worker 1 reads the stale state: wait for the latter's banner.
            wait_for(
                lambda: (
                    page.inner_text("#now-due") == "withheld"
                    and page.is_visible("#banner")
                    and "cannot vouch" in page.inner_text("#banner")
                ),
                60,
                "the counts withheld and the banner",
                0.2,
            )
            banner = page.inner_text("#banner")
            assert "cannot vouch" in banner and "stalled" in banner
            assert page.inner_text("#status") in ("draining", "stalled")
            assert page.inner_text("#now-unclaimed_estimate") == "withheld"
            assert "withheld" in page.inner_text("#coming-chart")
            # The live fields are still served, from the lease table.
            assert page.get_attribute("#now-in_flight", "data-value") not in ("", None)
            shot(page, shots, "03-keeper-stopped")
        finally:
            os.kill(worker0, signal.SIGCONT)
        wait_for(
            lambda: (
                page.get_attribute("#now-due", "data-value") not in ("", None)
                and not page.is_visible("#banner")
            ),
            60,
            "the counts back after SIGCONT",
            0.2,
        )
        assert page.inner_text("#status") == "ready"
        shot(page, shots, "04-live-again")


def test_server_strings_render_as_text(browser: Any, node: NodeProcess, shots: Path) -> None:
    def hostile(route: Any) -> None:
        response = route.fetch()
        body = response.json()
        body["trust"]["live"] = False
        body["trust"]["live_reason"] = HOSTILE
        body["now"]["status_reason"] = HOSTILE
        route.fulfill(response=response, status=503, json=body)

    with console(browser, node, ADMIN_TOKEN) as page:
        page.route("**/prerender_admin/queue-state", hostile)
        wait_ticks(page, 2)
        banner = page.inner_text("#banner")
        assert HOSTILE in banner
        assert page.locator("#banner script, #banner img").count() == 0
        # A key holding markup, explained: shown as the text it is.
        page.fill("#explain-key", HOSTILE_KEY)
        page.click("#explain-form button")
        wait_for(lambda: HOSTILE_KEY in page.inner_text("#explain"), 15, "the explained key")
        assert page.locator("#explain img, #explain script").count() == 0
        assert page.evaluate("window.__pwned") is None
        shot(page, shots, "05-hostile-strings")


def test_explain_and_render_now_need_the_admin_token(
    browser: Any, node: NodeProcess, shots: Path
) -> None:
    key = "https://shop.example/p/0000200"  # not due: seeded an hour ahead
    with console(browser, node, READ_TOKEN) as page:
        wait_ticks(page)
        assert page.get_attribute("#now-due", "data-value") not in ("", None)
        page.fill("#explain-key", key)
        page.click("#explain-form button")
        wait_for(lambda: "not_due" in page.inner_text("#explain"), 15, "the explanation")
        page.click("#render-now")
        wait_for(lambda: "Refused" in page.inner_text("#explain-msg"), 15, "the refusal")
        message = page.inner_text("#explain-msg")
        assert "admin token" in message
        shot(page, shots, "06-read-only-refused")
        # With the admin token, render now makes it due.
        page.fill("#token", ADMIN_TOKEN)
        page.dispatch_event("#token", "change")
        page.click("#render-now")
        wait_for(lambda: "claimable" in page.inner_text("#explain"), 15, "the key due now")
        assert "due now" in page.inner_text("#explain-msg")
        row = admin_get(node, "/v1/schedule", key=key).json()
        assert row["next_render_at"] <= now_ms()
        shot(page, shots, "07-explain-render-now")


def test_the_token_stays_in_the_tab(browser: Any, node: NodeProcess) -> None:
    with console(browser, node, ADMIN_TOKEN) as page:
        wait_ticks(page)
        assert page.evaluate("sessionStorage.getItem('rq-token')") == ADMIN_TOKEN
        assert page.evaluate("localStorage.length") == 0
        assert "rq-token" not in page.evaluate("document.cookie")
    # A new tab (context) starts without it.
    with console(browser, node, None) as page:
        time.sleep(0.5)
        assert page.evaluate("sessionStorage.getItem('rq-token')") is None
        wait_for(lambda: "refused" in page.inner_text("#banner"), 15, "the refusal banner")


def test_the_cluster_section(browser: Any, shots: Path, pg_database: str, tmp_path: Path) -> None:
    """Two PostgreSQL nodes: the console shows the cluster's totals and each node's line
    from the cluster queue-state, and withholds the totals, naming the node, while one
    does not answer."""
    from test_api_cluster import ROWS, cluster_state, fresh_schema, two_nodes

    url = fresh_schema(pg_database)
    seed_rows(url, ROWS, due_share=0.5)
    # A TTL far longer than the wait: the frozen node stays in the member list, so the
    # console must name it rather than the cluster moving on without it.
    with two_nodes(tmp_path, url, ("--node-ttl-s", "120")) as nodes:
        a, b = nodes["a"], nodes["b"]
        state = wait_for(lambda: cluster_state(a), 90, "an exact cluster queue-state", 0.25)
        with console(browser, a, ADMIN_TOKEN) as page:
            wait_for(
                lambda: page.get_attribute("#cluster-due", "data-value") == str(ROWS // 2),
                30,
                "the cluster's due on the console",
                0.2,
            )
            assert state["now"]["due"] == ROWS // 2
            lines = page.locator("#cluster-nodes-table tr")
            assert lines.count() == 3  # a header and a line per node
            assert "(this node)" in page.inner_text('#cluster-nodes-table tr[data-node="a"]')
            assert b.url in page.inner_text('#cluster-nodes-table tr[data-node="b"]')
            assert "exact" in page.inner_text("#cluster-note")
            shot(page, shots, "08-cluster")
            assert b.process is not None
            frozen = [b.process.pid, b.worker_pid(0)]
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            try:
                wait_for(
                    lambda: "node 'b'" in page.inner_text("#cluster-note"),
                    30,
                    "the console to name the silent node",
                    0.2,
                )
                assert page.inner_text("#cluster-due") == "withheld"
                shot(page, shots, "09-cluster-node-missing")
            finally:
                for pid in frozen:
                    os.kill(pid, signal.SIGCONT)


def test_the_keeper_section_lists_the_fences(browser: Any, shots: Path, tmp_path: Path) -> None:
    """A cluster's keeper record with two fences, written into a node's keeper buffer: the
    keeper's statistics name each fence's node, reason, due keys and end, and the count."""
    import msgspec

    from keeper.state import (
        ClusterStatistics,
        Fence,
        FenceCount,
        FencedGroup,
        decode_keeper_statistics,
        encode_keeper_statistics,
    )

    seed_rows(node_db(tmp_path), 10)
    with thread_node(tmp_path) as node:

        def record() -> Any:
            snapshot = node.segments.keeper.read()
            return None if snapshot is None else decode_keeper_statistics(snapshot.payload)

        written = wait_for(record, 30, "the keeper's record", 0.05)
        node.stop_keeper()  # nothing overwrites the record written below
        now = now_ms()
        fences = [
            Fence(node="b", view=("a", "b"), until_ms=now + 120_000, reason="awaiting"),
            Fence(node="c", view=(), until_ms=now + 60_000, reason="handed over", keys=7),
        ]
        counted = [
            FenceCount(node="b", reason="awaiting", due=9, until_ms=now + 120_000),
            FenceCount(node="c", reason="handed over", due=3, until_ms=now + 60_000, keys=7),
        ]
        cluster = ClusterStatistics(
            node="a",
            view=["a", "b", "c"],
            generation=3,
            confirmed=True,
            confirmed_at=now,
            changes=3,
            reads=9,
            read_failures=0,
            fences=fences,
            fenced_until=now + 120_000,
            fenced=FencedGroup(due=12, until_ms=now + 120_000, reasons=counted),
            claimable=28,
            counted_at=now,
        )
        payload = encode_keeper_statistics(msgspec.structs.replace(written, cluster=cluster))
        node.segments.keeper.write(payload, now)
        with console(browser, node, None) as page:
            wait_for(lambda: "fence: b" in page.inner_text("#keeper"), 30, "the fences listed", 0.1)
            rows = {
                cells[0]: cells[1]
                for cells in (
                    tr.locator("td").all_inner_texts() for tr in page.locator("#keeper tr").all()
                )
            }
            assert rows["cluster view"].startswith("a, b, c; membership confirmed")
            assert rows["fenced"].startswith("12 of 40 due keys, until ")
            assert rows["fence: b"].startswith("awaiting (gained from it, until it acknowledges")
            assert ": 9 due keys, until " in rows["fence: b"]
            assert rows["fence: c"].startswith("handed over (under leases it handed over")
            assert ": 3 due keys of 7 handed over, until " in rows["fence: c"]
            shot(page, shots, "10-keeper-fences")


# --- the sites section: its own node, whose sites hold leases and one a block ----------

SITE_ROWS = [
    ("https://busy.example/p/", 30),
    ("https://calm.example/q/", 6),
    ("https://slow.example/x/", 4),
]


class SitesNode(NodeProcess):
    leases_by_site: Counter[str]
    blocked_until: int


@pytest.fixture(scope="module")
def sites_node(tmp_path_factory: pytest.TempPathFactory, browser: Any) -> Iterator[SitesNode]:
    """Every row due; every key leased for 15 min and left open, but one of slow.example's,
    whose origin answered Retry-After an hour: the site blocked, that key handed back."""
    directory = tmp_path_factory.mktemp("console-sites")
    now = now_ms()
    for prefix, rows in SITE_ROWS:
        seed_rows(node_db(directory), rows, prefix=prefix, now=now)
    process = SitesNode(directory, workers=1, tokens=True)
    process.start()
    try:
        with process.client(ADMIN_TOKEN) as admin, process.client(FLEET_TOKEN) as fleet:
            wait_for(
                lambda: admin.get("/v1/sites").status_code == 200, 60, "the sites listing", 0.2
            )
            claimed = fleet.post(
                "/v1/claims", json={"max": 100, "worker": "console", "lease_s": 900}
            )
            assert claimed.status_code == 200, claimed.text
            leases = claimed.json()["leases"]
            assert len(leases) == sum(rows for _, rows in SITE_ROWS)
            slow = next(lease for lease in leases if "slow.example" in lease["key"])
            item = {
                "key": slow["key"],
                "token": slow["token"],
                "outcome": "failed",
                "site_retry_after_s": 3600,
            }
            done = fleet.post("/v1/completions", json={"items": [item]})
            assert done.status_code == 200, done.text
            process.blocked_until = done.json()["results"][0]["site_blocked_until"]
            process.leases_by_site = Counter(
                lease["key"].split("/")[2] for lease in leases if lease is not slow
            )
        yield process
    finally:
        process.stop()


def site_cells(page: Any, table: str, site: str) -> list[str]:
    """A site's row in a table of the sites section ([] while it is being redrawn)."""
    return [str(c) for c in page.locator(f'#{table} tr[data-site="{site}"] td').all_inner_texts()]


def test_the_sites_section_shows_in_flight_blocks_and_the_hour(
    browser: Any, sites_node: SitesNode, shots: Path
) -> None:
    counted = sites_node.leases_by_site
    with console(browser, sites_node, ADMIN_TOKEN) as page:
        # The top sites: due, and in flight from the supervisor's count (none is capped).
        # A site's count is shown once the supervisor has named it from the keeper's
        # listing, which it reads again a few seconds on when a count is unnamed.
        wait_for(
            lambda: (
                site_cells(page, "sites", "busy.example")[1:4] == ["30", "30", "30"]
                and site_cells(page, "sites", "slow.example")[3:4] == [str(counted["slow.example"])]
            ),
            30,
            "busy.example's due, held and in flight, and slow.example's in flight",
            0.1,
        )
        listed = admin_get(sites_node, "/v1/sites").json()["sites"]
        assert [
            r.locator("td").first.inner_text() for r in page.locator("#sites tr[data-site]").all()
        ] == [s["site"] for s in listed]
        # The blocked site, until when and why, as GET /v1/sites/{site} says.
        state = admin_get(sites_node, "/v1/sites/slow.example").json()
        assert (state["blocked_until"], state["blocked_reason"]) == (
            sites_node.blocked_until,
            "retry_after",
        )
        blocked = site_cells(page, "sites-blocked", "slow.example")
        assert blocked[1] == page.evaluate(f"new Date({sites_node.blocked_until}).toLocaleString()")
        assert "Retry-After" in blocked[3]
        assert page.locator("#sites-blocked tr[data-site]").count() == 1
        # The chart: a line per site, loaded with the page from the node's own history and
        # drawn again at each tick. A census (every second) that ran while the claim was
        # granting counted part of it, and one between the claim and the hand-back counted
        # the handed-back key too: the peaks settle once the page draws a census after both.
        chart = '#site-chart g[data-site="busy.example"]'
        wait_for(
            lambda: (
                page.locator(chart).count() == 1 and page.get_attribute(chart, "data-peak") == "30"
            ),
            30,
            "busy.example's line at its peak",
            0.1,
        )
        assert page.locator(f"{chart} polyline, {chart} circle").count() >= 1
        in_flight = sum(counted.values())

        def history_peak() -> int:
            hour = admin_get(sites_node, "/v1/sites-in-flight").json()
            return max(v or 0 for v in hour["total"])

        wait_for(lambda: history_peak() >= in_flight, 30, "a census after the hand-back", 0.1)
        total = '#site-chart g[data-series="total"]'
        wait_for(
            lambda: page.get_attribute(total, "data-peak") == str(history_peak()),
            30,
            "the total's line at the hour's peak",
            0.1,
        )
        assert int(page.get_attribute(total, "data-peak")) in (in_flight, in_flight + 1)
        assert "busy.example (peak 30)" in page.inner_text("#site-chart-legend")
        # Sorted by lateness: the site whose oldest due row waited longest first.
        page.click('.sites-sort button[data-sort="lateness"]')
        oldest = max(listed, key=lambda s: s["oldest_age_s"])["site"]
        wait_for(
            lambda: page.locator("#sites tr[data-site]").first.get_attribute("data-site") == oldest,
            30,
            "the sites sorted by lateness",
            0.1,
        )
        shot(page, shots, "11-sites")


def test_set_a_sites_cap_from_the_page(browser: Any, sites_node: SitesNode, shots: Path) -> None:
    asked: list[str] = []
    answer = {"confirm": False}

    def on_dialog(dialog: Any) -> None:
        asked.append(dialog.message)
        if answer["confirm"]:
            dialog.accept()
        else:
            dialog.dismiss()

    def set_site(site: str, cap: str, interval: str) -> str:
        page.evaluate('document.getElementById("sites-msg").textContent = ""')
        page.fill("#site-name", site)
        page.fill("#site-cap", cap)
        page.fill("#site-interval", interval)
        page.click("#site-set")
        return str(
            wait_for(
                lambda: (
                    (text := page.inner_text("#sites-msg"))
                    and any(
                        w in text for w in ("done", "not sent", "not a whole", "Failed", "Refused")
                    )
                    and text
                ),
                60,
                f"the console to report setting {site}",
            )
        )

    with console(browser, sites_node, ADMIN_TOKEN, on_dialog) as page:
        wait_for(lambda: site_cells(page, "sites", "calm.example"), 30, "calm.example listed")
        # Not confirmed: nothing is sent.
        message = set_site("calm.example", "2", "250")
        assert "not sent" in message, message
        assert asked == ["Set calm.example: max in flight 2, min interval 250 ms, on every node?"]
        assert admin_get(sites_node, "/v1/sites/calm.example").json()["settings"] == {
            "max_in_flight": None,
            "min_interval_ms": None,
        }
        # Confirmed: set, on the page and in GET /v1/sites/{site}.
        answer["confirm"] = True
        message = set_site("calm.example", "2", "250")
        assert "done" in message and "at most 2 at once, 250 ms apart" in message, message
        assert len(asked) == 2
        wait_for(
            lambda: site_cells(page, "sites", "calm.example")[5:6] == ["2"],
            30,
            "calm.example's cap on the page",
            0.1,
        )
        state = admin_get(sites_node, "/v1/sites/calm.example").json()
        assert state["settings"] == {"max_in_flight": 2, "min_interval_ms": 250}
        assert state["in_force"] == {"max_in_flight": 2, "min_interval_ms": 250}
        shot(page, shots, "12-site-capped")
        # A bad value is refused by the page, before any question.
        message = set_site("calm.example", "two", "")
        assert "not a whole number: two" in message and len(asked) == 2
        # "none" gives it the node's default again.
        message = set_site("calm.example", "none", "none")
        assert "done" in message, message
        wait_for(
            lambda: site_cells(page, "sites", "calm.example")[5:6] == ["none"],
            30,
            "calm.example's cap cleared on the page",
            0.1,
        )
        assert admin_get(sites_node, "/v1/sites/calm.example").json()["settings"] == {
            "max_in_flight": None,
            "min_interval_ms": None,
        }


def test_a_poll_keeps_the_site_buttons_it_shows(browser: Any, sites_node: SitesNode) -> None:
    """As for the routes: the poll writes the counts in place and redraws the rows only
    when a site, its cap or its block changes, so an edit button is never replaced under
    a click."""
    edit = 'button[data-site="busy.example"][data-action="edit"]'
    with console(browser, sites_node, ADMIN_TOKEN) as page:
        wait_for(lambda: page.locator(edit).count() == 1, 30, "busy.example's edit button")
        page.evaluate(f"document.querySelector('{edit}').dataset.mark = 'kept'")
        due_cell = '#sites tr[data-site="busy.example"] td:nth-child(2)'
        page.evaluate(f"document.querySelector('{due_cell}').textContent = 'stale'")
        wait_ticks(page, 3)
        assert page.get_attribute(edit, "data-mark") == "kept"
        assert page.inner_text(due_cell) == "30"
        page.click(edit)
        assert page.input_value("#site-name") == "busy.example"
