// zbroker client for Node.js, written from docs/PROTOCOL.md (wire protocol v1) alone.
//
// Theory of operation
// -------------------
// One Connection = one ZeroMQ DEALER to one actor endpoint (PROTOCOL.md s.2).
// Each request gets a fresh correlation id; a single read loop matches
// replies to pending requests by id, because replies may arrive out of order
// (s.4). Every request has its own timeout, since a DEALER silently queues
// requests while a peer is down.
//
// A Client holds the coordinator connection (to one node of a cluster at a time:
// `Coordinators` follows NOT_COORDINATOR's data.leader, or moves to the next
// bootstrap URL on a timeout, with backoff, s.2), one connection per partition
// actor endpoint (taken from `metadata`, s.8.2), a metadata cache, and the
// idempotent-producer state: one (producer_id, next sequence) per
// (topic, partition), with one batch in flight at a time (s.13).
//
// A Consumer (client.consumer(...)) runs the group flow of s.14: join, poll
// for leases, fetch the leased ranges from the owning partition actor, ack
// ranges with their lease ids; FENCED -> re-join with the same member_id,
// UNKNOWN_MEMBER -> join fresh; STALE_LEASE -> those ranges are dropped;
// UNAVAILABLE, SHUTTING_DOWN, TIMEOUT -> back off and retry until
// retryTimeoutMs (the coordinator answers UNAVAILABLE while it reloads
// offsets after a restart). Range sets go RANGES_PER_REQUEST at a time, so a
// header never exceeds the 1 MiB limit; a request whose header would is
// refused locally with TOO_LARGE, since the actor's reply to it carries no id.
//
// Record payloads are read by a strict hand-written reader (PayloadReader):
// headers are null-prototype objects, so any name, "__proto__" included, is
// an ordinary header. Offsets are JS numbers: a fetched batch reaching past
// Number.MAX_SAFE_INTEGER (2^53 - 1) fails with a local TOO_LARGE rather
// than yielding rounded offsets. Lease and producer ids, which do exceed
// 2^53, are BigInts.

import crypto from "node:crypto";
import zlib from "node:zlib";

import { Decoder, Encoder } from "@msgpack/msgpack";
import { Dealer } from "zeromq";

export const PROTOCOL_VERSION = 1;
export const SUPPORTED_VERSIONS = [1];
export const DEFAULT_URL = "tcp://127.0.0.1:7400";
export const CLIENT_NAME = "zbroker-node/0.1.0";

// The frame 0 limit of every actor until its hello says otherwise (s.6, limits.max_header_bytes).
export const DEFAULT_MAX_HEADER_BYTES = 1_048_576;

const BATCH_MAGIC = Buffer.from("ZBB1", "ascii");
export const BATCH_HEADER_SIZE = 44;

// ---------------------------------------------------------------------------------------
// Errors (PROTOCOL.md s.7)
// ---------------------------------------------------------------------------------------

export const RETRIABLE = Object.freeze({
  BAD_REQUEST: false, UNSUPPORTED_VERSION: false, UNKNOWN_OP: false, UNKNOWN_TOPIC: false,
  UNKNOWN_PARTITION: false, TOPIC_EXISTS: false, TOO_LARGE: false, NOT_OWNER: true,
  FENCED: true, UNKNOWN_MEMBER: true, STALE_LEASE: false, OFFSET_OUT_OF_RANGE: false,
  DUPLICATE_SEQUENCE: false, CORRUPT_BATCH: false, UNKNOWN_GROUP: false, UNAUTHORIZED: false,
  UNAVAILABLE: true, SHUTTING_DOWN: true, TIMEOUT: true, INTERNAL: false,
  NOT_LEADER: true, NOT_ENOUGH_REPLICAS: true, STALE_EPOCH: false, NOT_COORDINATOR: true,
  GROUP_NOT_EMPTY: false, INVALID_PARTITIONS: false, TOPIC_IN_USE: false,
});

/** Every error this module throws. `code` is a stable wire code; `data` carries the facts. */
export class ZBrokerError extends Error {
  constructor(code, message, { retriable, data = {}, op = null, local = false } = {}) {
    super(`${code}: ${message}`);
    this.name = "ZBrokerError";
    this.code = code;
    this.retriable = retriable ?? RETRIABLE[code] ?? false;
    this.data = data;
    this.op = op;
    // true when raised by this client (timeout, decode failure), false when sent by an actor
    this.local = local;
  }

  static fromWire(op, error) {
    if (error === null || typeof error !== "object" || typeof error.code !== "string") {
      return new ZBrokerError("INTERNAL", `malformed error reply: ${JSON.stringify(error)}`,
        { op, local: true });
    }
    const known = Object.hasOwn(RETRIABLE, error.code);
    return new ZBrokerError(error.code, String(error.message ?? ""), {
      // unknown codes: behave like INTERNAL but honour the wire flag (s.7)
      retriable: known ? RETRIABLE[error.code] : error.retriable === true,
      data: error.data && typeof error.data === "object" ? error.data : {},
      op,
    });
  }
}

function corrupt(message, data = {}) {
  return new ZBrokerError("CORRUPT_BATCH", message, { data, local: true });
}

// ---------------------------------------------------------------------------------------
// msgpack, frames, batches (PROTOCOL.md s.3, 9, 10, 11, 12)
// ---------------------------------------------------------------------------------------

// msgpack ext types are forbidden in both directions (s.1): this codec encodes nothing
// as ext (so a Date is an error, not a timestamp ext) and rejects every ext on decode.
const NO_EXT = {
  tryToEncode: () => null,
  decode: (_data, type) => { throw new Error(`msgpack ext type ${type} is not allowed`); },
};
// BigInt -> int64/uint64 (producer_id); undefined fields are omitted so defaults apply (s.3).
const encoder = new Encoder({ useBigInt64: true, ignoreUndefined: true, extensionCodec: NO_EXT });
// 64-bit integers are read as BigInt so that none loses precision (lease ids and producer
// ids exceed 2^53); `fromWire` turns every one that fits a JS number back into a number.
const decoder = new Decoder({ extensionCodec: NO_EXT, useBigInt64: true });

/** Decoded msgpack -> JS: integers as numbers when exact, as BigInt above 2^53 (s.1, s.4). */
export function fromWire(value) {
  if (typeof value === "bigint") {
    return value >= BigInt(Number.MIN_SAFE_INTEGER) && value <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(value) : value;
  }
  if (Array.isArray(value)) {
    for (let i = 0; i < value.length; i++) value[i] = fromWire(value[i]);
    return value;
  }
  if (value !== null && typeof value === "object" && !(value instanceof Uint8Array)) {
    for (const k of Object.keys(value)) value[k] = fromWire(value[k]);
  }
  return value;
}

/**
 * Prepare a value for the encoder: with useBigInt64, @msgpack/msgpack writes a JS number
 * outside [-2^31, 2^32) as float64, and the protocol has no floats (s.1): a millisecond
 * timestamp would arrive as a float. Such integers become BigInt (written as int64/uint64),
 * and small BigInts become numbers, so every integer is written in its shortest form.
 * A non-integer number is a programming error.
 */
export function wireValue(value) {
  if (typeof value === "number") {
    if (!Number.isInteger(value)) throw new TypeError(`protocol integers only, got ${value}`);
    if (value >= 0x100000000 || value < -0x80000000) {
      if (!Number.isSafeInteger(value)) throw new RangeError(`integer ${value} is not exact; pass a BigInt`);
      return BigInt(value);
    }
    return value;
  }
  if (typeof value === "bigint") {
    // Small BigInts as numbers, so every integer gets its shortest encoding (as Python's).
    return value >= -0x80000000n && value < 0x100000000n ? Number(value) : value;
  }
  if (Array.isArray(value)) return value.map(wireValue);
  if (value !== null && typeof value === "object" && !(value instanceof Uint8Array)) {
    // Null prototype: a key such as "__proto__" (a record header name) stays a key.
    const out = Object.create(null);
    for (const [k, v] of Object.entries(value)) out[k] = wireValue(v);
    return out;
  }
  return value;
}

