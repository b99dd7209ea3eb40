/* convod-bench: load generator for convod. One libuv loop drives N pipelined connections
 * through a voice-assistant request mix (or a bulk fill) and reports throughput, latency
 * percentiles and errors by code. */
#include "bench_hist.h"
#include "bench_linebuf.h"
#include "jscan.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#define EXIT_ERRORS 1
#define EXIT_USAGE 2
#define EXIT_FATAL 3

#define MAX_CODES 32
#define READ_CHUNK 65536
#define NS_PER_S 1000000000.0

enum op {
	OP_ADD_USER,
	OP_ADD_ASSISTANT,
	OP_GET_MESSAGES,
	OP_TO_MESSAGES_MAP,
	OP_GET_SUMMARY_INFO,
	OP_ADD_SUMMARY,
	OP__COUNT,
};

static const char *const op_names[OP__COUNT] = {
    "add_user",        "add_assistant",    "get_messages",
    "to_messages_map", "get_summary_info", "add_summary",
};

enum mix { MIX_VOICE, MIX_ADDS_ONLY, MIX_READS };

enum phase { PHASE_CONNECTING, PHASE_WARMUP, PHASE_MEASURE, PHASE_DRAIN, PHASE_DONE };

struct options {
	const char *socket;
	const char *run_id;
	unsigned connections;
	unsigned conversations;
	unsigned pipeline;
	double duration;
	uint64_t requests;
	double warmup;
	enum mix mix;
	size_t message_bytes;
	unsigned read_every;
	unsigned summary_every;
	unsigned rotate_after;
	unsigned messages_per_conversation;
	double timeout;
	size_t max_response_bytes;
	long pid;
	bool fill;
	bool json;
	bool allow_errors;
};

struct conv {
	char *summary_args; /* owned: ,"ids":[..],"versions":[..] for the queued add_summary */
	uint32_t gen;
	uint32_t adds;
	uint8_t queue[4];
	uint8_t qlen;
	bool blocked; /* waiting for get_summary_info's answer */
};

struct pending {
	uint64_t t0;
	uint64_t id;
	uint32_t conv;
	uint8_t op;
	bool measured;
};

struct outbuf {
	char *data;
	size_t len;
	size_t cap;
};

struct bench;

struct conn {
	uv_pipe_t pipe;
	uv_connect_t connect_req;
	uv_write_t write_req;
	struct bench *b;
	unsigned index;
	struct linebuf in;
	struct outbuf out[2];
	int writing; /* index of the buffer under uv_write, or -1 */
	int pend;    /* index of the buffer new requests go to */
	struct pending *ring;
	unsigned ring_head;
	unsigned ring_len;
	unsigned n_convs; /* this connection drives conversations index + j * connections */
	unsigned cursor;
	bool connected;
	bool dead;
	bool handle_open;
};

struct code_count {
	char name[48];
	uint64_t count;
};

struct bench {
	struct options opt;
	uv_loop_t *loop;
	uv_timer_t phase_timer;
	uv_timer_t watchdog;
	uv_signal_t sigint;
	uv_signal_t sigterm;
	struct conn *conns;
	struct conv *convs;
	char *text;
	enum phase phase;
	unsigned n_connected;
	unsigned n_alive;
	uint64_t next_id;
	uint64_t inflight;
	uint64_t measured_issued;
	uint64_t measured_done;
	uint64_t done_in_window;
	uint64_t all_done;
	uint64_t t_start;
	uint64_t t_measure;
	uint64_t t_end;
	uint64_t last_progress;
	uint64_t bytes_out;
	uint64_t bytes_in;
	uint64_t summary_cycles;
	uint64_t summary_skipped;
	uint64_t op_count[OP__COUNT];
	uint64_t op_errors[OP__COUNT];
	struct bench_hist hist[OP__COUNT];
	struct code_count codes[MAX_CODES];
	unsigned n_codes;
	uint64_t errors;
	bool fatal;
	int signals;
};

static void error_count(struct bench *b, const char *code)
{
	unsigned i;

	b->errors++;
	for (i = 0; i < b->n_codes; i++)
		if (strcmp(b->codes[i].name, code) == 0)
			break;
	if (i == b->n_codes) {
		if (b->n_codes == MAX_CODES)
			code = "other";
		for (i = 0; i < b->n_codes; i++)
			if (strcmp(b->codes[i].name, code) == 0)
				break;
		if (i == b->n_codes) {
			snprintf(b->codes[i].name, sizeof(b->codes[i].name), "%s", code);
			b->n_codes++;
		}
	}
	b->codes[i].count++;
}

static bool in_fill(const struct bench *b)
{
	return b->opt.fill;
}

/* ---- request generation ---- */

static int outbuf_reserve(struct outbuf *o, size_t want)
{
	size_t cap;
	char *data;

	if (o->cap - o->len >= want)
		return 0;
	cap = o->cap ? o->cap : 4096;
	while (cap - o->len < want)
		cap *= 2;
	data = realloc(o->data, cap);
	if (!data)
		return -ENOMEM;
	o->data = data;
	o->cap = cap;
	return 0;
}

static uint8_t conv_next_op(struct bench *b, struct conv *cv)
{
	uint8_t op;

	if (cv->qlen > 0) {
		op = cv->queue[0];
		memmove(cv->queue, cv->queue + 1, --cv->qlen);
		return op;
	}
	if (b->opt.mix == MIX_READS && !in_fill(b))
		return OP_GET_MESSAGES;
	if (b->opt.rotate_after && !in_fill(b) && cv->adds >= b->opt.rotate_after) {
		cv->gen++;
		cv->adds = 0;
	}
	op = cv->adds % 2 == 0 ? OP_ADD_USER : OP_ADD_ASSISTANT;
	cv->adds++;
	if (in_fill(b) || b->opt.mix != MIX_VOICE)
		return op;
	if (b->opt.read_every && cv->adds % b->opt.read_every == 0) {
		cv->queue[cv->qlen++] = OP_GET_MESSAGES;
		cv->queue[cv->qlen++] = OP_TO_MESSAGES_MAP;
	}
	if (b->opt.summary_every && cv->adds % b->opt.summary_every == 0)
		cv->queue[cv->qlen++] = OP_GET_SUMMARY_INFO;
	return op;
}

