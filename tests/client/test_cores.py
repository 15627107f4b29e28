"""The client cores, driven by hand: crafted replies in, requests and decisions out, the
clock an argument. No sockets, no broker, no private attributes."""

from __future__ import annotations

import ast
import importlib.util
import pathlib

import pytest

from zbroker.client.consumer_core import (ACK_FAILED, ACK_REJOIN, ACK_STALE, AHEAD_RETRY_S, FOLLOW, RAISE,
                                          READ_AHEAD_FOLLOW, REJOIN, AckRequests, ConsumerCore, FetchSizer,
                                          GroupCallRetry, RetryBackoff, failure_reason, fetch_bytes, max_wait_ms,
                                          membership_lost)
from zbroker.protocol.batch import build_batch_header, encode_values
from zbroker.protocol.codec import Envelope
from zbroker.client.core import MAX_FRAME_BYTES, RANGES_PER_REQUEST, ConsumedRecord, MetadataCache
from zbroker.client.fetch_round import FetchRound
from zbroker.client.producer_core import ProduceError, ProducerCore, failure_fields, leader_hint, retry_delay
from zbroker.client.transport import Coordinators, Correlation, bootstrap_urls
from zbroker.protocol import messages as m
from zbroker.protocol.errors import (ProtocolError as BadRequest, NotCoordinator, NotLeader, NotOwner, RequestTimeout,
                                     ErrorCode, Fenced, StaleLease, UnknownMember)

CLIENT = pathlib.Path(__file__).resolve().parents[2] / "zbroker" / "client"
FORBIDDEN = {"zmq", "asyncio", "time", "socket"}


@pytest.mark.parametrize("module", ["consumer_core.py", "consumer_flow.py", "fetch_round.py", "producer_core.py",
                                    "producer_flow.py", "steps.py", "core.py", "transport.py", "admin_calls.py"])
