"""Bearer tokens: the fleet token opens the fleet endpoints, the admin token opens all.

A scope with no token configured is open, and the settings then keep the node on loopback:
with no token at all everything is open to local callers; with only the fleet token the
fleet endpoints need it and the admin ones stay open to local callers. Comparisons are
constant-time; errors follow RFC 6750: 401 for a missing or unknown token, 403 for a valid
token without the scope.
"""

from __future__ import annotations

import hmac
from typing import Literal

from api.problems import ApiError

Scope = Literal["public", "fleet", "admin"]
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="renderqueue"'}


class Authenticator:
    def __init__(self, *, fleet_token: str | None, admin_token: str | None) -> None:
        self._fleet = fleet_token.encode() if fleet_token else None
        self._admin = admin_token.encode() if admin_token else None

    @property
    def enabled(self) -> bool:
        return self._admin is not None or self._fleet is not None

    def check(self, scope: Scope, authorization: str | None) -> None:
        if scope == "public":
            return
        # A scope whose tokens are all unset is open: the settings keep such a node on
        # loopback (the admin endpoints without an admin token, everything with none).
        if scope == "admin" and self._admin is None:
            return
        if scope == "fleet" and self._admin is None and self._fleet is None:
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
            if scope == "fleet":
                return
            raise ApiError(
                403,
                "Forbidden",
                "this endpoint needs the admin token; the fleet token only opens /v1/claims, "
                "/v1/completions and /v1/leases/renew",
                headers={
                    "WWW-Authenticate": 'Bearer realm="renderqueue", error="insufficient_scope"'
                },
            )
        raise ApiError(
            401,
            "Invalid token",
            "the bearer token is not one this node knows",
            headers={"WWW-Authenticate": 'Bearer realm="renderqueue", error="invalid_token"'},
        )