static int format_request(struct bench *b, struct outbuf *o, uint64_t id, unsigned k,
                          const struct conv *cv, uint8_t op)
{
	char conv_id[96];

	if (cv->gen == 0)
		snprintf(conv_id, sizeof(conv_id), "bench-%s-%u", b->opt.run_id, k);
	else
		snprintf(conv_id, sizeof(conv_id), "bench-%s-%u-g%" PRIu32, b->opt.run_id, k,
		         cv->gen);
	for (;;) {
		size_t room = o->cap - o->len;
		char *p = o->data ? o->data + o->len : NULL;
		int n;

		switch (op) {
		case OP_ADD_USER:
		case OP_ADD_ASSISTANT:
			n = snprintf(
			    p, room,
			    "{\"id\":%" PRIu64
			    ",\"op\":\"%s\",\"conversation\":\"%s\",\"contents\":\"%s\"}\n",
			    id, op_names[op], conv_id, b->text);
			break;
		case OP_GET_MESSAGES:
			n = snprintf(p, room,
			             "{\"id\":%" PRIu64 ",\"op\":\"get_messages\",\"conversation\":"
			             "\"%s\",\"format\":\"meta\"}\n",
			             id, conv_id);
			break;
		case OP_ADD_SUMMARY:
			n = snprintf(p, room,
			             "{\"id\":%" PRIu64 ",\"op\":\"add_summary\",\"conversation\":"
			             "\"%s\",\"contents\":\"The user and the assistant chatted "
			             "about the weather.\"%s}\n",
			             id, conv_id, cv->summary_args ? cv->summary_args : "");
			break;
		default:
			n = snprintf(p, room,
			             "{\"id\":%" PRIu64 ",\"op\":\"%s\",\"conversation\":\"%s\"}\n",
			             id, op_names[op], conv_id);
			break;
		}
		if (n < 0)
			return -EINVAL;
		if ((size_t)n < room) {
			o->len += (size_t)n;
			return 0;
		}
		if (outbuf_reserve(o, (size_t)n + 1) < 0)
			return -ENOMEM;
	}
}

static bool may_issue(const struct bench *b)
{
	if (b->phase == PHASE_WARMUP)
		return true;
	if (b->phase != PHASE_MEASURE)
		return false;
	if (!in_fill(b) && b->opt.requests && b->measured_issued >= b->opt.requests)
		return false;
	return true;
}

/* Picks the conversation for the next request of c, or returns UINT32_MAX. */
static uint32_t conn_pick(struct conn *c)
{
	struct bench *b = c->b;
	unsigned n = b->opt.connections;

	if (in_fill(b)) {
		while (c->cursor < c->n_convs) {
			uint32_t k = c->index + c->cursor * n;

			if (b->convs[k].adds < b->opt.messages_per_conversation)
				return k;
			c->cursor++;
		}
		return UINT32_MAX;
	}
	for (unsigned tries = 0; tries < c->n_convs; tries++) {
		uint32_t k = c->index + c->cursor * n;

		c->cursor = (c->cursor + 1) % c->n_convs;
		if (!b->convs[k].blocked)
			return k;
	}
	return UINT32_MAX;
}

static void conn_fail(struct conn *c, const char *why);

static void write_cb(uv_write_t *req, int status);

/* Writes the pending buffer unless a write is under way; write_cb comes back here. */
static void conn_flush(struct conn *c)
{
	struct outbuf *o = &c->out[c->pend];
	uv_buf_t buf;
	int r;

	if (c->dead || c->writing >= 0 || o->len == 0)
		return;
	buf = uv_buf_init(o->data, (unsigned)o->len);
	/* Most writes fit the socket at once: no request, and no POLLOUT watcher for libuv to
	 * arm and disarm (an epoll_ctl each), as convod itself writes. */
	r = uv_try_write((uv_stream_t *)&c->pipe, &buf, 1);
	if (r == (int)o->len) {
		c->b->bytes_out += o->len;
		o->len = 0;
		return;
	}
	if (r > 0) {
		memmove(o->data, o->data + r, o->len - (size_t)r);
		c->b->bytes_out += (size_t)r;
		o->len -= (size_t)r;
		buf = uv_buf_init(o->data, (unsigned)o->len);
	} else if (r != UV_EAGAIN) {
		conn_fail(c, "write_failed");
		return;
	}
	r = uv_write(&c->write_req, (uv_stream_t *)&c->pipe, &buf, 1, write_cb);
	if (r < 0) {
		conn_fail(c, "write_failed");
		return;
	}
	c->b->bytes_out += o->len;
	c->writing = c->pend;
	c->pend = 1 - c->pend;
}

static void write_cb(uv_write_t *req, int status)
{
	struct conn *c = req->data;

	if (c->writing >= 0)
		c->out[c->writing].len = 0;
	c->writing = -1;
	if (status < 0) {
		if (status != UV_ECANCELED)
			conn_fail(c, "write_failed");
		return;
	}
	conn_flush(c);
}