export function toBuffer(u8) {
  return Buffer.isBuffer(u8) ? u8 : Buffer.from(u8.buffer, u8.byteOffset, u8.byteLength);
}

/** Bytes of a key, value or header value: Buffer/Uint8Array as is, strings as UTF-8. */
export function toBytes(x) {
  if (x === null || x === undefined) return null;
  if (x instanceof Uint8Array) return x;
  if (typeof x === "string") return Buffer.from(x, "utf8");
  throw new TypeError(`expected bytes or string, got ${typeof x}`);
}

/** IEEE CRC-32 as an unsigned 32-bit number (s.10). */
export function crc32(bytes, initial = 0) {
  return zlib.crc32(bytes, initial) >>> 0;
}

/** partition = crc32(key) mod partitions (s.12). */
export function partitionForKey(key, partitions) {
  if (!Number.isInteger(partitions) || partitions <= 0) throw new RangeError("partitions must be positive");
  const bytes = toBytes(key);
  if (bytes === null) throw new TypeError("a key-less record has no key partition (it may go to any, s.12)");
  return crc32(bytes) % partitions;
}

/** A random non-zero 63-bit producer id, as a BigInt (s.13). */
export function randomProducerId() {
  for (;;) {
    const id = crypto.randomBytes(8).readBigUInt64BE() & ((1n << 63n) - 1n);
    if (id !== 0n) return id;
  }
}

/** Frame 0 of a request: {...fields, v, op, id}. */
export function encodeHeader(op, fields, id, version = PROTOCOL_VERSION) {
  return encoder.encode(wireValue({ ...fields, v: version, op, id }));
}

/** Decode a frame 0 into a plain object; throws a local BAD_REQUEST if it is not a map. */
export function decodeHeader(frame) {
  let header;
  try {
    header = fromWire(decoder.decode(frame));
  } catch (err) {
    throw new ZBrokerError("BAD_REQUEST", `reply header is not valid msgpack: ${err.message}`, { local: true });
  }
  if (header === null || typeof header !== "object" || Array.isArray(header) || header instanceof Uint8Array) {
    throw new ZBrokerError("BAD_REQUEST", "reply header is not a msgpack map", { local: true });
  }
  return header;
}

/**
 * Normalise one record for a payload. Accepts a value (Buffer/Uint8Array/string) or
 * {key, value, headers, timestampMs}; headers is an object or a Map of name -> bytes or
 * string, and every own name is a header, "__proto__" included.
 * Returns [timestamp_ms, key, value, headers] (s.9).
 */
export function normaliseRecord(rec, defaults = {}) {
  const r = rec instanceof Uint8Array || typeof rec === "string" ? { value: rec } : rec;
  if (r === null || typeof r !== "object") throw new TypeError("record must be a value or an object");
  const value = toBytes(r.value);
  if (value === null) throw new TypeError("record value must not be null");
  const key = toBytes(r.key !== undefined ? r.key : defaults.key);
  const ts = r.timestampMs ?? defaults.timestampMs ?? Date.now();
  if (!Number.isSafeInteger(ts)) throw new TypeError("timestampMs must be an integer");
  let headers = null;
  if (r.headers !== undefined && r.headers !== null) {
    // Null prototype, or a header named "__proto__" would set the prototype and vanish.
    headers = Object.create(null);
    const entries = r.headers instanceof Map ? r.headers : Object.entries(r.headers);
    for (const [name, v] of entries) {
      if (typeof name !== "string") throw new TypeError(`header names are strings, got ${typeof name}`);
      headers[name] = toBytes(v) ?? new Uint8Array(0);
    }
  }
  return [ts, key, value, headers];
}

/** The produce payload: a msgpack array of records, at least one (s.9). */
export function encodeRecords(records, defaults = {}) {
  if (!Array.isArray(records) || records.length === 0) throw new TypeError("a batch needs at least one record");
  return encoder.encode(wireValue(records.map((r) => normaliseRecord(r, defaults))));
}

/** Both frames of a produce request (exported for the cross-language checks). */
export function produceFrames({ topic, partition, producerId = 0n, sequence = -1, id, payload }) {
  const header = encodeHeader("produce", {
    topic, partition, producer_id: BigInt(producerId), sequence,
  }, id);
  return [header, payload];
}

// The largest offset a JS number holds exactly. Offsets are u64 on the wire (s.10); this
// client keeps them as numbers, so a batch reaching past this fails loudly instead of
// being rounded to wrong offsets.
const MAX_EXACT_OFFSET = BigInt(Number.MAX_SAFE_INTEGER);

/**
 * Walk the stored batches of a fetch reply's frame 1 (s.10, s.11) and return the records
 * with offsets in [fromOffset, untilOffset). Also returns the batches' headers and the
 * offset after the last batch (nextOffset, or fromOffset when there was none).
 * A batch whose base_offset + record_count exceeds Number.MAX_SAFE_INTEGER is a local
 * TOO_LARGE (data.limit, data.got): its offsets cannot be represented exactly.
 */
export function decodeStoredBatches(blob, { fromOffset = 0, untilOffset = Infinity, verifyCrc = true,
  topic = null, partition = null } = {}) {
  const buf = toBuffer(blob);
  const records = [];
  const batches = [];
  let pos = 0;
  let nextOffset = fromOffset;
  while (pos < buf.length) {
    if (buf.length - pos < BATCH_HEADER_SIZE) throw corrupt("short batch header", { position: pos });
    if (!buf.subarray(pos, pos + 4).equals(BATCH_MAGIC)) throw corrupt("bad batch magic", { position: pos });
    const crc = buf.readUInt32BE(pos + 4);
    const length = buf.readUInt32BE(pos + 8);
    const exactBase = buf.readBigUInt64BE(pos + 12);
    const count = buf.readUInt32BE(pos + 20);
    const appendTimeMs = Number(buf.readBigInt64BE(pos + 24));
    const producerId = buf.readBigInt64BE(pos + 32);
    const producerSeq = buf.readInt32BE(pos + 40);
    if (count === 0) throw corrupt("batch with zero records", { position: pos });
    const end = pos + BATCH_HEADER_SIZE + length;
    if (end > buf.length) throw corrupt("batch runs past the end of the frame", { position: pos });
    if (verifyCrc && crc32(buf.subarray(pos + 8, end)) !== crc) {
      throw corrupt("batch CRC mismatch", { position: pos, base_offset: exactBase });
    }
    if (exactBase + BigInt(count) > MAX_EXACT_OFFSET) {
      throw new ZBrokerError("TOO_LARGE",
        `batch at offset ${exactBase} (${count} records) reaches past 2^53 - 1, the largest offset this client represents exactly`,
        { local: true, data: { limit: Number.MAX_SAFE_INTEGER, got: exactBase + BigInt(count), base_offset: exactBase, topic, partition } });
    }
    const base = Number(exactBase);
    batches.push({ baseOffset: base, recordCount: count, appendTimeMs, producerId, producerSeq, crc });
    nextOffset = base + count;
    if (base + count > fromOffset && base < untilOffset) {
      readRecordPayload(buf, pos + BATCH_HEADER_SIZE, end, count,
        { baseOffset: base, fromOffset, untilOffset, topic, partition, into: records });
    }
    pos = end;
  }
  return { records, batches, nextOffset };
}

