/*
 * zbload: a load generator for zbroker in C, written from docs/PROTOCOL.md.
 *
 * Why C: the benchmark's Python-client rows measure the Python client as much
 * as the broker. This program spends a fraction of the broker's CPU per record
 * (it reports its own CPU seconds so the table can show both), so the rows it
 * drives measure the broker's capacity.
 *
 *   zbload produce URL TOPIC COUNT SIZE WINDOW BATCH [FIRST_PARTITION STEP]
 *       Sends COUNT records of SIZE bytes in produce requests of BATCH records,
 *       spread round-robin over the topic's partitions FIRST, FIRST+STEP, ...,
 *       keeping at most WINDOW records sent and not yet acknowledged.
 *   zbload consume URL TOPIC GROUP COUNT WINDOW
 *       Configures GROUP for at most WINDOW leased, unacknowledged records a
 *       member, joins it, keeps two polls of WINDOW / 2 records out, fetches
 *       each lease's records from its partition actor, counts every record of
 *       the lease, and acks the leases as ranges, riding on the next poll or,
 *       when both polls are out, in an `ack` of their own, until COUNT records
 *       are acknowledged.
 *
 * Output: one line of JSON on stdout:
 *   {"records": N, "seconds": S, "cpu_s": C, "requests": R}
 * Exit status 0 on success, 1 on any error (message on stderr).
 *
 * One DEALER per actor endpoint (PROTOCOL.md s.2); every request carries an
 * integer id and replies are matched by id (s.4). Errors are fatal: a
 * benchmark that retried silently would report a rate it did not measure.
 */
#include <msgpack.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <zmq.h>

#define MAX_PARTITIONS 4096
#define MAX_ENDPOINTS 64
#define MAX_DELIVERIES 4096
#define REPLY_TIMEOUT_MS 30000

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("zbload: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static double cpu_s(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
}

/* ---- msgpack helpers ---------------------------------------------------------------- */

static void pack_str(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

static void pack_kv_str(msgpack_packer *pk, const char *k, const char *v) {
    pack_str(pk, k);
    pack_str(pk, v);
}

static void pack_kv_int(msgpack_packer *pk, const char *k, int64_t v) {
    pack_str(pk, k);
    msgpack_pack_int64(pk, v);
}

/* Starts a request header map of `fields` op fields plus v, op and id. */
static void begin_request(msgpack_packer *pk, const char *op, uint64_t id, uint32_t fields) {
    msgpack_pack_map(pk, 3 + fields);
    pack_kv_int(pk, "v", 1);
    pack_kv_str(pk, "op", op);
    pack_str(pk, "id");
    msgpack_pack_uint64(pk, id);
}

static const msgpack_object *map_get(const msgpack_object *map, const char *key) {
    if (map->type != MSGPACK_OBJECT_MAP)
        return NULL;
    size_t n = strlen(key);
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        const msgpack_object *k = &map->via.map.ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == n && memcmp(k->via.str.ptr, key, n) == 0)
            return &map->via.map.ptr[i].val;
    }
    return NULL;
}

/* The reply being read, printed when a field is not what the protocol says. */
static const msgpack_object *reading = NULL;

static void die_reading(const char *what) {
    if (reading) {
        fputs("zbload: in reply ", stderr);
        msgpack_object_print(stderr, *reading);
        fputc('\n', stderr);
    }
    die("%s", what);
}