/* Queues requests until the connection has opt.pipeline in flight, then writes them at once. */
static void conn_fill(struct conn *c)
{
	struct bench *b = c->b;
	struct outbuf *o = &c->out[c->pend];

	if (c->dead || !c->connected)
		return;
	while (c->ring_len < b->opt.pipeline && may_issue(b)) {
		uint32_t k = conn_pick(c);
		struct conv *cv;
		struct pending *p;
		uint8_t op;

		if (k == UINT32_MAX)
			break;
		cv = &b->convs[k];
		op = conv_next_op(b, cv);
		if (format_request(b, o, b->next_id, k, cv, op) < 0) {
			fprintf(stderr, "convod-bench: out of memory\n");
			b->fatal = true;
			conn_fail(c, "internal");
			return;
		}
		if (op == OP_GET_SUMMARY_INFO)
			cv->blocked = true;
		if (op == OP_ADD_SUMMARY) {
			free(cv->summary_args);
			cv->summary_args = NULL;
		}
		p = &c->ring[(c->ring_head + c->ring_len) % b->opt.pipeline];
		c->ring_len++;
		p->t0 = uv_hrtime();
		p->id = b->next_id++;
		p->conv = k;
		p->op = op;
		p->measured = b->phase == PHASE_MEASURE;
		if (p->measured)
			b->measured_issued++;
		b->inflight++;
	}
	conn_flush(c);
}

/* ---- phases ---- */

static void close_cb(uv_handle_t *h)
{
	struct conn *c = h->data;

	if (c)
		c->handle_open = false;
}

static void finish(struct bench *b)
{
	if (b->phase == PHASE_DONE)
		return;
	if (!b->t_end)
		b->t_end = uv_hrtime();
	b->phase = PHASE_DONE;
	for (unsigned i = 0; b->conns && i < b->opt.connections; i++) {
		struct conn *c = &b->conns[i];

		c->dead = true;
		if (c->handle_open && !uv_is_closing((uv_handle_t *)&c->pipe))
			uv_close((uv_handle_t *)&c->pipe, close_cb);
	}
	uv_close((uv_handle_t *)&b->phase_timer, NULL);
	uv_close((uv_handle_t *)&b->watchdog, NULL);
	uv_close((uv_handle_t *)&b->sigint, NULL);
	uv_close((uv_handle_t *)&b->sigterm, NULL);
}

static void enter_drain(struct bench *b)
{
	if (b->phase >= PHASE_DRAIN)
		return;
	b->phase = PHASE_DRAIN;
	b->t_end = uv_hrtime();
	uv_timer_stop(&b->phase_timer);
	if (b->inflight == 0)
		finish(b);
}

static void fill_all(struct bench *b)
{
	for (unsigned i = 0; i < b->opt.connections; i++)
		conn_fill(&b->conns[i]);
}

/* Decides, after any progress, whether the run is over. */
static void check_done(struct bench *b)
{
	if (b->phase == PHASE_DONE)
		return;
	if (b->n_alive == 0 && b->phase != PHASE_CONNECTING) {
		enter_drain(b);
		finish(b);
		return;
	}
	if (b->phase == PHASE_DRAIN) {
		if (b->inflight == 0)
			finish(b);
		return;
	}
	if (b->phase != PHASE_MEASURE || b->inflight > 0)
		return;
	if (in_fill(b)) {
		for (unsigned i = 0; i < b->opt.connections; i++) {
			struct conn *c = &b->conns[i];

			if (!c->dead && conn_pick(c) != UINT32_MAX)
				return;
		}
		b->t_end = uv_hrtime();
		enter_drain(b);
	} else if (b->opt.requests && b->measured_done >= b->opt.requests) {
		b->t_end = uv_hrtime();
		enter_drain(b);
	}
}

static void phase_timer_cb(uv_timer_t *t)
{
	struct bench *b = t->data;

	if (b->phase == PHASE_WARMUP) {
		b->phase = PHASE_MEASURE;
		b->t_measure = uv_hrtime();
		if (!b->opt.requests)
			uv_timer_start(&b->phase_timer, phase_timer_cb,
			               (uint64_t)(b->opt.duration * 1000), 0);
		fill_all(b);
	} else if (b->phase == PHASE_MEASURE) {
		enter_drain(b);
	}
}

static void start_run(struct bench *b)
{
	b->last_progress = b->t_start = uv_hrtime();
	if (b->opt.warmup > 0 && !in_fill(b)) {
		b->phase = PHASE_WARMUP;
		uv_timer_start(&b->phase_timer, phase_timer_cb, (uint64_t)(b->opt.warmup * 1000),
		               0);
	} else {
		b->phase = PHASE_MEASURE;
		b->t_measure = b->t_start;
		if (!b->opt.requests && !in_fill(b))
			uv_timer_start(&b->phase_timer, phase_timer_cb,
			               (uint64_t)(b->opt.duration * 1000), 0);
	}
	fill_all(b);
	check_done(b);
}

static void watchdog_cb(uv_timer_t *t)
{
	struct bench *b = t->data;
	uint64_t now = uv_hrtime();
	double idle = (double)(now - b->last_progress) / NS_PER_S;

	if (idle < b->opt.timeout)
		return;
	if (b->phase == PHASE_CONNECTING) {
		fprintf(stderr, "convod-bench: connecting to %s timed out\n", b->opt.socket);
		b->fatal = true;
		finish(b);
	} else if (b->inflight > 0) {
		fprintf(stderr, "convod-bench: no response for %.1f s, %" PRIu64 " in flight\n",
		        idle, b->inflight);
		for (uint64_t i = 0; i < b->inflight; i++)
			error_count(b, "timeout");
		enter_drain(b);
		finish(b);
	}
}

static void signal_cb(uv_signal_t *s, int signum)
{
	struct bench *b = s->data;

	(void)signum;
	if (++b->signals > 1 || b->phase == PHASE_CONNECTING) {
		b->fatal = b->phase == PHASE_CONNECTING;
		finish(b);
		return;
	}
	enter_drain(b);
}

/* ---- responses ---- */

static void conn_fail(struct conn *c, const char *why)
{
	struct bench *b = c->b;

	if (c->dead)
		return;
	c->dead = true;
	if (b->phase != PHASE_DONE) {
		error_count(b, why);
		for (unsigned i = 0; i < c->ring_len; i++)
			error_count(b, "connection_lost");
	}
	b->inflight -= c->ring_len;
	c->ring_len = 0;
	if (c->connected)
		b->n_alive--;
	if (c->handle_open && !uv_is_closing((uv_handle_t *)&c->pipe))
		uv_close((uv_handle_t *)&c->pipe, close_cb);
	check_done(b);
}

