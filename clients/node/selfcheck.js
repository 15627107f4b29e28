#!/usr/bin/env node
// Helper for tests/node/test_cross_language.py: runs one piece of the Node client on
// JSON input (stdin) and prints JSON output (stdout). Bytes travel as hex strings; a
// BigInt (an integer above 2^53) as {"$bigint": "<decimal>"}.
//
//   node selfcheck.js <command> [url]
//
// Pure commands: partition, crc, produce-frames, decode-batches, decode-each, decode-reply,
// retriable, doc-example, coordinators.
// Socket commands (need a peer at url): scenarios, group-retry, range-limits, keyless
// (the fake broker of test_cross_language.py), follow (a fake standby before it), live, proto-headers, stale-omitted (a real broker).

import {
  Client, Connection, Coordinators, crc32, decodeHeader, decodeStoredBatches, encodeRecords, partitionForKey,
  produceFrames, RETRIABLE, ZBrokerError,
} from "./zbroker.js";

const hex = (u8) => (u8 === null || u8 === undefined ? null : Buffer.from(u8).toString("hex"));
const unhex = (s) => (s === null || s === undefined ? null : Buffer.from(s, "hex"));

function jsonSafe(value) {
  if (typeof value === "bigint") return { $bigint: value.toString() };  // exact, unlike a JSON number
  if (value instanceof Uint8Array) return { hex: hex(value) };
  if (Array.isArray(value)) return value.map(jsonSafe);
  if (value !== null && typeof value === "object") {
    return Object.fromEntries(Object.entries(value).map(([k, v]) => [k, jsonSafe(v)]));
  }
  return value;
}

function errorJson(err) {
  if (err instanceof ZBrokerError) {
    return { code: err.code, message: err.message, retriable: err.retriable, data: jsonSafe(err.data), local: err.local };
  }
  return { code: "JS_ERROR", message: String(err?.stack ?? err) };
}

/**
 * Run a socket scenario: body(client, results) with a fresh Client, then the results as
 * JSON, with an exception that escaped as results.failure.
 */
async function scenario(url, clientOptions, body) {
  const results = {};
  const client = new Client(url, clientOptions);
  try {
    await body(client, results);
  } catch (err) {
    results.failure = errorJson(err);
  } finally {
    client.close();
  }
  return jsonSafe(results);
}

/** Records from JSON; headers as an object with own properties (as JSON.parse makes), or a Map. */
function inputRecords(records, { headersAsMap = false } = {}) {
  return records.map((r) => {
    const headers = r.headers === null ? null : Object.entries(r.headers).map(([k, v]) => [k, unhex(v)]);
    return {
      key: unhex(r.key),
      value: unhex(r.value),
      headers: headers === null ? null : headersAsMap ? new Map(headers) : Object.fromEntries(headers),
      timestampMs: r.timestampMs,
    };
  });
}

function recordJson(r) {
  return {
    offset: r.offset, timestampMs: jsonSafe(r.timestampMs), key: hex(r.key), value: hex(r.value),
    headers: r.headers === null ? null : Object.fromEntries(Object.entries(r.headers).map(([k, v]) => [k, hex(v)])),
  };
}