static int64_t as_int(const msgpack_object *o) {
    if (o && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
        return (int64_t)o->via.u64;
    if (o && o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
        return o->via.i64;
    die_reading("expected an integer in a reply");
    return 0;
}

static uint64_t as_u64(const msgpack_object *o) {
    if (o && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
        return o->via.u64;
    die_reading("expected an unsigned integer in a reply");
    return 0;
}

static void copy_str(const msgpack_object *o, char *out, size_t cap) {
    if (!o || o->type != MSGPACK_OBJECT_STR || o->via.str.size >= cap)
        die_reading("expected a string in a reply");
    memcpy(out, o->via.str.ptr, o->via.str.size);
    out[o->via.str.size] = 0;
}

/* ---- connections and replies -------------------------------------------------------- */

typedef struct {
    void *sock;
    char endpoint[256];
} conn_t;

typedef struct {
    msgpack_unpacked header; /* its strings point into `head`: both live until reply_free */
    zmq_msg_t head;
    zmq_msg_t payload; /* frame 1, if any */
    int has_payload;
} reply_t;

static void *ctx;
static void *open_sockets[MAX_ENDPOINTS + 1]; /* closed before zmq_ctx_term, which waits for them */
static int n_open_sockets = 0;
static uint64_t next_id = 1;
static uint64_t requests = 0;

static void conn_open(conn_t *c, const char *endpoint) {
    snprintf(c->endpoint, sizeof c->endpoint, "%s", endpoint);
    c->sock = zmq_socket(ctx, ZMQ_DEALER);
    if (n_open_sockets == MAX_ENDPOINTS + 1)
        die("too many connections");
    open_sockets[n_open_sockets++] = c->sock;
    int zero = 0, hwm = 100000;
    zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(c->sock, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(c->sock, ZMQ_RCVHWM, &hwm, sizeof hwm);
    if (zmq_connect(c->sock, endpoint) != 0)
        die("connect %s: %s", endpoint, zmq_strerror(zmq_errno()));
}

static void send_request(conn_t *c, msgpack_sbuffer *header, const void *payload, size_t payload_len) {
    int more = payload ? ZMQ_SNDMORE : 0;
    if (zmq_send(c->sock, header->data, header->size, more) < 0)
        die("send: %s", zmq_strerror(zmq_errno()));
    if (payload && zmq_send(c->sock, payload, payload_len, 0) < 0)
        die("send payload: %s", zmq_strerror(zmq_errno()));
    requests++;
}

/* Receives one reply on `c` (waiting up to the timeout); dies on an error reply unless
 * `errors_ok`, when it returns 0 for one (1 for a success). */
static int recv_reply_or_error(conn_t *c, reply_t *r, uint64_t *id_out, int errors_ok) {
    zmq_pollitem_t item = {c->sock, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, REPLY_TIMEOUT_MS) <= 0)
        die("no reply from %s within %d ms", c->endpoint, REPLY_TIMEOUT_MS);
    zmq_msg_init(&r->head);
    if (zmq_msg_recv(&r->head, c->sock, 0) < 0)
        die("recv: %s", zmq_strerror(zmq_errno()));
    msgpack_unpacked_init(&r->header);
    if (msgpack_unpack_next(&r->header, zmq_msg_data(&r->head), zmq_msg_size(&r->head), NULL)
        != MSGPACK_UNPACK_SUCCESS)
        die("an unreadable reply header");
    r->has_payload = 0;
    if (zmq_msg_more(&r->head)) {
        zmq_msg_init(&r->payload);
        zmq_msg_recv(&r->payload, c->sock, 0);
        r->has_payload = 1;
        while (zmq_msg_more(&r->payload)) { /* frames past the first are not ours to read */
            zmq_msg_t extra;
            zmq_msg_init(&extra);
            zmq_msg_recv(&extra, c->sock, 0);
            int more = zmq_msg_more(&extra);
            zmq_msg_close(&extra);
            if (!more)
                break;
        }
    }
    reading = &r->header.data;
    *id_out = as_u64(map_get(&r->header.data, "id"));
    const msgpack_object *ok = map_get(&r->header.data, "ok");
    if (!ok || ok->type != MSGPACK_OBJECT_BOOLEAN || !ok->via.boolean) {
        if (errors_ok)
            return 0;
        const msgpack_object *err = map_get(&r->header.data, "error");
        const msgpack_object *code = err ? map_get(err, "code") : NULL;
        const msgpack_object *message = err ? map_get(err, "message") : NULL;
        char text[512] = "?";
        if (code && code->type == MSGPACK_OBJECT_STR)
            snprintf(text, sizeof text, "%.*s: %.*s", (int)code->via.str.size, code->via.str.ptr,
                     message && message->type == MSGPACK_OBJECT_STR ? (int)message->via.str.size : 0,
                     message && message->type == MSGPACK_OBJECT_STR ? message->via.str.ptr : "");
        die("error reply from %s: %s", c->endpoint, text);
    }
    return 1;
}

static void recv_reply(conn_t *c, reply_t *r, uint64_t *id_out) { recv_reply_or_error(c, r, id_out, 0); }

static void reply_free(reply_t *r) {
    msgpack_unpacked_destroy(&r->header);
    zmq_msg_close(&r->head);
    if (r->has_payload)
        zmq_msg_close(&r->payload);
}

/* A request with no payload whose single reply is awaited at once. */
static void call(conn_t *c, msgpack_sbuffer *header, reply_t *r) {
    send_request(c, header, NULL, 0);
    uint64_t id;
    recv_reply(c, r, &id);
}

/* ---- metadata ----------------------------------------------------------------------- */

typedef struct {
    int partitions;
    int endpoint_of[MAX_PARTITIONS]; /* index into endpoints */
    int endpoints;
    conn_t conns[MAX_ENDPOINTS];
} topic_map_t;

static void hello(conn_t *c) {
    msgpack_sbuffer buf;
    msgpack_sbuffer_init(&buf);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &buf, msgpack_sbuffer_write);
    begin_request(&pk, "hello", next_id++, 2);
    pack_str(&pk, "versions");
    msgpack_pack_array(&pk, 1);
    msgpack_pack_int64(&pk, 1);
    pack_kv_str(&pk, "client", "zbload");
    reply_t r;
    call(c, &buf, &r);
    reply_free(&r);
    msgpack_sbuffer_destroy(&buf);
}

static void load_metadata(conn_t *coord, const char *topic, topic_map_t *tm) {
    msgpack_sbuffer buf;
    msgpack_sbuffer_init(&buf);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &buf, msgpack_sbuffer_write);
    begin_request(&pk, "metadata", next_id++, 1);
    pack_str(&pk, "topics");
    msgpack_pack_array(&pk, 1);
    pack_str(&pk, topic);
    reply_t r;
    call(coord, &buf, &r);
    const msgpack_object *topics = map_get(&r.header.data, "topics");
    if (!topics || topics->type != MSGPACK_OBJECT_ARRAY || topics->via.array.size != 1)
        die("metadata: topic %s not found", topic);
    const msgpack_object *parts = map_get(&topics->via.array.ptr[0], "partitions");
    if (!parts || parts->type != MSGPACK_OBJECT_ARRAY || parts->via.array.size > MAX_PARTITIONS)
        die("metadata: bad partitions");
    tm->partitions = (int)parts->via.array.size;
    tm->endpoints = 0;
    for (uint32_t i = 0; i < parts->via.array.size; i++) {
        const msgpack_object *p = &parts->via.array.ptr[i];
        int partition = (int)as_int(map_get(p, "partition"));
        char endpoint[256];
        const msgpack_object *ep = map_get(p, "endpoint");
        if (!ep || ep->type != MSGPACK_OBJECT_STR)
            die("metadata: partition %d has no endpoint (not placed yet)", partition);
        copy_str(ep, endpoint, sizeof endpoint);
        int found = -1;
        for (int e = 0; e < tm->endpoints; e++)
            if (strcmp(tm->conns[e].endpoint, endpoint) == 0)
                found = e;
        if (found < 0) {
            if (tm->endpoints == MAX_ENDPOINTS)
                die("metadata: too many endpoints");
            found = tm->endpoints++;
            conn_open(&tm->conns[found], endpoint);
            hello(&tm->conns[found]);
        }
        if (partition < 0 || partition >= MAX_PARTITIONS)
            die("metadata: partition %d out of range", partition);
        tm->endpoint_of[partition] = found;
    }
    reply_free(&r);
    msgpack_sbuffer_destroy(&buf);
}

/* ---- produce ------------------------------------------------------------------------ */

/* The record array of section 9: BATCH records [timestamp, nil, value, nil]. */
static void build_payload(msgpack_sbuffer *out, int batch, int size) {
    msgpack_packer pk;
    msgpack_packer_init(&pk, out, msgpack_sbuffer_write);
    char *value = calloc(1, size > 0 ? size : 1);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t ms = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    msgpack_pack_array(&pk, batch);
    for (int i = 0; i < batch; i++) {
        msgpack_pack_array(&pk, 4);
        msgpack_pack_int64(&pk, ms);
        msgpack_pack_nil(&pk);
        msgpack_pack_bin(&pk, size);
        msgpack_pack_bin_body(&pk, value, size);
        msgpack_pack_nil(&pk);
    }
    free(value);
}

static int run_produce(int argc, char **argv) {
    if (argc < 8)
        die("usage: zbload produce URL TOPIC COUNT SIZE WINDOW BATCH [FIRST_PARTITION STEP]");
    const char *url = argv[2], *topic = argv[3];
    long count = atol(argv[4]);
    int size = atoi(argv[5]), window = atoi(argv[6]), batch = atoi(argv[7]);
    int first = argc > 8 ? atoi(argv[8]) : 0, step = argc > 9 ? atoi(argv[9]) : 1;
    if (count <= 0 || size < 0 || window < 1 || batch < 1 || step < 1)
        die("produce: bad numbers");
    if (batch > window)
        batch = window;
    conn_t coord;
    conn_open(&coord, url);
    hello(&coord);
    static topic_map_t tm;
    load_metadata(&coord, topic, &tm);
    if (first >= tm.partitions)
        die("produce: first partition %d but the topic has %d", first, tm.partitions);

    msgpack_sbuffer payload;
    msgpack_sbuffer_init(&payload);
    build_payload(&payload, batch, size);

    double t0 = now_s(), c0 = cpu_s();
    long sent = 0, acked = 0, in_flight = 0;
    int partition = first;
    msgpack_sbuffer header;
    msgpack_sbuffer_init(&header);
    zmq_pollitem_t items[MAX_ENDPOINTS];
    for (int e = 0; e < tm.endpoints; e++)
        items[e] = (zmq_pollitem_t){tm.conns[e].sock, 0, ZMQ_POLLIN, 0};
    while (acked < count) {
        /* Fill the window with whole batches (the last one may be short). */
        while (sent < count && in_flight + batch <= window) {
            long n = count - sent < batch ? count - sent : batch;
            if (n != batch) {
                msgpack_sbuffer_clear(&payload);
                build_payload(&payload, (int)n, size);
            }
            msgpack_sbuffer_clear(&header);
            msgpack_packer pk;
            msgpack_packer_init(&pk, &header, msgpack_sbuffer_write);
            begin_request(&pk, "produce", next_id++, 2);
            pack_kv_str(&pk, "topic", topic);
            pack_kv_int(&pk, "partition", partition);
            send_request(&tm.conns[tm.endpoint_of[partition]], &header, payload.data, payload.size);
            sent += n;
            in_flight += n;
            partition += step;
            if (partition >= tm.partitions)
                partition = first;
        }
        if (zmq_poll(items, tm.endpoints, REPLY_TIMEOUT_MS) <= 0)
            die("produce: no reply within %d ms", REPLY_TIMEOUT_MS);
        for (int e = 0; e < tm.endpoints; e++) {
            while (zmq_poll(&items[e], 1, 0) > 0 && (items[e].revents & ZMQ_POLLIN)) {
                reply_t r;
                uint64_t id;
                recv_reply(&tm.conns[e], &r, &id);
                long n = (long)as_int(map_get(&r.header.data, "count"));
                acked += n;
                in_flight -= n;
                reply_free(&r);
            }
        }
    }
    double seconds = now_s() - t0, cpu = cpu_s() - c0;
    printf("{\"records\": %ld, \"seconds\": %.6f, \"cpu_s\": %.6f, \"requests\": %lu}\n", acked, seconds, cpu,
           (unsigned long)requests);
    return 0;
}

/* ---- consume + ack ------------------------------------------------------------------ */

typedef struct {
    char topic[256];
    int partition;
    uint64_t lease_id;
    int64_t start, end;
    uint64_t fetch_id;
    int64_t fetched_to; /* offsets of the lease counted so far */
} lease_t;

static uint32_t be32(const unsigned char *p) { return (uint32_t)p[0] << 24 | p[1] << 16 | p[2] << 8 | p[3]; }

static uint64_t be64(const unsigned char *p) { return (uint64_t)be32(p) << 32 | be32(p + 4); }

/* Counts the records of stored batches (s.10) that fall in [from, to); returns the
 * offset after the last whole batch read. Each counted record is walked in its
 * payload (a consumer reads what it consumes), not merely counted from the header. */
static int64_t count_records(const unsigned char *data, size_t len, int64_t from, int64_t to, long *counted) {
    size_t pos = 0;
    int64_t reached = from;
    msgpack_unpacked rec;
    msgpack_unpacked_init(&rec);
    while (pos + 44 <= len) {
        if (memcmp(data + pos, "ZBB1", 4) != 0)
            die("fetch: a batch without its magic");
        uint32_t payload_len = be32(data + pos + 8);
        uint64_t base = be64(data + pos + 12);
        uint32_t n = be32(data + pos + 20);
        if (pos + 44 + payload_len > len)
            break;
        const char *payload = (const char *)data + pos + 44;
        size_t off = 0;
        msgpack_unpack_next(&rec, payload, payload_len, &off); /* the array: walked whole */
        for (uint32_t i = 0; i < n; i++) {
            int64_t offset = (int64_t)base + i;
            if (offset >= from && offset < to)
                (*counted)++;
        }
        if ((int64_t)(base + n) > reached)
            reached = (int64_t)(base + n);
        pos += 44 + payload_len;
    }
    msgpack_unpacked_destroy(&rec);
    return reached;
}

static void send_fetch(topic_map_t *tm, lease_t *l) {
    msgpack_sbuffer header;
    msgpack_sbuffer_init(&header);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &header, msgpack_sbuffer_write);
    l->fetch_id = next_id++;
    begin_request(&pk, "fetch", l->fetch_id, 4);
    pack_kv_str(&pk, "topic", l->topic);
    pack_kv_int(&pk, "partition", l->partition);
    pack_kv_int(&pk, "offset", l->fetched_to);
    /* Sized from the lease (PROTOCOL.md: the 1 MiB default returns far past it). */
    pack_kv_int(&pk, "max_bytes", (l->end - l->fetched_to) * 160 + 4096);
    send_request(&tm->conns[tm->endpoint_of[l->partition]], &header, NULL, 0);
    msgpack_sbuffer_destroy(&header);
}