/* Keeps ids and versions of a get_summary_info answer for the add_summary that follows. */
static void take_summary_ids(struct bench *b, struct conv *cv, json_t *result)
{
	json_t *ids = json_object_get(result, "ids");
	json_t *versions = json_object_get(result, "versions");
	char *ids_s = NULL, *versions_s = NULL;
	size_t len;

	if (!json_is_array(ids) || json_array_size(ids) == 0) {
		b->summary_skipped++;
		goto out;
	}
	ids_s = json_dumps(ids, JSON_COMPACT);
	if (json_is_array(versions))
		versions_s = json_dumps(versions, JSON_COMPACT);
	if (!ids_s || (json_is_array(versions) && !versions_s))
		goto out;
	len = strlen(ids_s) + (versions_s ? strlen(versions_s) : 0) + 32;
	free(cv->summary_args);
	cv->summary_args = malloc(len);
	if (!cv->summary_args)
		goto out;
	if (versions_s)
		snprintf(cv->summary_args, len, ",\"ids\":%s,\"versions\":%s", ids_s, versions_s);
	else
		snprintf(cv->summary_args, len, ",\"ids\":%s", ids_s);
	memmove(cv->queue + 1, cv->queue, cv->qlen);
	cv->queue[0] = OP_ADD_SUMMARY;
	cv->qlen++;
	b->summary_cycles++;
out:
	free(ids_s);
	free(versions_s);
}

/* A response line checked with jscan: 1 when it is a valid ok answer to request id, 0 when
 * it is not (the error code, or why, in code), -1 when jscan leaves it to jansson. */
static int check_line_fast(const char *line, size_t len, uint64_t id, char *code, size_t size)
{
	struct jscan_member mem[8], emem[8];
	const struct jscan_member *ok, *jid, *err, *jc;
	size_t n, en;
	uint64_t v = 0;

	if (jscan_object(line, len, mem, 8, &n) < 0 || n > 8)
		return -1;
	ok = jscan_find(mem, n, "ok", 2, NULL);
	jid = jscan_find(mem, n, "id", 2, NULL);
	if (!ok || (ok->value.type != JSCAN_TRUE && ok->value.type != JSCAN_FALSE)) {
		snprintf(code, size, "invalid_response");
		return 0;
	}
	if (jid) {
		if (jid->value.type != JSCAN_INTEGER || jid->value.p[0] == '-') {
			snprintf(code, size, "id_mismatch");
			return 0;
		}
		for (size_t i = 0; i < jid->value.len; i++)
			v = v * 10 + (uint64_t)(jid->value.p[i] - '0');
		if (v != id) {
			snprintf(code, size, "id_mismatch");
			return 0;
		}
	}
	if (ok->value.type == JSCAN_TRUE)
		return 1;
	err = jscan_find(mem, n, "error", 5, NULL);
	snprintf(code, size, "invalid_response");
	if (err && err->value.type == JSCAN_OBJECT &&
	    jscan_object(err->value.p, err->value.len, emem, 8, &en) == 0 &&
	    (jc = jscan_find(emem, en < 8 ? en : 8, "code", 4, NULL)) &&
	    jc->value.type == JSCAN_STRING && !jc->value.escaped && jc->value.len < size)
		snprintf(code, size, "%.*s", (int)jc->value.len, jc->value.p);
	return 0;
}

/* Checks one response line against the oldest request in flight on c. */
static void handle_line(struct conn *c, const char *line, size_t len, bool too_long)
{
	struct bench *b = c->b;
	uint64_t t1 = uv_hrtime();
	struct pending p;
	json_t *root = NULL, *ok, *jid;
	json_error_t jerr;
	const char *bad = NULL;
	char codebuf[64];

	if (c->ring_len == 0) {
		/* e.g. a refusal the daemon sends on accept when over --max-connections */
		const char *code = "unexpected_response";

		root = too_long ? NULL : json_loadb(line, len, 0, &jerr);
		if (root) {
			json_t *jc = json_object_get(json_object_get(root, "error"), "code");

			if (json_is_string(jc))
				code = json_string_value(jc);
		}
		error_count(b, code);
		json_decref(root);
		return;
	}
	p = c->ring[c->ring_head];
	c->ring_head = (c->ring_head + 1) % b->opt.pipeline;
	c->ring_len--;
	b->inflight--;
	b->all_done++;
	b->last_progress = t1;
	b->op_count[p.op]++;
	if (p.measured) {
		b->measured_done++;
		bench_hist_add(&b->hist[p.op], t1 - p.t0);
	}
	if (b->phase == PHASE_MEASURE)
		b->done_in_window++;
	if (p.op == OP_GET_SUMMARY_INFO)
		b->convs[p.conv].blocked = false;

	if (too_long) {
		bad = "response_too_large";
		goto out;
	}
	if (p.op != OP_GET_SUMMARY_INFO) {
		/* The common answers are checked without a tree: the whole line must be one
		 * valid JSON object (jscan.h), "ok" a boolean, "id" this request's. Lines jscan
		 * leaves to jansson go the slow way below. */
		int r = check_line_fast(line, len, p.id, codebuf, sizeof(codebuf));
		if (r == 1)
			goto out;
		if (r == 0) {
			bad = codebuf;
			goto out;
		}
	}
	root = json_loadb(line, len, 0, &jerr);
	if (!json_is_object(root)) {
		bad = "invalid_response";
		goto out;
	}
	ok = json_object_get(root, "ok");
	jid = json_object_get(root, "id");
	if (!json_is_boolean(ok)) {
		bad = "invalid_response";
		goto out;
	}
	if (jid && (!json_is_integer(jid) || (uint64_t)json_integer_value(jid) != p.id)) {
		bad = "id_mismatch";
		goto out;
	}
	if (json_is_false(ok)) {
		json_t *jc = json_object_get(json_object_get(root, "error"), "code");

		bad = json_is_string(jc) ? json_string_value(jc) : "invalid_response";
		goto out;
	}
	if (p.op == OP_GET_SUMMARY_INFO)
		take_summary_ids(b, &b->convs[p.conv], json_object_get(root, "result"));
out:
	if (bad) {
		b->op_errors[p.op]++;
		error_count(b, bad);
	}
	json_decref(root);
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
	struct conn *c = h->data;
	char *area;
	size_t len;

	(void)suggested;
	if (linebuf_reserve(&c->in, READ_CHUNK, &area, &len) < 0) {
		*buf = uv_buf_init(NULL, 0);
		return;
	}
	*buf = uv_buf_init(area, (unsigned)(len > UINT_MAX ? UINT_MAX : len));
}

