"""The nodes a fleet works against: found from one or more seed URLs through
`GET /v1/cluster`, and followed as nodes join and leave.

Every node serves the member list, so any seed that answers is enough. In a cluster the
fleet talks to each node at the URL the node advertises (the URL it registered, which the
other nodes use too); a single node (`clustered` false, or a node too old to serve
`/v1/cluster`) is used at the seed's URL as given, since it may sit behind a proxy whose
address the node does not know.

A node that leaves keeps its client until the fleet closes (its leases' completions are
sent to a live node instead, which forwards them or says the node is gone); a node that
comes back under its name gets its client again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import httpx
import msgspec

from fleet.client import AsyncFleetClient, ClientStatistics
from fleet.messages import ClusterNodes

CLUSTER_PATH = "/v1/cluster"
DEFAULT_REFRESH_S = 3.0


class Member(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    url: str


class ClusterDirectory:
    def __init__(
        self,
        seeds: Sequence[str],
        make_client: Callable[[str], AsyncFleetClient],
        *,
        token: str | None = None,
        refresh_s: float = DEFAULT_REFRESH_S,
        timeout_s: float = 5.0,
        log: Callable[[str], None] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not seeds:
            raise ValueError("at least one node URL is needed")
        self.seeds = [seed.rstrip("/") for seed in seeds]
        self.refresh_s = refresh_s
        self._make_client = make_client
        self._log = log or (lambda message: None)
        headers = {"accept": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._http = httpx.AsyncClient(headers=headers, timeout=timeout_s, transport=transport)
        self.members: dict[str, Member] = {}  # the live nodes, by name
        self.clients: dict[str, AsyncFleetClient] = {}  # every node seen, by name
        self.clustered = False
        self.refreshes = 0
        self.refresh_failures = 0
        self.changes = 0
        self.last_error = ""

    @property
    def live(self) -> list[str]:
        return sorted(self.members)

    def client(self, node: str) -> AsyncFleetClient | None:
        """The live node's client; None when it is not live."""
        return self.clients.get(node) if node in self.members else None

    def any_client(self, avoid: str | None = None) -> AsyncFleetClient | None:
        names = [n for n in self.live if n != avoid] or self.live
        return self.clients[names[0]] if names else None

    async def _read(self) -> tuple[list[Member], bool]:
        """The member list from the first node that gives it: known nodes, then seeds."""
        errors: list[str] = []
        urls = [m.url for m in self.members.values()] + self.seeds
        for url in dict.fromkeys(urls):
            try:
                response = await self._http.get(url + CLUSTER_PATH)
            except httpx.HTTPError as exc:
                errors.append(f"{url}: {type(exc).__name__}")
                continue
            if response.status_code == 404 and url in self.seeds:
                # A node that predates the cluster: one node, at the seed's address.
                return [Member(node=url, url=url)], False
            if response.status_code != 200:
                errors.append(f"{url}: HTTP {response.status_code}")
                continue
            try:
                found = msgspec.json.decode(response.content, type=ClusterNodes)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                errors.append(f"{url}: unreadable member list ({exc})")
                continue
            if not found.clustered:
                return [Member(node=found.node, url=url)], False
            members = [Member(node=m.node, url=m.url.rstrip("/")) for m in found.nodes]
            if members:
                return members, True
            errors.append(f"{url}: no live nodes listed")
        raise LookupError("; ".join(errors) or "no node answered")

    async def refresh(self) -> bool:
        """Read the member list again; True when the live nodes changed. A failed read keeps
        the last list (the nodes may be fine and only the reads failing)."""
        self.refreshes += 1
        try:
            members, clustered = await self._read()
        except LookupError as exc:
            self.refresh_failures += 1
            self.last_error = str(exc)
            if not self.members:
                self._log(f"no node gave the member list yet: {exc}")
            return False
        self.clustered = clustered
        found = {m.node: m for m in members}
        changed = found.keys() != self.members.keys() or any(
            self.members[name].url != m.url for name, m in found.items() if name in self.members
        )
        if not changed:
            return False
        joined = sorted(found.keys() - self.members.keys())
        left = sorted(self.members.keys() - found.keys())
        for name, member in found.items():
            known = self.clients.get(name)
            previous = self.members.get(name)
            if known is None or (previous is not None and previous.url != member.url):
                if known is not None:
                    await known.aclose()
                self.clients[name] = self._make_client(member.url)
        self.members = found
        self.changes += 1
        if clustered or joined or left:
            parts = [f"nodes {', '.join(f'{n} ({found[n].url})' for n in self.live)}"]
            if self.changes > 1 and joined:
                parts.append(f"joined {', '.join(joined)}")
            if left:
                parts.append(f"left {', '.join(left)}")
            self._log("; ".join(parts))
        return True

    def statistics(self) -> ClientStatistics:
        every = [client.statistics() for client in self.clients.values()]
        return ClientStatistics(
            requests=sum(s.requests for s in every),
            retries=sum(s.retries for s in every),
            unready_waits=sum(s.unready_waits for s in every),
            transport_errors=sum(s.transport_errors for s in every),
            server_errors=sum(s.server_errors for s in every),
            slept_s=round(sum(s.slept_s for s in every), 3),
        )

    async def aclose(self) -> None:
        for client in self.clients.values():
            await client.aclose()
        await self._http.aclose()