/* Finished leases as ack ranges: each lease's records were all counted, so each is one. */
static void pack_ranges(msgpack_packer *pk, lease_t *acks, int n_acks) {
    msgpack_pack_array(pk, n_acks);
    for (int i = 0; i < n_acks; i++) {
        msgpack_pack_array(pk, 5);
        pack_str(pk, acks[i].topic);
        msgpack_pack_int64(pk, acks[i].partition);
        msgpack_pack_uint64(pk, acks[i].lease_id);
        msgpack_pack_int64(pk, acks[i].start);
        msgpack_pack_int64(pk, acks[i].end);
    }
}

/* Sends a poll (`max_records` > 0) carrying `acks`, or an `ack` of them alone
 * (`max_records` 0); the two share every field but the poll's own. Returns the id. */
static uint64_t send_poll_or_ack(conn_t *coord, msgpack_sbuffer *buf, const char *group, const char *member,
                                 int64_t generation, int max_records, lease_t *acks, int n_acks) {
    msgpack_packer pk;
    msgpack_packer_init(&pk, buf, msgpack_sbuffer_write);
    msgpack_sbuffer_clear(buf);
    uint64_t id = next_id++;
    begin_request(&pk, max_records ? "poll" : "ack", id, max_records ? 6 : 4);
    pack_kv_str(&pk, "group", group);
    pack_kv_str(&pk, "member_id", member);
    pack_kv_int(&pk, "generation", generation);
    if (max_records) {
        pack_kv_int(&pk, "max_records", max_records);
        pack_kv_int(&pk, "max_wait_ms", 1000);
    }
    pack_str(&pk, max_records ? "acks" : "ranges");
    pack_ranges(&pk, acks, n_acks);
    send_request(coord, buf, NULL, 0);
    return id;
}