// ---------------------------------------------------------------------------------------
// The record payload reader (PROTOCOL.md s.9)
// ---------------------------------------------------------------------------------------
//
// Why not @msgpack/msgpack: a header name is application data, and that decoder refuses
// the map key "__proto__" (which the broker accepts), so one such record would fail every
// fetch of its batch. A payload can only be a msgpack array of
// [timestamp_ms int, key bin|nil, value bin, headers nil|map str->bin] (the partition
// actor refuses anything else on produce), so this reader accepts exactly that: headers
// become null-prototype objects (any name is an ordinary key), keys and values are views
// into the fetched frame (no copy), and anything else is CORRUPT_BATCH. It is the consume
// path, so it reads bytes directly and allocates only what it returns.

const strictUtf8 = new TextDecoder("utf-8", { fatal: true });

class PayloadReader {
  constructor(buf, start, end, baseOffset) {
    this.buf = buf;
    this.pos = start;
    this.end = end;
    this.baseOffset = baseOffset;
  }

  fail(what) {
    throw corrupt(`stored payload: ${what}`, { base_offset: this.baseOffset, position: this.pos });
  }

  /** Advance over `n` bytes and return where they start. */
  take(n) {
    const at = this.pos;
    if (this.end - at < n) this.fail("truncated");
    this.pos = at + n;
    return at;
  }

  arrayLength(what) {
    const b = this.buf[this.take(1)];
    if (b >= 0x90 && b <= 0x9f) return b & 0x0f;
    if (b === 0xdc) return this.buf.readUInt16BE(this.take(2));
    if (b === 0xdd) return this.buf.readUInt32BE(this.take(4));
    return this.fail(`${what} is not an array`);
  }

  /** A msgpack int of any width, as a number when exact, else a BigInt (as fromWire). */
  int() {
    const buf = this.buf;
    const b = buf[this.take(1)];
    if (b <= 0x7f) return b;
    if (b >= 0xe0) return b - 0x100;
    switch (b) {
      case 0xcc: return buf[this.take(1)];
      case 0xcd: return buf.readUInt16BE(this.take(2));
      case 0xce: return buf.readUInt32BE(this.take(4));
      case 0xcf: return fromWire(buf.readBigUInt64BE(this.take(8)));
      case 0xd0: return buf.readInt8(this.take(1));
      case 0xd1: return buf.readInt16BE(this.take(2));
      case 0xd2: return buf.readInt32BE(this.take(4));
      case 0xd3: return fromWire(buf.readBigInt64BE(this.take(8)));
      default: return this.fail("timestamp is not an int");
    }
  }

  /** A bin as a Buffer view; null for nil when `nilAllowed`. */
  bin(what, nilAllowed = false) {
    const buf = this.buf;
    const b = buf[this.take(1)];
    let length;
    if (b === 0xc4) length = buf[this.take(1)];
    else if (b === 0xc5) length = buf.readUInt16BE(this.take(2));
    else if (b === 0xc6) length = buf.readUInt32BE(this.take(4));
    else if (b === 0xc0 && nilAllowed) return null;
    else return this.fail(`${what} is not bin`);
    const at = this.take(length);
    return buf.subarray(at, at + length);
  }

  str(what) {
    const buf = this.buf;
    const b = buf[this.take(1)];
    let length;
    if (b >= 0xa0 && b <= 0xbf) length = b & 0x1f;
    else if (b === 0xd9) length = buf[this.take(1)];
    else if (b === 0xda) length = buf.readUInt16BE(this.take(2));
    else if (b === 0xdb) length = buf.readUInt32BE(this.take(4));
    else return this.fail(`${what} is not str`);
    const at = this.take(length);
    const stop = at + length;
    let ascii = true;
    for (let i = at; i < stop; i++) {
      if (buf[i] > 0x7f) { ascii = false; break; }
    }
    if (ascii) return buf.toString("latin1", at, stop);
    try {
      return strictUtf8.decode(buf.subarray(at, stop));
    } catch {
      return this.fail(`${what} is not valid UTF-8`);
    }
  }

  headers() {
    const buf = this.buf;
    const b = buf[this.pos];
    let entries;
    if (b === 0xc0) { this.pos += 1; return null; }
    if (b >= 0x80 && b <= 0x8f) { this.pos += 1; entries = b & 0x0f; }
    else if (b === 0xde) { this.take(1); entries = buf.readUInt16BE(this.take(2)); }
    else if (b === 0xdf) { this.take(1); entries = buf.readUInt32BE(this.take(4)); }
    else return this.fail("headers are neither a map nor nil");
    const headers = Object.create(null);
    for (let i = 0; i < entries; i++) {
      const name = this.str("header name");
      headers[name] = this.bin("header value");
    }
    return headers;
  }
}

/**
 * Read the `count` records of the payload buf[start, end) of the batch at baseOffset and
 * push those with offsets in [fromOffset, untilOffset) onto `into` as record objects.
 */
function readRecordPayload(buf, start, end, count, { baseOffset, fromOffset, untilOffset, topic, partition, into }) {
  const reader = new PayloadReader(buf, start, end, baseOffset);
  if (reader.arrayLength("payload") !== count) reader.fail("record count does not match header");
  for (let i = 0; i < count; i++) {
    if (reader.arrayLength("record") !== 4) reader.fail("record is not a 4-array");
    const timestampMs = reader.int();
    const key = reader.bin("key", true);
    const value = reader.bin("value");
    const headers = reader.headers();
    const offset = baseOffset + i;
    if (offset < fromOffset || offset >= untilOffset) continue;  // first batch may start below
    into.push({ topic, partition, offset, timestampMs, key, value, headers });
  }
  if (reader.pos !== end) reader.fail("bytes after the last record");
}

// ---------------------------------------------------------------------------------------
// One DEALER to one actor (PROTOCOL.md s.2, 3, 4)
// ---------------------------------------------------------------------------------------

export class Connection {
  constructor(url, { requestTimeoutMs = 10_000 } = {}) {
    this.url = url;
    this.requestTimeoutMs = requestTimeoutMs;
    this.version = PROTOCOL_VERSION;
    this.socket = new Dealer({ linger: 0 });
    this.socket.connect(url);
    this.nextId = 1;
    this.pending = new Map();
    this.sendChain = Promise.resolve();  // zeromq v6 allows one send() at a time
    this.closed = false;
    this.reader = this.#readLoop();
  }

