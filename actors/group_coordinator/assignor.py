"""Sticky, balanced partition assignment for exclusive-mode consumer groups.

`assign` is a pure function: the same inputs give the same output, whatever
the order of the dicts passed in.

Balance is per topic: the members subscribed to a topic split its partitions
so that their counts differ by at most one. Stickiness: a member keeps as
many of its current partitions of that topic as its share allows, and the
members that currently hold the most get the larger shares, so the number of
partitions that move is the minimum any balanced assignment allows. Freed
and new partitions go to the members with room, least loaded first counting
every topic assigned so far, which also spreads many single-partition topics
across the group instead of piling them on one member.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

Key = tuple[str, int]


def assign(current_owner: Mapping[Key, Hashable],
           subscriptions: Mapping[Hashable, Sequence[str]],
           partitions: Mapping[str, int]) -> dict[Key, Hashable]:
    """Owner of every partition of every subscribed topic.

    current_owner: the assignment in force, (topic, partition) -> member; entries
        for members or topics no longer present are ignored.
    subscriptions: member -> topics it consumes.
    partitions: topic -> partition count; subscribed topics missing here are skipped.
    """
    members = sorted(subscriptions, key=str)
    load = {m: 0 for m in members}  # partitions given so far, all topics
    result: dict[Key, Hashable] = {}
    topics = sorted({t for m in members for t in subscriptions[m] if t in partitions})
    for topic in topics:
        count = partitions[topic]
        subscribers = [m for m in members if topic in subscriptions[m]]
        held: dict[Hashable, list[int]] = {m: [] for m in subscribers}
        for p in range(count):
            owner = current_owner.get((topic, p))
            if owner in held:
                held[owner].append(p)
        base, extra = divmod(count, len(subscribers))
        # The larger shares go to whoever holds most now (fewest moves), then to the
        # least loaded so far, then by name (determinism).
        by_claim = sorted(subscribers, key=lambda m: (-len(held[m]), load[m], str(m)))
        quota = {m: base + (1 if i < extra else 0) for i, m in enumerate(by_claim)}
        taken: dict[Hashable, list[int]] = {m: held[m][:quota[m]] for m in subscribers}
        kept = {p for ps in taken.values() for p in ps}
        for p in range(count):
            if p in kept:
                continue
            # Room is guaranteed: the quotas add up to `count`.
            m = min((m for m in subscribers if len(taken[m]) < quota[m]),
                    key=lambda m: (load[m] + len(taken[m]), str(m)))
            taken[m].append(p)
        for m, ps in taken.items():
            load[m] += len(ps)
            for p in ps:
                result[(topic, p)] = m
    return result