const commands = {
  // Where Coordinators sends a client after each error of `errors`, and the backoff then.
  coordinators({ urls, errors }) {
    const c = new Coordinators(urls);
    const steps = errors.map(({ code, leader, local = false, from }) => {
      const again = c.redirected(new ZBrokerError(code, code, { local, data: leader === undefined ? {} : { leader } }),
        from ?? c.current);
      return { again, current: c.current, backoffMs: c.backoffMs() };
    });
    c.answered();
    return { steps, afterAnswer: c.backoffMs(), attempts: c.attempts() };
  },

  // A client given a list (or only a standby) finds the leader: hello, a topic, records in and out.
  async follow({ requestTimeoutMs = 10_000 }, url) {
    return scenario(url, { requestTimeoutMs, retryTimeoutMs: 20_000 }, async (client, r) => {
      const hello = await client.hello();
      r.actor = hello.actor;
      r.features = client.features;
      await client.createTopic("follow", 1);
      await client.produce("follow", [{ value: Buffer.from("a") }, { value: Buffer.from("b") }], { partition: 0 });
      r.fetched = (await client.fetch("follow", 0, 0)).records.map((rec) => rec.value.toString());
      r.topics = (await client.metadata()).map((t) => t.name);
      r.url = client.url;
    });
  },

  partition({ keys, partitions }) {
    return { results: keys.map((k) => partitions.map((n) => partitionForKey(unhex(k), n))) };
  },

  crc({ data }) {
    return { crc: data.map((d) => crc32(unhex(d))) };
  },

  "produce-frames"({ topic, partition, producerId, sequence, id, records, headersAsMap }) {
    const payload = encodeRecords(inputRecords(records, { headersAsMap }));
    const frames = produceFrames({ topic, partition, producerId: BigInt(producerId), sequence, id, payload });
    return { frames: frames.map(hex) };
  },

  "decode-batches"({ blob, fromOffset = 0, untilOffset = null }) {
    try {
      const out = decodeStoredBatches(unhex(blob), { fromOffset, untilOffset: untilOffset ?? Infinity });
      return { records: out.records.map(recordJson), batches: jsonSafe(out.batches), nextOffset: out.nextOffset };
    } catch (err) {
      return { error: errorJson(err) };
    }
  },

  // decode-batches for many blobs in one process; also says whether headers have no prototype.
  "decode-each"({ blobs }) {
    return {
      results: blobs.map((blob) => {
        try {
          const { records } = decodeStoredBatches(unhex(blob));
          return {
            records: records.map(recordJson),
            nullPrototypeHeaders: records.every((r) => r.headers === null || Object.getPrototypeOf(r.headers) === null),
          };
        } catch (err) {
          return { error: errorJson(err) };
        }
      }),
    };
  },

  "decode-reply"({ frames }) {
    const header = decodeHeader(unhex(frames[0]));
    const out = { header: jsonSafe(header) };
    if (header.ok === false) out.error = errorJson(ZBrokerError.fromWire(header.op, header.error));
    return out;
  },

  retriable() {
    return { ...RETRIABLE };
  },

  // The example of PROTOCOL.md section 15, built with the client's own encoders.
  "doc-example"() {
    const payload = encodeRecords([{ key: "user-1", value: "hello", headers: { trace: "abc" }, timestampMs: 1767225600000 }]);
    const partition = partitionForKey("user-1", 4);
    const frames = produceFrames({
      topic: "orders", partition, producerId: 3413179181191910423n, sequence: 0, id: 7, payload,
    });
    return { partition, frames: frames.map(hex) };
  },

  // Socket scenarios against the fake broker of the Python test.
  async scenarios(_input, url) {
    const results = {};
    const client = new Client(url, { requestTimeoutMs: 400, retryTimeoutMs: 5_000 });
    try {
      results.hello = jsonSafe(await client.hello());

      // Version negotiation: a v2-only hello is refused with the supported list.
      const v2 = new Connection(url, { requestTimeoutMs: 2_000 });
      try {
        await v2.hello({ versions: [2] });
        results.v2 = { error: null };
      } catch (err) {
        results.v2 = { error: errorJson(err) };
      } finally {
        v2.close();
      }

      await client.createTopic("sc", 1);
      await client.metadata(["sc"]);

      // Out-of-order replies on one DEALER: a long-polling fetch at log_end is answered
      // after a produce sent later on the same connection.
      const order = [];
      const longFetch = client.fetch("sc", 0, 0, { maxWaitMs: 1_500 }).then((r) => { order.push("fetch"); return r; });
      await new Promise((resolve) => setTimeout(resolve, 100));
      const produced = await client.produce("sc", [{ key: "k", value: "v0" }], { partition: 0 }).then((r) => { order.push("produce"); return r; });
      const fetched = await longFetch;
      results.outOfOrder = { order, produced, fetched: fetched.records.map(recordJson) };

      // Idempotent retry: the fake drops the reply to the next produce once; the client
      // times out, resends the same sequence and gets duplicate: true.
      const before = client.producers.get("sc\u00000");
      const seqBefore = before.sequence;
      const pidBefore = before.producerId;
      const retried = await client.produce("sc", [{ value: "v1" }], { partition: 0 });
      const after = await client.produce("sc", [{ value: "v2" }], { partition: 0 });
      results.retry = {
        retried, after, seqBefore, seqAfter: before.sequence,
        sameProducer: before.producerId === pidBefore, producerId: pidBefore.toString(),
      };
      const all = await client.fetch("sc", 0, 0);
      results.log = all.records.map(recordJson);

      // A wrong-typed field is refused by the Python codec with BAD_REQUEST and its data.
      try {
        await client.call("fetch", { topic: "sc", partition: 0, offset: "zero" });
        results.badRequest = { error: null };
      } catch (err) {
        results.badRequest = { error: errorJson(err) };
      }
    } catch (err) {
      results.failure = errorJson(err);
    } finally {
      client.close();
    }
    return jsonSafe(results);
  },

  // The consumer against injected retriable errors (the fake broker answers the first join,
  // poll, ack and heartbeat with one) and a poll whose reply is lost after its acks applied.
  "group-retry"(_input, url) {
    return scenario(url, { requestTimeoutMs: 500, retryTimeoutMs: 10_000 }, async (client, results) => {
      // Long session: no background heartbeat takes the injected heartbeat error first.
      const consumer = client.consumer("gr-g", ["gr"], { sessionTimeoutMs: 600_000 });
      await client.hello();
      await client.createTopic("gr", 1);
      await client.produce("gr", ["a", "b", "c"], { partition: 0 });
      const joined = await consumer.join();
      results.join = { generation: joined.generation, memberId: joined.member_id };
      const first = await consumer.poll({ maxRecords: 10 });
      results.firstPoll = first.map((d) => d.records.map((r) => r.value.toString()));
      results.ack = await consumer.ack(first);
      try {
        results.heartbeat = { ok: jsonSafe(await consumer.heartbeat()) };
      } catch (err) {
        results.heartbeat = { error: errorJson(err) };
      }
      await client.produce("gr", ["d", "e"], { partition: 0 });
      const second = await consumer.poll({ maxRecords: 10 });
      results.secondPoll = second.map((d) => d.records.map((r) => r.value.toString()));
      await consumer.poll({ maxRecords: 10, acks: second });
      results.pollAcks = consumer.lastPollAcks;
      consumer.close();
    });
  },

  // More ranges than one request may carry, as ack() and as a poll's acks, and one request
  // whose header is over the 1 MiB limit.
  "range-limits"(_input, url) {
    const n = 9000;
    const values = Array.from({ length: n }, (_, i) => `v${i}`);
    // One range per offset of a delivery, so no two ranges overlap.
    const perOffset = (d) => Array.from({ length: d.end - d.start }, (_, i) =>
      [d.topic, d.partition, d.leaseId, d.start + i, d.start + i + 1]);
    return scenario(url, { requestTimeoutMs: 2_000, retryTimeoutMs: 10_000 }, async (client, results) => {
      const consumer = client.consumer("rl-g", ["rl"], { sessionTimeoutMs: 600_000 });
      await client.hello();
      await client.createTopic("rl", 1);
      await client.produce("rl", values, { partition: 0 });
      const [first] = await consumer.poll({ maxRecords: n });
      const bogus = (start) => ["rl", 0, 1n, start, start + 1];  // lease 1 was never granted: stale
      results.ack = await consumer.ack([...perOffset(first), bogus(0)]);
      await client.produce("rl", values, { partition: 0 });
      const [second] = await consumer.poll({ maxRecords: n });
      // The first ranges ride on the poll, the rest go ahead as acks of their own.
      await consumer.poll({ maxRecords: 1, acks: [bogus(1), ...perOffset(second), bogus(2)] });
      results.pollAcks = consumer.lastPollAcks;
      const oversized = Array.from({ length: 80_000 }, (_, i) => ["rl", 0, second.leaseId, n + i % n, n + i % n + 1]);
      try {
        await client.call("ack", { group: "rl-g", member_id: consumer.memberId, generation: consumer.generation,
          ranges: oversized });
        results.oversized = { error: null };
      } catch (err) {
        results.oversized = { error: errorJson(err) };
      }
      consumer.close();
    });
  },

  // produceKeyed with records that have no key, then produce() continuing the rotation.
  keyless(_input, url) {
    return scenario(url, { requestTimeoutMs: 2_000, retryTimeoutMs: 10_000 }, async (client, results) => {
      await client.hello();
      await client.createTopic("kl", 3);
      results.first = await client.produceKeyed("kl", [
        { key: "user-1", value: "a" }, { value: "b" }, "c", { key: null, value: "d" }, { key: "user-2", value: "e" }]);
      results.second = await client.produceKeyed("kl", [{ value: "f" }]);
      results.third = await client.produce("kl", ["g"]);
      results.logs = [];
      for (let p = 0; p < 3; p++) {
        const { records } = await client.fetch("kl", p, 0);
        results.logs.push(records.map((r) => [r.key === null ? null : r.key.toString(), r.value.toString()]));
      }
    });
  },

  // Headers named "__proto__" on a real broker: fetch and consume a record the Python
  // producer wrote with one, and produce two (headers as an object and as a Map).
  "proto-headers"({ topic }, url) {
    const headersJson = (r) => Object.fromEntries(Object.entries(r.headers ?? {}).map(([k, v]) => [k, v.toString()]));
    return scenario(url, { requestTimeoutMs: 5_000, retryTimeoutMs: 10_000 }, async (client, results) => {
      const consumer = client.consumer("proto-g", [topic], { sessionTimeoutMs: 600_000 });
      const { records } = await client.fetch(topic, 0, 0);
      results.fetched = records.map(headersJson);
      const deliveries = await consumer.poll({ maxRecords: 10, maxWaitMs: 1_000 });
      results.consumed = deliveries.flatMap((d) => d.records.map(headersJson));
      results.ack = await consumer.ack(deliveries);
      const fromJson = await client.produce(topic, [{ value: "object", headers: JSON.parse('{"__proto__": "node", "a": "1"}') }],
        { partition: 0 });
      const fromMap = await client.produce(topic, [{ value: "map", headers: new Map([["__proto__", "map"]]) }],
        { partition: 0 });
      results.produced = [fromJson.baseOffset, fromMap.baseOffset];
      consumer.close();
    });
  },

  // produce_many and fetch_many (s.8.3): keyed records over 8 partitions of one actor go in
  // one request; a poll's deliveries of that actor are fetched in one; each record once.
  "multi-partition"(_input, url) {
    return scenario(url, { requestTimeoutMs: 5_000, retryTimeoutMs: 20_000 }, async (client, results) => {
      await client.createTopic("mp", 8);
      const records = Array.from({ length: 400 }, (_x, i) => ({ key: `k${i}`, value: `v${i}` }));
      const produced = await client.produceKeyed("mp", records);
      results.partitions = produced.length;
      results.produced = produced.reduce((n, r) => n + r.count, 0);
      const consumer = client.consumer("mp-g", ["mp"], { sessionTimeoutMs: 60_000 });
      const seen = new Set();
      let duplicates = 0;
      for (let round = 0; round < 100 && seen.size < records.length; round++) {
        const deliveries = await consumer.poll({ maxRecords: 1000, maxWaitMs: 500 });
        for (const d of deliveries) {
          for (const r of d.records) {
            const v = r.value.toString();
            if (seen.has(v)) duplicates += 1;
            seen.add(v);
          }
        }
        if (deliveries.length > 0) await consumer.ack(deliveries);
      }
      results.consumed = seen.size;
      results.duplicates = duplicates;
      const endpoint = await client.endpointFor("mp", 0);
      const conn = await client.actorConnection(endpoint);
      results.features = conn.features;
      const { header } = await conn.request("status", {});
      results.counters = header.actors[0].counters;
      consumer.close();
    });
  },

  // More stale ranges than a STALE_LEASE lists (s.6: at most 1000, the rest counted in
  // data.stale_omitted), as ack() and as a poll's acks, against a real broker.
  "stale-omitted"(_input, url) {
    return scenario(url, { requestTimeoutMs: 5_000, retryTimeoutMs: 10_000 }, async (client, results) => {
      await client.hello();
      await client.createTopic("so", 1);
      const consumer = client.consumer("so-g", ["so"], { sessionTimeoutMs: 60_000 });
      await consumer.join();
      // Lease ids never granted, one per range: every range is stale on its own.
      const bogus = Array.from({ length: 1500 }, (_, i) => ["so", 0, BigInt(i + 1), i, i + 1]);
      results.ack = await consumer.ack(bogus);
      await consumer.poll({ maxRecords: 1, acks: bogus });
      results.pollAcks = consumer.lastPollAcks;
      results.stats = consumer.stats;
      await consumer.leave();
    });
  },

  // Claims of PROTOCOL.md checked against a real broker (tests/node/test_node_client.py).
  async live(_input, url) {
    const r = {};
    const attempt = async (name, fn) => {
      try {
        r[name] = { ok: jsonSafe(await fn()) };
      } catch (err) {
        r[name] = { error: errorJson(err) };
      }
    };
    const client = new Client(url, { requestTimeoutMs: 5_000, retryTimeoutMs: 10_000 });
    const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
    try {
      await attempt("hello", () => client.hello());
      const v2 = new Connection(url, { requestTimeoutMs: 5_000 });
      await attempt("helloV2", () => v2.hello({ versions: [2] }));
      v2.close();
      await attempt("create", () => client.createTopic("live", 1));
      await attempt("createAgain", () => client.createTopic("live", 3));
      await attempt("badName", () => client.createTopic("..bad", 1));
      await attempt("metadataUnknown", () => client.metadata(["no-such-topic"]));
      await attempt("metadata", async () => (await client.metadata(["live"]))[0]);
      const endpoint = await client.endpointFor("live", 0);
      const part = await client.actorConnection(endpoint);
      r.partitionHello = { ok: { actor: part.actor, limits: part.limits } };

      // Idempotence table of section 13, with hand-made sequences.
      const pid = 4242424242424242n;
      const payload = encodeRecords([{ value: "idem", timestampMs: 1 }]);
      const produce = (seq, frames = [payload]) => part.request("produce",
        { topic: "live", partition: 0, producer_id: pid, sequence: seq }, { frames }).then((x) => x.header);
      await attempt("seq0", () => produce(0));
      await attempt("seq0again", () => produce(0));
      await attempt("seq5gap", () => produce(5));
      await attempt("seq3gap", () => produce(3));
      await attempt("seq3again", () => produce(3));
      await attempt("belowOldest", () => produce(-1));
      await attempt("noPayload", () => produce(6, []));
      await attempt("notOwned", () => part.request("fetch", { topic: "live", partition: 7, offset: 0 }));
      await attempt("beyondEnd", () => client.fetch("live", 0, 1_000_000));
      await attempt("badType", () => client.call("fetch", { topic: "live", partition: 0, offset: -1 }));
      await attempt("unknownOpAtCoordinator", () => client.call("produce", { topic: "live", partition: 0 }));

      // Out-of-order replies from a real partition actor: a fetch waiting at log_end is
      // answered after a fetch sent later on the same DEALER, and woken by a produce.
      const order = [];
      const end = (await client.fetch("live", 0, 0)).logEnd;
      const waiting = client.fetch("live", 0, end, { maxWaitMs: 3_000 }).then((x) => { order.push("waiting"); return x; });
      await sleep(200);
      await client.fetch("live", 0, 0).then(() => order.push("immediate"));
      await client.produce("live", [{ value: "wake" }], { partition: 0 });
      const woke = await waiting;
      r.outOfOrder = { order, values: woke.records.map((x) => x.value.toString()) };

      // s.4: a fetch with `follow` is answered under id, id + 1, ...: the connection reserves
      // those ids, so the push that a later produce wakes is never taken for that produce's reply.
      const followFrom = (await client.fetch("live", 0, 0)).logEnd;
      const followed = await part.request("fetch", { topic: "live", partition: 0, offset: followFrom - 1,
        max_wait_ms: 2_000, follow: 3 });
      const next = await part.request("produce", { topic: "live", partition: 0, producer_id: 0n, sequence: -1 },
        { frames: [encodeRecords([{ value: "pushed" }])] });
      r.followReserved = { more: followed.header.more, nextOp: next.header.op, nextOffset: next.header.base_offset,
        followFrom };

      // Leases: expire one (ack_timeout_ms 300) and ack it late; then fence a member.
      await attempt("configure", () => client.configureGroup("live-g", { ackTimeoutMs: 300, mode: "shared" }));
      const a = client.consumer("live-g", ["live"], { sessionTimeoutMs: 10_000 });
      await attempt("joinA", () => a.join());
      const first = await a.poll({ maxRecords: 2, maxWaitMs: 1_000 });
      r.firstPoll = jsonSafe(first.map(({ records, ...d }) => ({ ...d, values: records.map((x) => x.value.toString()) })));
      await sleep(700);
      await attempt("lateAck", () => client.call("ack", {
        group: "live-g", member_id: a.memberId, generation: a.generation,
        ranges: first.map((d) => [d.topic, d.partition, d.leaseId, d.start, d.end]) }));
      const again = await a.poll({ maxRecords: 2, maxWaitMs: 1_000 });
      r.redelivery = jsonSafe(again.map(({ records, ...d }) => d));
      await attempt("ackInTime", () => a.ack(again));
      const b = client.consumer("live-g", ["live"], { sessionTimeoutMs: 10_000 });
      await attempt("joinB", () => b.join());
      const generationBefore = a.generation;
      await attempt("pollAfterRebalance", async () => (await a.poll({ maxRecords: 100, maxWaitMs: 200 })).length);
      r.fence = { stats: a.stats, generationBefore, generationAfter: a.generation };
      await attempt("heartbeat", () => a.heartbeat());
      await sleep(300);
      await attempt("describeGroup", () => client.describeGroup("live-g"));
      await attempt("listGroups", () => client.listGroups());
      await attempt("describeUnknownGroup", () => client.describeGroup("no-such-group"));
      await attempt("describeTopic", () => client.describeTopic("live"));
      await attempt("status", () => client.status());

      // s.8.5 admin operations, their refusals first (live members), then their effects.
      await attempt("deleteGroupLive", () => client.deleteGroup("live-g"));
      await attempt("deleteTopicLive", () => client.deleteTopic("live"));
      await attempt("resetToTime", () => client.resetGroupToTime("live-g", "live", 0));
      await attempt("alterGrow", () => client.alterTopic("live", { partitions: 2, retentionMs: 3_600_000 }));
      await attempt("alterShrink", () => client.alterTopic("live", { partitions: 1 }));
      await attempt("leaveA", () => a.leave());
      await attempt("leaveB", () => b.leave());
      await attempt("deleteGroup", () => client.deleteGroup("live-g"));
      await attempt("deleteGroupAgain", () => client.deleteGroup("live-g"));
      await attempt("deleteTopic", () => client.deleteTopic("live"));
      await attempt("deleteTopicAgain", () => client.deleteTopic("live"));
      await attempt("listTopicsAfterDelete", () => client.listTopics());
    } catch (err) {
      r.failure = errorJson(err);
    } finally {
      client.close();
    }
    return r;
  },
};

async function main() {
  const [command, url] = process.argv.slice(2);
  const fn = commands[command];
  if (fn === undefined) {
    process.stderr.write(`unknown command ${command}; one of ${Object.keys(commands).join(", ")}\n`);
    process.exit(2);
  }
  let raw = "";
  if (!process.stdin.isTTY) {
    for await (const chunk of process.stdin) raw += chunk;
  }
  const input = raw.trim() ? JSON.parse(raw) : {};
  const out = await fn(input, url);
  // Exit only once stdout is flushed: a large write to a pipe completes asynchronously.
  await new Promise((resolve) => process.stdout.write(`${JSON.stringify(out)}\n`, resolve));
}

main().then(() => process.exit(0), (err) => {
  process.stderr.write(`${err?.stack ?? err}\n`);
  process.exit(1);
});
