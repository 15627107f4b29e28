"""A partition actor's shell loop in a thread of the test, on inproc sockets of a shared context."""

from __future__ import annotations

import threading

import structlog
import zmq

from zbroker.actors import runtime
from zbroker.actors.partition_log import shell


def start_actor_loop(ctx: zmq.Context, core, dealer_to: str, link: str = "") -> tuple[threading.Thread,
                                                                                     runtime.StopFlag, list]:
    """Runs `shell._loop` for `core` with its DEALER dialled to `dealer_to` (and `link`, the
    coordinator endpoints it may move between). Returns the thread, its stop flag, and the
    list that receives what the loop raised. Set ``stop.stopping`` and join to end it."""
    stop, failed = runtime.StopFlag(), []

    def actor() -> None:
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        try:
            router.bind("inproc://actor")
            dealer.connect(dealer_to)
            shell._loop(core, router, dealer, "inproc://actor", "host:/data", stop, structlog.get_logger(), None, [],
                        link)
        except BaseException as exc:  # reported by the test thread
            failed.append(exc)
        finally:
            router.close(linger=0)
            dealer.close(linger=0)

    thread = threading.Thread(target=actor, daemon=True)
    thread.start()
    return thread, stop, failed
