"""RangeSet and RangeMap against plain Python sets and dicts."""

from hypothesis import given, settings
from hypothesis import strategies as st

from zbroker.actors.group_coordinator.ranges import RangeMap, RangeSet


def test_add_merges_overlapping_and_adjacent_ranges():
    s = RangeSet()
    s.add(10, 20)
    s.add(30, 40)
    s.add(20, 25)  # adjacent to the first
    assert list(s) == [(10, 25), (30, 40)]
    s.add(24, 31)  # bridges both
    assert list(s) == [(10, 40)]
    assert s.len_ranges() == 1 and s.count() == 30


def test_remove_splits_and_reports_how_many_were_present():
    s = RangeSet([(0, 100)])
    assert s.remove(10, 20) == 10
    assert s.remove(15, 30) == 10
    assert list(s) == [(0, 10), (30, 100)]
    assert s.remove(200, 300) == 0
    assert s.count() == 80


def test_contains_first_gap_gaps_and_intersection():
    s = RangeSet([(11, 12), (13, 14)])
    assert 11 in s and 12 not in s and 13 in s
    assert s.first_gap_from(11) == 12
    assert s.first_gap_from(12) == 12
    assert s.first_gap_from(5) == 5
    assert s.gaps(10, 15) == [(10, 11), (12, 13), (14, 15)]
    assert s.intersection(0, 100) == [(11, 12), (13, 14)]
    assert s.first() == (11, 12) and s.last() == (13, 14)


def test_empty_and_inverted_ranges_are_ignored():
    s = RangeSet()
    s.add(5, 5)
    s.add(7, 3)
    assert not s and s.count() == 0
    assert s.gaps(3, 3) == []


def test_range_map_merges_only_equal_neighbours():
    r: RangeMap[str] = RangeMap()
    r.set(0, 10, "a")
    r.set(10, 20, "a")
    r.set(20, 30, "b")
    assert list(r) == [(0, 20, "a"), (20, 30, "b")]
    r.set(5, 25, "c")
    assert list(r) == [(0, 5, "a"), (5, 25, "c"), (25, 30, "b")]
    assert r.count() == 30
    assert r.pieces(3, 7) == [(3, 5, "a"), (5, 7, "c")]
    assert r.remove(4, 26) == [(4, 5, "a"), (5, 25, "c"), (25, 26, "b")]
    assert list(r) == [(0, 4, "a"), (26, 30, "b")]
    assert r.get(2) == "a" and r.get(10) is None and r.entry_at(27) == (26, 30, "b")


ops = st.lists(st.tuples(st.sampled_from(["add", "remove"]), st.integers(0, 60), st.integers(0, 60)),
               max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(0, 61))
def test_range_set_behaves_like_a_set_of_offsets(operations, probe):
    s, model = RangeSet(), set()
    for op, a, b in operations:
        start, end = min(a, b), max(a, b)
        if op == "add":
            s.add(start, end)
            model |= set(range(start, end))
        else:
            assert s.remove(start, end) == len(model & set(range(start, end)))
            model -= set(range(start, end))
        ranges = list(s)
        # Canonical: sorted, non-empty, disjoint and never touching.
        assert all(a < b for a, b in ranges)
        assert all(ranges[i][1] < ranges[i + 1][0] for i in range(len(ranges) - 1))
        assert {o for a, b in ranges for o in range(a, b)} == model
        assert s.count() == len(model)
    assert (probe in s) == (probe in model)
    gap = probe
    while gap in model:
        gap += 1
    assert s.first_gap_from(probe) == gap
    assert {o for a, b in s.gaps(0, 62) for o in range(a, b)} == set(range(62)) - model


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "remove"]), st.integers(0, 40), st.integers(0, 40),
                          st.sampled_from("xyz")), max_size=40),
       st.integers(0, 40), st.integers(0, 40))
def test_range_map_behaves_like_a_dict_of_offsets(operations, qa, qb):
    r: RangeMap[str] = RangeMap()
    model: dict[int, str] = {}
    for op, a, b, value in operations:
        start, end = min(a, b), max(a, b)
        if op == "set":
            r.set(start, end, value)
            model.update({o: value for o in range(start, end)})
        else:
            removed = r.remove(start, end)
            assert {o: v for s, e, v in removed for o in range(s, e)} == \
                {o: model[o] for o in range(start, end) if o in model}
            for o in range(start, end):
                model.pop(o, None)
        entries = list(r)
        assert {o: v for s, e, v in entries for o in range(s, e)} == model
        assert r.count() == len(model)
        # Equal neighbours always merge: uniform state is one entry.
        assert all(not (entries[i][1] == entries[i + 1][0] and entries[i][2] == entries[i + 1][2])
                   for i in range(len(entries) - 1))
    start, end = min(qa, qb), max(qa, qb)
    assert {o: v for s, e, v in r.pieces(start, end) for o in range(s, e)} == \
        {o: model[o] for o in range(start, end) if o in model}
