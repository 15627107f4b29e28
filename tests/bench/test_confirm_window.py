"""bench.peers.rabbitmq.ConfirmWindow: publisher-confirm bookkeeping (no RabbitMQ needed)."""

from __future__ import annotations

from bench.peers.rabbitmq import ConfirmWindow


def published(n: int) -> ConfirmWindow:
    window = ConfirmWindow()
    for _ in range(n):
        window.published()
    return window


def test_multiple_ack_settles_everything_up_to_the_tag():
    window = published(10)
    assert window.confirm(4, multiple=True) == 4
    assert window.outstanding == 6
    assert window.confirm(10, multiple=True) == 6
    assert window.outstanding == 0


def test_single_acks_out_of_order_then_a_multiple_one_counts_each_tag_once():
    window = published(6)
    assert window.confirm(3, multiple=False) == 1
    assert window.confirm(5, multiple=False) == 1
    assert window.confirm(3, multiple=False) == 0   # a repeat settles nothing
    assert window.confirm(6, multiple=True) == 4    # 1, 2, 4, 6
    assert window.outstanding == 0


def test_tags_continue_after_settling():
    window = published(3)
    window.confirm(3, multiple=True)
    window.published()
    assert window.next_tag == 5 and window.outstanding == 1
    assert window.confirm(4, multiple=True) == 1