  async #readLoop() {
    try {
      for await (const frames of this.socket) {
        let header;
        try {
          header = decodeHeader(frames[0]);
        } catch {
          continue;  // nothing to match it to
        }
        const waiter = this.pending.get(header.id);
        if (waiter === undefined) continue;  // late reply to a timed-out request, or id nil
        this.pending.delete(header.id);
        clearTimeout(waiter.timer);
        if (header.ok === true) {
          waiter.resolve({ header, frames: frames.slice(1) });
        } else if (header.ok === false) {
          waiter.reject(ZBrokerError.fromWire(header.op ?? waiter.op, header.error));
        } else {
          waiter.reject(new ZBrokerError("BAD_REQUEST", "reply carries no 'ok'", { op: waiter.op, local: true }));
        }
      }
    } catch (err) {
      if (!this.closed) this.#failAll(new ZBrokerError("UNAVAILABLE", `socket error: ${err.message}`, { local: true }));
    }
  }

  #failAll(err) {
    for (const [id, waiter] of this.pending) {
      clearTimeout(waiter.timer);
      waiter.reject(err);
      this.pending.delete(id);
    }
  }

  /**
   * Send one request; resolve with {header, frames} of an ok reply, reject with ZBrokerError.
   * timeoutMs: local deadline for the reply (TIMEOUT, retriable, local=true).
   * A header over the actor's max_header_bytes is a local TOO_LARGE (data.limit, data.got)
   * and is not sent: the actor would answer it with id nil, which matches no request (s.6).
   */
  request(op, fields = {}, { frames = [], timeoutMs = this.requestTimeoutMs } = {}) {
    if (this.closed) return Promise.reject(new ZBrokerError("SHUTTING_DOWN", "connection closed", { op, local: true }));
    const id = this.nextId++;
    // A fetch with `follow` gets its later replies under id + 1 .. id + follow (s.4): reserve them,
    // so that they match no other request (they are dropped here, like any unmatched reply).
    if (op === "fetch" && Number.isInteger(fields.follow) && fields.follow > 0) this.nextId += fields.follow;
    const header = encodeHeader(op, fields, id, this.version);
    const limit = this.limits?.max_header_bytes ?? DEFAULT_MAX_HEADER_BYTES;
    if (header.length > limit) {
      return Promise.reject(new ZBrokerError("TOO_LARGE",
        `${op} header is ${header.length} bytes, over the ${limit}-byte limit of ${this.url}`,
        { op, local: true, data: { limit, got: header.length } }));
    }
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        if (this.pending.delete(id)) {
          reject(new ZBrokerError("TIMEOUT", `no reply to ${op} from ${this.url} within ${timeoutMs} ms`,
            { op, local: true, data: { timeout_ms: timeoutMs } }));
        }
      }, timeoutMs);
      this.pending.set(id, { resolve, reject, timer, op });
      this.sendChain = this.sendChain
        .then(() => this.socket.send([header, ...frames]))
        .catch((err) => {
          if (this.pending.delete(id)) {
            clearTimeout(timer);
            reject(new ZBrokerError("UNAVAILABLE", `send failed: ${err.message}`, { op, local: true }));
          }
        });
    });
  }

  /** hello (s.5, 8.1): negotiate the version, return the reply header. */
  async hello({ versions = SUPPORTED_VERSIONS, client = CLIENT_NAME, token } = {}) {
    this.version = Math.min(...versions);
    const { header } = await this.request("hello", { versions, client, token });
    if (!versions.includes(header.version)) {
      throw new ZBrokerError("UNSUPPORTED_VERSION", `actor chose version ${header.version}`,
        { local: true, data: { supported: [header.version] } });
    }
    this.version = header.version;
    this.limits = header.limits ?? {};
    this.actor = header.actor;
    // What the actor supports beyond the base protocol (s.8.1); an older actor sends none,
    // and an unknown string is ignored by whoever checks for a known one.
    this.features = Array.isArray(header.features) ? header.features.filter((f) => typeof f === "string") : [];
    return header;
  }

  close() {
    if (this.closed) return;
    this.closed = true;
    this.#failAll(new ZBrokerError("SHUTTING_DOWN", "connection closed", { local: true }));
    this.socket.close();
  }
}

// ---------------------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------------------

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** Capped exponential backoff before retry number `attempt` (from 0), never past `deadline`. */
function backoffMs(attempt, deadline) {
  return Math.max(0, Math.min(25 * 2 ** attempt, 1000, deadline - Date.now()));
}
// Errors after which a partition request is retried once metadata has been refreshed (s.7).
const REFRESH_CODES = new Set(["NOT_OWNER", "NOT_LEADER", "UNAVAILABLE", "SHUTTING_DOWN", "TIMEOUT"]);

/** The coordinator URLs of a client URL argument: a comma-separated string, or an array. */
export function bootstrapUrls(url) {
  const parts = Array.isArray(url) ? url : String(url).split(",");
  const urls = [...new Set(parts.map((u) => String(u).trim()).filter((u) => u.length > 0))];
  if (urls.length === 0) {
    throw new ZBrokerError("BAD_REQUEST", `no coordinator URL in ${JSON.stringify(url)} (a URL looks like tcp://HOST:PORT)`,
      { local: true, data: { field: "url" } });
  }
  return urls;
}

/**
 * The bootstrap list and the coordinator a client talks to now (s.2), as the Python
 * client's `Coordinators`. NOT_COORDINATOR naming a leader (data.leader.endpoint) moves
 * the client there; naming none (mid-failover) or naming the current one moves it to the
 * next URL, as does a TIMEOUT when there are several (or when the client was sent to a
 * leader not on its list). The caller retries after backoffMs(): 50 ms doubling to 2 s
 * while the failures go on, reset by the first answer. A leader that stopped answering is
 * remembered with the epoch it was named at: standbys name it until its lease runs out,
 * and a redirect to it at that epoch or older moves on through the list instead (each
 * return to it cost a request timeout). No I/O.
 */
export class Coordinators {
  static BACKOFF_START_MS = 50;
  static BACKOFF_MAX_MS = 2000;

  constructor(url) {
    this.urls = bootstrapUrls(url);
    this.current = this.urls[0];
    this.failures = 0;
    this.currentEpoch = null;   // the epoch `current` was named leader at, if it was
    this.unreachable = null;    // {endpoint, epoch} of the leader that stopped answering
  }

  /**
   * After `err` from the coordinator at `from`: true when the request should go again (to
   * `current`, after backoffMs()). An error from where the client no longer is (a concurrent
   * request already moved it) moves nothing more.
   */
  redirected(err, from = this.current) {
    if (!(err instanceof ZBrokerError)) return false;
    const silent = err.code === "TIMEOUT" && err.local && (this.urls.length > 1 || !this.urls.includes(this.current));
    const redirecting = err.code === "NOT_COORDINATOR" || silent;
    if (redirecting && from !== this.current) return true;
    if (err.code === "NOT_COORDINATOR") {
      const endpoint = err.data?.leader?.endpoint;
      const epoch = Number.isInteger(err.data?.leader?.epoch) ? err.data.leader.epoch : null;
      if (typeof endpoint === "string" && endpoint.length > 0 && endpoint !== this.current
          && !this.#knownUnreachable(endpoint, epoch)) {
        this.current = endpoint;
        this.currentEpoch = epoch;
      } else {
        this.#rotate();
      }
      this.failures += 1;
      return true;
    }
    if (silent) {
      this.unreachable = { endpoint: this.current, epoch: this.currentEpoch };
      this.#rotate();
      this.failures += 1;
      return true;
    }
    return false;
  }

  #knownUnreachable(endpoint, epoch) {
    const u = this.unreachable;
    if (u === null || u.endpoint !== endpoint) return false;
    return u.epoch === null || epoch === null || epoch <= u.epoch;
  }

  #rotate() {
    this.currentEpoch = null;
    const i = this.urls.indexOf(this.current);
    // A leader we were sent to that stopped answering is not on the list: back to its start.
    this.current = i < 0 ? this.urls[0] : this.urls[(i + 1) % this.urls.length];
    if (this.urls.length > 1 && this.unreachable !== null && this.current === this.unreachable.endpoint) {
      // Round the list past the one that stopped answering; an answer puts it back.
      this.current = this.urls[(this.urls.indexOf(this.current) + 1) % this.urls.length];
    }
  }

  backoffMs() {
    return Math.min(Coordinators.BACKOFF_MAX_MS, Coordinators.BACKOFF_START_MS * 2 ** Math.max(0, this.failures - 1));
  }

  answered() {
    this.failures = 0;
    this.unreachable = null;
  }

  /** How many redirects one call follows before giving up: every URL a few times over. */
  attempts() {
    return 4 * this.urls.length + 4;
  }
}

/** Open a client to the coordinator at `url` (one URL, a comma-separated list, or an array) and say hello. */
export async function connect(url = DEFAULT_URL, options = {}) {
  const client = new Client(url, options);
  try {
    await client.hello();
  } catch (err) {
    client.close();
    throw err;
  }
  return client;
}