static void read_cb(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
	struct conn *c = s->data;
	struct bench *b = c->b;
	const char *line;
	size_t len;
	enum linebuf_next r;

	(void)buf;
	if (nread == UV_ENOBUFS) {
		conn_fail(c, "out_of_memory");
		return;
	}
	if (nread < 0) {
		conn_fail(c, "connection_closed");
		return;
	}
	if (c->dead)
		return;
	linebuf_commit(&c->in, (size_t)nread);
	b->bytes_in += (uint64_t)nread;
	while ((r = linebuf_next(&c->in, &line, &len)) != LINEBUF_NEED_MORE)
		handle_line(c, line, len, r == LINEBUF_TOO_LONG);
	check_done(b);
	if (b->phase == PHASE_WARMUP || b->phase == PHASE_MEASURE)
		conn_fill(c);
}

static void connect_cb(uv_connect_t *req, int status)
{
	struct conn *c = req->data;
	struct bench *b = c->b;
	int r;

	if (b->phase == PHASE_DONE)
		return;
	if (status < 0) {
		fprintf(stderr, "convod-bench: connect %s: %s\n", b->opt.socket,
		        uv_strerror(status));
		b->fatal = true;
		finish(b);
		return;
	}
	r = uv_read_start((uv_stream_t *)&c->pipe, alloc_cb, read_cb);
	if (r < 0) {
		fprintf(stderr, "convod-bench: read: %s\n", uv_strerror(r));
		b->fatal = true;
		finish(b);
		return;
	}
	c->connected = true;
	b->n_alive++;
	b->last_progress = uv_hrtime();
	if (++b->n_connected == b->opt.connections)
		start_run(b);
}

/* ---- reporting ---- */

static long read_status_kb(long pid, const char *field)
{
	char path[64], line[256];
	size_t flen = strlen(field);
	long kb = -1;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%ld/status", pid);
	f = fopen(path, "r");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		if (strncmp(line, field, flen) == 0 && line[flen] == ':') {
			kb = strtol(line + flen + 1, NULL, 10);
			break;
		}
	fclose(f);
	return kb;
}

static double us(uint64_t ns)
{
	return (double)ns / 1000.0;
}

static json_t *hist_json(const struct bench_hist *h)
{
	return json_pack("{s:I,s:f,s:f,s:f,s:f,s:f}", "count", (json_int_t)h->total, "p50",
	                 us(bench_hist_quantile(h, 0.50)), "p99", us(bench_hist_quantile(h, 0.99)),
	                 "p999", us(bench_hist_quantile(h, 0.999)), "max", us(h->max), "mean",
	                 bench_hist_mean(h) / 1000.0);
}

