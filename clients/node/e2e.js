#!/usr/bin/env node
// End-to-end check of the Node client against a running broker.
//
//   node e2e.js <coordinator-url> <topic> [--acks-on-poll]
//
// Creates <topic> (2 partitions) if missing, produces 500 keyed records with headers,
// fetches them back and checks content and order per partition, then consumes them all
// through group "node-e2e" with acks and waits until describe_group shows
// committed == log_end for every partition. With --acks-on-poll the acks of each poll's
// deliveries ride on the next poll (Poll.acks) instead of going as an ack request.
// Prints one JSON summary line on stdout; exits non-zero on any mismatch (details on stderr).

import crypto from "node:crypto";

import { connect, partitionForKey, ZBrokerError } from "./zbroker.js";

const TOTAL = 500;
const PARTITIONS = 2;
const BATCH = 50;
const GROUP = "node-e2e";
const TIMEOUT_MS = Number(process.env.ZBROKER_E2E_TIMEOUT_MS ?? 90_000);

class Mismatch extends Error {}

function check(cond, message) {
  if (!cond) throw new Mismatch(message);
}

const sameBytes = (a, b) => a !== null && b !== null && Buffer.compare(Buffer.from(a), Buffer.from(b)) === 0;

function sameHeaders(got, want) {
  if (got === null) return false;
  const gk = Object.keys(got).sort();
  const wk = Object.keys(want).sort();
  return gk.length === wk.length && gk.every((k, i) => k === wk[i] && sameBytes(got[k], Buffer.from(want[k])));
}

function checkRecord(rec, want, where) {
  check(sameBytes(rec.key, Buffer.from(want.key)), `${where}: key ${rec.key} != ${want.key}`);
  check(sameBytes(rec.value, Buffer.from(want.value)), `${where}: value differs`);
  check(sameHeaders(rec.headers, want.headers), `${where}: headers differ`);
  check(rec.timestampMs === want.timestampMs, `${where}: timestamp ${rec.timestampMs} != ${want.timestampMs}`);
}

async function ensureTopic(client, topic) {
  try {
    return (await client.metadata([topic]))[0];
  } catch (err) {
    if (!(err instanceof ZBrokerError) || err.code !== "UNKNOWN_TOPIC") throw err;
  }
  try {
    await client.createTopic(topic, PARTITIONS);
  } catch (err) {
    if (!(err instanceof ZBrokerError) || err.code !== "TOPIC_EXISTS") throw err;
  }
  return (await client.metadata([topic]))[0];
}

async function produceAll(client, topic, partitions, runId) {
  const byPartition = new Map();
  const t0 = Date.now();
  for (let i = 0; i < TOTAL; i++) {
    const key = `user-${i % 37}`;
    const rec = {
      key, value: JSON.stringify({ run: runId, i }), headers: { run: runId, i: String(i) }, timestampMs: t0 + i,
    };
    const p = partitionForKey(key, partitions);
    if (!byPartition.has(p)) byPartition.set(p, []);
    byPartition.get(p).push(rec);
  }
  // expected[p] = [{offset, ...record}] in production order
  const expected = new Map();
  await Promise.all([...byPartition].map(async ([p, recs]) => {
    const out = [];
    for (let i = 0; i < recs.length; i += BATCH) {
      const batch = recs.slice(i, i + BATCH);
      const res = await client.produce(topic, batch, { partition: p });
      check(res.partition === p, `produce went to ${res.partition}, not ${p}`);
      check(res.count === batch.length, `produce count ${res.count} != ${batch.length}`);
      if (out.length > 0) {
        const prev = out[out.length - 1].offset;
        check(res.baseOffset > prev, `partition ${p}: base offset ${res.baseOffset} not after ${prev}`);
      }
      batch.forEach((r, j) => out.push({ ...r, offset: res.baseOffset + j }));
    }
    expected.set(p, out);
  }));
  return expected;
}

async function fetchBack(client, topic, expected) {
  let fetched = 0;
  for (const [p, want] of expected) {
    const byOffset = new Map();
    let offset = want[0].offset;
    const last = want[want.length - 1].offset;
    let previous = -1;
    while (offset <= last) {
      const res = await client.fetch(topic, p, offset, { maxBytes: 16 * 1024, maxWaitMs: 100 });
      for (const r of res.records) {
        check(r.offset >= offset, `partition ${p}: fetch from ${offset} returned offset ${r.offset}`);
        check(r.offset > previous, `partition ${p}: offsets out of order (${r.offset} after ${previous})`);
        previous = r.offset;
        byOffset.set(r.offset, r);
      }
      check(res.nextOffset > offset || res.batches.length === 0, `partition ${p}: fetch made no progress`);
      check(res.logEnd > last, `partition ${p}: log_end ${res.logEnd} <= last produced ${last}`);
      offset = res.nextOffset;
    }
    for (const w of want) {
      const rec = byOffset.get(w.offset);
      check(rec !== undefined, `partition ${p}: offset ${w.offset} missing from fetch`);
      checkRecord(rec, w, `fetch ${p}@${w.offset}`);
      fetched += 1;
    }
  }
  return fetched;
}