export class Client {
  /**
   * requestTimeoutMs: local timeout of one request attempt.
   * retryTimeoutMs: how long a produce, fetch or consumer group request keeps retrying
   * retriable errors.
   */
  constructor(url = DEFAULT_URL, { requestTimeoutMs = 10_000, retryTimeoutMs = 30_000, clientName = CLIENT_NAME } = {}) {
    this.bootstrap = new Coordinators(url);
    this.url = this.bootstrap.current;
    this.requestTimeoutMs = requestTimeoutMs;
    this.retryTimeoutMs = retryTimeoutMs;
    this.clientName = clientName;
    this.coordinator = new Connection(this.url, { requestTimeoutMs });
    this.features = [];            // of the coordinator's last hello
    this.actors = new Map();       // endpoint -> {conn, ready: Promise}
    this.topics = new Map();       // topic -> {name, partitions: [{partition, endpoint, actor_id}], config}
    this.producerId = randomProducerId();
    this.producers = new Map();    // "topic\0partition" -> {producerId, sequence, tail: Promise}
    this.roundRobin = new Map();   // topic -> next partition for key-less batches
    this.closed = false;
  }

  /** Send a request to the coordinator; returns the reply header. */
  async call(op, fields = {}, options = {}) {
    const { header } = await this.#toCoordinator((conn) => conn.request(op, fields, options));
    return header;
  }

  /** hello to the coordinator: its version, limits and `features` (kept in this.features). */
  async hello() {
    const header = await this.#toCoordinator((conn) => conn.hello({ client: this.clientName }));
    this.features = this.coordinator.features;
    return header;
  }

