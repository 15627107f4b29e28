"""The partition actor's process shell: what it does when the background fsync fails."""

import concurrent.futures
import errno

import pytest
import structlog
import zmq

from actors import runtime
from actors.partition_log import shell


def test_a_failed_background_fsync_stops_the_loop():
    # After a failed fsync the kernel may have dropped the dirty pages, so a later
    # fsync cannot be trusted: the actor exits and its successor recovers from disk.
    failures: list = []
    done = concurrent.futures.Future()
    done.set_exception(OSError(errno.EIO, "Input/output error"))
    shell._log_sync_failure(structlog.get_logger(), failures)(done)
    assert len(failures) == 1

    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        with pytest.raises(OSError, match="Input/output error"):
            shell._loop(None, router, dealer, "tcp://127.0.0.1:1", "host:/data", runtime.StopFlag(),
                        structlog.get_logger(), None, failures)
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


def test_a_successful_background_fsync_records_nothing():
    failures: list = []
    done = concurrent.futures.Future()
    done.set_result(None)
    shell._log_sync_failure(structlog.get_logger(), failures)(done)
    assert failures == []