static int report(struct bench *b, long rss_before, long rss_after, long hwm_after)
{
	struct bench_hist all;
	double window, secs, rps;
	uint64_t total;
	const char *mode = in_fill(b) ? "fill" : "load";
	const char *mix = b->opt.mix == MIX_VOICE       ? "voice"
	                  : b->opt.mix == MIX_ADDS_ONLY ? "adds-only"
	                                                : "reads";

	bench_hist_reset(&all);
	for (int i = 0; i < OP__COUNT; i++)
		bench_hist_merge(&all, &b->hist[i]);
	secs = b->t_end > b->t_measure ? (double)(b->t_end - b->t_measure) / NS_PER_S : 0;
	if (!in_fill(b) && !b->opt.requests) {
		/* duration mode: answers that arrived inside the window, over the window */
		window = secs;
		total = b->done_in_window;
	} else {
		window = secs;
		total = b->measured_done;
	}
	rps = window > 0 ? (double)total / window : 0;

	if (b->opt.json) {
		json_t *root, *ops, *codes;
		char *s;

		ops = json_object();
		for (int i = 0; i < OP__COUNT; i++) {
			json_t *o;

			if (!b->op_count[i])
				continue;
			o = hist_json(&b->hist[i]);
			json_object_set_new(o, "errors", json_integer((json_int_t)b->op_errors[i]));
			json_object_set_new(ops, op_names[i], o);
		}
		codes = json_object();
		for (unsigned i = 0; i < b->n_codes; i++)
			json_object_set_new(codes, b->codes[i].name,
			                    json_integer((json_int_t)b->codes[i].count));
		root = json_pack(
		    "{s:s,s:s,s:I,s:I,s:I,s:f,s:I,s:f,s:o,s:o,s:{s:I,s:o},s:{s:I,s:I},s:{s:I,s:I}}",
		    "mode", mode, "mix", mix, "connections", (json_int_t)b->opt.connections,
		    "pipeline", (json_int_t)b->opt.pipeline, "conversations",
		    (json_int_t)b->opt.conversations, "seconds", secs, "requests",
		    (json_int_t)total, "throughput_rps", rps, "latency_us", hist_json(&all), "ops",
		    ops, "errors", "total", (json_int_t)b->errors, "by_code", codes, "summaries",
		    "cycles", (json_int_t)b->summary_cycles, "skipped",
		    (json_int_t)b->summary_skipped, "bytes", "sent", (json_int_t)b->bytes_out,
		    "received", (json_int_t)b->bytes_in);
		if (!root)
			return -ENOMEM;
		if (in_fill(b)) {
			json_object_set_new(root, "messages_per_conversation",
			                    json_integer(b->opt.messages_per_conversation));
			if (b->opt.pid > 0)
				json_object_set_new(root, "rss_kb",
				                    json_pack("{s:I,s:I,s:I}", "before",
				                              (json_int_t)rss_before, "after",
				                              (json_int_t)rss_after, "hwm_after",
				                              (json_int_t)hwm_after));
		}
		s = json_dumps(root, JSON_COMPACT | JSON_REAL_PRECISION(9));
		json_decref(root);
		if (!s)
			return -ENOMEM;
		printf("%s\n", s);
		free(s);
		return 0;
	}

	if (in_fill(b))
		printf("convod-bench fill: %u conversations x %u messages, %u connections, "
		       "pipeline %u\n",
		       b->opt.conversations, b->opt.messages_per_conversation, b->opt.connections,
		       b->opt.pipeline);
	else
		printf("convod-bench: mix %s, %u connections, pipeline %u, %u conversations\n", mix,
		       b->opt.connections, b->opt.pipeline, b->opt.conversations);
	printf("time        %.3f s\n", secs);
	printf("requests    %" PRIu64 " (%.0f req/s)\n", total, rps);
	printf("latency us  p50 %.1f  p99 %.1f  p99.9 %.1f  max %.1f  mean %.1f\n",
	       us(bench_hist_quantile(&all, 0.50)), us(bench_hist_quantile(&all, 0.99)),
	       us(bench_hist_quantile(&all, 0.999)), us(all.max), bench_hist_mean(&all) / 1000.0);
	printf("%-18s %10s %8s %10s %10s %10s %10s\n", "op", "count", "errors", "p50", "p99",
	       "p99.9", "max");
	for (int i = 0; i < OP__COUNT; i++) {
		const struct bench_hist *h = &b->hist[i];

		if (!b->op_count[i])
			continue;
		printf("%-18s %10" PRIu64 " %8" PRIu64 " %10.1f %10.1f %10.1f %10.1f\n",
		       op_names[i], h->total, b->op_errors[i], us(bench_hist_quantile(h, 0.5)),
		       us(bench_hist_quantile(h, 0.99)), us(bench_hist_quantile(h, 0.999)),
		       us(h->max));
	}
	if (b->summary_cycles || b->summary_skipped)
		printf("summaries   %" PRIu64 " cycles, %" PRIu64 " with nothing to summarize\n",
		       b->summary_cycles, b->summary_skipped);
	printf("errors      %" PRIu64 "\n", b->errors);
	for (unsigned i = 0; i < b->n_codes; i++)
		printf("  %-24s %" PRIu64 "\n", b->codes[i].name, b->codes[i].count);
	if (in_fill(b) && b->opt.pid > 0) {
		uint64_t msgs = (uint64_t)b->opt.conversations * b->opt.messages_per_conversation;

		printf("daemon rss  before %ld kB, after %ld kB (peak %ld kB)", rss_before,
		       rss_after, hwm_after);
		if (rss_before >= 0 && rss_after >= 0 && msgs)
			printf(", %.0f bytes/message",
			       (double)(rss_after - rss_before) * 1024.0 / (double)msgs);
		printf("\n");
	}
	return 0;
}

/* ---- set-up ---- */

static void usage(FILE *f)
{
	fprintf(
	    f,
	    "usage: convod-bench --socket PATH [options]\n"
	    "  --connections N            connections (50)\n"
	    "  --conversations M          conversations, bench-<run>-<k> (1000)\n"
	    "  --pipeline D               requests in flight per connection (1; fill: 64)\n"
	    "  --duration SEC             measured time (10)\n"
	    "  --requests TOTAL           stop after TOTAL measured requests instead\n"
	    "  --warmup SEC               unmeasured load before measuring (0)\n"
	    "  --mix voice|adds-only|reads  request mix (voice); adds-only: add_user and\n"
	    "                             add_assistant alternating in each conversation;\n"
	    "                             reads: get_messages (format meta) only, on\n"
	    "                             conversations that must already exist\n"
	    "  --message-bytes B          bytes of text per message (40)\n"
	    "  --read-every K             get_messages + to_messages_map every K adds (4, 0 off)\n"
	    "  --summary-every S          get_summary_info + add_summary every S adds (0 off)\n"
	    "  --rotate-after N           move a conversation to a new id after N adds (0 off)\n"
	    "  --fill                     create the conversations as fast as possible\n"
	    "  --messages-per-conversation K   messages per conversation in --fill (20)\n"
	    "  --pid PID                  report the daemon's VmRSS before and after (--fill)\n"
	    "  --run-id STR               run id in conversation ids (random)\n"
	    "  --timeout SEC              give up when nothing answers for SEC (10)\n"
	    "  --max-response-bytes N     longest response line accepted (67108864)\n"
	    "  --json                     print a JSON summary on stdout\n"
	    "  --allow-errors             exit 0 even when requests failed\n");
}

static int parse_uint(const char *s, unsigned long long lo, unsigned long long hi,
                      unsigned long long *out)
{
	char *end;
	unsigned long long v;

	if (!s || !*s || *s == '-')
		return -EINVAL;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || *end || v < lo || v > hi)
		return -EINVAL;
	*out = v;
	return 0;
}

static int parse_secs(const char *s, double *out)
{
	char *end;
	double v;

	if (!s || !*s)
		return -EINVAL;
	errno = 0;
	v = strtod(s, &end);
	if (errno || *end || !(v >= 0) || v > 86400)
		return -EINVAL;
	*out = v;
	return 0;
}