  /**
   * `send(connection)` to the coordinator that leads: a NOT_COORDINATOR answer, or with
   * several URLs a timeout, moves the connection (this.url says where it is now) and sends
   * again after a backoff, up to bootstrap.attempts() times; a failover is a pause, not an
   * error. Other errors are the caller's.
   */
  async #toCoordinator(send) {
    for (let attempt = 0; ; attempt++) {
      const conn = this.coordinator;
      try {
        const reply = await send(conn);
        this.bootstrap.answered();
        return reply;
      } catch (err) {
        // A request on a connection another one closed when it moved: sent again where the client is now.
        if (conn !== this.coordinator && !this.closed && attempt + 1 < this.bootstrap.attempts()) continue;
        if (this.closed || attempt + 1 >= this.bootstrap.attempts() || !this.bootstrap.redirected(err, conn.url)) {
          throw err;
        }
        if (this.bootstrap.current !== this.coordinator.url) {
          this.coordinator.close();
          this.coordinator = new Connection(this.bootstrap.current, { requestTimeoutMs: this.requestTimeoutMs });
          this.url = this.bootstrap.current;
        }
        await sleep(this.bootstrap.backoffMs());
      }
    }
  }

  status() {
    return this.call("status");
  }

  // -- topics ---------------------------------------------------------------------------

  async createTopic(topic, partitions = 1, config = undefined) {
    return this.call("create_topic", { topic, partitions, config });
  }

  /** metadata for `topics` (all when omitted); refreshes the endpoint cache. */
  async metadata(topics = undefined) {
    const reply = await this.call("metadata", { topics });
    for (const t of reply.topics) this.topics.set(t.name, t);
    return reply.topics;
  }

  async listTopics() {
    return (await this.call("list_topics")).topics;
  }

  async describeTopic(topic) {
    return this.call("describe_topic", { topic });
  }

  // Admin operations (PROTOCOL.md s.8.5); an older broker answers each UNKNOWN_OP.

  /** changes: {partitions, retentionMs, retentionBytes}; omitted = unchanged (partitions only grow). */
  async alterTopic(topic, changes = {}) {
    return this.call("alter_topic", { topic, partitions: changes.partitions, retention_ms: changes.retentionMs,
      retention_bytes: changes.retentionBytes });
  }

  /** Refused TOPIC_IN_USE while live members consume it. The broker answers once the files and
   * the groups' offsets are gone (up to 4 s), so this waits longer than other requests. */
  async deleteTopic(topic) {
    this.topics.delete(topic);
    return this.call("delete_topic", { topic }, { timeoutMs: Math.max(10_000, this.requestTimeoutMs ?? 0) });
  }

  async partitionCount(topic) {
    if (!this.topics.has(topic)) await this.metadata([topic]);
    return this.topics.get(topic).partitions.length;
  }

  // -- groups (admin) -------------------------------------------------------------------

  async listGroups() {
    return (await this.call("list_groups")).groups;
  }

  async describeGroup(group) {
    return (await this.call("describe_group", { group })).group;
  }

  /** settings: {mode, ackTimeoutMs, maxDeliveries, maxInFlight, dlq, start}; omitted = unchanged. */
  async configureGroup(group, settings = {}) {
    const reply = await this.call("configure_group", {
      group, mode: settings.mode, ack_timeout_ms: settings.ackTimeoutMs,
      max_deliveries: settings.maxDeliveries, max_in_flight: settings.maxInFlight,
      dlq: settings.dlq, start: settings.start,
    });
    return reply.config;
  }

  async resetGroup(group, topic, to) {
    return this.call("reset_group", { group, topic, to });
  }

  /** Each partition to its first offset appended at or after `timeMs` (wall-clock ms since 1970). */
  async resetGroupToTime(group, topic, timeMs) {
    return this.call("reset_group", { group, topic, to_time_ms: timeMs });
  }

  /** Refused GROUP_NOT_EMPTY while it has live members; its offsets go for good. */
  async deleteGroup(group) {
    return this.call("delete_group", { group });
  }

  consumer(group, topics, options = {}) {
    return new Consumer(this, group, topics, options);
  }

  // -- partition actors -----------------------------------------------------------------

  /** Endpoint of the actor owning (topic, partition); waits while it is unplaced (nil). */
  async endpointFor(topic, partition, { refresh = false, deadline = Date.now() + this.retryTimeoutMs } = {}) {
    for (let attempt = 0; ; attempt++) {
      if (refresh || attempt > 0 || !this.topics.has(topic)) await this.metadata([topic]);
      const meta = this.topics.get(topic);
      const p = meta?.partitions.find((x) => x.partition === partition);
      if (p === undefined) {
        throw new ZBrokerError("UNKNOWN_PARTITION", `${topic}/${partition} is not in metadata`,
          { local: true, data: { topic, partition } });
      }
      if (p.endpoint) return p.endpoint;
      if (Date.now() >= deadline) {
        throw new ZBrokerError("UNAVAILABLE", `${topic}/${partition} has no endpoint`, { local: true, data: { topic, partition } });
      }
      await sleep(Math.min(50 * 2 ** attempt, 500));
    }
  }

  /** The connection to a partition actor, said hello to once (to learn its limits). */
  async actorConnection(endpoint) {
    let entry = this.actors.get(endpoint);
    if (entry === undefined) {
      const conn = new Connection(endpoint, { requestTimeoutMs: this.requestTimeoutMs });
      entry = { conn, ready: conn.hello({ client: this.clientName }) };
      this.actors.set(endpoint, entry);
    }
    try {
      await entry.ready;
    } catch (err) {
      if (this.actors.get(endpoint) === entry) this.actors.delete(endpoint);
      entry.conn.close();
      throw err;
    }
    return entry.conn;
  }

  /**
   * A request to the actor owning (topic, partition). Retriable errors (NOT_OWNER,
   * UNAVAILABLE, SHUTTING_DOWN, TIMEOUT) refresh metadata and retry until retryTimeoutMs,
   * resending exactly the same fields and frames.
   */
  async partitionRequest(topic, partition, op, fields, { frames = [], timeoutMs } = {}) {
    const deadline = Date.now() + this.retryTimeoutMs;
    let refresh = false;
    for (let attempt = 0; ; attempt++) {
      try {
        const endpoint = await this.endpointFor(topic, partition, { refresh, deadline });
        const conn = await this.actorConnection(endpoint);
        if (op === "produce" && frames[0] && conn.limits?.max_batch_bytes !== undefined
            && frames[0].length > conn.limits.max_batch_bytes) {
          throw new ZBrokerError("TOO_LARGE", "batch payload exceeds the actor's max_batch_bytes",
            { local: true, data: { limit: conn.limits.max_batch_bytes, got: frames[0].length } });
        }
        return await conn.request(op, fields, { frames, timeoutMs: timeoutMs ?? this.requestTimeoutMs });
      } catch (err) {
        if (!(err instanceof ZBrokerError) || !REFRESH_CODES.has(err.code) || Date.now() >= deadline || this.closed) throw err;
        refresh = true;
        await sleep(backoffMs(attempt, deadline));
      }
    }
  }

  // -- produce (s.8.3, 9, 12, 13) -------------------------------------------------------

  /**
   * Append `records` as ONE batch to one partition of `topic`.
   * records: values (Buffer/Uint8Array/string) or {key, value, headers, timestampMs}.
   * options.partition: target partition; otherwise options.key picks it with the key
   * partitioner (and is the default key of every record); otherwise round-robin.
   * Returns {topic, partition, baseOffset, count, duplicate}.
   */
  async produce(topic, records, { partition, key, timestampMs } = {}) {
    const payload = encodeRecords(records, { key, timestampMs: timestampMs ?? Date.now() });
    const n = await this.partitionCount(topic);
    if (partition === undefined || partition === null) {
      partition = key !== undefined && key !== null ? partitionForKey(key, n) : this.#nextRoundRobin(topic, n);
    }
    const stream = this.#producerStream(topic, partition);
    // One batch in flight per (producer, topic, partition): chain on the previous one.
    const run = stream.tail.then(() => this.#produceOne(stream, topic, partition, payload));
    stream.tail = run.catch(() => {});
    return run;
  }

  /**
   * Produce records that carry their own keys: group them by partition (one batch per
   * partition, in input order) and produce the batches concurrently. Returns the results.
   * Records without a key (nor options.key) may go anywhere (s.12): together they join the
   * batch of the next round-robin partition, as produce() rotates one batch at a time.
   */
  async produceKeyed(topic, records, options = {}) {
    const n = await this.partitionCount(topic);
    const byPartition = new Map();
    let keylessPartition = null;
    for (const rec of records) {
      const key = rec?.key ?? options.key ?? null;
      const p = key !== null ? partitionForKey(key, n) : (keylessPartition ??= this.#nextRoundRobin(topic, n));
      if (!byPartition.has(p)) byPartition.set(p, []);
      byPartition.get(p).push(rec);
    }
    // The partitions of one actor that serves produce_many go in one request (s.8.3, "Many
    // partitions in one request"); the rest, and every partition of an older actor, alone.
    const byActor = new Map();
    const alone = [];
    for (const [p, recs] of byPartition) {
      const conn = byPartition.size > 1 ? await this.#multiPartitionActor(topic, p) : null;
      if (conn === null) { alone.push([p, recs]); continue; }
      if (!byActor.has(conn)) byActor.set(conn, []);
      byActor.get(conn).push([p, recs]);
    }
    const results = new Map();
    const runs = alone.map(([p, recs]) => this.produce(topic, recs, { ...options, partition: p })
      .then((r) => results.set(p, r)));
    for (const [conn, group] of byActor) {
      const payloads = group.map(([p, recs]) => [p, encodeRecords(recs, { key: options.key,
        timestampMs: options.timestampMs ?? Date.now() })]);
      runs.push(this.#produceMany(topic, payloads, conn).then((rs) => rs.forEach((r) => results.set(r.partition, r))));
    }
    await Promise.all(runs);
    return [...byPartition.keys()].map((p) => results.get(p));
  }

  /** The connection to the actor of (topic, partition) if it serves produce_many and fetch_many, else null. */
  multiPartitionActorFor(topic, partition) {
    return this.#multiPartitionActor(topic, partition);
  }

  async #multiPartitionActor(topic, partition) {
    try {
      const conn = await this.actorConnection(await this.endpointFor(topic, partition));
      return conn.features?.includes("multi_partition") ? conn : null;
    } catch {
      return null;  // the single-partition path retries and reports it
    }
  }

  /** One produce_many of [partition, payload] batches, each on its partition's producer stream. */
  #produceMany(topic, payloads, conn) {
    const streams = payloads.map(([p]) => this.#producerStream(topic, p));
    const run = Promise.all(streams.map((s) => s.tail)).then(() => this.#produceManyOnce(topic, payloads, streams, conn));
    for (const s of streams) s.tail = run.catch(() => {});
    return run;
  }

  async #produceManyOnce(topic, payloads, streams, conn) {
    const parts = payloads.map(([p, payload], i) => {
      const s = streams[i];
      if (s.sequence > 0x7fffffff) {
        s.producerId = randomProducerId();
        s.sequence = 0;
      }
      return [topic, p, s.producerId, s.sequence, payload.length];
    });
    // Each part that is not settled here goes again alone, under the same sequence (the
    // log keeps a batch that did land once, s.13): what a single produce would retry.
    const alone = (i) => this.#produceOne(streams[i], topic, payloads[i][0], payloads[i][1]);
    let header;
    try {
      ({ header } = await conn.request("produce_many", { parts },
        { frames: [Buffer.concat(payloads.map(([, payload]) => payload))] }));
    } catch (err) {
      if (!(err instanceof ZBrokerError) || !(err.code === "UNKNOWN_OP" || err.retriable || REFRESH_CODES.has(err.code))) {
        throw err;
      }
      if (err.code === "UNKNOWN_OP") conn.features = conn.features.filter((f) => f !== "multi_partition");
      return Promise.all(payloads.map((_x, i) => alone(i)));
    }
    return Promise.all(header.results.map(async ([baseOffset, count, duplicate, error], i) => {
      const partition = payloads[i][0];
      if (error === null || error === undefined) {
        streams[i].sequence += 1;
        return { topic, partition, baseOffset, count, duplicate: duplicate === true };
      }
      const err = ZBrokerError.fromWire("produce", error);
      if (err.retriable || REFRESH_CODES.has(err.code)) return alone(i);
      streams[i].sequence += 1;  // as #produceOne: never reuse a sequence that may be taken
      throw err;
    }));
  }

  /** The partition for the next key-less batch of `topic`. */
  #nextRoundRobin(topic, partitions) {
    const partition = (this.roundRobin.get(topic) ?? 0) % partitions;
    this.roundRobin.set(topic, partition + 1);
    return partition;
  }

  #producerStream(topic, partition) {
    const k = `${topic}\0${partition}`;
    let s = this.producers.get(k);
    if (s === undefined) {
      s = { producerId: this.producerId, sequence: 0, tail: Promise.resolve() };
      this.producers.set(k, s);
    }
    return s;
  }

  async #produceOne(stream, topic, partition, payload) {
    if (stream.sequence > 0x7fffffff) {
      stream.producerId = randomProducerId();
      stream.sequence = 0;
    }
    const fields = { topic, partition, producer_id: stream.producerId, sequence: stream.sequence };
    try {
      const { header } = await this.partitionRequest(topic, partition, "produce", fields, { frames: [payload] });
      stream.sequence += 1;
      return { topic, partition, baseOffset: header.base_offset, count: header.count, duplicate: header.duplicate === true };
    } catch (err) {
      // The batch may or may not have been appended (s.13): never reuse this sequence for
      // other records. Gaps are allowed, so the next batch simply takes the next number.
      const last = err instanceof ZBrokerError ? err.data?.last_sequence : undefined;
      stream.sequence = Number.isInteger(last) && last >= stream.sequence ? last + 1 : stream.sequence + 1;
      throw err;
    }
  }

  // -- fetch (s.8.3, 10, 11) ------------------------------------------------------------

  /**
   * Fetch records of one partition from `offset`. Returns
   * {records, logStart, logEnd, nextOffset, batches}; records below `offset` are skipped
   * and, with options.untilOffset, records at or above it are dropped.
   */
  async fetch(topic, partition, offset, { maxBytes, maxWaitMs = 0, untilOffset = Infinity, verifyCrc = true } = {}) {
    const { header, frames } = await this.partitionRequest(topic, partition, "fetch",
      { topic, partition, offset, max_bytes: maxBytes, max_wait_ms: maxWaitMs },
      { timeoutMs: maxWaitMs + this.requestTimeoutMs });
    const blob = frames[0] ?? new Uint8Array(0);
    const decoded = decodeStoredBatches(blob, { fromOffset: offset, untilOffset, verifyCrc, topic, partition });
    return {
      records: decoded.records, batches: decoded.batches, nextOffset: decoded.nextOffset,
      logStart: header.log_start, logEnd: header.log_end,
    };
  }

  close() {
    if (this.closed) return;
    this.closed = true;
    this.coordinator.close();
    for (const { conn } of this.actors.values()) conn.close();
    this.actors.clear();
  }
}

