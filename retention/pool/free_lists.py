"""Intrusive doubly linked free lists: one per priority per tier, plus an empty list.

TensorRT-LLM's ``LRUEvictionPolicy`` (``cpp/tensorrt_llm/batch_manager/evictionPolicy.cpp``,
``LRUEvictionPolicy::initialize`` / ``getFreeBlock`` / ``addToFreeBlockQueue``) keeps, per
cache level, one ``std::list`` FIFO per priority 0..100 and picks the victim as the front
of the lowest non-empty priority. We keep the same shape with the links stored *in* the
block (vLLM v1 ``FreeKVCacheBlockQueue``), so a move is O(1) and allocates nothing::

    tier 0:  empty ─ e1 ⇄ e2                (never-used / content-free slots, used first)
             p=0   ─ (empty)
             p=35  ─ b7 ⇄ b3 ⇄ b9          head = least recently released
             p=90  ─ b1
    victim = empty head, else head of the lowest non-empty priority (bitmask lookup)

Order inside a priority list is ascending ``release_seq`` (least recently released
first). Releases append at the tail in O(1). A block that *becomes* a leaf later (its
last same-tier child left) is inserted at its ``release_seq`` position; that walk is
O(1) in the common case (a parent is released right after its child, so it lands next
to the head the child just left) and O(list length) at worst.

Deviation from TensorRT-LLM, on purpose: TensorRT-LLM parks never-used blocks in the
priority-35 queue (``LRUEvictionPolicy::initialize``), so a cached block below 35 is
evicted before unused memory; and it releases content-free blocks at their own
priority. kvgate keeps content-free slots in a separate ``empty`` list consumed first.
"""

from __future__ import annotations

from retention.pool.blocks import Block
from retention.types import MAX_PRIORITY, MIN_PRIORITY


class FreeList:
    """A FIFO of blocks ordered by ``release_seq``; sentinel-free, head/tail pointers."""

    __slots__ = ("head", "tail", "size", "key")

    def __init__(self, key: int) -> None:
        self.head: Block | None = None
        self.tail: Block | None = None
        self.size = 0
        self.key = key  # priority, or -1 for the empty list

    def append(self, block: Block) -> None:
        """Insert at the tail (most recently released). O(1)."""
        block.free_list = self
        block.next = None
        block.prev = self.tail
        if self.tail is None:
            self.head = block
        else:
            self.tail.next = block
        self.tail = block
        self.size += 1

    def insert_ordered(self, block: Block) -> None:
        """Insert keeping ascending ``release_seq``; walks from the nearer end."""
        seq = block.release_seq
        head, tail = self.head, self.tail
        if tail is None or tail.release_seq <= seq:
            self.append(block)
            return
        assert head is not None
        if seq <= head.release_seq:
            after: Block | None = None
        elif seq - head.release_seq <= tail.release_seq - seq:
            after = head
            while after.next is not None and after.next.release_seq <= seq:
                after = after.next
        else:
            after = tail
            while after is not None and after.release_seq > seq:
                after = after.prev
        block.free_list = self
        if after is None:
            block.prev = None
            block.next = head
            head.prev = block
            self.head = block
        else:
            nxt = after.next
            block.prev = after
            block.next = nxt
            after.next = block
            if nxt is None:
                self.tail = block
            else:
                nxt.prev = block
        self.size += 1

    def remove(self, block: Block) -> None:
        """Unlink ``block`` (which must be in this list). O(1)."""
        prev, nxt = block.prev, block.next
        if prev is None:
            self.head = nxt
        else:
            prev.next = nxt
        if nxt is None:
            self.tail = prev
        else:
            nxt.prev = prev
        block.prev = block.next = None
        block.free_list = None
        self.size -= 1

    def __iter__(self):
        node = self.head
        while node is not None:
            yield node
            node = node.next

    def __len__(self) -> int:
        return self.size


class TierFreeLists:
    """The empty list plus one :class:`FreeList` per priority for one tier.

    ``_mask`` has bit ``p`` set iff priority ``p``'s list is non-empty, so the lowest
    non-empty priority is one bit trick away instead of a 101-step scan.
    """

    __slots__ = ("empty", "by_priority", "_mask", "size")

    def __init__(self) -> None:
        self.empty = FreeList(-1)
        self.by_priority = [FreeList(p) for p in range(MIN_PRIORITY, MAX_PRIORITY + 1)]
        self._mask = 0
        self.size = 0  # total blocks in all lists of this tier

    def add_empty(self, block: Block) -> None:
        self.empty.append(block)
        self.size += 1

    def add_cached(self, block: Block, *, ordered: bool) -> None:
        lst = self.by_priority[block.priority]
        if ordered:
            lst.insert_ordered(block)
        else:
            lst.append(block)
        self._mask |= 1 << block.priority
        self.size += 1

    def remove(self, block: Block) -> None:
        lst = block.free_list
        assert isinstance(lst, FreeList)
        lst.remove(block)
        if lst.size == 0 and lst.key >= 0:
            self._mask &= ~(1 << lst.key)
        self.size -= 1

    def lowest_cached_priority(self) -> int | None:
        mask = self._mask
        if not mask:
            return None
        return (mask & -mask).bit_length() - 1

    def peek_victim(self) -> Block | None:
        """Empty head, else head of the lowest non-empty priority; ``None`` if nothing is free."""
        if self.empty.head is not None:
            return self.empty.head
        priority = self.lowest_cached_priority()
        if priority is None:
            return None
        return self.by_priority[priority].head

    def pop_victim(self) -> Block | None:
        """Remove and return what :meth:`peek_victim` would return."""
        lst = self.empty
        if lst.head is None:
            mask = self._mask
            if not mask:
                return None
            lst = self.by_priority[(mask & -mask).bit_length() - 1]
        block = lst.head
        assert block is not None
        lst.remove(block)
        if lst.size == 0 and lst.key >= 0:
            self._mask &= ~(1 << lst.key)
        self.size -= 1
        return block

    def victim_order(self) -> list[Block]:
        """Every free block in the order victims would be taken if nothing changed (tests)."""
        out = list(self.empty)
        for lst in self.by_priority:
            out.extend(lst)
        return out
