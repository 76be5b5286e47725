"""FreeBlockQueue, the doubly linked list of free KV blocks in eviction order: the order after
every popleft, remove and append, and misuse caught by assertions."""

from __future__ import annotations

import pytest

from kvserve.kv.block_pool import FreeBlockQueue, KVBlock


def make_queue(n: int) -> tuple[list[KVBlock], FreeBlockQueue]:
    blocks = [KVBlock(i) for i in range(n)]
    return blocks, FreeBlockQueue(blocks)


def queue_ids(q: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in q]


def test_free_queue_starts_in_order():
    blocks, q = make_queue(5)
    assert q.num_free == 5
    assert queue_ids(q) == [0, 1, 2, 3, 4]
    assert all(q.contains(b) for b in blocks)


def test_free_queue_popleft_order():
    blocks, q = make_queue(4)
    assert q.popleft() is blocks[0]
    assert q.popleft() is blocks[1]
    assert q.num_free == 2
    assert queue_ids(q) == [2, 3]
    assert not q.contains(blocks[0]) and not q.contains(blocks[1])
    # a popped block is fully unlinked
    assert blocks[0].prev_free is None and blocks[0].next_free is None


def test_free_queue_popleft_empty_raises():
    _, q = make_queue(1)
    q.popleft()
    assert q.num_free == 0
    assert queue_ids(q) == []
    with pytest.raises(IndexError):
        q.popleft()


def test_free_queue_remove_middle_head_tail():
    blocks, q = make_queue(5)
    q.remove(blocks[2])  # middle
    assert queue_ids(q) == [0, 1, 3, 4]
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    q.remove(blocks[0])  # head
    assert queue_ids(q) == [1, 3, 4]
    q.remove(blocks[4])  # tail
    assert queue_ids(q) == [1, 3]
    assert q.num_free == 2
    assert not q.contains(blocks[2])
    assert q.popleft() is blocks[1]
    assert q.popleft() is blocks[3]
    assert q.num_free == 0


def test_free_queue_remove_non_free_block_asserts():
    blocks, q = make_queue(3)
    q.remove(blocks[1])
    with pytest.raises(AssertionError):
        q.remove(blocks[1])
    assert q.num_free == 2


def test_free_queue_append_goes_to_tail():
    blocks, q = make_queue(4)
    b0 = q.popleft()
    b1 = q.popleft()
    q.append(b1)
    q.append(b0)
    assert queue_ids(q) == [2, 3, 1, 0]
    assert q.num_free == 4
    q.remove(blocks[3])
    q.append(blocks[3])
    assert queue_ids(q) == [2, 1, 0, 3]
    assert [q.popleft().block_id for _ in range(4)] == [2, 1, 0, 3]


def test_free_queue_append_twice_asserts():
    blocks, q = make_queue(2)
    with pytest.raises(AssertionError):
        q.append(blocks[0])  # already linked
    assert q.num_free == 2


def test_free_queue_iteration_after_emptying_and_refilling():
    blocks, q = make_queue(3)
    for _ in range(3):
        q.popleft()
    assert list(q) == []
    for b in reversed(blocks):
        q.append(b)
    assert queue_ids(q) == [2, 1, 0]
    assert list(q) == [blocks[2], blocks[1], blocks[0]]
