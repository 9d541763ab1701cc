"""Bearer tokens and what each opens.

- the admin token opens everything;
- the fleet token opens the fleet endpoints (claims, completions, renewals);
- the read-only token (`metrics_token`) opens the reads an operator's tools make:
  `/metrics`, queue-state (the node's and the cluster's), overview, explain, the routes,
  a row and the sites listing; nothing that writes;
- `GET /v1/cluster` (the live nodes and their URLs) opens to each of the three: the fleet
  finds the cluster with it, a console or an autoscaler watches it.

A scope with no token configured is open, and the settings then keep the node on loopback:
with no token at all everything is open to local callers; with only the fleet token the
fleet endpoints need it and the admin ones stay open to local callers. `/metrics` may also
be served to loopback peers without a token (`metrics_open_on_loopback`), for a scraper on
the same host. Comparisons are constant-time; errors follow RFC 6750: 401 for a missing or
unknown token, 403 for a valid token without the scope.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Literal

from api.problems import ApiError

# "read": the read-only token's reads; "metrics": the same, plus loopback peers when the
# node is set to serve /metrics to them without a token.
# "discover": any of the three tokens (the member list, which the fleet and a console both
# read).
Scope = Literal["public", "fleet", "read", "metrics", "admin", "discover"]
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="renderqueue"'}
_INSUFFICIENT = {"WWW-Authenticate": 'Bearer realm="renderqueue", error="insufficient_scope"'}
_FLEET_OPENS = (
    "the fleet token only opens /v1/claims, /v1/completions, /v1/leases/renew and GET /v1/cluster"
)
_READ_OPENS = (
    "the read-only token opens only reads (/metrics, queue-state, cluster queue-state, "
    "overview, explain, GET /v1/routes, GET /v1/schedule, GET /v1/sites, GET "
    "/v1/sites/{site}, GET /v1/cluster)"
)


def is_loopback_peer(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Authenticator:
    def __init__(
        self,
        *,
        fleet_token: str | None,
        admin_token: str | None,
        read_token: str | None = None,
        metrics_open_on_loopback: bool = False,
    ) -> None:
        self._fleet = fleet_token.encode() if fleet_token else None
        self._admin = admin_token.encode() if admin_token else None
        self._read = read_token.encode() if read_token else None
        self._metrics_open_on_loopback = metrics_open_on_loopback

    @property
    def enabled(self) -> bool:
        return self._admin is not None or self._fleet is not None

    def check(self, scope: Scope, authorization: str | None, peer: str | None = None) -> None:
        if scope == "public":
            return
        # A scope whose tokens are all unset is open: the settings keep such a node on
        # loopback (the admin endpoints without an admin token, everything with none).
        if scope in ("admin", "read", "metrics", "discover") and self._admin is None:
            return
        if scope == "fleet" and self._admin is None and self._fleet is None:
            return
        if scope == "metrics" and self._metrics_open_on_loopback and is_loopback_peer(peer):
            return
        if not authorization:
            raise ApiError(
                401,
                "Authentication required",
                "send `Authorization: Bearer <token>`",
                headers=_CHALLENGE,
            )
        kind, _, presented = authorization.partition(" ")
        if kind.lower() != "bearer" or not presented.strip():
            raise ApiError(
                401,
                "Authentication required",
                "the Authorization header must be `Bearer <token>`",
                headers=_CHALLENGE,
            )
        token = presented.strip().encode()
        if self._admin is not None and hmac.compare_digest(token, self._admin):
            return
        if self._fleet is not None and hmac.compare_digest(token, self._fleet):
            if scope in ("fleet", "discover"):
                return
            needs = (
                "the admin or read-only token"
                if scope in ("read", "metrics")
                else "the admin token"
            )
            raise ApiError(
                403,
                "Forbidden",
                f"this endpoint needs {needs}; {_FLEET_OPENS}",
                headers=_INSUFFICIENT,
            )
        if self._read is not None and hmac.compare_digest(token, self._read):
            if scope in ("read", "metrics", "discover"):
                return
            needs = "the fleet or admin token" if scope == "fleet" else "the admin token"
            raise ApiError(
                403,
                "Forbidden",
                f"this endpoint changes the node and needs {needs}; {_READ_OPENS}",
                headers=_INSUFFICIENT,
            )
        raise ApiError(
            401,
            "Invalid token",
            "the bearer token is not one this node knows",
            headers={"WWW-Authenticate": 'Bearer realm="renderqueue", error="invalid_token"'},
        )
