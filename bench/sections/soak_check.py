"""The soak's verdicts, from the logs the fleet and the writers keep themselves.

Nothing here asks the node: every grant, renewal and completion the fleet saw, and every
write the writers sent, each with the client's send and answer times, are the evidence.
Pure functions over plain records, so the tests can hand them a log with a double hold,
a lost row or a resurrected one and watch them fail.

Times are epoch ms. The node stamps a lease's expiry as its own clock at the grant plus
the lease length, so `expires_at - lease_ms` is the moment the node judged the key free
(the same clock as the clients': one machine). A client call's send time is that of its
first HTTP attempt that may have reached the node: a refused connection sent nothing.

**Held by two at once.** Grant B of a key overlaps an earlier grant A when the node judged
the key free (B's grant time) before A's lease could have ended:

- A's expiry as of B: A's own, or a later one a renewal of A returned before B was asked
  for (a renewal answered after B's request was sent may not have landed yet);
- and A not answered yet: no completion of A was sent before B's answer came back (a
  completion applies at some moment between its send and its answer; B's grant happened
  before its answer, so a completion sent after that cannot have ended A first).

Only what is certain counts: a renewal whose answer was lost is not taken to have
extended A, and a completion whose answer was lost is taken to have ended A at its send.

**Rows lost or resurrected.** Every operation on a key is an interval in which it took
effect: an answered one between its send and its answer; one whose answer was lost
(a reset connection, a time-out) from its send to `LOST_WINDOW_MS` later and maybe never
(a stopped worker can apply a request it read before the stop once it runs again). The
row's final state must be the effect of an operation nothing definitely followed: one
whose interval ends after the latest start of any certain operation on the key. A row
expected and absent is lost; one present with the wrong due time or route is a lost
write (stale); one present where every candidate is a delete is resurrected; a row no
one ever wrote is resurrected too.
"""

from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Iterable, Sequence
from typing import Any, Literal, NamedTuple

import msgspec

# A request whose answer was lost may still be applied this long after it was sent: the
# client's time-out and a SIGSTOP of the worker that read it, with room to spare.
LOST_WINDOW_MS = 60_000
# A worker reads the routes at most this long ago (api/routebook.py's TTL), plus slack.
ROUTE_STALE_MS = 1_100


class Grant(NamedTuple):
    fleet: int
    key: str
    token: str
    route: str
    expires_at: int
    lease_ms: int
    sent: int
    answered: int

    @property
    def granted_at(self) -> int:
        return self.expires_at - self.lease_ms


class Renewal(NamedTuple):
    fleet: int
    key: str
    token: str
    sent: int
    answered: int  # 0: the answer was lost
    ok: bool
    expires_at: int  # 0 unless ok


class Completion(NamedTuple):
    fleet: int
    key: str
    token: str
    outcome: str  # rendered | failed | gone
    next_render_at: int  # 0: not given
    sent: int  # the first attempt that may have reached the node (0: none did)
    answered: int  # 0: lost
    result: str  # ok | lease_not_held | lost | unsent (no attempt reached the node) | ...
    attempts: int  # attempts that may have reached it (a retry may follow an applied one)


class Write(NamedTuple):
    key: str
    op: Literal["preload", "upsert", "delete", "import"]
    route: str  # "" for an import (the node's rules choose)
    next_render_at: int  # 0 for delete and import
    sent: int
    answered: int  # 0: lost


class Pause(NamedTuple):
    route: str
    paused: bool
    sent: int
    answered: int  # 0: lost


class TableRow(NamedTuple):
    key: str
    route: str
    next_render_at: int
    sitemap: bool = False