enum {
	O_SOCKET = 256,
	O_CONNECTIONS,
	O_CONVERSATIONS,
	O_PIPELINE,
	O_DURATION,
	O_REQUESTS,
	O_WARMUP,
	O_MIX,
	O_MESSAGE_BYTES,
	O_READ_EVERY,
	O_SUMMARY_EVERY,
	O_ROTATE_AFTER,
	O_FILL,
	O_MESSAGES_PER_CONV,
	O_PID,
	O_RUN_ID,
	O_TIMEOUT,
	O_MAX_RESPONSE,
	O_JSON,
	O_ALLOW_ERRORS,
	O_HELP,
};

static const struct option long_opts[] = {
    {"socket", required_argument, NULL, O_SOCKET},
    {"connections", required_argument, NULL, O_CONNECTIONS},
    {"conversations", required_argument, NULL, O_CONVERSATIONS},
    {"pipeline", required_argument, NULL, O_PIPELINE},
    {"duration", required_argument, NULL, O_DURATION},
    {"requests", required_argument, NULL, O_REQUESTS},
    {"warmup", required_argument, NULL, O_WARMUP},
    {"mix", required_argument, NULL, O_MIX},
    {"message-bytes", required_argument, NULL, O_MESSAGE_BYTES},
    {"read-every", required_argument, NULL, O_READ_EVERY},
    {"summary-every", required_argument, NULL, O_SUMMARY_EVERY},
    {"rotate-after", required_argument, NULL, O_ROTATE_AFTER},
    {"fill", no_argument, NULL, O_FILL},
    {"messages-per-conversation", required_argument, NULL, O_MESSAGES_PER_CONV},
    {"pid", required_argument, NULL, O_PID},
    {"run-id", required_argument, NULL, O_RUN_ID},
    {"timeout", required_argument, NULL, O_TIMEOUT},
    {"max-response-bytes", required_argument, NULL, O_MAX_RESPONSE},
    {"json", no_argument, NULL, O_JSON},
    {"allow-errors", no_argument, NULL, O_ALLOW_ERRORS},
    {"help", no_argument, NULL, O_HELP},
    {NULL, 0, NULL, 0},
};

static bool run_id_ok(const char *s)
{
	size_t n = strlen(s);

	if (n == 0 || n > 32)
		return false;
	for (; *s; s++)
		if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') ||
		      (*s >= '0' && *s <= '9') || *s == '_' || *s == '.'))
			return false;
	return true;
}

/* Returns 0, or EXIT_USAGE after printing why. */
static int parse_options(int argc, char **argv, struct options *o)
{
	bool pipeline_set = false;
	unsigned long long v;
	int ch;

	memset(o, 0, sizeof(*o));
	o->connections = 50;
	o->conversations = 1000;
	o->pipeline = 1;
	o->duration = 10;
	o->mix = MIX_VOICE;
	o->message_bytes = 40;
	o->read_every = 4;
	o->messages_per_conversation = 20;
	o->timeout = 10;
	o->max_response_bytes = 64u << 20;

	while ((ch = getopt_long(argc, argv, "", long_opts, NULL)) != -1) {
		int r = 0;
		double d;

		switch (ch) {
		case O_SOCKET:
			o->socket = optarg;
			break;
		case O_CONNECTIONS:
			r = parse_uint(optarg, 1, 100000, &v);
			o->connections = (unsigned)v;
			break;
		case O_CONVERSATIONS:
			r = parse_uint(optarg, 1, 100000000, &v);
			o->conversations = (unsigned)v;
			break;
		case O_PIPELINE:
			r = parse_uint(optarg, 1, 65536, &v);
			o->pipeline = (unsigned)v;
			pipeline_set = true;
			break;
		case O_DURATION:
			r = parse_secs(optarg, &d);
			o->duration = d;
			if (!r && d <= 0)
				r = -EINVAL;
			break;
		case O_REQUESTS:
			r = parse_uint(optarg, 1, UINT64_MAX, &v);
			o->requests = v;
			break;
		case O_WARMUP:
			r = parse_secs(optarg, &d);
			o->warmup = d;
			break;
		case O_MIX:
			if (strcmp(optarg, "voice") == 0)
				o->mix = MIX_VOICE;
			else if (strcmp(optarg, "adds-only") == 0)
				o->mix = MIX_ADDS_ONLY;
			else if (strcmp(optarg, "reads") == 0)
				o->mix = MIX_READS;
			else
				r = -EINVAL;
			break;
		case O_MESSAGE_BYTES:
			r = parse_uint(optarg, 1, 16u << 20, &v);
			o->message_bytes = (size_t)v;
			break;
		case O_READ_EVERY:
			r = parse_uint(optarg, 0, 1000000, &v);
			o->read_every = (unsigned)v;
			break;
		case O_SUMMARY_EVERY:
			r = parse_uint(optarg, 0, 1000000, &v);
			o->summary_every = (unsigned)v;
			break;
		case O_ROTATE_AFTER:
			r = parse_uint(optarg, 0, 100000000, &v);
			o->rotate_after = (unsigned)v;
			break;
		case O_FILL:
			o->fill = true;
			break;
		case O_MESSAGES_PER_CONV:
			r = parse_uint(optarg, 1, 100000000, &v);
			o->messages_per_conversation = (unsigned)v;
			break;
		case O_PID:
			r = parse_uint(optarg, 1, INT_MAX, &v);
			o->pid = (long)v;
			break;
		case O_RUN_ID:
			o->run_id = optarg;
			if (!run_id_ok(optarg))
				r = -EINVAL;
			break;
		case O_TIMEOUT:
			r = parse_secs(optarg, &d);
			o->timeout = d;
			if (!r && d <= 0)
				r = -EINVAL;
			break;
		case O_MAX_RESPONSE:
			r = parse_uint(optarg, 1024, SIZE_MAX / 4, &v);
			o->max_response_bytes = (size_t)v;
			break;
		case O_JSON:
			o->json = true;
			break;
		case O_ALLOW_ERRORS:
			o->allow_errors = true;
			break;
		case O_HELP:
			usage(stdout);
			exit(0);
		default:
			usage(stderr);
			return EXIT_USAGE;
		}
		if (r < 0) {
			fprintf(stderr, "convod-bench: bad value for --%s: '%s'\n",
			        long_opts[ch - O_SOCKET].name, optarg);
			return EXIT_USAGE;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "convod-bench: unexpected argument '%s'\n", argv[optind]);
		return EXIT_USAGE;
	}
	if (!o->socket) {
		fprintf(stderr, "convod-bench: --socket is required\n");
		usage(stderr);
		return EXIT_USAGE;
	}
	if (o->fill && !pipeline_set)
		o->pipeline = 64;
	if (o->connections > o->conversations) {
		fprintf(stderr, "convod-bench: only %u conversations, using %u connections\n",
		        o->conversations, o->conversations);
		o->connections = o->conversations;
	}
	return 0;
}

