"""Multipart send and receive on pyzmq sockets, for the hot loops of actors and clients.

pyzmq's `send_multipart` and `recv_multipart` convert their flags and socket
options through Python enums on every frame (`SNDMORE | flags`, the RCVMORE
query), and a non-blocking receive on an empty socket raises `zmq.Again`,
which builds an exception with its error text. Measured on this project's
2-vCPU VM: a two-frame `send_multipart` 6.8 us against 1.4 us with plain
integer flags, and the `zmq.Again` that ends every drain 8 us against 2 us
for asking the socket for ZMQ_EVENTS first. A partition actor answering one
record per request pays each of these once per record.

Same semantics as pyzmq's: a multipart message is queued whole or not at all
(ZeroMQ checks the high-water mark on its first frame, and every frame's type
is checked before the first is sent), and received frames are bytes or, with
``copy=False``, `zmq.Frame` objects.
"""

from __future__ import annotations

from typing import Any, Sequence

import zmq

_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_FRAME_TYPES = (bytes, bytearray, memoryview, zmq.Frame)
# pyzmq's `zmq.Socket.send` is a Python method that handles routing_id and group (the
# draft SERVER and RADIO sockets) and then calls the compiled send of `zmq.backend.Socket`,
# its base class. Called directly, `send_frames` of a two-frame reply costs 10,200
# instructions instead of 15,800 (callgrind; bench/PROFILE.md, twentieth pass). Only
# for sockets whose class does not override `send` (zmq.asyncio's does: it keeps its own).
_SUGAR_SEND = zmq.Socket.send
_COMPILED_SEND = zmq.backend.Socket.send
_COPY_THRESHOLD = zmq.COPY_THRESHOLD


def send_frames(sock: zmq.Socket, frames: Sequence[Any], copy: bool = True, block: bool = False) -> None:
    """Queue one multipart message; raises `zmq.Again` (nothing sent) when the peer's
    queue is at its high-water mark, at once or, with ``block``, after the socket's
    ZMQ_SNDTIMEO."""
    for frame in frames:
        # Checked before the first frame goes: a TypeError half-way would leave the
        # frames before it queued, and the next message would be glued onto them.
        if not isinstance(frame, _FRAME_TYPES):
            raise TypeError(f"a frame must be bytes, bytearray, memoryview or zmq.Frame, not {type(frame).__name__}")
    flags = 0 if block else _NOBLOCK
    last = len(frames) - 1
    if sock.__class__.send is _SUGAR_SEND:
        # A frame under zmq.COPY_THRESHOLD is copied by pyzmq either way; asking for the
        # copy skips the memoryview it makes first to find that out.
        send = _COMPILED_SEND
        for i in range(last):
            frame = frames[i]
            send(sock, frame, flags | _SNDMORE, copy or len(frame) < _COPY_THRESHOLD)
        frame = frames[last]
        send(sock, frame, flags, copy or len(frame) < _COPY_THRESHOLD)
        return
    send = sock.send
    for i in range(last):
        send(frames[i], flags | _SNDMORE, copy=copy)
    send(frames[last], flags, copy=copy)


def recv_frames(sock: zmq.Socket, copy: bool = True) -> list | None:
    """The next whole message waiting on ``sock``, or None when there is none (never blocks)."""
    if not sock.get(_EVENTS) & _POLLIN:
        return None
    recv = sock.recv
    try:
        frames = [recv(_NOBLOCK, copy=copy)]
    except zmq.Again:
        return None
    more = sock.get
    while more(_RCVMORE):
        frames.append(recv(_NOBLOCK, copy=copy))  # the rest of a message arrives with its first frame
    return frames
