"""Two real partition actors replicating one partition, with the test as their coordinator
(a ROUTER that answers `register` with a hand-made assignment and serves `alter_isr`)."""

import time

import pytest
import zmq

from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.batch import decode_fetched, encode_records
from zbroker.protocol.errors import ErrorCode, ProtocolError
from tests.fuzz.single_actor import bind_router, spawn_actor, stop_actor

pytestmark = pytest.mark.processes
SETUP_S = 30  # a bound on waiting for what the actors signal, never a timing claim


class FakeCoordinator:
    def __init__(self, tmp_path, names=("a", "b")):
        self.ctx = zmq.Context()
        self.router, self.endpoint = bind_router(self.ctx)
        self.procs = {}
        self.endpoints = {}
        self.identities = {}
        self.isr = list(names)
        self.alter_isr_requests = []
        self.keeping_up = None  # as the leader of t/0 last reported it
        self.assigned = False
        self.holding = set()  # actors whose registration lists a replica of t/0: they opened it
        self.tmp_path = tmp_path
        for name in names:
            self.procs[name] = spawn_actor("zbroker.actors.partition_log.shell:run", name, self.endpoint,
                                           str(tmp_path / name), log_file=str(tmp_path / f"{name}.log"),
                                           log_level="warning", fsync="always", replica_lag_ms=3000)
        self.serve(lambda: len(self.endpoints) == len(names))
        # Registered is not ready: a produce sent before the leader has opened its log
        # gets NOT_OWNER (seen in CI). Every actor says so in its next registration.
        self.serve(lambda: self.holding >= set(names))

    def state(self):
        return {"leader_epoch": 0, "leader": "a", "leader_endpoint": self.endpoints["a"],
                "replicas": list(self.procs), "isr": list(self.isr), "min_insync": 2,
                "replica_endpoints": dict(self.endpoints)}

    def serve(self, done, timeout=SETUP_S):
        """Answer registrations (with the assignment once every actor is known) and alter_isr
        until `done()`."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError("the actors did not get there: " + self.logs())
            if not self.router.poll(50):
                continue
            identity, *frames = self.router.recv_multipart()
            try:
                is_reply, env = codec.decode_any(frames)
            except ProtocolError:
                continue
            if is_reply:
                continue
            if env.op in ("register", "report"):
                for item in env.msg.replica_states:
                    if item[:2] == ["t", 0] and len(item) > 5 and item[5] is not None:
                        self.keeping_up = item[5]
            if env.op == "register":
                self.endpoints[env.msg.actor_id] = env.msg.endpoint
                if any(item[:2] == ["t", 0] for item in env.msg.replica_states):
                    self.holding.add(env.msg.actor_id)
                self.identities[env.msg.actor_id] = identity
                if len(self.endpoints) == len(self.procs):
                    reply = m.RegisterReply(assignment=[["t", 0, None]], coordinator_epoch=1,
                                            replicas=[["t", 0, self.state()]])
                    if not self.assigned:
                        # The first to register was told nothing yet: everyone hears it now.
                        self.assigned = True
                        for other in self.identities.values():
                            self.router.send_multipart([other, *codec.encode_request(
                                m.Assign(assignment=reply.assignment, coordinator_epoch=1,
                                         replicas=reply.replicas), 99)])
                else:
                    reply = m.RegisterReply(assignment=[])
                self.router.send_multipart([identity, *codec.encode_reply(reply, env.corr_id)])
            elif env.op == "alter_isr":
                self.alter_isr_requests.append(env.msg.isr)
                self.isr = list(env.msg.isr)
                reply = m.AlterIsrReply(env.msg.topic, env.msg.partition, env.msg.leader_epoch, self.isr)
                self.router.send_multipart([identity, *codec.encode_reply(reply, env.corr_id)])

    def client(self, name):
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoints[name])
        return sock

    def call(self, sock, msg, frames=()):
        """Send a request and serve the actors until its reply arrives."""
        sock.send_multipart(codec.encode_request(msg, 1, list(frames)))
        replies = []

        def arrived():
            if sock.poll(0):
                replies.append(codec.decode_reply(sock.recv_multipart()))
            return bool(replies)
        self.serve(arrived)
        return replies[0]

    def logs(self):
        return " | ".join(p.read_text(errors="replace")[-1500:] for p in self.tmp_path.glob("*.log"))

    def close(self):
        self.router.close(linger=0)
        for proc in self.procs.values():
            stop_actor(proc)
        self.ctx.term()


@pytest.fixture
def cluster(tmp_path):
    fake = FakeCoordinator(tmp_path)
    yield fake
    fake.close()


def produce_msg(value):
    return m.Produce(topic="t", partition=0), [encode_records([[1, None, value, None]])]


def test_produce_is_acknowledged_after_replication_and_refused_below_min_insync(cluster):
    leader, follower = cluster.client("a"), cluster.client("b")
    try:
        msg, frames = produce_msg(b"one")
        reply = cluster.call(leader, msg, frames)
        assert reply.ok and reply.msg.base_offset == 0, reply.error
        fetched = cluster.call(leader, m.Fetch(topic="t", partition=0, offset=0))
        assert fetched.msg.log_end == 1
        assert [r.value for r in decode_fetched(fetched.frames[0], "t", 0)] == [b"one"]
        refused = cluster.call(follower, m.Fetch(topic="t", partition=0, offset=0))
        assert refused.error.code is ErrorCode.NOT_LEADER
        assert refused.error.data["leader"]["actor_id"] == "a"
        # The follower goes away: the leader counts it out (it stays in the ISR, which may not
        # fall below min_insync), and then refuses produce.
        stop_actor(cluster.procs["b"])
        cluster.serve(lambda: cluster.keeping_up == 1)
        assert ["a"] not in cluster.alter_isr_requests
        msg, frames = produce_msg(b"two")
        late = cluster.call(leader, msg, frames)
        assert late.error.code is ErrorCode.NOT_ENOUGH_REPLICAS
    finally:
        leader.close(linger=0)
        follower.close(linger=0)
    assert (cluster.tmp_path / "b").exists()