/* Plain ASCII words, so the text needs no JSON escaping and is never blank. */
static char *make_text(size_t n)
{
	static const char words[] = "Could you tell me what the weather will be like "
	                            "tomorrow morning in the city centre please ";
	char *t = malloc(n + 1);

	if (!t)
		return NULL;
	for (size_t i = 0; i < n; i++)
		t[i] = words[i % (sizeof(words) - 1)];
	t[n] = '\0';
	return t;
}

static int setup(struct bench *b)
{
	const struct options *o = &b->opt;
	int r;

	b->loop = uv_default_loop();
	uv_timer_init(b->loop, &b->phase_timer);
	uv_timer_init(b->loop, &b->watchdog);
	uv_signal_init(b->loop, &b->sigint);
	uv_signal_init(b->loop, &b->sigterm);
	b->convs = calloc(o->conversations, sizeof(*b->convs));
	b->conns = calloc(o->connections, sizeof(*b->conns));
	b->text = make_text(o->message_bytes);
	if (!b->convs || !b->conns || !b->text)
		return -ENOMEM;
	for (int i = 0; i < OP__COUNT; i++)
		bench_hist_reset(&b->hist[i]);
	b->phase_timer.data = b->watchdog.data = b->sigint.data = b->sigterm.data = b;
	uv_signal_start(&b->sigint, signal_cb, SIGINT);
	uv_signal_start(&b->sigterm, signal_cb, SIGTERM);
	b->last_progress = uv_hrtime();
	uv_timer_start(&b->watchdog, watchdog_cb, 250, 250);

	for (unsigned i = 0; i < o->connections; i++) {
		struct conn *c = &b->conns[i];

		c->b = b;
		c->index = i;
		c->writing = -1;
		c->n_convs = (o->conversations - i + o->connections - 1) / o->connections;
		linebuf_init(&c->in, o->max_response_bytes);
		c->ring = calloc(o->pipeline, sizeof(*c->ring));
		if (!c->ring)
			return -ENOMEM;
		r = uv_pipe_init(b->loop, &c->pipe, 0);
		if (r < 0)
			return r;
		c->handle_open = true;
		c->pipe.data = c;
		c->connect_req.data = c;
		c->write_req.data = c;
		uv_pipe_connect(&c->connect_req, &c->pipe, o->socket, connect_cb);
	}
	return 0;
}

static void teardown(struct bench *b)
{
	/* let the close callbacks run before the connections' memory goes */
	uv_run(b->loop, UV_RUN_DEFAULT);
	uv_loop_close(b->loop);
	if (b->conns) {
		for (unsigned i = 0; i < b->opt.connections; i++) {
			struct conn *c = &b->conns[i];

			linebuf_free(&c->in);
			free(c->out[0].data);
			free(c->out[1].data);
			free(c->ring);
		}
	}
	if (b->convs)
		for (unsigned i = 0; i < b->opt.conversations; i++)
			free(b->convs[i].summary_args);
	free(b->conns);
	free(b->convs);
	free(b->text);
}

int main(int argc, char **argv)
{
	static struct bench bench;
	struct bench *b = &bench;
	char run_id[40];
	long rss_before = -1, rss_after = -1, hwm_after = -1;
	int r, rc = 0;

	r = parse_options(argc, argv, &b->opt);
	if (r)
		return r;
	if (!b->opt.run_id) {
		snprintf(run_id, sizeof(run_id), "%lx%x", (unsigned long)getpid(),
		         (unsigned)(uv_hrtime() & 0xffffff));
		b->opt.run_id = run_id;
	}
	signal(SIGPIPE, SIG_IGN);
	if (b->opt.fill && b->opt.pid > 0) {
		rss_before = read_status_kb(b->opt.pid, "VmRSS");
		if (rss_before < 0)
			fprintf(stderr, "convod-bench: cannot read /proc/%ld/status\n", b->opt.pid);
	}
	r = setup(b);
	if (r < 0) {
		fprintf(stderr, "convod-bench: setup: %s\n", strerror(-r));
		b->fatal = true;
		finish(b);
		goto out;
	}
	uv_run(b->loop, UV_RUN_DEFAULT);
	if (b->opt.fill && b->opt.pid > 0) {
		rss_after = read_status_kb(b->opt.pid, "VmRSS");
		hwm_after = read_status_kb(b->opt.pid, "VmHWM");
	}
	if (!b->fatal && report(b, rss_before, rss_after, hwm_after) < 0)
		b->fatal = true;
out:
	if (b->fatal)
		rc = EXIT_FATAL;
	else if (b->errors > 0 && !b->opt.allow_errors)
		rc = EXIT_ERRORS;
	if (b->fatal && b->errors)
		fprintf(stderr, "convod-bench: %" PRIu64 " errors before giving up\n", b->errors);
	teardown(b);
	return rc;
}
