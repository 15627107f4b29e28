"""The blocking steps a client flow yields, and the loops that perform them.

Theory of operation
-------------------
The client's calls are written once, as generators (`consumer_flow.ConsumerFlow`,
`producer_flow.ProducerFlow`) that yield a *step* whenever they need I/O, and are
sent the step's result back (or have its error thrown in):

=================  ===================================================  ==============
step               what the driver does                                 result
=================  ===================================================  ==============
`Send`             send the request (to the coordinator when            correlation id
                   ``endpoint`` is None) with its ``frames``; a
                   followed fetch reserves the ids of its later replies
`Wait`             wait for the reply to one id (others are kept in     the envelope
                   `Correlation.early`); RequestTimeout when it does
                   not come within ``timeout`` (None: the request
                   timeout)
`WaitAny`          wait until any reply arrives, or ``timeout``         None
`Endpoint`         the partition's actor, asking the coordinator when   endpoint
                   the metadata cache does not know it
`Coordinator`      a request to the coordinator, following              the reply
                   NOT_COORDINATOR (`transport.Coordinators`)
`Sleep`            sleep                                                None
`Notify`           call a rebalance callback (awaited if it returns a   None
                   coroutine)
`Connect`          connect to these actors now, in the background       None
=================  ===================================================  ==============

The sync driver performs a step by blocking (`run_blocking`), the asyncio
driver by awaiting (`run_awaiting`): that is all either does, so the two
cannot drift apart. A step's error, any (KeyboardInterrupt and CancelledError
too), is thrown into the flow at the step that raised it: its cleanup runs,
and it re-raises what it does not handle. This module does no I/O.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from zbroker.protocol import messages as m


class Send(NamedTuple):
    endpoint: str | None  # None: the coordinator the connection talks to now
    msg: m.Message
    frames: tuple = ()


class Wait(NamedTuple):
    corr: int
    timeout: float | None = None  # None: the connection's request timeout


class WaitAny(NamedTuple):
    timeout: float


class Endpoint(NamedTuple):
    topic: str
    partition: int


class Coordinator(NamedTuple):
    msg: m.Message
    timeout: float | None = None


class Sleep(NamedTuple):
    seconds: float


class Notify(NamedTuple):
    callback: Callable[[list], Any]
    partitions: list


class Connect(NamedTuple):
    topics: list[str]
    assignment: list


Flow = Any  # a generator of steps

# Each step, and the name of the driver's method that performs it (`step_methods`).
STEP_METHODS = ((Send, "_send"), (Wait, "_wait"), (WaitAny, "_wait_any"), (Endpoint, "_endpoint"),
                (Coordinator, "_coordinator"), (Sleep, "_sleep"), (Notify, "_notify"), (Connect, "_connect"))


def step_methods(driver: Any) -> dict[type, Callable]:
    """The driver's methods that perform each step, by step class."""
    return {step: getattr(driver, name) for step, name in STEP_METHODS}


class Done(NamedTuple):
    value: Any  # what the flow returned


def resume(flow: Flow, result: Any, error: BaseException | None) -> Any:
    """Give ``flow`` the last step's result (or throw it the step's error): its next step, or
    `Done` with what it returned."""
    try:
        return flow.send(result) if error is None else flow.throw(error)
    except StopIteration as stop:
        return Done(stop.value)


def run_blocking(flow: Flow, perform: dict[type, Callable]) -> Any:
    """Run ``flow`` to its end, performing each step with ``perform[type(step)]``, which blocks."""
    step = resume(flow, None, None)
    while step.__class__ is not Done:
        try:
            result, error = perform[step.__class__](step), None
        except BaseException as err:  # noqa: B036
            result, error = None, err
        step = resume(flow, result, error)
    return step.value


async def run_awaiting(flow: Flow, perform: dict[type, Callable]) -> Any:
    """Run ``flow`` to its end, awaiting ``perform[type(step)](step)`` for each step."""
    step = resume(flow, None, None)
    while step.__class__ is not Done:
        try:
            result, error = await perform[step.__class__](step), None
        except BaseException as err:  # noqa: B036
            result, error = None, err
        step = resume(flow, result, error)
    return step.value
