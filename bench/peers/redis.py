"""A Redis sorted set (score = due time) with Lua claim and complete scripts.

The claim script takes the earliest due members and re-scores them to the lease's
end in one atomic step, so two claimants never get the same key and the range
scan only meets unleased due members. Cadences live in a hash beside the set.
"""

from __future__ import annotations

import redis

from bench.harness.workload import REDIS_URL, Rows, unique_suffix
from bench.peers.base import Spec

CLAIM = """
local keys = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
for _, key in ipairs(keys) do
    redis.call('ZADD', KEYS[1], ARGV[3], key)
end
return keys
"""

COMPLETE = """
local now = tonumber(ARGV[1])
for i = 2, #ARGV do
    local cadence = tonumber(redis.call('HGET', KEYS[2], ARGV[i]))
    redis.call('ZADD', KEYS[1], now + cadence * 1000, ARGV[i])
end
return #ARGV - 1
"""


class RedisPeer:
    name = "Redis zset + Lua"

    def __init__(self, url: str = REDIS_URL) -> None:
        self.url = url
        prefix = f"rqbench:{unique_suffix()}"
        self.due_key = f"{prefix}:due"
        self.cadence_key = f"{prefix}:cadence"
        self.db = redis.Redis.from_url(url)

    def load(self, rows: Rows) -> None:
        for part in rows.chunks(10_000):
            pipe = self.db.pipeline(transaction=False)
            pipe.zadd(self.due_key, {rows.keys[i]: rows.next_render_at[i] for i in part})
            pipe.hset(self.cadence_key, mapping={rows.keys[i]: rows.cadences_s[i] for i in part})
            pipe.execute()

    def churn(self, rows: Rows, plan: list[tuple[int, int]]) -> None:
        for start in range(0, len(plan), 1000):
            self.db.zadd(self.due_key, {rows.keys[i]: due for i, due in plan[start : start + 1000]})

    def spec(self) -> Spec:
        return Spec(
            kind="redis",
            params={"url": self.url, "due_key": self.due_key, "cadence_key": self.cadence_key},
        )

    def drop(self) -> None:
        self.db.delete(self.due_key, self.cadence_key)
        self.db.close()


class RedisClaimant:
    def __init__(self, params: dict[str, str]) -> None:
        self.db = redis.Redis.from_url(params["url"])
        self.keys = [params["due_key"], params["cadence_key"]]
        self.claim_script = self.db.register_script(CLAIM)
        self.complete_script = self.db.register_script(COMPLETE)

    def claim(self, n: int, now_ms: int, lease_ms: int) -> list[str]:
        got = self.claim_script(keys=self.keys[:1], args=[now_ms, n, now_ms + lease_ms])
        return [key.decode() for key in got]

    def complete(self, keys: list[str], now_ms: int) -> None:
        self.complete_script(keys=self.keys, args=[now_ms, *keys])

    def close(self) -> None:
        self.db.close()
