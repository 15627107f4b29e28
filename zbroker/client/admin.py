"""Admin requests both client drivers (sync.py, aio.py) send: built here once, so each
driver's method is one line that sends what this returns.

The coordinator holds a `delete_topic` reply until the partition actors have deleted the
files and the commit writer has the offsets' tombstones (up to 4 s, then it answers with
what is pending), so its request timeout is longer than the default 5 s.
"""

from __future__ import annotations

from zbroker.protocol import messages as m

DELETE_TOPIC_TIMEOUT_S = 10.0


def delete_topic(name: str) -> tuple[m.DeleteTopic, float]:
    """The request and its timeout."""
    return m.DeleteTopic(topic=name), DELETE_TOPIC_TIMEOUT_S