async function consumeAll(client, topic, expected, runId, deadline, acksOnPoll) {
  const want = new Map();
  for (const [p, recs] of expected) for (const r of recs) want.set(`${p}:${r.offset}`, r);
  const lastByPartition = new Map([...expected].map(([p, recs]) => [p, recs[recs.length - 1].offset]));
  const consumer = client.consumer(GROUP, [topic], { sessionTimeoutMs: 10_000 });
  const seen = new Set();
  let committed = null;
  let pending = [];  // with acksOnPoll: the last deliveries, acked by the next poll
  let ackedOnPolls = 0;
  try {
    await consumer.join();
    for (;;) {
      check(Date.now() < deadline, `timed out: consumed ${seen.size}/${TOTAL}, committed ${JSON.stringify(committed)}`);
      const deliveries = await consumer.poll({ maxRecords: 200, maxWaitMs: 200, acks: acksOnPoll ? pending : undefined });
      if (acksOnPoll && pending.length > 0) ackedOnPolls += consumer.lastPollAcks.applied;
      for (const d of deliveries) {
        check(d.start < d.end, `empty lease ${JSON.stringify([d.topic, d.partition, d.start, d.end])}`);
        if (d.topic !== topic) continue;
        check(d.records.length === d.end - d.start,
          `lease ${d.partition} [${d.start}, ${d.end}): fetched ${d.records.length} records`);
        const offsets = d.records.map((r) => r.offset);
        check(offsets.every((o, i) => o === d.start + i), `lease ${d.partition} [${d.start}, ${d.end}): got offsets ${offsets.slice(0, 5)}...`);
        for (const r of d.records) {
          const w = want.get(`${d.partition}:${r.offset}`);
          if (r.headers?.run === undefined || Buffer.from(r.headers.run).toString() !== runId) continue;  // an earlier run's record
          check(w !== undefined, `consumed unexpected ${d.partition}@${r.offset}`);
          checkRecord(r, w, `consume ${d.partition}@${r.offset}`);
          seen.add(`${d.partition}:${r.offset}`);
        }
      }
      if (acksOnPoll) pending = deliveries;
      else if (deliveries.length > 0) await consumer.ack(deliveries);  // stale ranges come back later
      if (seen.size < TOTAL || deliveries.length > 0) continue;
      const group = await client.describeGroup(GROUP);
      const parts = (group.partitions ?? []).filter((x) => x.topic === topic);
      committed = Object.fromEntries(parts.map((x) => [String(x.partition), x.committed]));
      const done = parts.length === lastByPartition.size && parts.every((x) =>
        x.committed === x.log_end && (!lastByPartition.has(x.partition) || x.committed > lastByPartition.get(x.partition)));
      if (done) break;
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
  } finally {
    await consumer.leave().catch(() => {});
    consumer.close();
  }
  return { consumed: seen.size, committed, ackedOnPolls, stats: consumer.stats };
}

async function main() {
  const [url, topic, flag] = process.argv.slice(2);
  if (!url || !topic || (flag !== undefined && flag !== "--acks-on-poll")) {
    process.stderr.write("usage: node e2e.js <coordinator-url> <topic> [--acks-on-poll]\n");
    return 2;
  }
  const deadline = Date.now() + TIMEOUT_MS;
  const runId = crypto.randomBytes(8).toString("hex");
  const client = await connect(url);
  const summary = { produced: 0, fetched: 0, consumed: 0, committed: {} };
  try {
    const meta = await ensureTopic(client, topic);
    const expected = await produceAll(client, topic, meta.partitions.length, runId);
    summary.produced = [...expected.values()].reduce((n, recs) => n + recs.length, 0);
    summary.fetched = await fetchBack(client, topic, expected);
    const consumed = await consumeAll(client, topic, expected, runId, deadline, flag === "--acks-on-poll");
    summary.consumed = consumed.consumed;
    summary.committed = consumed.committed;
    summary.acked_on_polls = consumed.ackedOnPolls;
    check(summary.produced === TOTAL && summary.fetched === TOTAL && summary.consumed === TOTAL,
      `counts differ: ${JSON.stringify(summary)}`);
    process.stderr.write(`consumer stats ${JSON.stringify(consumed.stats)}\n`);
    return 0;
  } catch (err) {
    process.stderr.write(`e2e FAILED: ${err instanceof Mismatch ? err.message : err.stack ?? err}\n`);
    return 1;
  } finally {
    process.stdout.write(`${JSON.stringify(summary)}\n`);
    client.close();
  }
}

const timer = setTimeout(() => {
  process.stderr.write(`e2e FAILED: no result within ${TIMEOUT_MS + 15_000} ms\n`);
  process.exit(3);
}, TIMEOUT_MS + 15_000);
timer.unref();

// Exit once stdout and stderr are flushed (writes to pipes may complete asynchronously).
function exitAfterFlush(code) {
  process.stdout.write("", () => process.stderr.write("", () => process.exit(code)));
}

main().then(exitAfterFlush, (err) => {
  process.stderr.write(`e2e FAILED: ${err.stack ?? err}\n`);
  exitAfterFlush(1);
});
