"""The slot table: keys found by hash through linear probing, kept exact under churn."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keeper import slots as slots_module
from keeper.slots import ABSENT, SlotTable
from shm import key_hash, key_hashes


def key(i: int) -> bytes:
    return f"https://shop.example.com/p/{i}".encode()


def check(table: SlotTable, model: dict[bytes, int]) -> None:
    assert len(table) == len(model)
    for k, slot in model.items():
        assert table.find(key_hash(k)) == slot
        assert table.key(slot) == k
    assert sorted(table.live_slots().tolist()) == sorted(model.values())
    hashes = key_hashes(list(model))
    assert table.find_many(hashes).tolist() == [model[k] for k in model]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 300), st.sampled_from(["add", "remove", "bulk"])), max_size=300
    )
)
def test_find_add_remove_agree_with_a_dict(ops: list[tuple[int, str]]) -> None:
    table = SlotTable(index_capacity=16)  # grows many times
    model: dict[bytes, int] = {}
    for i, op in ops:
        k = key(i)
        h = key_hash(k)
        if op == "add" and k not in model:
            assert table.find(h) == ABSENT
            model[k] = table.add(h, k)
        elif op == "remove" and k in model:
            table.remove(model.pop(k))
            assert table.find(h) == ABSENT
        elif op == "bulk":
            fresh = [key(j) for j in range(i, i + 7) if key(j) not in model]
            got = table.add_many(key_hashes(fresh), fresh)
            model.update(zip(fresh, got.tolist(), strict=True))
    check(table, model)


def test_freed_slots_are_reused_and_the_arena_is_compacted(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(slots_module, "MIN_GARBAGE_TO_COMPACT", 1000)
    table = SlotTable()
    model = {key(i): table.add(key_hash(key(i)), key(i)) for i in range(2000)}
    for i in range(0, 2000, 2):
        table.remove(model.pop(key(i)))
    stats = table.statistics()
    assert stats.compactions >= 1
    assert stats.arena_bytes < sum(len(k) for k in model) * 1.4
    check(table, model)
    again = table.add(key_hash(key(5000)), key(5000))
    assert again < 2000, "a freed slot is reused"
    model[key(5000)] = again
    check(table, model)


def test_keys_come_back_in_the_order_asked() -> None:
    table = SlotTable()
    slots = table.add_many(key_hashes([key(i) for i in range(50)]), [key(i) for i in range(50)])
    picked = np.array(slots[::-7])
    assert table.keys(picked) == [table.key(int(s)) for s in picked]
    assert table.keys(picked) == [key(i) for i in range(49, -1, -7)]


def test_fit_drops_the_arenas_spare_room_and_keeps_every_key() -> None:
    import sys

    table = SlotTable()
    model: dict[bytes, int] = {}
    for i in range(5_000):
        k = key(i)
        model[k] = table.add(key_hash(k), k)
    spare = sys.getsizeof(table.arena) - len(table.arena)
    table.fit()
    assert sys.getsizeof(table.arena) - len(table.arena) < spare
    assert sys.getsizeof(table.arena) - len(table.arena) <= sys.getsizeof(bytearray(b"x")) - 1
    check(table, model)
    k = key(10_000)
    model[k] = table.add(key_hash(k), k)  # it grows again from there
    check(table, model)


def wide(i: int) -> bytes:
    return key(1000 + i)  # all of one length


def test_an_arena_past_its_limit_compacts_first_then_refuses(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from keeper.slots import KeyArenaFull

    monkeypatch.setattr(slots_module, "MAX_ARENA_BYTES", 40 * len(wide(0)))
    monkeypatch.setattr(slots_module, "MIN_GARBAGE_TO_COMPACT", 1 << 30)  # only when full
    table = SlotTable()
    model = {wide(i): table.add(key_hash(wide(i)), wide(i)) for i in range(30)}
    for i in range(10):
        table.remove(model.pop(wide(i)))
    # 20 live keys and 10 keys of garbage: 20 more fit only once the garbage is gone.
    fresh = [wide(i) for i in range(100, 120)]
    model.update(zip(fresh, table.add_many(key_hashes(fresh), fresh).tolist(), strict=True))
    check(table, model)
    assert table.statistics().compactions == 1
    with pytest.raises(KeyArenaFull, match="spread the rows over more nodes"):
        table.add(key_hash(wide(999)), wide(999))
    with pytest.raises(KeyArenaFull):
        table.add_many(key_hashes([wide(998)]), [wide(998)])
    check(table, model)  # the refused keys changed nothing