def test_the_cores_import_neither_zmq_asyncio_time_nor_socket(module):
    imported = set()
    for node in ast.walk(ast.parse((CLIENT / module).read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & FORBIDDEN, f"{module} imports {imported & FORBIDDEN}"


def imports_of(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from pkg import module`
    return names


def forbidden_reach(module: str) -> dict[str, set[str]]:
    """The forbidden imports reached from ``zbroker.client.<module>`` through the zbroker modules
    it imports (the `zbroker.client` package's own __init__ aside: it is the public face and
    imports the drivers), by the module that makes each."""
    seen, todo, found = set(), [f"zbroker.client.{module}"], {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            spec = importlib.util.find_spec(name) if name.startswith("zbroker.") else None
        except ModuleNotFoundError:  # `from zbroker.x import SomeClass`: a name, not a module
            spec = None
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        for imported in imports_of(pathlib.Path(spec.origin)):
            top = imported.split(".")[0]
            if top in FORBIDDEN:
                found.setdefault(name, set()).add(top)
            elif top == "zbroker":
                todo.append(imported)
    return found


@pytest.mark.parametrize("module", ["consumer_core", "consumer_flow", "fetch_round", "producer_core", "producer_flow",
                                    "steps", "transport", "admin_calls"])
def test_nothing_a_core_imports_imports_zmq_asyncio_time_or_socket_either(module):
    assert not forbidden_reach(module)


def test_the_transitive_check_sees_a_driver_side_module():
    assert forbidden_reach("sockets") == {"zbroker.client.sockets": {"zmq"}, "zbroker.client.keys": {"zmq"}}


def test_the_import_check_sees_a_forbidden_import():
    # The check above must be able to fail: the same walk over a module that imports time.
    tree = ast.parse("import json\nfrom time import monotonic\n")
    found = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert found & FORBIDDEN == {"time"}


def test_the_client_imports_nothing_from_the_actors():
    for path in CLIENT.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("zbroker.actors"), f"{path.name} imports {node.module}"


# -- consumer core: membership and rejoin -------------------------------------------------

def rec(partition: int, offset: int, lease: int = 7) -> ConsumedRecord:
    return ConsumedRecord("t", partition, offset, 0, None, b"", None, lease, 1, "new")


def join_reply(member: str, generation: int, assignment: list, mode: str = "exclusive") -> m.JoinReply:
    return m.JoinReply(member_id=member, generation=generation, mode=mode, assignment=assignment,
                       ack_timeout_ms=30000)


def joined_core() -> ConsumerCore:
    core = ConsumerCore(group="g", topics=["t"])
    revoked, assigned, _ = core.joined(join_reply("m", 1, [["t", 0], ["t", 1]]), previous_member="")
    assert (revoked, assigned) == ([], [("t", 0), ("t", 1)])
    return core


def test_a_member_the_coordinator_forgot_joins_as_a_new_one_and_keeps_nothing_leased():
    core = joined_core()
    core.held = [[rec(0, 0)]]
    join = core.join_as_new(session_timeout_ms=3000)
    assert (join.member_id, join.session_timeout_ms) == ("", 3000) and core.member_lost
    core.joined(join_reply("m-new", 7, [["t", 0]]), previous_member="m")
    assert core.held == [] and (core.member_id, core.generation, core.member_lost) == ("m-new", 7, False)


def test_a_poll_carries_what_one_request_holds_of_the_acks_and_asks_as_this_member_now():
    core = joined_core()
    for lease in range(RANGES_PER_REQUEST + 2):
        core.acks.add_range(["t", 0, lease, 2 * lease, 2 * lease + 1])  # a gap each: no two fold
    riding, rest = core.acks_for_poll()
    assert (len(riding), len(rest)) == (RANGES_PER_REQUEST, 2) and not core.acks  # taken, all of them
    poll = core.poll_request(max_records=50, wait_ms=200, acks=riding)
    assert (poll.group, poll.member_id, poll.generation, poll.max_records, poll.max_wait_ms, poll.ahead) == (
        "g", "m", 1, 50, 200, 0)
    assert poll.acks is riding
    core.joined(join_reply("m", 2, [["t", 0]]), previous_member="m")
    nack = core.member_request(m.Nack, ranges=rest, delay_ms=5, reason="")
    assert (nack.member_id, nack.generation, nack.ranges) == ("m", 2, rest)  # the generation of now
    assert core.acks_for_poll() == ([], [])


def test_the_next_poll_goes_ahead_only_with_nothing_leased_left_and_none_on_its_way():
    core = joined_core()
    assert not core.poll_ahead_now(poll_in_flight=False)  # poll_ahead off
    core = ConsumerCore(group="g", topics=["t"], poll_ahead=True)
    core.joined(join_reply("m", 1, [["t", 0]]), previous_member="")
    assert core.poll_ahead_now(poll_in_flight=False)
    assert not core.poll_ahead_now(poll_in_flight=True)
    core.held = [[rec(0, 0)]]  # more leased than the last poll() asked for: the next one takes them
    assert not core.poll_ahead_now(poll_in_flight=False)
    assert ConsumerCore(group="g", topics=["t"], lease_ahead=True).poll_ahead  # lease-ahead implies it


def test_a_rejoin_keeps_held_records_whose_lease_still_stands_and_drops_the_rest():
    core = joined_core()
    core.held = [[rec(0, 0), rec(0, 1)], [rec(1, 5)]]
    revoked, assigned, _ = core.joined(join_reply("m", 2, [["t", 0]]), previous_member="m")
    assert (revoked, assigned) == ([("t", 1)], [])
    # partition 1 moved: its lease went to another member, its record must not be handed out
    assert [[r.offset for r in part] for part in core.held] == [[0, 1]]


def test_a_member_the_coordinator_lost_keeps_nothing_it_held():
    core = joined_core()
    core.held = [[rec(0, 0)]]
    core.lost(forget_id=True)  # UNKNOWN_MEMBER: join as a new member
    assert core.join_request(10_000, as_new=True).member_id in ("", None)
    core.joined(join_reply("m2", 2, [["t", 0], ["t", 1]]), previous_member="")
    assert core.held == []


def test_fenced_without_being_known_drops_the_held_records_even_under_the_same_id():
    core = joined_core()
    core.held = [[rec(0, 0)]]
    core.lost(forget_id=False)
    core.joined(join_reply("m", 2, [["t", 0], ["t", 1]]), previous_member="m")
    assert core.held == []


def test_a_poll_answered_before_a_rejoin_keeps_only_its_standing_ordinary_deliveries():
    core = joined_core()
    core.joined(join_reply("m", 2, [["t", 0]]), previous_member="m")
    deliveries = [["t", 0, 7, 0, 5, 1, "new"], ["t", 1, 8, 0, 5, 1, "new"], ["t", 0, 9, 5, 15, 1, "ahead"]]
    assert core.standing_deliveries(deliveries, "m", lost=False) == [["t", 0, 7, 0, 5, 1, "new"]]
    assert core.standing_deliveries(deliveries, "other", lost=False) == []
    assert core.standing_deliveries(deliveries, "m", lost=True) == []


def poll_of(core: ConsumerCore, acks: list, max_wait_ms: int = 100) -> m.Poll:
    return m.Poll(group="g", member_id=core.member_id, generation=core.generation, max_records=10,
                  max_wait_ms=max_wait_ms, acks=acks)


def test_a_poll_sent_is_given_up_after_its_wait_and_the_request_timeout():
    core = joined_core()
    sent = core.poll_sent(41, poll_of(core, [["t", 0, 7, 0, 3]], max_wait_ms=250), now=10.0, request_timeout=5.0)
    assert (sent.reply, sent.member_id, sent.generation, sent.give_up_at) == (41, "m", 1, 15.25)
    assert sent.take_acks() == [["t", 0, 7, 0, 3]] and sent.acks == []


def test_a_poll_answered_counts_its_acks_applied_and_notes_the_stale_ones():
    core = joined_core()
    sent = core.poll_sent(41, poll_of(core, [["t", 0, 7, 0, 3]]), now=0.0, request_timeout=5.0)
    reply = m.PollReply(deliveries=[], generation=1, ack_timeout_ms=30000, acked=2, stale=[["t", 0, 7, 2, 3]])
    assert core.poll_replied(sent, Envelope(op="poll", corr_id=41, msg=reply), now=0.1) is reply
    assert (core.stats["acked"], core.stats["stale"], core.held_acks()) == (2, 1, 0)


def test_a_poll_fenced_on_arrival_holds_its_acks_again_and_asks_for_a_rejoin_once():
    core = joined_core()
    sent = core.poll_sent(41, poll_of(core, [["t", 0, 7, 0, 3]]), now=0.0, request_timeout=5.0)
    fenced = Fenced("fenced", generation=2, member_known=False)
    assert core.poll_replied(sent, Envelope(op="poll", corr_id=41, error=fenced), now=1.0) is None
    assert core.held_acks() == 3 and core.acks_due_at(1.0) == 1.0 + core.ack_interval_s
    assert core.rejoin_after(fenced, sent.member_id, sent.generation)
    assert core.member_lost and core.member_id == "m"  # known no more: its leases are gone, its id stays
    core.joined(join_reply("m", 2, [["t", 0]]), previous_member="m")
    assert not core.rejoin_after(fenced, sent.member_id, sent.generation)  # re-joined since it was sent


def test_a_poll_answered_after_it_waited_applied_its_acks_and_other_errors_are_raised():
    core = joined_core()
    sent = core.poll_sent(41, poll_of(core, [["t", 0, 7, 0, 3]]), now=0.0, request_timeout=5.0)
    fenced = Fenced("fenced", generation=2, acked=3)
    assert core.poll_replied(sent, Envelope(op="poll", corr_id=41, error=fenced), now=1.0) is None
    assert (core.stats["acked"], core.held_acks()) == (3, 0)
    assert core.rejoin_after(UnknownMember("gone"), "m", 1) and core.member_id == ""
    with pytest.raises(NotCoordinator):
        core.poll_replied(sent, Envelope(op="poll", corr_id=41, error=NotCoordinator("moved")), now=1.0)


def test_what_a_refused_ack_request_means_for_its_ranges():
    core = joined_core()
    ranges = [["t", 0, 7, 0, 5]]
    stale = StaleLease("stale", applied=3, stale=[["t", 0, 7, 3, 5]])
    assert core.ack_refused(stale, ranges, now=1.0) == ACK_STALE
    assert (core.stats["acked"], core.stats["stale"], core.held_acks()) == (3, 2, 0)  # not sent again
    assert core.ack_refused(Fenced("fenced", generation=2), ranges, now=1.0) == ACK_REJOIN
    assert core.take_acks() == ranges and core.member_id == "m"  # held for the request after the join
    assert core.ack_refused(UnknownMember("gone"), ranges, now=1.0) == ACK_REJOIN and core.member_id == ""
    core.take_acks()
    assert core.ack_refused(RequestTimeout("lost"), ranges, now=1.0) == ACK_FAILED and core.take_acks() == ranges
    assert core.ack_refused(BadRequest("bad"), ranges, now=1.0) == ACK_FAILED and core.held_acks() == 0


def test_ack_requests_stand_for_their_ranges_and_the_last_for_the_acks_that_rode_on_a_poll_before_it():
    ranges = [["t", 0, lease, 0, 1] for lease in range(RANGES_PER_REQUEST + 1)]
    rode = [["t", 0, 99, 0, 5]]
    requests = AckRequests.requests(ranges, rode)
    assert [(len(chunk), before) for chunk, before in requests] == [(RANGES_PER_REQUEST, []), (1, rode)]
    assert AckRequests.requests([], rode) == [([], rode)]  # an empty request proves the poll's acks applied
    sent = AckRequests()
    for corr, (chunk, before) in enumerate(requests, start=1):
        sent.sent(corr, chunk, before, now=10.0)
    assert sent and sent.waiting() == [1, 2]
    assert not sent.overdue(2, now=15.0, request_timeout=5.0) and sent.overdue(2, now=15.01, request_timeout=5.0)
    assert sent.lost(2) == [*rode, ranges[-1]]  # no reply: all it stood for goes again
    assert sent.answered(1) == (ranges[:RANGES_PER_REQUEST], []) and not sent


def test_a_join_ends_the_ahead_leases_and_gives_up_the_fetches_of_partitions_not_kept():
    core = ConsumerCore(group="g", topics=["t"], lease_ahead=True)
    core.joined(join_reply("m", 1, [["t", 0], ["t", 1]]), previous_member="")
    core.take_ahead_leases([["t", 0, 7, 0, 10, 1, "ahead"], ["t", 1, 8, 0, 10, 1, "ahead"]])
    core.ahead.sent(("t", 1), 40, 0, follow=3)
    _, _, given_up = core.joined(join_reply("m", 2, [["t", 0]]), previous_member="m")
    assert core.ahead_leases == {}
    assert given_up == [(40, 43)]


def test_shared_groups_do_not_read_ahead_and_ask_for_no_ahead_lease():
    core = ConsumerCore(group="g", topics=["t"], lease_ahead=True)
    core.joined(join_reply("m", 1, [["t", 0]], mode="shared"), previous_member="")
    assert not core.reading_ahead and core.ahead_wanted(100) == 0
    core.joined(join_reply("m", 2, [["t", 0]], mode="exclusive"), previous_member="m")
    assert core.reading_ahead and core.ahead_wanted(100) == 100


def test_stale_acks_end_the_ahead_lease_they_name():
    core = ConsumerCore(group="g", topics=["t"], lease_ahead=True)
    core.joined(join_reply("m", 1, [["t", 0]]), previous_member="")
    core.take_ahead_leases([["t", 0, 7, 0, 10, 1, "ahead"]])
    core.applied(3, [["t", 0, 7, 0, 2]])
    assert core.ahead_leases == {} and core.stats["stale"] == 2 and core.stats["acked"] == 3


def test_a_damaged_frame_under_an_ahead_lease_drops_that_partitions_read_ahead_and_serves_the_others():
    core = ConsumerCore(group="g", topics=["t"], lease_ahead=True)
    core.metadata.update([{"name": "t", "partitions": [{"endpoint": "ep"}, {"endpoint": "ep"}]}])
    core.joined(join_reply("m", 1, [["t", 0], ["t", 1]]), previous_member="")
    core.take_ahead_leases([["t", 0, 7, 0, 3, 1, "ahead"], ["t", 1, 8, 0, 3, 1, "ahead"]])
    rotten = bytearray(frame(0, 3))
    rotten[-1] ^= 0xFF  # bit rot in the segment: its CRC fails
    for key, corr, data in ((("t", 0), 40, bytes(rotten)), (("t", 1), 50, frame(0, 3))):
        core.ahead.sent(key, corr, 0, follow=2)
        core.ahead.arrived(key, corr, data, more=True)
    parts, given_up = core.ahead_records(10, now=5.0)
    assert [[(r.partition, r.offset) for r in part] for part in parts] == [[(1, 0), (1, 1), (1, 2)]]
    assert given_up == [(41, 42)]  # partition 0's fetch: its later replies are dropped when they come
    assert core.ahead_retry == {("t", 0): 5.0 + AHEAD_RETRY_S}  # and it is fetched again after a pause


def test_the_stale_ranges_a_consumer_keeps_are_bounded():
    """Every ack that comes back stale (a lease that expired or moved first) was appended to
    `Consumer.stale` for ever: a consumer that runs for months grows without bound."""
    core = ConsumerCore(group="l", topics=["long"])
    for lease in range(5000):
        core.note_stale([["long", 0, lease, 0, 2]])
    assert len(core.stale) <= 1000
    assert list(core.stale)[-1] == ["long", 0, 4999, 0, 2]  # the latest are kept
    assert core.stats["stale"] == 10_000  # and all are counted


def test_a_failed_ahead_read_is_restarted_after_its_pause_on_the_hand_driven_clock():
    core = ConsumerCore(group="g", topics=["t"], lease_ahead=True)
    core.joined(join_reply("m", 1, [["t", 0]]), previous_member="")
    core.take_ahead_leases([["t", 0, 7, 3, 10, 1, "ahead"]])
    core.ahead.drop(("t", 0))
    core.read_ahead_failed(("t", 0), now=10.0)
    core.restart_ahead_reads(now=10.01)
    assert core.ahead.wanted() == []  # not yet
    core.restart_ahead_reads(now=10.06)
    assert [(key, offset) for key, offset, _n in core.ahead.wanted()] == [(("t", 0), 3)]


def test_held_acks_go_again_and_restart_their_interval():
    core = ConsumerCore(group="g", topics=["t"], ack_interval_s=0.005)
    core.hold_again([["t", 0, 7, 0, 5]], now=50.0)
    assert core.acks_due_at(50.0) == 50.005 and not core.acks_due(50.004) and core.acks_due(50.005)
    assert core.take_acks() == [["t", 0, 7, 0, 5]] and core.acks_due_at(60.0) is None


def test_fetch_planning():
    assert fetch_bytes(0, 10) == 4096 and fetch_bytes(0, 100) == 25_600
    assert max_wait_ms(0.0123) == 12 and max_wait_ms(-1) == 0 and max_wait_ms(10 ** 9) == m.MAX_WAIT_MS


def test_a_lease_fetch_is_sized_from_the_lease_and_what_earlier_fetches_brought():
    sizer = FetchSizer()
    assert sizer.max_bytes(0, 100) == fetch_bytes(0, 100) == 25_600  # before any fetch: 256 bytes a record
    sizer.learn(frame_bytes=400_000, records=100)  # 4 KB records: the estimate follows at once
    assert sizer.max_bytes(0, 100) == 100 * (400_000 * 5 // 400 + 1)
    sizer.learn(frame_bytes=100_000, records=100)  # then smaller ones: it comes down, halving the gap
    assert sizer.per_record == (5001 + 1251) // 2
    for _ in range(20):  # small records: never below where it started
        sizer.learn(frame_bytes=3_000, records=100)
    assert sizer.per_record == 256
    assert sizer.max_bytes(0, 1) == 4096  # bounded below (one batch header and more) ...
    assert FetchSizer(per_record=1 << 20).max_bytes(0, 1000) == 8 << 20  # ... and above
    sizer.learn(frame_bytes=0, records=0)  # an empty reply teaches nothing
    assert sizer.per_record == 256


def frame(first: int, count: int) -> bytes:
    payload = encode_values([b"v%d" % o for o in range(first, first + count)], 0)
    return build_batch_header(payload, base_offset=first, record_count=count, append_time_ms=0) + payload


def fetch_reply(first: int, count: int, more: bool = False) -> Envelope:
    return Envelope(op="fetch", corr_id=0, msg=m.FetchReply(log_start=0, log_end=first + count, more=more),
                    frames=[frame(first, count)])


def test_the_core_plans_a_lease_fetch_learns_its_size_and_asks_for_the_rest():
    core = joined_core()
    delivery = ["t", 0, 7, 0, 10, 1, "new"]
    fetch = core.lease_fetch(delivery, 0)
    assert (fetch.topic, fetch.partition, fetch.offset, fetch.max_bytes) == ("t", 0, 0, 4096)
    got, rest, given_up = core.lease_fetch_replied(delivery, 0, fetch_reply(0, 4), None, now=1.0)
    assert [r.offset for r in got] == [0, 1, 2, 3] and rest == 4 and given_up == []  # cut short: the rest next
    assert core.fetch_sizer.per_record == 256  # small records: the next fetch keeps the floor
    got, rest, _ = core.lease_fetch_replied(delivery, 4, fetch_reply(4, 10), None, now=1.0)
    assert [r.offset for r in got] == list(range(4, 10)) and rest is None  # records past the lease end dropped


def many_reply(*parts: tuple[int, int]) -> Envelope:
    frames = [frame(first, count) for first, count in parts]
    rows = [[0, first + count, len(f), None] for (first, count), f in zip(parts, frames)]
    return Envelope(op="fetch_many", corr_id=0, msg=m.FetchManyReply(parts=rows), frames=[b"".join(frames)])


def test_a_fetch_round_sends_one_fetch_many_per_actor_and_fetches_the_rest_of_a_cut_lease_alone():
    core = joined_core()
    deliveries = [["t", 0, 7, 0, 5, 1, "new"], ["t", 1, 8, 0, 3, 1, "new"], ["t", 2, 9, 0, 2, 1, "new"]]
    fetches = FetchRound(core, deliveries)
    fetches.route((0, deliveries[0], 0), "ep-a")
    fetches.route((1, deliveries[1], 0), "ep-a")
    fetches.route((2, deliveries[2], 0), "ep-b")
    requests = fetches.requests()
    assert [(endpoint, msg.op) for endpoint, msg, _items in requests] == [("ep-a", "fetch_many"), ("ep-b", "fetch")]
    fetches.sent(11, requests[0])
    fetches.sent(12, requests[1])
    assert fetches.next_awaited() == 11  # the fetch_many first
    again = fetches.replied(11, many_reply((0, 2), (0, 3)), None, now=1.0)
    assert again == [(0, deliveries[0], 2)]  # partition 0's lease was cut short at offset 2
    fetches.route(again[0], "ep-a", alone=True)
    [rest] = fetches.requests()
    assert (rest[1].op, rest[1].offset) == ("fetch", 2)
    fetches.sent(13, rest)
    assert fetches.next_awaited() == 12  # then the fetches, in the order sent
    assert fetches.replied(12, fetch_reply(0, 2), None, now=1.0) == []
    assert fetches.replied(13, fetch_reply(2, 3), None, now=1.0) == [] and fetches.next_awaited() is None
    assert [[r.offset for r in part] for part in fetches.parts] == [[0, 1, 2, 3, 4], [0, 1, 2], [0, 1]]


def test_a_fetch_round_costs_a_partition_it_cannot_reach_only_its_own_delivery():
    core = joined_core()
    core.metadata.update([{"name": "t", "partitions": [{"endpoint": "ep-a"}, {"endpoint": "ep-b"}]}])
    deliveries = [["t", 0, 7, 0, 2, 1, "new"], ["t", 1, 8, 0, 2, 1, "new"]]
    fetches = FetchRound(core, deliveries)
    fetches.route((0, deliveries[0], 0), "ep-a")
    fetches.unroutable((1, deliveries[1], 0), NotOwner("moved"), now=1.0)
    [request] = fetches.requests()
    fetches.sent(5, request)
    assert fetches.replied(5, None, RequestTimeout("no reply"), now=2.0) == []
    assert fetches.parts == [[], []] and fetches.next_awaited() is None
    assert "t" not in core.metadata.topics  # where its partitions live is asked again


def test_an_actor_without_fetch_many_gets_single_fetches_from_then_on():
    core = joined_core()
    deliveries = [["t", 0, 7, 0, 2, 1, "new"], ["t", 1, 8, 0, 2, 1, "new"]]
    fetches = FetchRound(core, deliveries)
    for i, d in enumerate(deliveries):
        fetches.route((i, d, 0), "ep-old")
    [request] = fetches.requests()
    fetches.sent(5, request)
    refused = Envelope(op="fetch_many", corr_id=5, error=BadRequest("unknown op", code=ErrorCode.UNKNOWN_OP))
    again = fetches.replied(5, refused, None, now=1.0)
    assert again == [(0, deliveries[0], 0), (1, deliveries[1], 0)]
    for item in again:
        fetches.route(item, "ep-old")  # even routed together, they now go one by one
    assert [msg.op for _e, msg, _items in fetches.requests()] == ["fetch", "fetch"]


def test_a_fetch_round_cut_short_leaves_each_delivery_from_where_it_lacks_records_and_nothing_twice():
    # The asyncio poll() cancelled mid-round: what was filed is handed out, the rest is the next round's.
    core = joined_core()
    deliveries = [["t", 0, 7, 0, 5, 1, "new"], ["t", 1, 8, 0, 3, 1, "new"], ["t", 2, 9, 0, 2, 1, "new"],
                  ["t", 3, 6, 4, 6, 1, "new"], ["t", 4, 5, 0, 2, 1, "new"]]
    fetches = FetchRound(core, deliveries)
    assert fetches.lacking == [0, 0, 0, 4, 0]
    fetches.served(3, 6)  # the read-ahead held all of partition 3's lease
    fetches.served(4, 1)  # and the first record of partition 4's
    for i in range(3):
        fetches.route((i, deliveries[i], 0), "ep-%d" % i)
    requests = fetches.requests()
    for corr, request in enumerate(requests, start=20):
        fetches.sent(corr, request)
    assert fetches.replied(20, fetch_reply(0, 2), None, now=1.0) == [(0, deliveries[0], 2)]  # cut at 2
    assert fetches.replied(21, fetch_reply(0, 3), None, now=1.0) == []  # partition 1: all of it
    assert fetches.replied(22, None, RequestTimeout("no reply"), now=1.0) == []  # partition 2: given up
    # Cut short here: partition 0 lacks 2.., partition 4 (never routed) lacks 1..; none of the others.
    assert [(d[1], d[3]) for d in fetches.unfinished()] == [(0, 2), (4, 1)]
    assert [[r.offset for r in part] for part in fetches.parts] == [[0, 1], [0, 1, 2], [], [], []]


def test_a_lease_fetch_refused_as_not_owner_forgets_the_owner_and_costs_only_its_delivery():
    core = joined_core()
    core.metadata.update([{"name": "t", "partitions": [{"endpoint": "a0"}, {"endpoint": "a1"}]}])
    got, rest, _ = core.lease_fetch_replied(["t", 0, 7, 0, 10, 1, "new"], 0, None,
                                            NotOwner("moved", topic="t", partition=0), now=1.0)
    assert (got, rest) == ([], None) and "t" not in core.metadata.topics  # asked for again next time


def test_read_ahead_follows_the_log_end_and_a_fetch_without_a_reply_is_given_up_on_the_hand_driven_clock():
    core = joined_core()  # exclusive: it reads ahead
    core.lease_served(["t", 0, 7, 0, 5, 1, "new"])  # the next lease of partition 0 starts at 5
    [(key, fetch)] = core.read_ahead_fetches(wait_ms=1000, now=100.0)
    assert (key, fetch.offset, fetch.max_wait_ms, fetch.follow) == (("t", 0), 5, 1000, READ_AHEAD_FOLLOW)
    core.read_ahead_sent(key, 40, fetch, now=100.0, request_timeout=5.0)
    assert core.read_ahead_fetches(wait_ms=1000, now=100.0) == []  # one out per partition
    # Its first reply brings offsets 5..7 and says more will come, under id 41.
    assert core.collect_read_ahead({40: fetch_reply(5, 3, more=True)}, now=100.5) == []
    out: list = []
    pos, awaited, _ = core.serve_lease_from_read_ahead(["t", 0, 8, 5, 10, 1, "new"], 5, out, now=100.5)
    assert [r.offset for r in out] == [5, 6, 7] and (pos, awaited) == (8, 41)  # the driver waits for 41
    # 41 never comes: 1 s wait + 5 s request timeout after the last reply, the core gives up on 41..104.
    assert core.collect_read_ahead({}, now=106.4) == []
    assert core.collect_read_ahead({}, now=106.6) == [(41, 40 + READ_AHEAD_FOLLOW)]
    core.restart_ahead_reads(now=106.6)
    assert core.ahead.awaited(key, 8) is None


def test_a_later_reply_of_a_followed_fetch_arriving_first_gives_the_fetch_up():
    core = joined_core()
    core.lease_served(["t", 1, 7, 0, 5, 1, "new"])
    [(key, fetch)] = core.read_ahead_fetches(wait_ms=1000, now=0.0)
    core.read_ahead_sent(key, 10, fetch, now=0.0, request_timeout=5.0)
    # Reply 11 came and 10 did not: the actor's full queue dropped 10.
    assert core.collect_read_ahead({11: fetch_reply(5, 1)}, now=0.1) == [(10, 10 + READ_AHEAD_FOLLOW)]


def test_group_calls_rejoin_when_fenced_follow_a_moved_coordinator_and_raise_the_rest():
    retry = GroupCallRetry(Coordinators("tcp://a:1,tcp://b:1"))
    assert retry.after(Fenced("fenced", generation=2)) == REJOIN
    assert retry.after(NotCoordinator("moved", leader={"endpoint": "tcp://b:1"})) == FOLLOW
    assert retry.coordinators.current == "tcp://b:1"
    assert retry.after(Fenced("fenced", generation=3)) == REJOIN
    assert retry.after(Fenced("fenced", generation=4)) == RAISE  # the third time in one call
    assert GroupCallRetry(Coordinators("tcp://a:1")).after(StaleLease("stale")) == RAISE
    assert membership_lost(UnknownMember("gone")) == (True, True)
    assert membership_lost(Fenced("fenced", member_known=False)) == (True, False)
    assert membership_lost(Fenced("fenced")) == (False, False)


def test_run_backs_off_retriable_errors_and_raises_the_rest():
    backoff = RetryBackoff()
    assert [backoff.next_delay(RequestTimeout("slow"), "poll") for _ in range(8)] == [
        0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    backoff.reset()
    assert backoff.next_delay(RequestTimeout("slow"), "poll") == 0.1
    with pytest.raises(BadRequest):
        backoff.next_delay(BadRequest("no"), "poll")
    assert failure_reason(ValueError("x" * 500)) == ("ValueError: " + "x" * 500)[:200]


# -- producer core ----------------------------------------------------------------------------

def closed_batch(core: ProducerCore, n: int = 3, partition: int = 0):
    for i in range(n):
        core.acc.add("t", partition, [0, None, b"v%d" % i, None], 20, now=0.0)
    return core.acc.close(("t", partition))


def test_the_window_is_bounded_in_records_and_in_bytes():
    core = ProducerCore(max_in_flight_records=5, max_in_flight_bytes=1 << 20)
    first, second = closed_batch(core, 3), closed_batch(core, 3)
    assert core.has_room(first)
    core.admit(first)
    first.attempts += 1
    core.sent(1, first, now=0.0)
    assert not core.has_room(second)  # 6 records > 5
    core.replied(1, None, m.ProduceReply(base_offset=0, count=3, duplicate=False), now=0.1)
    assert core.has_room(second) and core.in_flight_records == 0 and first.outcome.base_offset == 0
    small = ProducerCore(max_in_flight_bytes=1)
    a, b = closed_batch(small), closed_batch(small)
    small.admit(a)
    small.sent(1, a, 0.0)
    assert not small.has_room(b)


def test_not_leader_is_retried_at_the_leader_it_names_with_a_capped_backoff():
    core = ProducerCore(retries=50)
    batch = closed_batch(core)
    core.admit(batch)
    leader = {"endpoint": "tcp://127.0.0.2:7401", "actor_id": "p2", "leader_epoch": 4}
    for attempt in range(1, 40):
        batch.attempts = attempt
        core.sent(attempt, batch, now=float(attempt))
        assert core.replied(attempt, NotLeader("moved", topic="t", partition=0, leader=leader), None,
                            now=float(attempt)) is None  # retried, not failed
        assert core.next_retry_at() == attempt + retry_delay(attempt) <= attempt + 1.0
        assert core.due(now=attempt + 2.0) == [batch]
    assert core.take_hints()[-1] == ("t", 0, "tcp://127.0.0.2:7401")
    assert core.take_failure() is None
    cache = MetadataCache()
    cache.update([{"name": "t", "partitions": [{"endpoint": "tcp://127.0.0.1:7401"}]}])
    cache.redirect("t", 0, "tcp://127.0.0.2:7401")
    assert cache.endpoint("t", 0) == "tcp://127.0.0.2:7401"


def test_batches_sent_together_go_as_one_produce_many_per_actor_each_an_attempt_more():
    core = ProducerCore()
    a, b, c = closed_batch(core, 2, partition=0), closed_batch(core, 2, partition=1), closed_batch(core, 2, partition=2)
    for batch in (a, b, c):
        core.admit(batch)
    requests = core.requests([("ep-1", a), ("ep-2", b), ("ep-1", c)])
    assert [(endpoint, msg.op) for endpoint, msg, _frames, _sent in requests] == [("ep-1", "produce_many"),
                                                                                 ("ep-2", "produce")]
    assert [x.attempts for x in (a, b, c)] == [1, 1, 1]
    assert requests[0][3].batches == [a, c] and requests[1][3] is b and requests[1][2] == (b.payload,)
    core.send_failed(requests[0][3], NotOwner("moved"), now=3.0)  # both retried after their backoff
    assert core.next_retry_at() == 3.0 + retry_delay(1)
    core.unroutable(b, NotOwner("moved"), now=3.0)
    assert b.attempts == 2 and core.stats["retries"] == 3


def test_the_sync_drivers_wait_and_its_resends_come_from_the_core():
    core = ProducerCore(retries=5)
    assert core.pump_wait(1.0, now=0.0) == 0.05 and core.pump_wait(0.01, now=0.0) == 0.01
    x, y = closed_batch(core, partition=0), closed_batch(core, partition=1)
    leader = {"endpoint": "tcp://127.0.0.2:7401"}
    for corr, batch in ((1, x), (2, y)):
        core.admit(batch)
        batch.attempts = 1
        core.sent(corr, batch, now=0.0)
        core.settle(corr, NotLeader("moved", leader=leader), None, now=0.0)
    assert core.pump_wait(1.0, now=0.04) == pytest.approx(0.01)  # not past the retry at 0.05
    assert core.resends(now=0.01) == ([], [], [])
    assert core.resends(now=0.05) == ([x, y], [("t", 0, "tcp://127.0.0.2:7401"), ("t", 1, "tcp://127.0.0.2:7401")],
                                      ["t"])


def test_a_batch_larger_than_a_frame_fails_at_once_and_is_reported():
    core = ProducerCore(batch_bytes=1 << 30)
    batch = closed_batch(core, 1)
    batch.payload = b"x" * (MAX_FRAME_BYTES + 1)
    core.admit(batch)
    assert core.produce_request(batch) is None and batch.attempts == 1  # never sent: no actor could take it
    assert (core.in_flight_records, core.in_flight_bytes) == (0, 0) and core.take_failure().code is ErrorCode.TOO_LARGE


def test_not_owner_without_a_hint_and_a_timeout_are_retried_too():
    assert leader_hint(NotOwner("moved")) is None
    assert leader_hint(NotLeader("moved", leader=None)) is None
    core = ProducerCore(request_timeout=5.0)
    batch = closed_batch(core)
    core.admit(batch)
    batch.attempts = 1
    core.sent(9, batch, now=0.0)
    assert core.timed_out(now=4.9) == [] and core.in_flight
    assert core.timed_out(now=5.1) == [] and not core.in_flight and core.retrying  # retried


def test_a_batch_out_of_retries_or_refused_fails_once_in_the_report():
    core = ProducerCore(retries=1)
    batch = closed_batch(core)
    core.admit(batch)
    batch.attempts = 1
    core.sent(1, batch, 0.0)
    assert core.replied(1, BadRequest("no", field="x"), None, 0.0) is batch
    assert core.replied(1, BadRequest("no"), None, 0.0) is None  # a reply to nothing in flight
    report = core.take_failure()
    assert isinstance(report, ProduceError) and report.code is ErrorCode.BAD_REQUEST and report.data["failed"] == 1
    assert batch.outcome.error is not None and core.in_flight_records == 0
    assert core.take_failure() is None


def test_batches_are_admitted_in_the_order_they_were_closed_and_an_empty_window_takes_any():
    import collections

    core = ProducerCore(max_in_flight_records=4)
    big, small, last = closed_batch(core, 4, partition=0), closed_batch(core, 1, partition=1), closed_batch(core, 1)
    first = closed_batch(core, 3, partition=2)
    queue = collections.deque([first, big, small, last])
    assert core.admit_in_order(queue) == [first]
    assert list(queue) == [big, small, last]  # `small` would fit, but `big` came first
    assert core.admit_in_order(queue) == [] and core.in_flight_records == 3  # admitted, not sent yet: it counts
    core.requests([("ep", first)])
    core.sent(1, first, now=0.0)
    core.settle(1, None, m.ProduceReply(base_offset=0, count=3, duplicate=False), now=0.1)
    assert core.admit_in_order(queue) == [big]
    oversized = closed_batch(core, 9, partition=3)
    assert not core.has_room(oversized)
    empty = ProducerCore(max_in_flight_records=4)
    assert empty.has_room(oversized)  # larger than the window: it would never go otherwise


def test_the_asyncio_drivers_wake_up_is_the_next_retry_or_request_timeout_and_a_stop_fails_the_rest():
    core = ProducerCore(request_timeout=5.0, retries=5)
    assert core.next_deadline() is None  # nothing to wait for but a reply or a batch
    sent, retried, unsent = closed_batch(core, partition=0), closed_batch(core, partition=1), closed_batch(core)
    for corr, batch in ((7, sent), (8, retried)):
        core.admit(batch)
        core.requests([("ep-%d" % corr, batch)])
        core.sent(corr, batch, now=1.0)
    assert core.next_deadline() == 6.0  # the oldest request's timeout
    core.settle(8, NotOwner("moved"), None, now=2.0)
    assert core.next_deadline() == 2.0 + retry_delay(1)
    closing = ProduceError("closing", code=ErrorCode.SHUTTING_DOWN)
    assert core.give_up(closing, [unsent]) == [7]  # the request no longer waited for
    assert [b for b, _e in core.take_failed()] == [sent, retried, unsent]
    assert (core.in_flight, core.retrying, core.in_flight_records, core.in_flight_bytes) == ({}, [], 0, 0)
    assert all(b.outcome.error is closing for b in (sent, retried, unsent))
    assert core.next_deadline() is None


def test_a_batch_that_fails_for_good_is_returned_for_the_driver_to_log_not_logged_by_the_core():
    imported = {node.module for node in ast.walk(ast.parse((CLIENT / "producer_core.py").read_text()))
                if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(ast.parse((CLIENT / "producer_core.py").read_text()))
                 if isinstance(node, ast.Import) for alias in node.names}
    assert not imported & {"structlog", "logging"}
    core = ProducerCore(retries=0, request_timeout=5.0)
    refused, late = closed_batch(core, partition=0), closed_batch(core, partition=1)
    for corr, batch in ((1, refused), (2, late)):
        core.admit(batch)
        batch.attempts = 1
        core.sent(corr, batch, now=0.0)
    core.settle(1, BadRequest("no", field="x"), None, now=1.0)
    assert [(b, e.code) for b, e in core.take_failed()] == [(refused, ErrorCode.BAD_REQUEST)]
    assert core.take_failed() == []  # each failure is handed over once
    core.timed_out(now=5.1)  # no retries left: the timeout fails it for good
    [(batch, err)] = core.take_failed()
    assert batch is late and failure_fields(batch, err) == {
        "topic": "t", "partition": 1, "code": "TIMEOUT", "reason": "produce timed out", "attempts": 1}
    assert core.take_failure().data["failed"] == 2  # the flush's report is apart from the log's


# -- transport: correlation and the bootstrap list ----------------------------------------------

def test_correlation_reserves_the_ids_of_later_replies_and_drops_orphans():
    corr = Correlation()
    assert corr.allocate() == 1 and corr.allocate(replies=65) == 2 and corr.allocate() == 67
    corr.orphan_ranges([(2, 66)])
    corr.orphan(67)
    for i in (3, 50, 67, 68):
        corr.keep(type("Env", (), {"corr_id": i})())
    corr.keep(type("Env", (), {"corr_id": None})())  # no id: nobody can wait for it
    corr.drop_orphans()
    assert list(corr.early) == [68]


def test_a_url_may_list_several_coordinators():
    assert bootstrap_urls("tcp://a:1, tcp://b:2,") == ["tcp://a:1", "tcp://b:2"]
    with pytest.raises(ValueError):
        bootstrap_urls(" , ")


def test_not_coordinator_follows_the_leader_named_or_rotates_with_a_capped_backoff():
    c = Coordinators("tcp://a:1,tcp://b:2,tcp://c:3")
    assert c.redirected(NotCoordinator("not me", leader={"endpoint": "tcp://c:3", "node_id": "n3", "epoch": 2}))
    assert c.current == "tcp://c:3"
    assert c.redirected(NotCoordinator("not me", leader=None)) and c.current == "tcp://a:1"
    assert c.redirected(RequestTimeout("no reply")) and c.current == "tcp://b:2"
    delays = []
    for _ in range(10):
        c.redirected(RequestTimeout("no reply"))
        delays.append(c.backoff())
    assert delays == sorted(delays) and delays[-1] == Coordinators.BACKOFF_MAX_S
    c.answered()
    assert c.backoff() == Coordinators.BACKOFF_START_S
    assert not c.redirected(BadRequest("no"))


def test_a_coordinator_request_is_sent_again_after_a_backoff_until_its_attempts_run_out():
    c = Coordinators("tcp://a:1,tcp://b:2")
    assert c.retry_in(NotCoordinator("not me", leader=None), attempt=0) == Coordinators.BACKOFF_START_S
    assert c.current == "tcp://b:2"
    assert c.retry_in(BadRequest("no"), attempt=1) is None  # the caller's
    assert c.retry_in(NotCoordinator("not me"), attempt=c.attempts() - 1) is None  # the last attempt raises
    assert Coordinators("tcp://a:1").retry_in(RequestTimeout("no reply"), attempt=0) is None  # one URL: as before


def test_no_connection_to_the_current_coordinator_rotates_as_a_timeout_does():
    # Seen in the failover benchmark: a standby named the killed leader, whose socket then
    # refused every send (UNAVAILABLE, no connection), and the client retried it for ever.
    from zbroker.protocol.errors import Unavailable

    c = Coordinators("tcp://a:1,tcp://b:2")
    c.redirected(NotCoordinator("not me", leader={"endpoint": "tcp://dead:1", "node_id": "d", "epoch": 3}))
    assert c.redirected(Unavailable("no connection to tcp://dead:1", endpoint="tcp://dead:1"))
    assert c.current == "tcp://a:1"
    assert not c.redirected(Unavailable("offsets loading"))  # the coordinator's own answer: the caller's
    assert not Coordinators("tcp://a:1").redirected(Unavailable("no connection", endpoint="tcp://a:1"))


def test_a_leader_that_stopped_answering_is_not_followed_back_until_a_newer_epoch_names_it():
    # Standbys name the killed leader until its lease runs out; going back to it cost a
    # request timeout each time (the failover benchmark's 10.5 s kill).
    from zbroker.protocol.errors import Unavailable

    def named(endpoint, epoch):
        return NotCoordinator("not me", leader={"endpoint": endpoint, "node_id": endpoint, "epoch": epoch})

    c = Coordinators("tcp://a:1,tcp://b:2")
    assert c.redirected(named("tcp://dead:1", 4)) and c.current == "tcp://dead:1"
    assert c.redirected(RequestTimeout("no reply")) and c.current == "tcp://a:1"
    assert c.redirected(named("tcp://dead:1", 4)) and c.current == "tcp://b:2"  # not back to it
    assert c.redirected(named("tcp://dead:1", 3)) and c.current == "tcp://a:1"  # older: neither
    assert c.redirected(named("tcp://b:2", 5)) and c.current == "tcp://b:2"     # the new leader
    assert c.redirected(Unavailable("no connection", endpoint="tcp://b:2")) and c.current == "tcp://a:1"
    assert c.redirected(named("tcp://dead:1", 6)) and c.current == "tcp://dead:1"  # back, leading again
    c.answered()
    c.redirected(Unavailable("no connection", endpoint="tcp://dead:1"))
    c.answered()  # an answer forgets what stopped answering
    c.current = "tcp://a:1"
    assert c.redirected(named("tcp://dead:1", 6)) and c.current == "tcp://dead:1"


def test_rotation_goes_round_the_list_past_the_node_that_stopped_answering():
    from zbroker.protocol.errors import Unavailable

    c = Coordinators("tcp://a:1,tcp://b:2,tcp://c:3")
    c.current = "tcp://c:3"  # the leader, from the list
    assert c.redirected(Unavailable("no connection", endpoint="tcp://c:3")) and c.current == "tcp://a:1"
    seen = []
    for _ in range(4):  # standbys naming the dead leader, until its lease runs out
        c.redirected(NotCoordinator("not me", leader={"endpoint": "tcp://c:3", "node_id": "c", "epoch": 2}))
        seen.append(c.current)
    assert seen == ["tcp://b:2", "tcp://a:1", "tcp://b:2", "tcp://a:1"]
    c.answered()
    assert [c.redirected(NotCoordinator("no leader", leader=None)) and c.current for _ in range(2)] == \
        ["tcp://b:2", "tcp://c:3"]  # back on the round once anything answered


def test_one_url_a_standby_sends_the_client_from_goes_back_to_it_when_the_leader_dies():
    c = Coordinators("tcp://standby:1")
    c.redirected(NotCoordinator("not me", leader={"endpoint": "tcp://leader:1", "node_id": "l", "epoch": 2}))
    assert c.current == "tcp://leader:1"
    assert c.redirected(RequestTimeout("no reply")) and c.current == "tcp://standby:1"
    assert not c.redirected(RequestTimeout("no reply"))  # its own URL: the caller's, as before


def test_a_single_coordinator_url_raises_its_timeouts_as_before():
    c = Coordinators("tcp://a:1")
    assert not c.redirected(RequestTimeout("no reply"))
    assert c.redirected(NotCoordinator("not me", leader=None)) and c.current == "tcp://a:1"
