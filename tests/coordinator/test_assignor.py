"""The exclusive-mode assignor: balanced per topic, sticky, deterministic."""

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from zbroker.actors.group_coordinator.assignor import assign


def counts(assignment, topic=None):
    return Counter(m for (t, _p), m in assignment.items() if topic is None or t == topic)


def test_partitions_are_split_evenly():
    result = assign({}, {"a": ["t"], "b": ["t"], "c": ["t"]}, {"t": 8})
    assert sorted(counts(result).values()) == [2, 3, 3]
    assert set(result) == {("t", p) for p in range(8)}


def test_adding_a_third_member_moves_only_what_it_must():
    two = assign({}, {"a": ["t"], "b": ["t"]}, {"t": 6})
    assert sorted(counts(two).values()) == [3, 3]
    three = assign(two, {"a": ["t"], "b": ["t"], "c": ["t"]}, {"t": 6})
    moved = [k for k in two if two[k] != three[k]]
    assert len(moved) == 2  # the minimum: c needs 2, nobody else changes hands
    assert all(three[k] == "c" for k in moved)
    assert sorted(counts(three).values()) == [2, 2, 2]


def test_removing_a_member_moves_only_its_partitions():
    before = assign({}, {"a": ["t"], "b": ["t"], "c": ["t"]}, {"t": 9})
    after = assign(before, {"a": ["t"], "b": ["t"]}, {"t": 9})
    for key, owner in before.items():
        if owner != "c":
            assert after[key] == owner
    assert sorted(counts(after).values()) == [4, 5]


def test_only_subscribers_get_a_topic_and_load_spreads_over_topics():
    result = assign({}, {"a": ["x", "y", "z"], "b": ["x", "y", "z"], "c": ["y"]},
                    {"x": 1, "y": 3, "z": 1, "unused": 4})
    assert {m for (t, _), m in result.items() if t in ("x", "z")} <= {"a", "b"}
    assert sorted(counts(result, "y").values()) == [1, 1, 1]
    assert not any(t == "unused" for t, _ in result)
    # Two single-partition topics do not both land on the same member.
    assert result[("x", 0)] != result[("z", 0)]


def test_unknown_owners_and_topics_are_ignored():
    result = assign({("t", 0): "gone", ("t", 1): "a", ("old", 0): "a"}, {"a": ["t", "missing"], "b": ["t"]},
                    {"t": 2})
    assert result[("t", 1)] == "a" and result[("t", 0)] == "b"


def test_deterministic_whatever_the_dict_order():
    subs = {f"m{i}": ["t", "u"] if i % 2 else ["t"] for i in range(7)}
    parts = {"t": 13, "u": 5}
    current = {("t", p): f"m{p % 3}" for p in range(13)}
    expected = assign(current, subs, parts)
    for seed in range(10):
        rng = random.Random(seed)
        shuffled_subs = dict(rng.sample(list(subs.items()), len(subs)))
        shuffled_current = dict(rng.sample(list(current.items()), len(current)))
        assert assign(shuffled_current, shuffled_subs, dict(reversed(parts.items()))) == expected


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from("abcdef"), st.sets(st.sampled_from(["t", "u", "v"]), min_size=1),
                       min_size=1),
       st.dictionaries(st.sampled_from(["t", "u", "v"]), st.integers(1, 12), min_size=1),
       st.dictionaries(st.tuples(st.sampled_from(["t", "u", "v"]), st.integers(0, 11)),
                       st.sampled_from("abcdefg")))
def test_balanced_complete_and_sticky(subscriptions, partitions, current):
    subs = {m: sorted(ts) for m, ts in subscriptions.items()}
    result = assign(current, subs, partitions)
    for topic, n in partitions.items():
        subscribers = [m for m in subs if topic in subs[m]]
        keys = {(topic, p) for p in range(n)}
        if not subscribers:
            assert not keys & set(result)
            continue
        assert keys <= set(result)
        assert all(result[k] in subscribers for k in keys)
        per_member = [sum(1 for k in keys if result[k] == m) for m in subscribers]
        assert max(per_member) - min(per_member) <= 1
        # Sticky: each member keeps at least as many of its partitions as the smaller share allows.
        floor_share = n // len(subscribers)
        for m in subscribers:
            held = {k for k in keys if current.get(k) == m}
            assert len({k for k in held if result[k] == m}) >= min(len(held), floor_share)
        # Minimal movement: only partitions above a member's share (or orphaned) move.
        moved = sum(1 for k in keys if current.get(k) in subscribers and result[k] != current[k])
        held_counts = sorted((sum(1 for k in keys if current.get(k) == m) for m in subscribers), reverse=True)
        base, extra = divmod(n, len(subscribers))
        quotas = [base + 1] * extra + [base] * (len(subscribers) - extra)
        assert moved == sum(max(0, h - q) for h, q in zip(held_counts, quotas))
