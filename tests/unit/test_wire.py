"""zbroker.client.wire: the multipart send/receive the hot loops use instead of pyzmq's, byte for byte."""

import itertools
import time

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from zbroker.client.wire import recv_frames, send_frames

_endpoints = itertools.count()


@pytest.fixture
def pair():
    ctx = zmq.Context()
    url = f"inproc://wire-{next(_endpoints)}"
    router = ctx.socket(zmq.ROUTER)
    router.bind(url)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"peer")
    dealer.connect(url)
    yield router, dealer
    router.close(linger=0)
    dealer.close(linger=0)
    ctx.term()


def _wait(sock):
    assert sock.poll(1000), "nothing arrived"


frame_lists = st.lists(st.binary(max_size=300), min_size=1, max_size=5)


@settings(max_examples=50, deadline=None)
@given(messages=st.lists(frame_lists, min_size=1, max_size=5))
def test_what_send_frames_sends_recv_multipart_reads_and_the_reverse(messages):
    ctx = zmq.Context()
    url = f"inproc://wire-{next(_endpoints)}"
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind(url)
    dealer.setsockopt(zmq.IDENTITY, b"peer")
    dealer.connect(url)
    try:
        for frames in messages:
            send_frames(dealer, frames)
        for frames in messages:
            _wait(router)
            assert router.recv_multipart() == [b"peer", *frames]
        for frames in messages:
            router.send_multipart([b"peer", *frames])
        for frames in messages:
            _wait(dealer)
            assert recv_frames(dealer) == frames
        assert recv_frames(dealer) is None
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


def test_recv_frames_on_an_empty_socket_is_none_not_an_exception(pair):
    router, dealer = pair
    assert recv_frames(router) is None
    assert recv_frames(dealer, copy=False) is None


def test_zero_copy_frames_keep_their_bytes(pair):
    router, dealer = pair
    send_frames(dealer, [b"header", memoryview(b"payload")], copy=False)
    _wait(router)
    frames = recv_frames(router, copy=False)
    assert [f.bytes for f in frames] == [b"peer", b"header", b"payload"]


def _stuck_dealer(ctx, send_timeout_ms):
    """A DEALER whose one-message queue is full: nobody accepts its connection."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.SNDHWM, 1)
    dealer.setsockopt(zmq.IMMEDIATE, 0)
    dealer.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
    dealer.connect("tcp://127.0.0.1:9")
    sent = 0
    with pytest.raises(zmq.Again):
        for _ in range(10):
            send_frames(dealer, [b"a", b"b"])
            sent += 1
    assert sent >= 1
    return dealer


def test_a_full_queue_raises_again_at_once_without_block():
    ctx = zmq.Context()
    dealer = _stuck_dealer(ctx, send_timeout_ms=2000)  # a blocking send would wait this long
    try:
        started = time.monotonic()
        with pytest.raises(zmq.Again):
            send_frames(dealer, [b"a", b"b"])
        assert time.monotonic() - started < 1.0  # not the 2 s a blocking send would wait
    finally:
        dealer.close(linger=0)
        ctx.term()


def test_block_waits_for_the_send_timeout_before_giving_up():
    ctx = zmq.Context()
    dealer = _stuck_dealer(ctx, send_timeout_ms=300)
    try:
        started = time.monotonic()
        with pytest.raises(zmq.Again):
            send_frames(dealer, [b"a", b"b"], block=True)
        assert time.monotonic() - started >= 0.25
    finally:
        dealer.close(linger=0)
        ctx.term()


def test_a_frame_of_the_wrong_type_sends_nothing_and_the_next_message_arrives_whole(pair):
    router, dealer = pair
    with pytest.raises(TypeError):
        send_frames(dealer, [b"header", "not bytes"])
    send_frames(dealer, [b"next", b"payload"])
    _wait(router)
    assert recv_frames(router) == [b"peer", b"next", b"payload"]
