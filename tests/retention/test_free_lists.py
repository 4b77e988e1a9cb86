from __future__ import annotations

import random

import pytest

from retention.pool.blocks import Block
from retention.pool.free_lists import FreeList, TierFreeLists
from retention.types import Tier


def test_block_is_slotted() -> None:
    block = Block(Tier.PRIMARY, 0)
    assert not hasattr(block, "__dict__")
    with pytest.raises(AttributeError):
        block.unexpected = 1  # type: ignore[attr-defined]


def test_append_remove_is_fifo() -> None:
    lst = FreeList(35)
    blocks = [Block(Tier.PRIMARY, i) for i in range(5)]
    for i, b in enumerate(blocks):
        b.release_seq = i
        lst.append(b)
    lst.remove(blocks[0])
    lst.remove(blocks[3])
    assert [b.slot for b in lst] == [1, 2, 4] and len(lst) == 3
    assert lst.head is blocks[1] and lst.tail is blocks[4]
    assert blocks[3].prev is None and blocks[3].next is None and blocks[3].free_list is None


def test_ordered_insert_keeps_release_order() -> None:
    rng = random.Random(7)
    lst = FreeList(35)
    seqs = rng.sample(range(1000), 200)
    for s in seqs:
        b = Block(Tier.PRIMARY, s)
        b.release_seq = s
        lst.insert_ordered(b)
    assert [b.release_seq for b in lst] == sorted(seqs)
    # Links are consistent in both directions.
    back = []
    node = lst.tail
    while node is not None:
        back.append(node.release_seq)
        node = node.prev
    assert back == sorted(seqs, reverse=True)


def test_victim_is_empty_first_then_lowest_priority_head() -> None:
    lists = TierFreeLists()
    empty = Block(Tier.PRIMARY, 0)
    lists.add_empty(empty)
    cached = []
    for slot, (priority, seq) in enumerate([(60, 1), (20, 2), (20, 3), (90, 4)], start=1):
        b = Block(Tier.PRIMARY, slot, block_hash=slot, priority=priority, release_seq=seq)
        lists.add_cached(b, ordered=False)
        cached.append(b)
    assert lists.peek_victim() is empty
    lists.remove(empty)
    assert lists.peek_victim() is cached[1]
    lists.remove(cached[1])
    assert lists.peek_victim() is cached[2]
    lists.remove(cached[2])
    assert lists.lowest_cached_priority() == 60
    assert [b.slot for b in lists.victim_order()] == [1, 4]
    lists.remove(cached[0])
    lists.remove(cached[3])
    assert lists.peek_victim() is None and lists.size == 0
