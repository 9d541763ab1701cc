"""The queue-state record: round trips, and the readers' rules for live and vouching."""

from __future__ import annotations

import msgspec
import pytest

from keeper.state import (
    SCHEMA,
    AutoscaleGroup,
    ComingGroup,
    FlowGroup,
    LatenessGroup,
    NowGroup,
    QueueState,
    TrustGroup,
    as_read,
    decode_queue_state,
    encode_queue_state,
    liveness,
    state_age_ms,
    vouches,
)

T = 1_800_000_000_000


def state(**trust: object) -> QueueState:
    fields: dict[str, object] = {
        "live": True,
        "live_reason": "publishing",
        "phase": "live",
        "exact": True,
        "heartbeat_at": T,
        "counts_at": T,
    }
    fields.update(trust)
    return QueueState(
        schema=SCHEMA,
        node="n1",
        generated_at=T,
        now=NowGroup(status="ready", due=7),
        coming=ComingGroup(),
        lateness=LatenessGroup(),
        flow=FlowGroup(),
        trust=TrustGroup(**fields),  # type: ignore[arg-type]
        autoscale=AutoscaleGroup(due_now=7, oldest_claimable_age_s=12.5),
    )


def test_round_trip_and_the_autoscale_paths_are_stable() -> None:
    s = state()
    assert decode_queue_state(encode_queue_state(s)) == s
    plain = msgspec.to_builtins(s)
    assert plain["autoscale"] == {"due_now": 7, "oldest_claimable_age_s": 12.5}


def test_another_schema_or_shape_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_queue_state(encode_queue_state(msgspec.structs.replace(state(), schema=SCHEMA + 1)))
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        decode_queue_state(msgspec.msgpack.encode({"schema": SCHEMA}))


def test_a_stalled_keeper_reads_not_live_with_a_reason_once_its_heartbeat_ages() -> None:
    s = state()
    assert liveness(s, T + 2_000).live
    seen = liveness(s, T + 2_001)
    assert not seen.live and seen.status == "stalled" and "no publish for 2.0 s" in seen.reason
    read = as_read(
        msgspec.structs.replace(
            s,
            trust=msgspec.structs.replace(
                s.trust, publish=msgspec.structs.replace(s.trust.publish, last_at=T)
            ),
        ),
        T + 2_500,
    )
    assert not read.trust.live and read.now.status == "stalled"
    assert read.trust.publish_age_ms == 2_500
    assert not vouches(s, T + 2_500)


def test_vouches_needs_live_exact_ready_and_fresh_counts() -> None:
    assert vouches(state(), T + 500)
    assert not vouches(state(exact=False), T + 500)
    assert not vouches(state(live=False, live_reason="publish failed"), T + 500)
    not_ready = msgspec.structs.replace(state(), now=NowGroup(status="unready"))
    assert not vouches(not_ready, T + 500)
    old_counts = state(counts_at=T - 20_000)
    assert not vouches(old_counts, T + 500) and state_age_ms(old_counts, T) == 20_000
    assert liveness(state(live=False, live_reason="publish failed"), T).reason == "publish failed"
