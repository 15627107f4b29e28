"""ISR membership against --replica-lag-ms on a hand-driven clock: a follower's lag counts
from the first append it does not have, so a caught-up follower whose fetch waits at the log
end (the long-poll, FETCH_WAIT_MS = 500 ms) stays in the ISR even with a lag of 300 ms, and one
that stopped fetching leaves it exactly one lag period after the append it missed."""

from zbroker.actors.partition_log.replica import FETCH_WAIT_MS, ProposeIsr, Replica, ReplicaState
from zbroker.protocol import messages as m
from tests.replication.model import MemoryLog

LAG_MS = 300
NAMES = ("a", "b", "c")


def leader_and_followers(now=0):
    state = ReplicaState(1, "a", "a", NAMES, NAMES, 2, {n: n for n in NAMES})
    log = MemoryLog()
    leader = Replica("t", 0, "a", log, state, now, replica_lag_ms=LAG_MS)
    followers = {n: Replica("t", 0, n, MemoryLog(), state, now, replica_lag_ms=LAG_MS) for n in ("b", "c")}
    return leader, log, followers


def fetch(leader, follower, now):
    """One replica_fetch from `follower` answered at once (a woken or unparked fetch)."""
    request = follower.next_fetch(now)
    assert request is not None
    reply, data, effects = leader.on_replica_fetch(request[1], now)
    follower.on_fetch_reply(reply, data, now)
    return effects


def produce(leader, log, batch_id, now):
    base, end = log.append(1, batch_id)
    return leader.hold(batch_id, end, now) + leader.on_local_end(log.log_end, now)


def proposals(effects):
    return [tuple(e.request.isr) for e in effects if isinstance(e, ProposeIsr)]


def test_a_caught_up_follower_long_polling_past_the_lag_stays_in_the_isr():
    assert FETCH_WAIT_MS > LAG_MS  # the case this is about
    leader, log, followers = leader_and_followers()
    produce(leader, log, 0, 0)
    for f in followers.values():
        fetch(leader, f, 1)
        fetch(leader, f, 2)  # at the log end: the shell parks this one for FETCH_WAIT_MS
    # Nothing appended; each parked fetch comes back empty after 500 ms and is sent again.
    effects = []
    for now in range(2, 5000, 50):
        effects += leader.tick(now)
        if (now - 2) % FETCH_WAIT_MS == 0:
            for f in followers.values():
                effects += fetch(leader, f, now)
    assert proposals(effects) == []
    assert leader.isr == NAMES
    # The next wake-up: should the followers not fetch again when their waits end.
    last_fetch = 2 + FETCH_WAIT_MS * ((4999 - 2) // FETCH_WAIT_MS)
    assert leader.deadline_ms() == last_fetch + FETCH_WAIT_MS + LAG_MS + 1


def test_an_append_wakes_the_parked_fetch_and_the_follower_stays_in_the_isr():
    leader, log, followers = leader_and_followers()
    for f in followers.values():
        fetch(leader, f, 0)  # at the (empty) log end, parked
    effects = []
    for i, now in enumerate(range(1000, 6000, 700)):  # an append every 700 ms, > LAG_MS apart
        effects += produce(leader, log, i, now)
        for f in followers.values():
            effects += fetch(leader, f, now + 5)   # the woken fetch takes the batch
            effects += fetch(leader, f, now + 10)  # and the next one waits at the end again
        effects += leader.tick(now + 400)
    assert proposals(effects) == [] and leader.isr == NAMES


def test_a_stopped_follower_leaves_one_lag_period_after_the_append_it_missed():
    leader, log, followers = leader_and_followers()
    for f in followers.values():
        fetch(leader, f, 0)  # both wait at the log end until 500; c stops there
    produce(leader, log, 0, 200)
    fetch(leader, followers["b"], 205)  # b's woken fetch takes it, and its next one says so
    fetch(leader, followers["b"], 210)
    assert leader.deadline_ms() == 200 + LAG_MS + 1
    assert proposals(leader.tick(200 + LAG_MS)) == []
    assert proposals(leader.tick(200 + LAG_MS + 1)) == [("a", "b")]
    leader.on_isr_recorded(m.AlterIsrReply("t", 0, 1, ["a", "b"]), 600)
    assert leader.isr == ("a", "b")


def test_on_an_idle_partition_a_stopped_follower_leaves_one_lag_period_after_its_wait_ran_out():
    leader, log, followers = leader_and_followers()
    produce(leader, log, 0, 0)
    for f in followers.values():
        fetch(leader, f, 1)
        fetch(leader, f, 2)  # at the log end, waiting until 2 + FETCH_WAIT_MS; c stops here
    effects = []
    for now in range(2, 3000, 10):
        if (now - 2) % FETCH_WAIT_MS == 0:
            effects += fetch(leader, followers["b"], now)  # b fetches again each time its wait ends
        effects += leader.tick(now)
        if proposals(effects):
            break
    assert proposals(effects) == [("a", "b")]
    assert now - 10 <= 2 + FETCH_WAIT_MS + LAG_MS < now  # the first tick past its wait and the lag