// ---------------------------------------------------------------------------------------
// Consumer (PROTOCOL.md s.8.4, 14)
// ---------------------------------------------------------------------------------------

const RANGE_OPS = new Set(["ack", "nack", "extend", "reject"]);

// Ranges per ack/nack/extend/reject request (and per poll's acks), as the Python client's
// RANGES_PER_REQUEST: a range naming a 200-character topic takes about 235 bytes, so 4000
// stay under the 1 MiB header limit, whose TOO_LARGE reply has no id to match (s.6).
export const RANGES_PER_REQUEST = 4000;

function toRange(d) {
  if (Array.isArray(d)) return d.slice(0, 5);
  return [d.topic, d.partition, d.leaseId, d.start, d.end];
}

export class Consumer {
  constructor(client, group, topics, { sessionTimeoutMs = 10_000, memberId = "", onError = () => {} } = {}) {
    this.client = client;
    this.group = group;
    this.topics = topics;
    this.sessionTimeoutMs = sessionTimeoutMs;
    this.memberId = memberId;
    this.generation = -1;
    this.mode = null;
    this.assignment = [];
    this.ackTimeoutMs = null;
    this.onError = onError;
    this.heartbeatTimer = null;
    this.joining = null;
    this.stats = { joins: 0, fenced: 0, unknownMember: 0, staleRanges: 0 };
  }

  /**
   * join (fresh when memberId is "", else re-join as the same member). Retriable errors
   * (UNAVAILABLE while the coordinator reloads offsets after a restart, SHUTTING_DOWN,
   * TIMEOUT) are retried with backoff until client.retryTimeoutMs.
   */
  async join() {
    if (this.joining) return this.joining;
    this.joining = (async () => {
      const deadline = Date.now() + this.client.retryTimeoutMs;
      let reply;
      for (let attempt = 0; reply === undefined; attempt++) {
        try {
          reply = await this.client.call("join", {
            group: this.group, topics: this.topics, member_id: this.memberId,
            session_timeout_ms: this.sessionTimeoutMs,
          });
        } catch (err) {
          if (!this.#mayRetry(err, deadline)) throw err;
          await sleep(backoffMs(attempt, deadline));
        }
      }
      this.memberId = reply.member_id;
      this.generation = reply.generation;
      this.mode = reply.mode;
      this.assignment = reply.assignment;
      this.ackTimeoutMs = reply.ack_timeout_ms;
      this.stats.joins += 1;
      this.#startHeartbeat();
      return reply;
    })();
    try {
      return await this.joining;
    } finally {
      this.joining = null;
    }
  }

  #startHeartbeat() {
    if (this.heartbeatTimer) return;
    const every = Math.max(50, Math.floor(this.sessionTimeoutMs / 3));
    let busy = false;
    this.heartbeatTimer = setInterval(async () => {
      if (busy || this.joining) return;
      busy = true;
      try {
        await this.heartbeat();
      } catch (err) {
        this.onError(err);
      } finally {
        busy = false;
      }
    }, every);
    this.heartbeatTimer.unref?.();
  }

  /**
   * heartbeat (s.8.4). FENCED and UNKNOWN_MEMBER are handled by re-joining (which is
   * itself a sign of life), so this returns null then.
   */
  async heartbeat() {
    return this.#groupCall("heartbeat", {}, { retry: false });
  }

