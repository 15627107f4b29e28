"""The producer's conversations with the broker, written once for both drivers.

Theory of operation
-------------------
`ProducerCore` decides: the window, which request carries which batches, what
a reply or a timeout means, when a failed batch goes again. `ProducerFlow`
orders those decisions into the two conversations both producers have with
the broker, as generators of `steps` (the sync `Producer` performs them by
blocking, the `AsyncProducer`'s sender task by awaiting):

- `send`: the batches admitted to the window go to their partitions' actors
  (an `Endpoint` step each, the coordinator asked where the cache does not
  know), as the core groups them (a `produce_many` per actor), a `Send` each.
  The driver's `Send` returns the request's correlation id; the reply is filed
  by the driver (`ProducerCore.settle`), not here: the sync producer takes
  replies in while it waits for room, the asyncio one as each future resolves.
- `resend_due`: the batches whose retry backoff is over. The leaders the
  errors named go into the metadata first (a failover is a pause for the
  sender, not an error), and every topic of them is asked about once
  (`Coordinator`), then they go out with whatever the driver adds to the same
  round (the asyncio sender's newly admitted batches), grouped together.

What is admitted and not sent is never dropped. A batch with no known owner,
or whose request could not be sent, is an attempt that failed (retried while
the core allows). A flow stopped at a step (CancelledError when a close gives
up, KeyboardInterrupt in the sync driver) counts every batch it had not sent
as failed with SHUTTING_DOWN, which is retriable: the next round sends it,
and a close that gives up fails it for good (`ProducerCore.give_up`).
"""

from __future__ import annotations

from typing import Callable

from zbroker.client.core import MetadataCache, PendingBatch
from zbroker.client.producer_core import ProduceError, ProducerCore
from zbroker.client.steps import Coordinator, Endpoint, Flow, Send
from zbroker.protocol import messages as m
from zbroker.protocol.errors import ErrorCode, ZBrokerError


def not_sent(what: str = "sent") -> ProduceError:
    """The error of a batch a stopped flow (or a closing producer) did not get to send."""
    return ProduceError(f"the producer stopped before the batch was {what}", code=ErrorCode.SHUTTING_DOWN)


class ProducerFlow:
    """One producer's sends and resends, as generators of steps (module docstring)."""

    def __init__(self, core: ProducerCore, metadata: MetadataCache, clock: Callable[[], float]) -> None:
        self.core = core
        self.metadata = metadata
        self.clock = clock

    def send(self, batches: list[PendingBatch]) -> Flow:
        """Send (or resend) ``batches``, admitted to the window, as `ProducerCore.requests` says."""
        core, routed = self.core, []
        for i, batch in enumerate(batches):
            try:
                routed.append(((yield Endpoint(batch.topic, batch.partition)), batch))
            except ZBrokerError as err:
                core.unroutable(batch, err, self.clock())
            except BaseException:
                for unsent in [b for _e, b in routed] + batches[i:]:
                    core.unroutable(unsent, not_sent(), self.clock())
                raise
        requests = core.requests(routed)
        for i, (endpoint, msg, frames, sent) in enumerate(requests):
            try:
                corr = yield Send(endpoint, msg, frames)
            except ZBrokerError as err:
                core.send_failed(sent, err, self.clock())
                continue
            except Exception as exc:  # a bug or a broken socket: flush() must report it, not succeed
                core.send_failed(sent, ProduceError(f"delivery failed: {exc!r}"), self.clock())
                continue
            except BaseException:
                for _e, _m, _f, unsent in requests[i:]:
                    core.send_failed(unsent, not_sent(), self.clock())
                raise
            core.sent(corr, sent, self.clock())

    def resend_due(self, also: Callable[[], list[PendingBatch]] = list) -> Flow:
        """The batches due for a retry, after the metadata they need, with ``also()``'s batches
        (admitted to the window, taken after the metadata questions) in the same round."""
        due, hints, topics = self.core.resends(self.clock())
        for topic, partition, endpoint in hints:  # the new leader, as the error named it
            self.metadata.redirect(topic, partition, endpoint)
        for topic in topics:
            try:
                self.metadata.update((yield Coordinator(m.Metadata(topics=[topic]))).topics)
            except ZBrokerError:
                pass  # the Endpoint step asks again; a batch with no owner is an attempt that failed
            except BaseException:
                for batch in due:
                    self.core.unroutable(batch, not_sent(), self.clock())
                raise
        batches = due + also()
        if batches:
            yield from self.send(batches)
