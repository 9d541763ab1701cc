"""A node's side of the cluster in the API: the member list, results routed to the node
that granted the lease, and the cluster's queue-state.

- `GET /v1/cluster` lists the live nodes from the shared database's member list (a
  single node lists itself), so the fleet finds every node from any one of them.
- Leases live in the granting node's shared memory: a completion or renewal only that
  node can check. A clustered node's tokens name it (`node-a:4294967297`), so a node
  handed an item another node granted forwards the item there (one hop: a forwarded
  request is never forwarded again) and answers every item in one response. The
  granting node applies it exactly as if it had been sent there; a forward that fails
  changes nothing here and says which node did not answer (`node_unavailable`).
- A completion whose granting node has left (a clean stop, a rolling restart) lands here
  while its lease lives: the node handed the lease over in the database with its token,
  and this node writes the completion in the transaction that settles the hand-over, so
  it lands once (api.completions.complete_handed_over). Any other item whose granting
  node is no longer live is `node_unavailable` while that node's leases may live (it
  died; restarted by then, it takes its leases back, so the completion lands there), and
  `lease_not_held` after (its leases ended with it), each with a `detail` naming the
  node. Renewals are never taken this way: a lease outlives its node only to its end.
- `GET /prerender_admin/cluster/queue-state` asks every live node for its queue-state at
  once; what is made of the answers is api.cluster_queue_state's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import httpx
import msgspec
from starlette.responses import Response

from api.body import json_response
from api.claims import LEASE_NOT_HELD, split_token
from api.cluster_queue_state import NodeAnswer, summary
from api.completions import check
from api.lane import StoreLane
from api.node import ApiSettings
from api.problems import PROBLEM_TYPE
from api.schedule import check_items
from api.version import VERSION
from keeper.cluster import leases_end
from shm.segment import now_ms
from store.errors import StoreError
from store.rows import MemberList, NodeRecord
from wire.schemas import (
    ClusterMember,
    ClusterNodes,
    CompletionItem,
    CompletionsRequest,
    ItemResult,
    ItemResults,
    RenewRequest,
    RenewResult,
    RenewResults,
)

# Set on a request one node forwards to another: the receiver never forwards it again,
# so two nodes whose member lists disagree for a moment cannot pass an item back and forth.
FORWARDED_BY = "x-renderqueue-forwarded-by"
NODE_UNAVAILABLE = "node_unavailable"
QUEUE_STATE_PATH = "/prerender_admin/queue-state"
MEMBERS_MAX_AGE_S = 1.0  # the member list is re-read at most this often per worker

_encoder = msgspec.json.Encoder()
Item = TypeVar("Item")
Result = TypeVar("Result")
# What answers, without the node, items a node that left granted: each item's answer,
# or None where it cannot (run on the worker's store lane).
Settle = Callable[[str, list[Item]], list[Result | None]]


class ClusterLink:
    """One worker's view of the cluster: the member list (cached briefly) and the client it
    reaches the other nodes with."""

    def __init__(
        self,
        settings: ApiSettings,
        lane: StoreLane,
        members: Callable[[float], MemberList],
        started_at_ms: Callable[[], int],
        settle_completions: Settle[CompletionItem, ItemResult] | None = None,
    ) -> None:
        self.settings = settings
        self.lane = lane
        # Completions of a node that left, through its hand-over (api.completions).
        self._settle_completions = settle_completions
        self._read_members = members  # the store's member list, as of a TTL (on the lane)
        self._started_at_ms = started_at_ms  # this node's start, for the list of one
        self._records: list[NodeRecord] = []
        self._members = MemberList(records=[], db_now_ms=0)
        self._read_at = 0.0
        self._http: httpx.AsyncClient | None = None
        self.forwarded = 0  # items this worker sent to the node that granted them
        self.forward_failures = 0

    # -- the member list -----------------------------------------------------------------

    async def live(self, max_age_s: float = MEMBERS_MAX_AGE_S) -> list[NodeRecord]:
        """The live nodes, by name; a single node is the only one. The list is read on the
        worker's store lane (api.lane)."""
        settings = self.settings
        if not settings.clustered:
            return [self._myself()]
        if time.monotonic() - self._read_at > max_age_s:
            read = self._read_members
            self._members = await self.lane.call(lambda: read(settings.node_ttl_s))
            self._records = [r for r in self._members.records if r.live]
            self._read_at = time.monotonic()
        return self._records

    def leases_may_live(self, name: str) -> int | None:
        """How much longer (ms) leases of `name`, no longer a live member as of the last
        read, may live: a node restarted by then takes them back (a snapshot, or its
        surviving lease table). None: none may."""
        found = [r for r in self._members.records if r.node == name and not r.live]
        if not found or not self._members.db_now_ms:
            return None
        settings = self.settings
        now = self._members.db_now_ms
        end = leases_end(
            found[0],
            now,
            ttl_ms=int(settings.node_ttl_s * 1000),
            grant_window_ms=int(settings.node_ttl_s * 500),
            max_lease_ms=settings.max_lease_s * 1000,
        )
        return end - now if end > now else None

    def _myself(self) -> NodeRecord:
        settings = self.settings
        return NodeRecord(
            node=settings.node,
            url=settings.advertised_url,
            instance=settings.instance,
            started_at_ms=self._started_at_ms(),
            heartbeat_age_ms=0,
            left=False,
            live=True,
            lease_horizon_ms=0,
            max_lease_ms=settings.max_lease_s * 1000,
        )

    async def url_of(self, name: str) -> str | None:
        """A live node's URL; the list is re-read once when the name is not in it (it may
        have just joined)."""
        for max_age in (MEMBERS_MAX_AGE_S, 0.0):
            for record in await self.live(max_age):
                if record.node == name:
                    return record.url.rstrip("/")
        return None

    async def members(self) -> ClusterNodes:
        settings = self.settings
        live = await self.live()
        return ClusterNodes(
            node=settings.node,
            version=VERSION,
            clustered=settings.clustered,
            ttl_s=settings.node_ttl_s,
            nodes=[
                ClusterMember(
                    node=r.node,
                    url=r.url,
                    started_at=r.started_at_ms,
                    heartbeat_age_ms=r.heartbeat_age_ms,
                    answering=r.node == settings.node,
                )
                for r in live
            ],
        )

    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(
                timeout=self.settings.peer_timeout_s,
                limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
            )
        return self._http

    # -- completions and renewals, at the node that granted them -------------------------

    def _granted_elsewhere(self, token: str) -> str | None:
        name, _ = split_token(token)
        return name if name is not None and name != self.settings.node else None

    async def _routed(
        self,
        items: Sequence[Item],
        token_of: Callable[[Item], str],
        key_of: Callable[[Item], str],
        run_here: Callable[[list[Item]], Any],
        path: str,
        encode: Callable[[list[Item]], bytes],
        decode: Callable[[bytes], list[Result]],
        refuse: Callable[[str, str, str], Result],
        authorization: str | None,
        forwarded_by: str | None,
        settle: Settle[Item, Result] | None = None,
    ) -> list[Result]:
        """Each item answered by the node that granted it, in the request's order; where
        that node has left, by `settle` (the items it can answer without the node)."""
        here: list[int] = []
        elsewhere: dict[str, list[int]] = {}
        for index, item in enumerate(items):
            owner = self._granted_elsewhere(token_of(item))
            if owner is None:
                here.append(index)
            else:
                elsewhere.setdefault(owner, []).append(index)
        answers: list[Result | None] = [None] * len(items)
        me = self.settings.node

        async def at(owner: str, indices: list[int]) -> None:
            group = [items[i] for i in indices]
            results = await self._forward(
                owner,
                group,
                key_of,
                path,
                encode,
                decode,
                refuse,
                authorization,
                forwarded_by,
                settle,
            )
            for i, result in zip(indices, results, strict=True):
                answers[i] = result

        async def local() -> None:
            if not here:
                return
            outcome = run_here([items[i] for i in here])
            results = await outcome if asyncio.iscoroutine(outcome) else outcome
            for i, result in zip(here, results, strict=True):
                answers[i] = result

        # Forwards first as tasks, then the local items: each group waits on its own.
        tasks = [asyncio.ensure_future(at(owner, idx)) for owner, idx in elsewhere.items()]
        try:
            await local()
        finally:
            if tasks:
                await asyncio.gather(*tasks)
        assert all(answer is not None for answer in answers), f"{me}: an item left unanswered"
        return [answer for answer in answers if answer is not None]

    async def _forward(
        self,
        owner: str,
        group: list[Item],
        key_of: Callable[[Item], str],
        path: str,
        encode: Callable[[list[Item]], bytes],
        decode: Callable[[bytes], list[Result]],
        refuse: Callable[[str, str, str], Result],
        authorization: str | None,
        forwarded_by: str | None,
        settle: Settle[Item, Result] | None,
    ) -> list[Result]:
        me = self.settings.node
        if forwarded_by is not None:
            detail = (
                f"granted by node {owner!r}; node {forwarded_by!r} forwarded it to this node "
                f"({me!r}), which does not forward again: send it to {owner!r} (GET /v1/cluster "
                "has its URL)"
            )
            return [refuse(key_of(item), LEASE_NOT_HELD, detail) for item in group]
        url = await self.url_of(owner) if self.settings.clustered else None
        if url is None:
            refused = self._gone(owner, group, key_of, refuse)
            if settle is None or not self.settings.clustered:
                return refused
            try:
                settled = await self.lane.call(lambda: settle(owner, group))
            except StoreError:  # answered as if nothing could be settled: nothing was
                return refused
            return [s if s is not None else r for s, r in zip(settled, refused, strict=True)]
        headers = {"content-type": "application/json", FORWARDED_BY: me}
        if authorization:
            headers["authorization"] = authorization
        self.forwarded += len(group)
        try:
            response = await self.http().post(url + path, content=encode(group), headers=headers)
        except httpx.HTTPError as exc:
            self.forward_failures += len(group)
            detail = (
                f"granted by node {owner!r} at {url}, which did not answer "
                f"({type(exc).__name__}): nothing changed; retry, or send it there"
            )
            return [refuse(key_of(item), NODE_UNAVAILABLE, detail) for item in group]
        if response.status_code != 200:
            self.forward_failures += len(group)
            problem = _detail(response)
            retry = response.status_code >= 500 or response.status_code == 429
            detail = (
                f"granted by node {owner!r} at {url}, which answered HTTP "
                f"{response.status_code}{': ' + problem if problem else ''}"
            )
            error = NODE_UNAVAILABLE if retry else LEASE_NOT_HELD
            return [refuse(key_of(item), error, detail) for item in group]
        try:
            results = decode(response.content)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.forward_failures += len(group)
            detail = f"granted by node {owner!r} at {url}, whose answer was unreadable ({exc})"
            return [refuse(key_of(item), NODE_UNAVAILABLE, detail) for item in group]
        if len(results) != len(group):
            detail = f"granted by node {owner!r}, which answered {len(results)} of {len(group)}"
            return [refuse(key_of(item), NODE_UNAVAILABLE, detail) for item in group]
        return results

    def _gone(
        self,
        owner: str,
        group: list[Item],
        key_of: Callable[[Item], str],
        refuse: Callable[[str, str, str], Result],
    ) -> list[Result]:
        """The refusals of items granted by `owner`, which is not a live member."""
        lasting = self.leases_may_live(owner)
        if lasting is not None:
            detail = (
                f"granted by node {owner!r}, which is not a live member of this cluster now, "
                f"but its leases may live {lasting / 1000:.1f} s more: started again by then, "
                "it takes them back; nothing changed, retry while your lease lasts"
            )
            return [refuse(key_of(item), NODE_UNAVAILABLE, detail) for item in group]
        detail = (
            f"granted by node {owner!r}, which is not a live member of this cluster: "
            "its leases ended with it; claim the key again"
            if self.settings.clustered
            else f"granted by node {owner!r}; this node ({self.settings.node!r}) is a single node"
        )
        return [refuse(key_of(item), LEASE_NOT_HELD, detail) for item in group]

    async def complete(
        self,
        request: CompletionsRequest,
        complete_here: Callable[[CompletionsRequest], Awaitable[ItemResults]],
        authorization: str | None,
        forwarded_by: str | None,
    ) -> ItemResults:
        """`complete_here` applies the items this node granted (and checks them)."""
        if not any(self._granted_elsewhere(item.token) for item in request.items):
            return await complete_here(request)
        check(request)  # 422 for the whole request before any item goes anywhere

        async def here(items: list[Any]) -> list[ItemResult]:
            answered = await complete_here(CompletionsRequest(items=items))
            return answered.results

        results = await self._routed(
            request.items,
            lambda item: item.token,
            lambda item: item.key,
            here,
            "/v1/completions",
            lambda items: _encoder.encode(CompletionsRequest(items=items)),
            lambda content: msgspec.json.decode(content, type=ItemResults).results,
            lambda key, error, detail: ItemResult(key=key, ok=False, error=error, detail=detail),
            authorization,
            forwarded_by,
            self._settle_completions,
        )
        return ItemResults(results=results)

    async def renew(
        self,
        request: RenewRequest,
        renew_here: Callable[[RenewRequest], RenewResults],
        authorization: str | None,
        forwarded_by: str | None,
    ) -> RenewResults:
        """`renew_here` renews the leases this node granted."""
        check_items(request.items)  # 422 for the whole request before any item goes anywhere
        if not any(self._granted_elsewhere(item.token) for item in request.items):
            return renew_here(request)
        results = await self._routed(
            request.items,
            lambda item: item.token,
            lambda item: item.key,
            lambda items: renew_here(RenewRequest(items=items)).results,
            "/v1/leases/renew",
            lambda items: _encoder.encode(RenewRequest(items=items)),
            lambda content: msgspec.json.decode(content, type=RenewResults).results,
            lambda key, error, detail: RenewResult(key=key, ok=False, error=error, detail=detail),
            authorization,
            forwarded_by,
        )
        return RenewResults(results=results)

    # -- the cluster's queue-state -------------------------------------------------------

    async def queue_state(
        self, authorization: str | None, mine: Callable[[], tuple[int, dict[str, Any]]]
    ) -> Response:
        """`mine`: this node's own queue-state (status, document), read without a hop."""
        settings = self.settings
        members = await self.live()
        names = sorted(r.node for r in members)

        async def ask(record: NodeRecord) -> NodeAnswer:
            if record.node == settings.node:
                status, own = mine()
                return NodeAnswer(record=record, http_status=status, document=own)
            headers = {"accept": "application/json"}
            if authorization:
                headers["authorization"] = authorization
            url = record.url.rstrip("/") + QUEUE_STATE_PATH
            try:
                response = await self.http().get(url, headers=headers)
            except httpx.HTTPError as exc:
                return NodeAnswer(record=record, error=f"{type(exc).__name__}: {exc}".rstrip(": "))
            document: Any
            try:
                document = msgspec.json.decode(response.content)
            except msgspec.DecodeError:
                document = None
            return NodeAnswer(
                record=record,
                http_status=response.status_code,
                document=document if isinstance(document, dict) else None,
            )

        answers = await asyncio.gather(*(ask(record) for record in members))
        status, body = summary(answers, names, settings.clustered, settings.node, now_ms())
        if status == 503:
            return Response(
                _encoder.encode(body),
                status_code=503,
                media_type=PROBLEM_TYPE,
                headers={"Retry-After": str(settings.retry_after_s)},
            )
        return json_response(body)


def _detail(response: httpx.Response) -> str:
    try:
        body = msgspec.json.decode(response.content)
    except msgspec.DecodeError:
        return response.text[:200]
    if isinstance(body, dict):
        return str(body.get("detail") or body.get("title") or "")[:300]
    return ""