  /** A retriable error with time left to retry it, on a client still open. */
  #mayRetry(err, deadline) {
    return err instanceof ZBrokerError && err.retriable && Date.now() < deadline && !this.client.closed;
  }

  /**
   * A group request with member_id and generation filled in (s.14):
   * FENCED -> re-join as the same member, then retry with the new generation;
   * UNKNOWN_MEMBER -> join fresh, then retry (poll) or report every range as stale
   * (ack, nack, extend, reject: a fresh member holds none of the old leases);
   * other retriable errors (UNAVAILABLE, SHUTTING_DOWN, TIMEOUT) -> back off and resend
   * the same fields until client.retryTimeoutMs (s.7, 8.4). A request that timed out may
   * have been applied; resending it is harmless (a repeated ack is counted again, a
   * repeated nack or reject of a settled lease reports it stale).
   * With retry=false (heartbeats) the call returns null after re-joining instead of
   * retrying, and reports every other error.
   */
  async #groupCall(op, fields, { retry = true, timeoutMs } = {}) {
    const deadline = Date.now() + this.client.retryTimeoutMs;
    let rejoins = 0;
    for (let backoffs = 0; ;) {
      if (this.generation < 0) await this.join();
      const sentGeneration = this.generation;
      const sentMember = this.memberId;
      try {
        return await this.client.call(op, {
          group: this.group, member_id: sentMember, generation: sentGeneration, ...fields,
        }, { timeoutMs });
      } catch (err) {
        if (!(err instanceof ZBrokerError)) throw err;
        if ((err.code === "FENCED" || err.code === "UNKNOWN_MEMBER") && rejoins++ >= 5) throw err;
        if (err.code === "FENCED") {
          this.stats.fenced += 1;
          // Someone else (heartbeat, a concurrent poll) may have re-joined already.
          if (this.generation === sentGeneration && this.memberId === sentMember) await this.join();
        } else if (err.code === "UNKNOWN_MEMBER") {
          this.stats.unknownMember += 1;
          if (this.memberId === sentMember) {
            this.memberId = "";
            await this.join();
          }
          if (RANGE_OPS.has(op)) {
            err.staleRanges = fields.ranges;
            throw err;
          }
        } else if (retry && this.#mayRetry(err, deadline)) {
          await sleep(backoffMs(backoffs++, deadline));
          continue;
        } else {
          throw err;
        }
        if (!retry) return null;
      }
    }
  }

  /**
   * poll for leases and fetch their records. Returns deliveries:
   * [{topic, partition, leaseId, start, end, attempt, reason, records}].
   * `acks` (deliveries or ranges, like ack()) ride on the poll and are applied before it
   * leases anything (s.8.4, "Acks on a poll"); what they came to is in `this.lastPollAcks`
   * as {applied, stale, staleOmitted}. The poll carries RANGES_PER_REQUEST of them; the rest go first as
   * acks of their own. A poll that fails may have applied none of them: ack them again
   * (a repeated ack is harmless).
   */
  async poll({ maxRecords = 1000, maxWaitMs = 0, fetchMaxBytes, acks } = {}) {
    const fields = { max_records: maxRecords, max_wait_ms: maxWaitMs };
    let ackedApart = { applied: 0, stale: [], staleOmitted: 0 };
    if (acks && acks.length > 0) {
      const ranges = acks.map(toRange);
      // Sent before the poll, so the capacity they free counts for it like the rest.
      if (ranges.length > RANGES_PER_REQUEST) ackedApart = await this.#rangeOp("ack", ranges.slice(RANGES_PER_REQUEST));
      fields.acks = ranges.slice(0, RANGES_PER_REQUEST);
    }
    const reply = await this.#groupCall("poll", fields, { timeoutMs: maxWaitMs + this.client.requestTimeoutMs });
    if (fields.acks) {
      const stale = ackedApart.stale;
      const staleOnPoll = Array.isArray(reply.stale) ? reply.stale : [];
      const omittedOnPoll = Number.isInteger(reply.stale_omitted) ? reply.stale_omitted : 0;
      this.stats.staleRanges += staleOnPoll.length + omittedOnPoll;
      for (const range of staleOnPoll) stale.push(range);
      const appliedOnPoll = Number.isInteger(reply.acked) ? reply.acked : 0;
      this.lastPollAcks = { applied: ackedApart.applied + appliedOnPoll, stale,
        staleOmitted: ackedApart.staleOmitted + omittedOnPoll };
    }
    if (reply.generation !== undefined) this.generation = reply.generation;
    if (reply.ack_timeout_ms !== undefined) this.ackTimeoutMs = reply.ack_timeout_ms;
    const deliveries = reply.deliveries.map(([topic, partition, leaseId, start, end, attempt, reason]) =>
      ({ topic, partition, leaseId, start, end, attempt, reason, records: [] }));
    await this.#fetchDeliveries(deliveries, fetchMaxBytes);
    return deliveries;
  }

  /**
   * The records of every delivery: the deliveries of one actor that serves fetch_many in
   * one request (s.8.3), and what that did not bring (an error, a byte budget used up)
   * by the usual fetch from where it stopped.
   */
  async #fetchDeliveries(deliveries, maxBytes) {
    const byActor = new Map();
    const alone = [];
    for (const d of deliveries) {
      const conn = deliveries.length > 1 ? await this.client.multiPartitionActorFor(d.topic, d.partition) : null;
      if (conn === null) { alone.push(d); continue; }
      if (!byActor.has(conn)) byActor.set(conn, []);
      byActor.get(conn).push(d);
    }
    const runs = alone.map((d) => this.#fetchLease(d, maxBytes));
    for (const [conn, group] of byActor) {
      if (group.length === 1) { runs.push(this.#fetchLease(group[0], maxBytes)); continue; }
      runs.push(this.#fetchTogether(conn, group, maxBytes));
    }
    await Promise.all(runs);
  }

  async #fetchTogether(conn, group, maxBytes) {
    const parts = group.map((d) => [d.topic, d.partition, d.start, maxBytes ?? 1 << 20]);
    let reply;
    try {
      reply = await conn.request("fetch_many", { parts, max_bytes: maxBytes });
    } catch (err) {
      if (err instanceof ZBrokerError && err.code === "UNKNOWN_OP") {
        conn.features = conn.features.filter((f) => f !== "multi_partition");
      }
      await Promise.all(group.map((d) => this.#fetchLease(d, maxBytes)));  // it reports what keeps failing
      return;
    }
    const blob = reply.frames[0] ?? new Uint8Array(0);
    let pos = 0;
    const rest = [];
    reply.header.parts.forEach(([, , length, error], i) => {
      const d = group[i];
      const slice = blob.subarray(pos, pos + length);
      pos += length;
      if (error !== null && error !== undefined) { rest.push([d, d.start]); return; }
      const decoded = decodeStoredBatches(slice, { fromOffset: d.start, untilOffset: d.end, verifyCrc: true,
        topic: d.topic, partition: d.partition });
      for (const record of decoded.records) d.records.push(record);
      const next = decoded.batches.length > 0 ? decoded.nextOffset : d.start;
      if (next < d.end) rest.push([d, next]);
    });
    await Promise.all(rest.map(([d, from]) => this.#fetchLease(d, maxBytes, from)));
  }

  /** Fetch [start, end) of a delivery (from `from`) from the partition actor that owns it (s.14 step 4). */
  async #fetchLease(d, maxBytes, from = d.start) {
    let offset = from;
    const deadline = Date.now() + this.client.retryTimeoutMs;
    while (offset < d.end) {
      let res;
      try {
        res = await this.client.fetch(d.topic, d.partition, offset,
          { maxBytes, maxWaitMs: 100, untilOffset: d.end });
      } catch (err) {
        if (err.code === "OFFSET_OUT_OF_RANGE" && Number.isInteger(err.data.log_start) && err.data.log_start > offset) {
          offset = err.data.log_start;  // removed by retention: nothing left to deliver below it
          continue;
        }
        throw err;
      }
      // Not push(...records): spreading ~125k arguments overflows the stack, and one
      // stored batch may hold that many records.
      for (const record of res.records) d.records.push(record);
      if (res.batches.length === 0) {
        if (Date.now() >= deadline) {
          throw new ZBrokerError("TIMEOUT", `leased ${d.topic}/${d.partition} [${offset}, ${d.end}) not fetchable`,
            { local: true, data: { topic: d.topic, partition: d.partition, offset, end: d.end } });
        }
        continue;
      }
      offset = res.nextOffset;
    }
  }

  /**
   * ack/nack/extend/reject: ranges are deliveries or [topic, partition, lease_id, start, end].
   * Returns {applied, stale, staleOmitted}; stale lists ranges the coordinator refused as
   * STALE_LEASE (their records are redelivered, s.14), at most 1000 per request: staleOmitted
   * counts the stale ranges the coordinator did not list (data.stale_omitted, s.6). More than RANGES_PER_REQUEST ranges go in
   * several requests, one after the other, whose results are summed; if one fails, those
   * before it were applied (sending them all again is harmless).
   */
  ack(ranges) {
    return this.#rangeOp("ack", ranges, {});
  }

  nack(ranges, { delayMs, reason } = {}) {
    return this.#rangeOp("nack", ranges, { delay_ms: delayMs, reason });
  }

  extend(ranges, { extendMs } = {}) {
    return this.#rangeOp("extend", ranges, { extend_ms: extendMs });
  }

  reject(ranges, { reason } = {}) {
    return this.#rangeOp("reject", ranges, { reason });
  }

  async #rangeOp(op, items, extra) {
    const ranges = items.map(toRange);
    const total = { applied: 0, stale: [], staleOmitted: 0 };
    for (let i = 0; i < ranges.length; i += RANGES_PER_REQUEST) {
      const part = await this.#rangeRequest(op, ranges.slice(i, i + RANGES_PER_REQUEST), extra);
      total.applied += part.applied;
      total.staleOmitted += part.staleOmitted;
      for (const range of part.stale) total.stale.push(range);  // not push(...): may be thousands
    }
    return total;
  }

  /** One ack/nack/extend/reject request of at most RANGES_PER_REQUEST ranges. */
  async #rangeRequest(op, ranges, extra) {
    try {
      const reply = await this.#groupCall(op, { ranges, ...extra });
      return { applied: reply.applied, stale: [], staleOmitted: 0 };
    } catch (err) {
      if (err.code === "STALE_LEASE") {
        const stale = Array.isArray(err.data.stale) ? err.data.stale : ranges;
        // Only the first 1000 stale ranges are listed; the rest are counted (s.6, s.7).
        const staleOmitted = Number.isInteger(err.data.stale_omitted) ? err.data.stale_omitted : 0;
        this.stats.staleRanges += stale.length + staleOmitted;
        return { applied: Number.isInteger(err.data.applied) ? err.data.applied : 0, stale, staleOmitted };
      }
      if (err.code === "UNKNOWN_MEMBER" && err.staleRanges) {
        this.stats.staleRanges += ranges.length;
        return { applied: 0, stale: ranges, staleOmitted: 0 };
      }
      throw err;
    }
  }

  /** leave the group (its leases are released at once) and stop heartbeats. */
  async leave() {
    this.#stopHeartbeat();
    if (this.generation < 0 || this.memberId === "") return;
    try {
      await this.client.call("leave", { group: this.group, member_id: this.memberId, generation: this.generation });
    } finally {
      this.generation = -1;
    }
  }

  #stopHeartbeat() {
    if (this.heartbeatTimer) clearInterval(this.heartbeatTimer);
    this.heartbeatTimer = null;
  }

  close() {
    this.#stopHeartbeat();
  }
}