class Overlap(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    first: Grant
    second: Grant
    first_expiry: int
    why: str


def double_holds(
    grants: Iterable[Grant], renewals: Iterable[Renewal], completions: Iterable[Completion]
) -> list[Overlap]:
    """Grants made while an earlier lease on the key was certainly live (module note)."""
    renewed: dict[tuple[int, str, str], list[tuple[int, int]]] = collections.defaultdict(list)
    for r in renewals:
        if r.ok and r.answered:
            renewed[(r.fleet, r.key, r.token)].append((r.answered, r.expires_at))
    answered_at: dict[tuple[int, str, str], int] = {}
    for c in completions:
        if not c.attempts:
            continue  # never reached the node: it ended nothing
        ident = (c.fleet, c.key, c.token)
        answered_at[ident] = min(answered_at.get(ident, c.sent), c.sent)
    by_key: dict[str, list[Grant]] = collections.defaultdict(list)
    for g in grants:
        by_key[g.key].append(g)
    found: list[Overlap] = []
    for key, held in by_key.items():
        held.sort(key=lambda g: (g.granted_at, g.answered))
        # Earlier grants whose lease could still reach past a later grant (their own expiry
        # or any renewal's): a key is granted many times in a long run, and comparing
        # every pair would be quadratic in that.
        live: list[tuple[Grant, int]] = []
        for second in held:
            live = [(first, reach) for first, reach in live if reach > second.granted_at]
            for first, _ in live:
                expiry = first.expires_at
                for answered, expires_at in renewed.get((first.fleet, first.key, first.token), ()):
                    if answered < second.sent:
                        expiry = max(expiry, expires_at)
                if second.granted_at >= expiry:
                    continue
                done = answered_at.get((first.fleet, first.key, first.token))
                if done is not None and done <= second.answered:
                    continue
                found.append(
                    Overlap(
                        key=key,
                        first=first,
                        second=second,
                        first_expiry=expiry,
                        why=f"granted at {second.granted_at}, {expiry - second.granted_at} ms "
                        f"before the first lease's expiry, no completion of it sent by then",
                    )
                )
            renewals_of = renewed.get((second.fleet, second.key, second.token), ())
            reach = max([second.expires_at, *(expires_at for _, expires_at in renewals_of)])
            live.append((second, reach))
    return found


def regrants_unanswered(grants: Iterable[Grant], completions: Iterable[Completion]) -> int:
    """Grants of a key whose previous lease had no completion sent before this grant was
    answered: the cases (expired, stranded or stopped leases) where a double hold could
    happen at all, so a run can show it had them."""
    sent: dict[tuple[int, str, str], int] = {}
    for c in completions:
        if not c.attempts:
            continue
        ident = (c.fleet, c.key, c.token)
        sent[ident] = min(sent.get(ident, c.sent), c.sent)
    by_key: dict[str, list[Grant]] = collections.defaultdict(list)
    for g in grants:
        by_key[g.key].append(g)
    count = 0
    for held in by_key.values():
        held.sort(key=lambda g: (g.granted_at, g.answered))
        for first, second in itertools.pairwise(held):
            done = sent.get((first.fleet, first.key, first.token))
            if done is None or done > second.answered:
                count += 1
    return count


class PausedGrant(msgspec.Struct, frozen=True, kw_only=True):
    grant: Grant
    paused_at: int
    resumed_at: int | None


def paused_grants(grants: Iterable[Grant], pauses: Sequence[Pause]) -> list[PausedGrant]:
    """Grants of a key on a route while it was certainly paused: after the pause was
    answered (and every worker's route view had turned over), before its resume was sent."""
    windows: dict[str, list[tuple[int, int | None]]] = collections.defaultdict(list)
    open_at: dict[str, int] = {}
    for p in sorted(pauses, key=lambda p: p.sent):
        if p.paused:
            if p.answered and p.route not in open_at:
                open_at[p.route] = p.answered
        elif p.route in open_at:
            windows[p.route].append((open_at.pop(p.route), p.sent))
    for route, since in open_at.items():
        windows[route].append((since, None))
    found: list[PausedGrant] = []
    for g in grants:
        for since, until in windows.get(g.route, ()):
            start = since + ROUTE_STALE_MS
            if g.granted_at > start and (until is None or g.granted_at < until):
                found.append(PausedGrant(grant=g, paused_at=since, resumed_at=until))
    return found


class _Op(NamedTuple):
    start: int
    end: int
    certain: bool  # it did take effect (an answered, applied operation)
    present: bool
    next_render_at: int | None  # None: not checked (an import, a failed render)
    route: str | None
    what: str


def _ops(writes: Iterable[Write], completions: Iterable[Completion]) -> dict[str, list[_Op]]:
    ops: dict[str, list[_Op]] = collections.defaultdict(list)
    for w in writes:
        present = w.op != "delete"
        nra = w.next_render_at if w.op in ("preload", "upsert") else None
        route = w.route if w.op in ("preload", "upsert") else None
        end = w.answered or w.sent + LOST_WINDOW_MS
        ops[w.key].append(_Op(w.sent, end, bool(w.answered), present, nra, route, w.op))
    for c in completions:
        if c.result == "ok":
            certain = True
            end = c.answered
        elif c.result == "lost" or c.attempts > 1:
            # Lost, or refused on a retry that may have followed an applied attempt.
            certain = False
            end = c.answered or c.sent + LOST_WINDOW_MS
        else:
            continue  # refused at its only attempt: it changed nothing
        present = c.outcome != "gone"
        nra = c.next_render_at if c.outcome == "rendered" and c.next_render_at else None
        ops[c.key].append(_Op(c.sent, end, certain, present, nra, None, c.outcome))
    return ops


class RowFault(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    kind: Literal["lost", "stale", "resurrected"]
    found: str
    expected: str


def final_rows(
    writes: Iterable[Write], completions: Iterable[Completion], table: Iterable[TableRow]
) -> tuple[list[RowFault], int]:
    """Every key's final row against what the logs allow (module note); also the number of
    keys whose final state the logs leave open between two outcomes."""
    ops = _ops(writes, completions)
    rows = {row.key: row for row in table}
    faults: list[RowFault] = []
    open_keys = 0
    for key in sorted(set(ops) | set(rows)):
        row = rows.get(key)
        key_ops = ops.get(key, [])
        if not key_ops:
            faults.append(
                RowFault(key=key, kind="resurrected", found=_show(row), expected="no row")
            )
            continue
        latest = max((op.start for op in key_ops if op.certain), default=None)
        if latest is None:
            candidates = key_ops  # none certain: any of them, or none at all
            allow_absent = True
        else:
            candidates = [op for op in key_ops if op.end >= latest]
            allow_absent = False
        if len({(op.present, op.next_render_at) for op in candidates}) > 1:
            open_keys += 1
        if any(_matches(op, row) for op in candidates) or (allow_absent and row is None):
            continue
        expected = " or ".join(sorted({_expect(op) for op in candidates}))
        if row is None:
            kind: Literal["lost", "stale", "resurrected"] = "lost"
        elif all(not op.present for op in candidates):
            kind = "resurrected"
        else:
            kind = "stale"
        faults.append(RowFault(key=key, kind=kind, found=_show(row), expected=expected))
    return faults, open_keys


def _matches(op: _Op, row: TableRow | None) -> bool:
    if not op.present:
        return row is None
    if row is None:
        return False
    if op.next_render_at is not None and row.next_render_at != op.next_render_at:
        return False
    return op.route is None or row.route == op.route


def _show(row: TableRow | None) -> str:
    return "no row" if row is None else f"route {row.route}, due {row.next_render_at}"


def _expect(op: _Op) -> str:
    if not op.present:
        return f"no row ({op.what})"
    due = "any due" if op.next_render_at is None else f"due {op.next_render_at}"
    return f"{op.what}: {due}" + (f", route {op.route}" if op.route else "")


class ServerError(msgspec.Struct, frozen=True, kw_only=True):
    at: int
    who: str
    method: str
    path: str
    status: int
    retry_after: str
    detail: str = ""  # the start of the answer's body: what the node said went wrong


class HttpVerdict(msgspec.Struct, kw_only=True):
    requests: int = 0
    transport_errors: int = 0
    transport_by_kind: dict[str, int] = {}
    unready_accepted: int = 0  # 503 with Retry-After inside a fault's window
    failures: list[ServerError] = []  # every other 5xx


def judge_http(
    answers: Iterable[tuple[Any, ...]],
    windows: Sequence[tuple[int, int]],
) -> HttpVerdict:
    """Answers are (who, sent, answered, method, path, status, retry-after or the transport
    error's name[, the start of a 5xx's body]); status 0 is a transport error. A 503 with
    Retry-After is accepted inside one of `windows` (a fault that leaves the node
    legitimately unready, and its grace); any other 5xx fails."""
    starts = sorted(windows)
    verdict = HttpVerdict()
    kinds: collections.Counter[str] = collections.Counter()
    for who, sent, answered, method, path, status, extra, *body in answers:
        verdict.requests += 1
        if status == 0:
            verdict.transport_errors += 1
            kinds[extra] += 1
            continue
        if status < 500:
            continue
        if status == 503 and extra and _inside(starts, sent, answered):
            verdict.unready_accepted += 1
            continue
        verdict.failures.append(
            ServerError(
                at=answered,
                who=who,
                method=method,
                path=path,
                status=status,
                retry_after=extra,
                detail=body[0] if body else "",
            )
        )
    verdict.transport_by_kind = dict(kinds)
    return verdict


def _inside(windows: Sequence[tuple[int, int]], sent: int, answered: int) -> bool:
    i = bisect.bisect_right(windows, (answered, 2**62))
    return any(start <= answered and sent <= end for start, end in windows[:i])


class Growth(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    role: str
    first_at: int
    last_at: int
    samples: int
    rss_mid_mb: float
    rss_end_mb: float
    growth: float  # over the second half of its life: end / mid - 1
    judged: bool  # lived long enough to judge


def rss_growth(samples: Iterable[tuple[int, int, str, int]], min_life_ms: int) -> list[Growth]:
    """Per process (samples are (at, pid, role, rss bytes)): the first half of its life is
    its warm-up; growth is the median RSS of its last tenth against the median around its
    midpoint. Processes that lived less than `min_life_ms` are listed, not judged."""
    by_pid: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    roles: dict[int, str] = {}
    for at, pid, role, rss in samples:
        by_pid[pid].append((at, rss))
        if role and not role.startswith("?"):
            roles[pid] = role
        roles.setdefault(pid, role)
    out: list[Growth] = []
    for pid, series in by_pid.items():
        series.sort()
        first, last = series[0][0], series[-1][0]
        life = last - first
        mid = first + life / 2
        around = [rss for at, rss in series if abs(at - mid) <= max(life * 0.05, 1)]
        if not around:
            around = [min(series, key=lambda s: abs(s[0] - mid))[1]]
        tail = [rss for at, rss in series if at >= last - life * 0.1]
        if len(tail) < 2:
            tail = [rss for _, rss in series[-2:]]
        rss_mid = _median(around)
        rss_end = _median(tail)
        out.append(
            Growth(
                pid=pid,
                role=roles.get(pid, "?"),
                first_at=first,
                last_at=last,
                samples=len(series),
                rss_mid_mb=round(rss_mid / 2**20, 2),
                rss_end_mb=round(rss_end / 2**20, 2),
                growth=round(rss_end / rss_mid - 1, 4) if rss_mid else 0.0,
                judged=life >= min_life_ms and len(series) >= 6,
            )
        )
    out.sort(key=lambda g: (g.role, g.first_at))
    return out


class RoleGrowth(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    first_peak_mb: float  # the first half of the run, after its warm-up
    second_peak_mb: float
    across_halves: float  # second / first - 1
    peak_pid: int  # the process that reached the second half's peak
    peak_pid_growth: float | None  # its own growth over its life (rss_growth), if sampled enough
    growth: float  # the judged figure: across_halves, unless the peak's process did not climb
    pids: int  # processes that held the role (a kill or a restart makes a new one)


def rss_by_role(
    samples: Iterable[tuple[int, int, str, int]], start: int, end: int, warmup_ms: int
) -> list[RoleGrowth]:
    """Per role (supervisor, worker 0, ...), whichever process held it: the peak RSS over
    the second half of the run against the peak over the first half after `warmup_ms`.

    Two things look like growth and are not. A process respawned after a kill starts low
    and climbs back to its role's level: its own climb is warm-up, and the role's peaks
    stay level. And a respawned process can be born above the first half's peak (its heap
    laid out by a load under traffic) and stay flat: the role's peaks differ, but nothing
    grows. A leak does both: the later peak is higher, and the process that reached it was
    still climbing over its own life. So the judged growth is the smaller of the role's
    rise across the halves and that process's own growth (`rss_growth`'s measure), and the
    rise alone where that process has too few samples to say."""
    mid = (start + end) // 2
    first: dict[str, int] = {}
    second: dict[str, tuple[int, int]] = {}  # role -> (peak, pid)
    pids: dict[str, set[int]] = collections.defaultdict(set)
    series: dict[int, list[tuple[int, int, str, int]]] = collections.defaultdict(list)
    for at, pid, role, rss in samples:
        series[pid].append((at, pid, role, rss))
        if role.startswith("?") or not start + warmup_ms <= at <= end:
            continue
        pids[role].add(pid)
        if at < mid:
            first[role] = max(first.get(role, 0), rss)
        elif rss > second.get(role, (0, 0))[0]:
            second[role] = (rss, pid)
    out = []
    for role in sorted(set(first) & set(second)):
        peak, pid = second[role]
        across = round(peak / first[role] - 1, 4)
        (own,) = rss_growth(series[pid], 0)
        own_growth = own.growth if own.samples >= 6 else None
        out.append(
            RoleGrowth(
                role=role,
                first_peak_mb=round(first[role] / 2**20, 2),
                second_peak_mb=round(peak / 2**20, 2),
                across_halves=across,
                peak_pid=pid,
                peak_pid_growth=own_growth,
                growth=across if own_growth is None else min(across, own_growth),
                pids=len(pids[role]),
            )
        )
    return out


def _median(values: Sequence[int]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return float(ordered[n // 2]) if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


class CountDiff(msgspec.Struct, frozen=True, kw_only=True):
    field: str
    queue_state: int
    table: int


def queue_state_vs_table(
    now_group: dict[str, int], counts_at: int, table: Iterable[TableRow], paused_routes: set[str]
) -> list[CountDiff]:
    """queue-state's exact counts against the same counts taken from the table at the
    moment the keeper took them (`trust.counts_at`)."""
    held = due = due_sitemap = paused = 0
    for row in table:
        held += 1
        if row.next_render_at <= counts_at:
            if row.route in paused_routes:
                paused += 1
            else:
                due += 1
                due_sitemap += row.sitemap
    diffs = []
    for name, value in (
        ("held", held),
        ("due", due),
        ("due_sitemap", due_sitemap),
        ("paused", paused),
    ):
        if int(now_group.get(name, -1)) != value:
            diffs.append(
                CountDiff(field=name, queue_state=int(now_group.get(name, -1)), table=value)
            )
    return diffs