/* Polls kept in flight, each for WINDOW / POLLS_AHEAD records, the group holding at most
 * WINDOW leased and unacknowledged: the next poll's leases are on their way while this
 * one's records are fetched, as the Python client's poll-ahead does. Polled one at a time,
 * the coordinator and the partition actor took turns, each idle while the other worked,
 * and consume+ack ran at 0.60x the Python client (bench/RESULTS.md of 2026-12-04 19:25). */
#define POLLS_AHEAD 2

static int run_consume(int argc, char **argv) {
    if (argc < 7)
        die("usage: zbload consume URL TOPIC GROUP COUNT WINDOW");
    const char *url = argv[2], *topic = argv[3], *group = argv[4];
    long count = atol(argv[5]);
    int window = atoi(argv[6]);
    if (count <= 0 || window < POLLS_AHEAD)
        die("consume: bad numbers");
    conn_t coord;
    conn_open(&coord, url);
    hello(&coord);
    static topic_map_t tm;
    load_metadata(&coord, topic, &tm);

    msgpack_sbuffer buf;
    msgpack_sbuffer_init(&buf);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &buf, msgpack_sbuffer_write);
    reply_t r;
    /* The window is the group's limit of leased, unacknowledged records per member. */
    begin_request(&pk, "configure_group", next_id++, 2);
    pack_kv_str(&pk, "group", group);
    pack_kv_int(&pk, "max_in_flight", window);
    call(&coord, &buf, &r);
    reply_free(&r);

    msgpack_sbuffer_clear(&buf);
    begin_request(&pk, "join", next_id++, 2);
    pack_kv_str(&pk, "group", group);
    pack_str(&pk, "topics");
    msgpack_pack_array(&pk, 1);
    pack_str(&pk, topic);
    call(&coord, &buf, &r);
    char member[256];
    copy_str(map_get(&r.header.data, "member_id"), member, sizeof member);
    int64_t generation = as_int(map_get(&r.header.data, "generation"));
    reply_free(&r);

    static lease_t active[MAX_DELIVERIES]; /* leases whose records are being fetched */
    static lease_t finished[MAX_DELIVERIES]; /* leases fetched whole, not yet acked */
    int n_active = 0, n_finished = 0, polls_out = 0, acks_out = 0;
    uint64_t poll_ids[POLLS_AHEAD];
    long done = 0, leased = 0;
    zmq_pollitem_t items[MAX_ENDPOINTS + 1];
    items[0] = (zmq_pollitem_t){coord.sock, 0, ZMQ_POLLIN, 0};
    for (int e = 0; e < tm.endpoints; e++)
        items[e + 1] = (zmq_pollitem_t){tm.conns[e].sock, 0, ZMQ_POLLIN, 0};
    double t0 = now_s(), c0 = cpu_s();
    while (done < count) {
        /* Acks ride on the next poll; when every poll is out (waiting, maybe for the very
         * capacity these acks free) or none is to come, they go alone in an `ack`. */
        while (polls_out < POLLS_AHEAD && leased < count) {
            poll_ids[polls_out++] = send_poll_or_ack(&coord, &buf, group, member, generation, window / POLLS_AHEAD,
                                                     finished, n_finished);
            n_finished = 0;
        }
        if (n_finished > 0) {
            send_poll_or_ack(&coord, &buf, group, member, generation, 0, finished, n_finished);
            n_finished = 0;
            acks_out++;
        }
        if (zmq_poll(items, tm.endpoints + 1, REPLY_TIMEOUT_MS) <= 0)
            die("consume: no reply within %d ms", REPLY_TIMEOUT_MS);
        while (zmq_poll(&items[0], 1, 0) > 0) {
            uint64_t id;
            recv_reply(&coord, &r, &id);
            int is_poll = 0;
            for (int i = 0; i < polls_out; i++)
                if (poll_ids[i] == id) {
                    poll_ids[i] = poll_ids[--polls_out];
                    is_poll = 1;
                    break;
                }
            if (!is_poll) { /* an ack's reply: one per request, in no particular order */
                if (acks_out-- == 0)
                    die("a reply to no request of ours (id %llu)", (unsigned long long)id);
                done += (long)as_int(map_get(&r.header.data, "applied"));
                reply_free(&r);
                continue;
            }
            const msgpack_object *acked = map_get(&r.header.data, "acked");
            if (acked)
                done += (long)as_int(acked);
            const msgpack_object *deliveries = map_get(&r.header.data, "deliveries");
            if (!deliveries || deliveries->type != MSGPACK_OBJECT_ARRAY)
                die("poll: no deliveries array");
            for (uint32_t i = 0; i < deliveries->via.array.size; i++) {
                if (n_active == MAX_DELIVERIES)
                    die("poll: more than %d leases out", MAX_DELIVERIES);
                const msgpack_object *d = deliveries->via.array.ptr[i].via.array.ptr;
                lease_t *l = &active[n_active++];
                copy_str(&d[0], l->topic, sizeof l->topic);
                l->partition = (int)as_int(&d[1]);
                l->lease_id = as_u64(&d[2]);
                l->start = as_int(&d[3]);
                l->end = as_int(&d[4]);
                l->fetched_to = l->start;
                leased += l->end - l->start;
                send_fetch(&tm, l);
            }
            reply_free(&r);
        }
        for (int e = 0; e < tm.endpoints; e++) {
            while (zmq_poll(&items[e + 1], 1, 0) > 0) {
                uint64_t id;
                recv_reply(&tm.conns[e], &r, &id);
                for (int i = 0; i < n_active; i++) {
                    lease_t *l = &active[i];
                    if (l->fetch_id != id)
                        continue;
                    long counted = 0;
                    if (r.has_payload)
                        l->fetched_to = count_records(zmq_msg_data(&r.payload), zmq_msg_size(&r.payload),
                                                      l->fetched_to, l->end, &counted);
                    if (l->fetched_to < l->end) {
                        send_fetch(&tm, l);
                    } else {
                        if (n_finished == MAX_DELIVERIES)
                            die("consume: more than %d leases to ack", MAX_DELIVERIES);
                        finished[n_finished++] = *l;
                        active[i] = active[--n_active];
                    }
                    break;
                }
                reply_free(&r);
            }
        }
    }
    double seconds = now_s() - t0, cpu = cpu_s() - c0;
    /* Leave, so the group's next use starts clean. A poll still parked is answered FENCED
     * when the member leaves: expected here, and not an error of the run. */
    msgpack_sbuffer_clear(&buf);
    begin_request(&pk, "leave", next_id++, 3);
    pack_kv_str(&pk, "group", group);
    pack_kv_str(&pk, "member_id", member);
    pack_kv_int(&pk, "generation", generation);
    send_request(&coord, &buf, NULL, 0);
    uint64_t leave_id = next_id - 1, id = 0;
    for (;;) { /* replies to the polls still out may come first */
        int ok = recv_reply_or_error(&coord, &r, &id, 1);
        reply_free(&r);
        if (id == leave_id) {
            if (!ok)
                die("leave: refused");
            break;
        }
    }
    printf("{\"records\": %ld, \"seconds\": %.6f, \"cpu_s\": %.6f, \"requests\": %lu}\n", done, seconds, cpu,
           (unsigned long)requests);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2)
        die("usage: zbload produce|consume ...");
    ctx = zmq_ctx_new();
    int rc = strcmp(argv[1], "produce") == 0 ? run_produce(argc, argv)
             : strcmp(argv[1], "consume") == 0 ? run_consume(argc, argv)
                                               : (die("unknown command %s", argv[1]), 1);
    fflush(stdout);
    for (int i = 0; i < n_open_sockets; i++)
        zmq_close(open_sockets[i]);
    zmq_ctx_term(ctx);
    return rc;
}
