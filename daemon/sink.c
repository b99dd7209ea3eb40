/* The flusher of sink.h: a table of pending writes keyed by (conversation, sk), sent in
 * BatchWriteItem calls through ddbclient with capped exponential backoff and full jitter,
 * outcomes recorded in the local store; plus the Query of a restore and CreateTable. */
#include "sink.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "buf.h"
#include "ddbclient.h"
#include "ddbitem.h"
#include "htable.h"
#include "log.h"

#define SUBSYS "sink"
#define LATENCY_SAMPLES 4096        /* calls the latency percentiles look at */
#define LAST_ERROR_MAX 256          /* bytes kept of the last error text */
#define RELOAD_MIN_INTERVAL_MS 1000 /* credential errors reread the settings at most this often */
#define JOB_RETRIES 4               /* a Query or CreateTable is sent at most 1 + this often */
#define TABLE_WAIT_MS 60000         /* CreateTable: how long to wait for ACTIVE */
#define TABLE_POLL_MS 100
#define QUERY_MAX_ITEMS (4u << 20) /* a restore collecting more gives up with -EFBIG */
#define BATCH_MAX_POPS 1024      /* ready entries one batch_send looks at, at most */
/* A scan of the whole spool on the loop (the statistics' bytes, sink_resync's read) runs at
 * most this often... */
#define STATS_RESCAN_MIN_MS 1000
#define STATS_RESCAN_FACTOR 50 /* ...and at most 1/50 of the time (rescan_due) */
/* sink_resync reads the spool in slices of about this long on the loop (one per loop turn),
 * so that a spool of a million rows (about a second to read) never holds the loop, or the
 * store's writer, for longer. */
#define RESYNC_SLICE_NS 2000000u
#define RESYNC_CLOCK_ROWS 64 /* rows read between two looks at the clock */
/* The statistics' count of the spool's bytes goes this many rows a slice (about 1 ms). */
#define BYTES_SLICE_ROWS 8192

/* A BatchWriteItem sent whole and left without an answer (none before the timeout, a
 * broken connection) or with a 5xx may still be applied by DynamoDB later, after a newer
 * version of one of its messages was written and confirmed: the older version would then
 * stay in DynamoDB for ever (persistence.md, promise 3). So each of its messages is looked
 * at again REPAIR_TIMEOUTS request timeouts after the call ended, when that late write can
 * be taken to have landed or never to land: when the store holds a newer version than the
 * call carried, that version is written with a PutItem on the condition that DynamoDB's
 * version is no newer than the call's (the late write landed, or nothing newer is there).
 * So a newer version written since, by this host or by another one the conversation moved
 * to, is never overwritten. A repair that fails is tried REPAIR_TRIES times in all. Each
 * is a row of the store's repairs table too, written in the loop turn's commit and
 * deleted once the repair is done or given up, so that a stop (or a crash) before it is
 * due does not forget it: the next start looks again (sink_load_repairs). At most
 * REPAIR_MAX wait at a time (later ones are let go, counted and logged). */
#define REPAIR_TIMEOUTS 3
#define REPAIR_MAX 65536
#define REPAIR_TRIES 5

/* A message to look at again after an unanswered write of version: in s->repairs (by
 * conversation, message and version: one each) from repair_add to repair_end, and in the
 * queue or in flight meanwhile. */
struct repair {
	struct hnode h;
	struct repair *next;
	struct sink *s;
	uint64_t queued_ms; /* loop time: due when queued (the queue's order) */
	uint64_t due_ms;    /* loop time: later when another write of version went unanswered */
	uint32_t version; /* what the unanswered call carried */
	uint32_t sending; /* the version of the PutItem in flight */
	unsigned tries;
	char sk[DDBITEM_SK_MAX + 1];
	size_t conv_len;
	char conv[]; /* conv_len bytes and a NUL */
};

/* Pending entries of one conversation; the conversation id is kept here once. Lives while
 * pending > 0. */
struct conv {
	struct hnode h;
	size_t pending;
	size_t len;
	char id[]; /* len bytes and a NUL */
};

enum entry_state { ENTRY_READY, ENTRY_WAITING, ENTRY_INFLIGHT };

/* One message to send. Always in exactly one of: the ready FIFO, the waiting heap, a batch
 * in flight. */
struct entry {
	struct hnode h;
	struct conv *conv;
	struct entry *qnext;         /* ready FIFO */
	struct entry *older, *newer; /* every entry, in enqueue order (oldest_pending_ms) */
	size_t heap_idx;             /* in the waiting heap */
	uint64_t next_ms;            /* loop time of the next attempt, while waiting */
	int64_t enqueued_ms;         /* Unix ms of the first enqueue */
	uint32_t wanted;             /* newest version enqueued */
	uint32_t sending;            /* version in flight, 0 when none */
	uint32_t attempts;           /* failures since the last confirmation */
	uint8_t state;               /* enum entry_state */
	bool alone;                  /* refused for good within a batch: sent alone next */
	bool failed;                 /* the next send is a retry (counted in retried) */
	char sk[DDBITEM_SK_MAX + 1];
};

struct batch {
	struct sink *s;
	size_t n;
	struct entry *e[DDBITEM_BATCH_MAX];
	uint32_t version[DDBITEM_BATCH_MAX];
	json_t *item[DDBITEM_BATCH_MAX];
};

enum job_kind { JOB_QUERY, JOB_CREATE_TABLE };

/* A Query (every page of one conversation) or a CreateTable with its wait for ACTIVE. */
struct job {
	struct job *next, *prev;
	struct sink *s;
	enum job_kind kind;
	bool describing; /* CreateTable done (or the table existed): polling DescribeTable */
	bool exists;
	bool inflight;
	bool ended;
	unsigned retries;
	uint64_t deadline_ms;
	char *conv; /* queries: NUL-terminated conversation id */
	json_t *items, *start_key;
	sink_query_cb query_cb;
	void (*table_cb)(void *arg, int status);
	void *arg;
	uv_timer_t timer; /* retry and poll delays; the job is freed in its close callback */
};

struct sink {
	uv_loop_t *loop;
	struct store *store;
	struct sink_config cfg;
	char *table; /* NULL: the local store is the sink */
	struct ddbclient *client;
	sink_settled_cb settled;
	void *settled_arg;
	uv_timer_t timer;       /* the earliest retry, or the end of the failure gate */
	uv_timer_t close_timer; /* sink_close's deadline, or "finish now" */
	uint64_t hash_seed, rng;

	struct htable convs, entries, repairs;
	/* the endpoint and signing region the client uses: a reload cannot change them */
	char endpoint[512], region[80];
	size_t depth;
	struct entry *ready_head, *ready_tail;
	struct entry **heap; /* min-heap on next_ms of the waiting entries */
	size_t nheap, heap_cap;
	struct entry *oldest, *newest;
	size_t batches_inflight;
	bool pumping;

	/* After a failed call, one batch at a time and none before gate_ms, until a call
	 * succeeds: a dead or throttling endpoint is not hammered by every entry's own retry. */
	unsigned fail_streak;
	uint64_t gate_ms;
	/* A call over the request timeout may have been too big to go through in time (a slow
	 * link): the next calls carry at most half its items, and each call that succeeds
	 * doubles that back. 0: no such cap (batch_items). */
	size_t timeout_cap;
	uint64_t last_reload_ms;
	bool reloaded;

	uint64_t writes_sent, confirmed, retried, dead_lettered, failures, unprocessed;
	/* repairs, in the order they were queued: by due time, but for one queued again with a
	 * shorter delay, which waits behind those before it (later, never lost) */
	struct repair *repair_head, *repair_tail;
	size_t nrepairs, repairs_inflight;
	uint64_t repaired, repairs_dropped;
	uint64_t answers_damaged; /* answers whose body did not match x-amz-crc32 */
	char last_error[LAST_ERROR_MAX];
	uint32_t lat[LATENCY_SAMPLES];
	size_t nlat, lat_pos;
	/* The statistics' bytes: the spool's map_bytes as of the last count (spool_bytes_at,
	 * which took spool_scan_ms), counted again in slices (scan_idle) from after bytes_seq
	 * while bytes_counting. */
	uint64_t spool_bytes, spool_bytes_at, spool_scan_ms;
	bool spool_bytes_valid, bytes_counting;
	int64_t bytes_seq;
	uint64_t bytes_sum, bytes_ns;
	/* Rows the sink may have lost (sink_lost): sink_resync reads the spool again, in
	 * slices (scan_idle, a slice of each scan under way a loop turn) from after resync_seq.
	 * resync_at is the loop time the last read ended, resync_ms its time on the loop (the
	 * slices' sum, resync_ns meanwhile). */
	bool lost, resync_ran, resyncing, resync_now, resync_asked;
	/* lost_rows: a recording was lost (not only rows put back, sink_reread); the read
	 * under way counts what it finds in resynced (resync_counts) */
	bool lost_rows, resync_counts;
	/* A commit failed since the repairs' rows were last written: rows it held are gone, so
	 * every repair's row is written again once commits succeed (sink_resync asks for it,
	 * rewrite_repairs, and the idle handle does it: not inside the caller's commit). */
	bool repairs_lost, rewrite_repairs;
	uint64_t repairs_overflow; /* of repairs_dropped, those let go past REPAIR_MAX */
	uv_idle_t scan_idle;
	int64_t resync_seq;
	uint64_t resync_at, resync_ms, resync_ns, resync_slice_end;
	size_t resync_rows, resync_slices, resync_found;
	uint64_t resynced; /* rows those reads enqueued that the sink had lost ("resent") */

	struct job *jobs;

	bool closing, finishing, client_closed;
	unsigned handles; /* uv handles not closed yet (the two timers, the scans' idle handle,
	                     every job's timer) */
	void (*on_closed)(void *arg);
	void *closed_arg;
};

void sink_config_defaults(struct sink_config *cfg)
{
	memset(cfg, 0, sizeof(*cfg));
	cfg->retry_base_ms = 100;
	cfg->retry_max_ms = 30000;
	cfg->batch_items = DDBITEM_BATCH_MAX;
	cfg->max_batches_inflight = 8;
	cfg->spool_max_items = 1000000;
	cfg->expires_days = 0;
	cfg->connect_timeout_ms = 3000;
	cfg->request_timeout_ms = 10000;
}

static void on_close_timer(uv_timer_t *t);
static void on_scan_idle(uv_idle_t *h);
static void maybe_freed(struct sink *s);

/* --- small helpers ------------------------------------------------------------------- */

static int64_t wall_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* An item's expiry (Unix s, 0 none): from the write, or from the message's last change
 * (updated, Unix ms) when the wall clock is behind it (set back: items written then must
 * not expire days early). */
static int64_t item_expires(const struct sink *s, int64_t updated)
{
	int64_t now_ms;

	if (!s->cfg.expires_days)
		return 0;
	now_ms = wall_ms();
	return (now_ms > updated ? now_ms : updated) / 1000 + (int64_t)s->cfg.expires_days * 86400;
}

static uint64_t rng_next(struct sink *s)
{
	/* xorshift64*: jitter only, nothing secret */
	uint64_t x = s->rng;
	x ^= x >> 12;
	x ^= x << 25;
	x ^= x >> 27;
	s->rng = x;
	return x * 0x2545F4914F6CDD1DULL;
}

/* Full jitter: uniform in [0, min(retry_max, retry_base * 2^(failures - 1))]. */
static uint64_t backoff_ms(struct sink *s, unsigned failures)
{
	uint64_t cap = s->cfg.retry_base_ms;
	for (unsigned i = 1; i < failures && cap < s->cfg.retry_max_ms; i++)
		cap *= 2;
	if (cap > s->cfg.retry_max_ms)
		cap = s->cfg.retry_max_ms;
	return rng_next(s) % (cap + 1);
}

static uint64_t hash_bytes(uint64_t h, const void *p, size_t n)
{
	const unsigned char *c = p;
	for (size_t i = 0; i < n; i++) {
		h ^= c[i];
		h *= 0x100000001b3ULL;
	}
	/* splitmix64's finalizer, so that the low bits used for buckets are well mixed */
	h ^= h >> 30;
	h *= 0xbf58476d1ce4e5b9ULL;
	h ^= h >> 27;
	h *= 0x94d049bb133111ebULL;
	h ^= h >> 31;
	return h;
}

/* The text of the last error, for stats: printable ASCII only, cut to fit. */
static void set_last_error(struct sink *s, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void set_last_error(struct sink *s, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(s->last_error, sizeof(s->last_error), fmt, ap);
	va_end(ap);
	for (char *p = s->last_error; *p; p++)
		if ((unsigned char)*p < 0x20 || (unsigned char)*p > 0x7e)
			*p = ' ';
}

/* Opens the transaction the daemon commits at the end of the loop turn, if none is. */
static int store_write_begin(struct sink *s)
{
	int rc;
	if (store_in_transaction(s->store))
		return 0;
	rc = store_begin(s->store);
	if (rc < 0)
		log_msg(LOG_ERROR, SUBSYS, "cannot open a local store transaction: %s",
		        strerror(-rc));
	return rc;
}

/* --- hash tables (htable.c) ---------------------------------------------------------- */

static struct conv *conv_find(const struct sink *s, const char *id, size_t len, uint64_t hash)
{
	for (struct hnode *h = ht_first(&s->convs, hash); h; h = h->next) {
		struct conv *c = (struct conv *)h;
		if (h->hash == hash && c->len == len && memcmp(c->id, id, len) == 0)
			return c;
	}
	return NULL;
}

static uint64_t entry_hash(const struct sink *s, const struct conv *c, const char *sk)
{
	return hash_bytes(c->h.hash ^ s->hash_seed, sk, strlen(sk));
}

static struct entry *entry_find(const struct sink *s, const struct conv *c, const char *sk)
{
	uint64_t hash = entry_hash(s, c, sk);
	for (struct hnode *h = ht_first(&s->entries, hash); h; h = h->next) {
		struct entry *e = (struct entry *)h;
		if (h->hash == hash && e->conv == c && strcmp(e->sk, sk) == 0)
			return e;
	}
	return NULL;
}

/* --- ready FIFO and waiting heap --------------------------------------------------------- */

static void ready_push_back(struct sink *s, struct entry *e)
{
	e->state = ENTRY_READY;
	e->qnext = NULL;
	if (s->ready_tail)
		s->ready_tail->qnext = e;
	else
		s->ready_head = e;
	s->ready_tail = e;
}

static void ready_push_front(struct sink *s, struct entry *e)
{
	e->state = ENTRY_READY;
	e->qnext = s->ready_head;
	s->ready_head = e;
	if (!s->ready_tail)
		s->ready_tail = e;
}

static struct entry *ready_pop(struct sink *s)
{
	struct entry *e = s->ready_head;
	if (e) {
		s->ready_head = e->qnext;
		if (!s->ready_head)
			s->ready_tail = NULL;
		e->qnext = NULL;
	}
	return e;
}

static void heap_set(struct sink *s, size_t i, struct entry *e)
{
	s->heap[i] = e;
	e->heap_idx = i;
}

static void heap_up(struct sink *s, size_t i)
{
	struct entry *e = s->heap[i];
	while (i > 0) {
		size_t p = (i - 1) / 2;
		if (s->heap[p]->next_ms <= e->next_ms)
			break;
		heap_set(s, i, s->heap[p]);
		i = p;
	}
	heap_set(s, i, e);
}

static void heap_down(struct sink *s, size_t i)
{
	struct entry *e = s->heap[i];
	for (;;) {
		size_t c = 2 * i + 1;
		if (c >= s->nheap)
			break;
		if (c + 1 < s->nheap && s->heap[c + 1]->next_ms < s->heap[c]->next_ms)
			c++;
		if (e->next_ms <= s->heap[c]->next_ms)
			break;
		heap_set(s, i, s->heap[c]);
		i = c;
	}
	heap_set(s, i, e);
}

static int heap_reserve(struct sink *s)
{
	if (s->nheap == s->heap_cap) {
		size_t ncap = s->heap_cap ? 2 * s->heap_cap : 256;
		struct entry **p = realloc(s->heap, ncap * sizeof(*p));
		if (!p)
			return -ENOMEM;
		s->heap = p;
		s->heap_cap = ncap;
	}
	return 0;
}

static struct entry *heap_pop(struct sink *s)
{
	struct entry *top = s->heap[0];
	if (--s->nheap > 0) {
		s->heap[0] = s->heap[s->nheap];
		heap_down(s, 0);
	}
	return top;
}

/* --- entries ------------------------------------------------------------------------------ */

/* Removes a settled entry (not queued anywhere); may run the settled callback. */
static void entry_remove(struct sink *s, struct entry *e)
{
	struct conv *c = e->conv;

	ht_remove(&s->entries, &e->h);
	if (e->older)
		e->older->newer = e->newer;
	else
		s->oldest = e->newer;
	if (e->newer)
		e->newer->older = e->older;
	else
		s->newest = e->older;
	s->depth--;
	free(e);
	if (--c->pending == 0) {
		/* Unlinked before the callback, which may enqueue this conversation again. */
		ht_remove(&s->convs, &c->h);
		if (s->settled)
			s->settled(s->settled_arg, c->id, c->len);
		free(c);
	}
	if (s->closing && s->depth == 0 && !s->finishing)
		uv_timer_start(&s->close_timer, on_close_timer, 0, 0); /* all sent: stop now */
}

/* A failed attempt: back to waiting, for a random time under the entry's backoff cap. */
static void entry_retry(struct sink *s, struct entry *e, uint64_t now)
{
	e->sending = 0;
	e->failed = true;
	if (e->attempts < UINT32_MAX)
		e->attempts++;
	if (heap_reserve(s) < 0) {
		/* Cannot wait in order: try again with the next pump rather than lose it. */
		ready_push_back(s, e);
		return;
	}
	e->state = ENTRY_WAITING;
	e->next_ms = now + backoff_ms(s, e->attempts);
	s->heap[s->nheap++] = e;
	heap_up(s, s->nheap - 1);
}

/* j's compact JSON text, NUL-terminated, its length in *len (if len); NULL when memory ran
 * out. Not
 * json_dumps: jansson 2.14's dumper ignores a failed allocation while writing an object's
 * key and goes on, so a refused allocation gave a body without that key, which DynamoDB
 * refused for good (SerializationException: the write became a dead letter). */
static char *json_text(const json_t *j, size_t *len)
{
	struct buf b = {NULL, 0, 0};

	if (buf_append_json(&b, j) < 0 || buf_append(&b, "", 1) < 0) {
		buf_free(&b);
		return NULL;
	}
	if (len)
		*len = b.len - 1;
	return b.data;
}

static void entry_confirmed(struct sink *s, struct entry *e, uint32_t version)
{
	int rc = store_write_begin(s);

	if (rc == 0 &&
	    (rc = store_spool_done(s->store, e->conv->id, e->conv->len, e->sk, version)) < 0) {
		log_msg(LOG_ERROR, SUBSYS,
		        "recording a confirmed write failed (%s); it will be sent again once the "
		        "store can be written",
		        strerror(-rc));
		s->lost = s->lost_rows = true;
	}
	s->confirmed++;
	e->sending = 0;
	e->attempts = 0;
	e->alone = false;
	e->failed = false;
	if (e->wanted > version)
		ready_push_back(s, e); /* changed meanwhile: the newer version goes out next */
	else
		entry_remove(s, e);
}

/* A write refused for good (or that can never be built): into the store's dead letters,
 * counted and logged. A newer version enqueued meanwhile has not been tried: it stays. */
static void entry_dead_letter(struct sink *s, struct entry *e, uint32_t version, const json_t *item,
                              const char *error)
{
	char *text = item ? json_text(item, NULL) : NULL;
	int rc = store_write_begin(s);

	if (rc == 0)
		rc = store_dead_letter(s->store, e->conv->id, e->conv->len, e->sk, version, text,
		                       error, wall_ms());
	if (rc < 0) /* the spool row stays: tried again after sink_resync */
		s->lost = s->lost_rows = true;
	free(text);
	s->dead_lettered++;
	set_last_error(s, "dead letter: %s", error);
	log_msg(LOG_ERROR, SUBSYS,
	        "write refused for good, kept as a dead letter%s: conversation \"%.*s\" message "
	        "%s version %" PRIu32 ": %s",
	        rc < 0 ? " (NOT recorded: the local store failed)" : "",
	        (int)(e->conv->len > 200 ? 200 : e->conv->len), e->conv->id, e->sk, version, error);
	e->sending = 0;
	e->attempts = 0;
	e->alone = false;
	e->failed = false;
	if (e->wanted > version)
		ready_push_back(s, e);
	else
		entry_remove(s, e);
}

int sink_enqueue(struct sink *s, const char *conv, size_t conv_len, const char *sk,
                 uint32_t version, int64_t enqueued_ms)
{
	size_t sk_len;
	uint64_t hash;
	struct conv *c;
	struct entry *e;
	bool new_conv = false;

	if (!s || !conv || conv_len == 0 || conv_len > DDBITEM_PARTITION_KEY_MAX || !sk ||
	    version == 0)
		return -EINVAL;
	sk_len = strlen(sk);
	if (sk_len == 0 || sk_len > DDBITEM_SK_MAX || memchr(conv, '\0', conv_len))
		return -EINVAL;
	if (!s->table)
		return -ENOTSUP;
	if (s->closing)
		return -ESHUTDOWN;
	hash = hash_bytes(s->hash_seed, conv, conv_len);
	c = conv_find(s, conv, conv_len, hash);
	if (c && (e = entry_find(s, c, sk))) {
		if (version > e->wanted)
			e->wanted = version;
		return 0;
	}
	if (!c) {
		c = malloc(sizeof(*c) + conv_len + 1);
		if (!c)
			return -ENOMEM;
		c->h.hash = hash;
		c->pending = 0;
		c->len = conv_len;
		memcpy(c->id, conv, conv_len);
		c->id[conv_len] = '\0';
		new_conv = true;
	}
	e = calloc(1, sizeof(*e));
	if (!e) {
		if (new_conv)
			free(c);
		return -ENOMEM;
	}
	if (new_conv)
		ht_insert(&s->convs, &c->h);
	e->conv = c;
	memcpy(e->sk, sk, sk_len + 1);
	e->h.hash = entry_hash(s, c, sk);
	e->wanted = version;
	e->enqueued_ms = enqueued_ms;
	ht_insert(&s->entries, &e->h);
	e->older = s->newest;
	if (s->newest)
		s->newest->newer = e;
	else
		s->oldest = e;
	s->newest = e;
	c->pending++;
	s->depth++;
	ready_push_back(s, e);
	return 0;
}

size_t sink_pending(const struct sink *s, const char *conv, size_t conv_len)
{
	const struct conv *c;
	if (!s || !s->table || !conv)
		return 0;
	c = conv_find(s, conv, conv_len, hash_bytes(s->hash_seed, conv, conv_len));
	return c ? c->pending : 0;
}

bool sink_full(const struct sink *s)
{
	return s && s->table && s->depth > s->cfg.spool_max_items; /* "grows past" it */
}

size_t sink_depth(const struct sink *s)
{
	return s ? s->depth : 0;
}

bool sink_remote(const struct sink *s)
{
	return s && s->table;
}

/* --- classification of answers ------------------------------------------------------------ */

enum outcome { OUT_OK, OUT_RETRY, OUT_CREDENTIALS, OUT_PERMANENT };

static bool credentials_error(const char *type)
{
	static const char *const names[] = {
	    "UnrecognizedClientException",
	    "ExpiredTokenException",
	    "ExpiredToken",
	    "InvalidSignatureException",
	    "MissingAuthenticationToken",
	    "MissingAuthenticationTokenException",
	    "IncompleteSignature",
	    "IncompleteSignatureException",
	    "InvalidClientTokenId",
	    "SignatureDoesNotMatch",
	    "AccessDeniedException",
	    NULL,
	};
	for (const char *const *p = names; *p; p++)
		if (strcmp(type, *p) == 0)
			return true;
	return false;
}

/* What an answer other than 200 means, and a text for logs and stats. Messages of
 * credential errors are left out: AWS may quote the canonical request in them. */
static enum outcome classify(const struct ddbclient_result *res, char *why, size_t size)
{
	char type[128], message[192];

	if (res->status == 200)
		return OUT_OK;
	if (res->status == 0) {
		snprintf(why, size, "%s: %s%s", res->operation, res->timed_out ? "timeout: " : "",
		         res->error[0] ? res->error : "transport failure");
		return OUT_RETRY;
	}
	if (ddbitem_error_parse(res->body, res->body_len, type, sizeof(type), message,
	                        sizeof(message)) < 0) {
		type[0] = '\0';
		message[0] = '\0';
	}
	if (type[0] && credentials_error(type)) {
		snprintf(why, size, "%s: HTTP %ld %s", res->operation, res->status, type);
		return OUT_CREDENTIALS;
	}
	if (res->status == 403) {
		snprintf(why, size, "%s: HTTP 403%s%s", res->operation, type[0] ? " " : "", type);
		return OUT_CREDENTIALS;
	}
	snprintf(why, size, "%s: HTTP %ld%s%s%s%s", res->operation, res->status, type[0] ? " " : "",
	         type, message[0] ? ": " : "", message);
	if (res->status >= 400 && res->status < 500 && type[0] && ddbitem_error_permanent(type))
		return OUT_PERMANENT;
	return OUT_RETRY; /* 5xx, throttling, other 4xx, unreadable answers */
}

static void maybe_reload_credentials(struct sink *s)
{
	uint64_t now = uv_now(s->loop);
	if (s->reloaded && now - s->last_reload_ms < RELOAD_MIN_INTERVAL_MS)
		return;
	s->reloaded = true;
	s->last_reload_ms = now;
	sink_reload_credentials(s);
}

int sink_reload_credentials(struct sink *s)
{
	struct awsconf conf;
	char err[AWSCONF_ERRBUF_SIZE], line[256], endpoint[512];
	bool same;
	int rc;

	if (!s || !s->client)
		return 0;
	rc = awsconf_load(&conf, err);
	if (rc < 0) {
		log_msg(LOG_WARN, SUBSYS, "rereading the AWS settings failed: %s", err);
		return rc;
	}
	if (!awsconf_has_credentials(&conf)) {
		log_msg(LOG_WARN, SUBSYS, "rereading the AWS settings: no credentials found (%s)",
		        awsconf_describe(&conf, line, sizeof(line)));
		awsconf_free(&conf);
		return -ENOKEY;
	}
	/* The endpoint and region are the client's for good: only the keys are taken. */
	if (awsconf_endpoint(&conf, endpoint, sizeof(endpoint)) < 0)
		endpoint[0] = '\0';
	same = strcmp(endpoint, s->endpoint) == 0 &&
	       strcmp(awsconf_signing_region(&conf), s->region) == 0;
	if (!same)
		log_msg(LOG_WARN, SUBSYS,
		        "the AWS settings now give endpoint %s, region %s; that needs a restart: "
		        "keeping %s, region %s",
		        endpoint[0] ? endpoint : "(none)", awsconf_signing_region(&conf),
		        s->endpoint, s->region);
	rc = ddbclient_set_credentials(s->client, conf.access_key_id, conf.secret_access_key,
	                               conf.session_token);
	if (rc == 0 && same)
		log_msg(LOG_INFO, SUBSYS, "AWS credentials reread: %s",
		        awsconf_describe(&conf, line, sizeof(line)));
	else if (rc == 0)
		log_msg(LOG_INFO, SUBSYS, "AWS credentials reread (endpoint %s, region %s)",
		        s->endpoint, s->region);
	else
		log_msg(LOG_WARN, SUBSYS, "the reread AWS credentials were refused: %s",
		        strerror(-rc));
	awsconf_free(&conf);
	return rc;
}

/* --- batches --------------------------------------------------------------------------- */

static void latency_add(struct sink *s, uint64_t ms)
{
	s->lat[s->lat_pos] = ms > UINT32_MAX ? UINT32_MAX : (uint32_t)ms;
	s->lat_pos = (s->lat_pos + 1) % LATENCY_SAMPLES;
	if (s->nlat < LATENCY_SAMPLES)
		s->nlat++;
}

static void batch_free(struct batch *b)
{
	for (size_t i = 0; i < b->n; i++)
		json_decref(b->item[i]);
	free(b);
}

static void repair_queue(struct sink *s, struct repair *r, uint64_t due_ms)
{
	r->next = NULL;
	r->queued_ms = r->due_ms = due_ms;
	if (s->repair_tail)
		s->repair_tail->next = r;
	else
		s->repair_head = r;
	s->repair_tail = r;
	s->nrepairs++;
}

/* Records r in the store (due in delay_ms), or, done, deletes its row. A failure is logged:
 * r is still done from memory, only a restart would not look at it again. */
static int repair_record(struct sink *s, const struct repair *r, bool done, uint64_t delay_ms)
{
	int rc = store_write_begin(s);

	if (rc == 0)
		rc = done ? store_repair_done(s->store, r->conv, r->conv_len, r->sk, r->version)
		          : store_repair_put(s->store, r->conv, r->conv_len, r->sk, r->version,
		                             wall_ms() + (int64_t)delay_ms);
	if (rc < 0)
		log_msg(LOG_WARN, SUBSYS,
		        "conversation \"%.*s\" message %s: %s the write of version %" PRIu32
		        " to look at again failed in the local store (%s)",
		        (int)(r->conv_len > 200 ? 200 : r->conv_len), r->conv, r->sk,
		        done ? "forgetting" : "recording", r->version, strerror(-rc));
	return rc;
}

/* r is done with (or given up): its row goes, and r. */
static void repair_end(struct sink *s, struct repair *r)
{
	repair_record(s, r, true, 0);
	ht_remove(&s->repairs, &r->h);
	free(r);
}

/* r looked at: done, unless another write of its version went unanswered meanwhile (its
 * due moved past now), which may land later still: then it waits again. */
static void repair_finish(struct sink *s, struct repair *r, uint64_t now)
{
	if (r->due_ms > now) {
		r->tries = 0;
		repair_queue(s, r, r->due_ms);
	} else {
		repair_end(s, r);
	}
}

static uint64_t repair_hash(const struct sink *s, const char *conv, size_t conv_len, const char *sk,
                            uint32_t version)
{
	return hash_bytes(hash_bytes(s->hash_seed ^ version, conv, conv_len), sk, strlen(sk));
}

static struct repair *repair_find(const struct sink *s, uint64_t hash, const char *conv,
                                  size_t conv_len, const char *sk, uint32_t version)
{
	for (struct hnode *h = ht_first(&s->repairs, hash); h; h = h->next) {
		struct repair *r = (struct repair *)h;
		if (h->hash == hash && r->version == version && r->conv_len == conv_len &&
		    memcmp(r->conv, conv, conv_len) == 0 && strcmp(r->sk, sk) == 0)
			return r;
	}
	return NULL;
}

/* A new repair of (conv, sk, version), due at due_ms (loop time), into s->repairs and the
 * queue; or the one there already, due no sooner than due_ms. NULL when out of memory. */
static struct repair *repair_new(struct sink *s, const char *conv, size_t conv_len, const char *sk,
                                 uint32_t version, uint64_t due_ms)
{
	uint64_t hash = repair_hash(s, conv, conv_len, sk, version);
	struct repair *r = repair_find(s, hash, conv, conv_len, sk, version);

	if (r) {
		if (due_ms > r->due_ms)
			r->due_ms = due_ms;
		return r;
	}
	if (!(r = malloc(sizeof(*r) + conv_len + 1)))
		return NULL;
	r->h.hash = hash;
	r->s = s;
	r->version = version;
	r->sending = 0;
	r->tries = 0;
	memset(r->sk, 0, sizeof(r->sk));
	memcpy(r->sk, sk, strlen(sk));
	r->conv_len = conv_len;
	memcpy(r->conv, conv, conv_len);
	r->conv[conv_len] = '\0';
	ht_insert(&s->repairs, &r->h);
	repair_queue(s, r, due_ms);
	return r;
}

/* Whether the nth of a repeated warning is logged: the 1st, 2nd, 4th, 8th, ... */
static bool thinned(uint64_t n)
{
	return (n & (n - 1)) == 0;
}

/* The messages of b, whose call may still be applied, are looked at again later. */
static void repair_add(struct sink *s, const struct batch *b, uint64_t now)
{
	uint64_t delay = (uint64_t)REPAIR_TIMEOUTS * (uint64_t)s->cfg.request_timeout_ms;

	for (size_t i = 0; i < b->n; i++) {
		const struct entry *e = b->e[i];
		struct repair *r;
		if (s->repairs.n >= REPAIR_MAX) {
			uint64_t n = ++s->repairs_overflow;
			s->repairs_dropped++;
			if (thinned(n))
				log_msg(LOG_WARN, SUBSYS,
				        "%d writes without a clear answer wait to be looked at "
				        "again; later ones are not (%" PRIu64 " let go so far)",
				        REPAIR_MAX, n);
			continue;
		}
		r = repair_new(s, e->conv->id, e->conv->len, e->sk, b->version[i], now + delay);
		if (!r) {
			s->repairs_dropped++;
			continue;
		}
		repair_record(s, r, false, delay);
	}
}

static void pump(struct sink *s);

/* r could not be done now: tried again later, or given up (logged, counted) after
 * REPAIR_TRIES tries, or at once when permanent. */
static void repair_failed(struct sink *s, struct repair *r, uint64_t now, bool permanent,
                          const char *why)
{
	if (!permanent && ++r->tries < REPAIR_TRIES) {
		uint64_t at = now + backoff_ms(s, r->tries);
		repair_queue(s, r, at > r->due_ms ? at : r->due_ms);
		return;
	}
	s->repairs_dropped++;
	log_msg(LOG_WARN, SUBSYS,
	        "conversation \"%.*s\" message %s: cannot look at it again after a write of "
	        "version %" PRIu32 " without an answer (%s); if that write lands late, DynamoDB "
	        "keeps it",
	        (int)(r->conv_len > 200 ? 200 : r->conv_len), r->conv, r->sk, r->version, why);
	repair_end(s, r);
}

/* An answer damaged on the way is taken as none (ddbclient), and retried as such. That
 * something between here and DynamoDB alters answers is worth a warning, but one that
 * alters every answer must not flood the log: the 1st, 2nd, 4th, 8th, ... are logged, with
 * the count so far (stats: sink.answers_damaged). */
static void warn_if_damaged(struct sink *s, const struct ddbclient_result *res)
{
	if (!res->damaged)
		return;
	s->answers_damaged++;
	if (thinned(s->answers_damaged))
		log_msg(LOG_WARN, SUBSYS,
		        "%s: %s (request id %s; %" PRIu64 " such answer%s so far); "
		        "trying again",
		        res->operation, res->error, res->request_id[0] ? res->request_id : "none",
		        s->answers_damaged, s->answers_damaged == 1 ? "" : "s");
}

static void on_repair_done(const struct ddbclient_result *res, void *arg)
{
	struct repair *r = arg;
	struct sink *s = r->s;
	char type[128], message[192], why[LAST_ERROR_MAX];
	enum outcome out;

	s->repairs_inflight--;
	warn_if_damaged(s, res);
	if (res->canceled || s->finishing) {
		ht_remove(&s->repairs, &r->h);
		free(r); /* its row stays: the next start looks again */
		return;
	}
	if (res->status == 200) {
		s->repaired++;
		log_msg(LOG_INFO, SUBSYS,
		        "conversation \"%.*s\" message %s: version %" PRIu32
		        " written again over the late write of version %" PRIu32,
		        (int)(r->conv_len > 200 ? 200 : r->conv_len), r->conv, r->sk, r->sending,
		        r->version);
		repair_finish(s, r, uv_now(s->loop));
	} else if (res->status == 400 &&
	           ddbitem_error_parse(res->body, res->body_len, type, sizeof(type), message,
	                               sizeof(message)) == 0 &&
	           strcmp(type, "ConditionalCheckFailedException") == 0) {
		/* DynamoDB holds newer than the late write: nothing to do */
		repair_finish(s, r, uv_now(s->loop));
	} else {
		out = classify(res, why, sizeof(why));
		if (out == OUT_CREDENTIALS)
			maybe_reload_credentials(s);
		repair_failed(s, r, uv_now(s->loop), out == OUT_PERMANENT, why);
	}
	pump(s);
}

/* Sends r's conditional PutItem of version (map, updated) of its message. 0 or -errno. */
static int repair_send(struct sink *s, struct repair *r, const json_t *map, uint32_t version,
                       int64_t updated)
{
	json_t *item = NULL, *req = NULL;
	char vtext[16], *body = NULL;
	size_t len = 0;
	struct error err;
	int rc = -ENOMEM;

	snprintf(vtext, sizeof(vtext), "%" PRIu32, r->version);
	if (ddbitem_from_map(r->conv, map, version, updated, item_expires(s, updated), &item,
	                     &err) != ERR_OK)
		return -EINVAL;
	req = json_pack("{s:s, s:o, s:s, s:{s:s}, s:{s:{s:s}}}", "TableName", s->table, "Item",
	                item, "ConditionExpression", "attribute_not_exists(#v) OR #v <= :v",
	                "ExpressionAttributeNames", "#v", "version", "ExpressionAttributeValues",
	                ":v", "N", vtext);
	if (req && (body = json_text(req, &len))) {
		r->sending = version;
		rc = ddbclient_call(s->client, "PutItem", body, len, on_repair_done, r);
		if (rc == 0)
			s->repairs_inflight++;
	}
	free(body);
	json_decref(req);
	return rc;
}

/* The repairs due by now, with at most max_batches_inflight PutItems in flight. A message
 * whose entry is in flight is looked at again a timeout later (that write may have left
 * before the late one landed). So is one whose entry waits: its write, due after the late
 * one, makes the repair needless only once it is confirmed; it may yet be refused for good
 * (a dead letter), and then the late write would stay over the newer version DynamoDB held
 * before it. Once the entry is gone, the repair writes what the store holds, on its
 * condition (refused, harmlessly, when the entry's write went through). */
static void repairs_run(struct sink *s, uint64_t now)
{
	struct repair *r;

	while ((r = s->repair_head) && r->queued_ms <= now &&
	       s->repairs_inflight < s->cfg.max_batches_inflight) {
		json_t *map = NULL;
		uint32_t version = 0;
		int64_t updated = 0;
		uint64_t hash = hash_bytes(s->hash_seed, r->conv, r->conv_len);
		struct conv *c;
		struct entry *e = NULL;
		char why[64];
		int rc;

		s->repair_head = r->next;
		if (!s->repair_head)
			s->repair_tail = NULL;
		s->nrepairs--;
		if (r->due_ms > now) { /* put off (repair_new) */
			repair_queue(s, r, r->due_ms);
			continue;
		}
		if ((c = conv_find(s, r->conv, r->conv_len, hash)))
			e = entry_find(s, c, r->sk);
		if (e) {
			repair_queue(s, r, now + (uint64_t)s->cfg.request_timeout_ms);
			continue;
		}
		rc = store_message_get(s->store, r->conv, r->conv_len, r->sk, &map, &version,
		                       &updated);
		if (rc == 0 && version > r->version)
			rc = repair_send(s, r, map, version, updated);
		else if (rc == 0 || rc == -ENOENT)
			rc = 1; /* nothing newer (or nothing at all) to write */
		json_decref(map);
		if (rc == 1) {
			repair_finish(s, r, now);
		} else if (rc < 0) {
			snprintf(why, sizeof(why), "%s", strerror(-rc));
			repair_failed(s, r, now, rc == -EINVAL, why);
		}
	}
}

static void arm_timer(struct sink *s, uint64_t now);

static int load_repair(void *arg, const char *conv, size_t conv_len, const char *sk,
                       uint32_t version, int64_t due_ms)
{
	struct sink *s = arg;
	uint64_t now = uv_now(s->loop),
	         most = (uint64_t)REPAIR_TIMEOUTS * (uint64_t)s->cfg.request_timeout_ms;
	int64_t left = due_ms - wall_ms();
	size_t sk_len = strlen(sk);

	if (s->repairs.n >= REPAIR_MAX)
		return 1; /* the rest wait for a later start */
	if (conv_len == 0 || conv_len > DDBITEM_PARTITION_KEY_MAX || sk_len == 0 ||
	    sk_len > DDBITEM_SK_MAX)
		return 0; /* never written by repair_add */
	/* Due when it was, on the wall clock; a clock set back waits no longer than a repair
	 * added now. */
	if (!repair_new(s, conv, conv_len, sk, version,
	                now + (left <= 0               ? 0
	                       : (uint64_t)left < most ? (uint64_t)left
	                                               : most)))
		return -ENOMEM;
	return 0;
}

int sink_load_repairs(struct sink *s)
{
	int rc;

	if (!s || !s->table || !s->store)
		return 0;
	rc = store_repair_each(s->store, load_repair, s);
	if (rc < 0)
		return rc;
	if (s->nrepairs) {
		log_msg(LOG_INFO, SUBSYS,
		        "%zu message%s to look at again after a write without an answer before "
		        "the last stop",
		        s->nrepairs, s->nrepairs == 1 ? "" : "s");
		arm_timer(s, uv_now(s->loop));
	}
	return 0;
}

/* A call failed in a way worth retrying, or could not be made: every entry waits its
 * backoff, and the gate holds further calls back for a while. unknown: it may have been
 * applied all the same (repair_add). Not counted in failures here: only calls that were
 * made are (batch_answer). */
static void batch_retry(struct sink *s, struct batch *b, const char *why, uint64_t now,
                        bool unknown)
{
	set_last_error(s, "%s", why);
	if (s->fail_streak < 64)
		s->fail_streak++;
	s->gate_ms = now + backoff_ms(s, s->fail_streak);
	if (thinned(s->fail_streak)) /* 1, 2, 4, 8, ... in a row */
		log_msg(LOG_WARN, SUBSYS,
		        "%s (%u failed attempt%s in a row); %zu item%s wait%s to be "
		        "sent again",
		        why, s->fail_streak, s->fail_streak == 1 ? "" : "s", b->n,
		        b->n == 1 ? "" : "s", b->n == 1 ? "s" : "");
	else
		log_msg(LOG_DEBUG, SUBSYS, "%s; %zu items wait", why, b->n);
	if (unknown)
		repair_add(s, b, now);
	for (size_t i = 0; i < b->n; i++)
		entry_retry(s, b->e[i], now);
}

/* Refused for good (by DynamoDB, or by the client before sending: too big): a batch of
 * several is split to find the culprit(s); a single item is a dead letter. */
static void batch_permanent(struct sink *s, struct batch *b, const char *why)
{
	set_last_error(s, "%s", why);
	if (b->n == 1) {
		entry_dead_letter(s, b->e[0], b->version[0], b->item[0], why);
		return;
	}
	log_msg(LOG_WARN, SUBSYS, "%s; sending the %zu items of that batch one by one", why, b->n);
	for (size_t i = b->n; i-- > 0;) {
		struct entry *e = b->e[i];
		e->sending = 0;
		e->alone = true;
		e->failed = true;
		ready_push_front(s, e);
	}
}

static void batch_succeeded(struct sink *s)
{
	if (s->timeout_cap && (s->timeout_cap *= 2) >= s->cfg.batch_items)
		s->timeout_cap = 0;
	if (s->fail_streak)
		log_msg(LOG_INFO, SUBSYS, "BatchWriteItem succeeds again after %u failed call%s",
		        s->fail_streak, s->fail_streak == 1 ? "" : "s");
	s->fail_streak = 0;
}

static void batch_answer(struct sink *s, struct batch *b, const struct ddbclient_result *res,
                         uint64_t now)
{
	json_t *unprocessed = NULL, *it;
	struct error err;
	bool back[DDBITEM_BATCH_MAX] = {false};
	size_t nback = 0, i, j;
	char why[LAST_ERROR_MAX];
	enum outcome out = classify(res, why, sizeof(why));

	/* sink.failures counts calls made that failed (proto/protocol.md): a transport
	 * failure, a timeout, an error answer, an answer that cannot be used. Not a call
	 * refused before it was sent (batch_send), nor one canceled by a stop. */
	if (out != OUT_OK)
		s->failures++;
	switch (out) {
	case OUT_OK:
		break;
	case OUT_CREDENTIALS:
		maybe_reload_credentials(s);
		batch_retry(s, b, why, now, false);
		return;
	case OUT_PERMANENT:
		batch_permanent(s, b, why);
		return;
	case OUT_RETRY:
		/* (Not a connect timeout: nothing of the call went out.) */
		if (res->timed_out && res->uploaded > 0 && b->n > 1 &&
		    (s->timeout_cap == 0 || b->n / 2 < s->timeout_cap)) {
			if (s->timeout_cap == 0)
				log_msg(
				    LOG_WARN, SUBSYS,
				    "a BatchWriteItem of %zu items timed out: the next calls carry "
				    "at most %zu until calls succeed again",
				    b->n, b->n / 2);
			s->timeout_cap = b->n / 2;
		}
		/* No answer to a call sent whole, or a 5xx: it may have been applied. */
		batch_retry(s, b, why, now, (res->status == 0 && res->sent) || res->status >= 500);
		return;
	}
	if (ddbitem_batch_write_parse(res->body, res->body_len, s->table, &unprocessed, &err) !=
	    ERR_OK) {
		snprintf(why, sizeof(why), "BatchWriteItem: unreadable answer: %.200s",
		         err.message);
		s->failures++;
		batch_retry(s, b, why, now, false); /* answered: nothing can land later */
		return;
	}
	json_array_foreach(unprocessed, i, it)
	{
		const char *conv, *sk;
		bool matched = false;
		if (ddbitem_key(it, &conv, &sk) == 0) {
			for (j = 0; j < b->n && !matched; j++) {
				if (!back[j] && strcmp(b->e[j]->sk, sk) == 0 &&
				    strcmp(b->e[j]->conv->id, conv) == 0) {
					back[j] = matched = true;
					nback++;
				}
			}
		}
		if (!matched) {
			/* Not one of ours: which item was left out is unknown, so all are. */
			json_decref(unprocessed);
			s->failures++;
			batch_retry(s, b, "BatchWriteItem: UnprocessedItems names an item not sent",
			            now, false);
			return;
		}
	}
	json_decref(unprocessed);
	if (nback < b->n)
		batch_succeeded(s);
	if (nback) {
		s->unprocessed += nback;
		log_msg(LOG_DEBUG, SUBSYS, "BatchWriteItem left %zu of %zu items unprocessed",
		        nback, b->n);
	}
	for (j = 0; j < b->n; j++) {
		if (back[j])
			entry_retry(s, b->e[j], now);
		else
			entry_confirmed(s, b->e[j], b->version[j]);
	}
}

static void pump(struct sink *s);

static void on_batch_done(const struct ddbclient_result *res, void *arg)
{
	struct batch *b = arg;
	struct sink *s = b->s;

	s->batches_inflight--;
	warn_if_damaged(s, res);
	if (res->canceled || s->finishing) {
		batch_free(b); /* the entries stay in the spool for the next start */
		return;
	}
	latency_add(s, res->elapsed_ms);
	batch_answer(s, b, res, uv_now(s->loop));
	batch_free(b);
	pump(s);
}

/* The item of entry e from the store's current row. 0, or -errno after disposing of e (dead
 * letter when it can never be built, back to waiting when the store could not be read). */
static int entry_item(struct sink *s, struct entry *e, uint64_t now, json_t **item,
                      uint32_t *version)
{
	json_t *map = NULL;
	int64_t updated = 0;
	struct error err;
	enum error_code ec;
	int rc;

	rc = store_message_get(s->store, e->conv->id, e->conv->len, e->sk, &map, version, &updated);
	if (rc == -ENOENT) {
		entry_dead_letter(s, e, e->wanted, NULL,
		                  "the message is no longer in the local store");
		return rc;
	}
	if (rc < 0) {
		set_last_error(s, "reading the local store failed: %s", strerror(-rc));
		entry_retry(s, e, now);
		return rc;
	}
	if (*version < e->wanted) {
		log_msg(LOG_WARN, SUBSYS,
		        "conversation \"%.*s\" message %s: the store holds version %" PRIu32
		        ", below the spooled %" PRIu32 "; sending the stored one",
		        (int)(e->conv->len > 200 ? 200 : e->conv->len), e->conv->id, e->sk,
		        *version, e->wanted);
		e->wanted = *version;
	}
	ec = ddbitem_from_map(e->conv->id, map, *version, updated, item_expires(s, updated), item,
	                      &err);
	json_decref(map);
	if (ec == ERR_INTERNAL) {
		set_last_error(s, "building an item: %s", err.message);
		entry_retry(s, e, now);
		return -ENOMEM;
	}
	if (ec != ERR_OK) {
		char why[LAST_ERROR_MAX];
		snprintf(why, sizeof(why), "the stored message cannot be made an item: %.200s",
		         err.message);
		entry_dead_letter(s, e, *version, NULL, why);
		return -EINVAL;
	}
	return 0;
}

/* Sends one batch of ready entries. 1 when a call went out, 0 when there was nothing to
 * send, -errno when the call could not be made (its entries are disposed of). */
static int batch_send(struct sink *s, uint64_t now)
{
	struct batch *b;
	struct entry *e;
	json_t *req = NULL;
	char *body = NULL;
	size_t body_len = 0, max;
	struct error err;
	char why[LAST_ERROR_MAX];
	int rc;

	b = calloc(1, sizeof(*b));
	if (!b)
		return -ENOMEM;
	b->s = s;
	/* Entries that cannot be sent go elsewhere (dead letters, waiting, rarely back to the
	 * ready tail): the pops are bounded so that this always ends. */
	max = s->timeout_cap && s->timeout_cap < s->cfg.batch_items ? s->timeout_cap
	                                                            : s->cfg.batch_items;
	for (size_t pops = 0; b->n < max && pops < BATCH_MAX_POPS && (e = s->ready_head); pops++) {
		if (e->alone && b->n > 0)
			break;
		ready_pop(s);
		if (entry_item(s, e, now, &b->item[b->n], &b->version[b->n]) < 0)
			continue;
		e->state = ENTRY_INFLIGHT;
		e->sending = b->version[b->n];
		b->e[b->n++] = e;
		if (e->alone)
			break;
	}
	if (b->n == 0) {
		free(b);
		return 0;
	}
	if (ddbitem_batch_write_request(s->table, b->item, b->n, &req, &err) != ERR_OK ||
	    !(body = json_text(req, &body_len))) {
		snprintf(why, sizeof(why), "BatchWriteItem: building the request: %.200s",
		         req ? "out of memory" : err.message);
		rc = -ENOMEM;
		goto fail;
	}
	rc = ddbclient_call(s->client, "BatchWriteItem", body, body_len, on_batch_done, b);
	if (rc == -EMSGSIZE) {
		snprintf(why, sizeof(why), "BatchWriteItem: request of %zu bytes over the limit",
		         body_len);
		batch_permanent(s, b, why);
		goto out;
	}
	if (rc == -ENOKEY) {
		maybe_reload_credentials(s);
		snprintf(why, sizeof(why), "BatchWriteItem: no AWS credentials");
		goto fail;
	}
	if (rc < 0) {
		snprintf(why, sizeof(why), "BatchWriteItem: %s", strerror(-rc));
		goto fail;
	}
	for (size_t i = 0; i < b->n; i++) {
		if (b->e[i]->failed) {
			s->retried++;
			b->e[i]->failed = false;
		}
	}
	s->writes_sent += b->n;
	s->batches_inflight++;
	b = NULL;
	rc = 1;
	goto out;
fail:
	batch_retry(s, b, why, now, false);
out:
	if (b)
		batch_free(b);
	free(body);
	json_decref(req);
	return rc;
}

static void on_timer(uv_timer_t *t)
{
	pump(t->data);
}

/* Wakes the pump when the next entry is due or the gate opens; completions wake it
 * otherwise. */
static void arm_timer(struct sink *s, uint64_t now)
{
	uint64_t due = UINT64_MAX;
	size_t limit = s->fail_streak ? 1 : s->cfg.max_batches_inflight;

	if (s->ready_head) {
		if (s->fail_streak && s->gate_ms > now)
			due = s->gate_ms;
		else if (s->batches_inflight < limit)
			due = now + 1; /* a call could not be made: try again shortly */
	} else if (s->nheap) {
		due = s->heap[0]->next_ms;
		if (s->fail_streak && s->gate_ms > due)
			due = s->gate_ms;
	}
	if (s->repair_head && s->repairs_inflight < s->cfg.max_batches_inflight &&
	    s->repair_head->queued_ms < due)
		due = s->repair_head->queued_ms;
	if (due == UINT64_MAX) {
		uv_timer_stop(&s->timer);
		return;
	}
	uv_timer_start(&s->timer, on_timer, due > now ? due - now : 0, 0);
}

static void pump(struct sink *s)
{
	uint64_t now;

	if (!s->client || s->finishing || s->pumping)
		return;
	s->pumping = true;
	now = uv_now(s->loop);
	repairs_run(s, now);
	while (s->nheap && s->heap[0]->next_ms <= now)
		ready_push_back(s, heap_pop(s));
	for (;;) {
		size_t limit = s->fail_streak ? 1 : s->cfg.max_batches_inflight;
		if (s->batches_inflight >= limit || !s->ready_head)
			break;
		if (s->fail_streak && now < s->gate_ms)
			break;
		if (batch_send(s, now) <= 0)
			break; /* nothing went out: go on from the timer, not in a loop here */
	}
	s->pumping = false;
	arm_timer(s, now);
}

void sink_kick(struct sink *s)
{
	if (s)
		pump(s);
}

void sink_lost(struct sink *s)
{
	if (s && s->table)
		s->lost = s->lost_rows = s->repairs_lost = true;
}

void sink_lost_row(struct sink *s)
{
	if (s && s->table)
		s->lost = s->lost_rows = true;
}

struct rewrite_ctx {
	uint64_t now;
	int rc;
};

static void repair_rewrite(struct hnode *h, void *arg)
{
	struct repair *r = (struct repair *)h;
	struct rewrite_ctx *x = arg;

	/* After one failed, the transaction fails as a whole: the commit's failure asks again. */
	if (x->rc == 0)
		x->rc = repair_record(r->s, r, false, r->due_ms > x->now ? r->due_ms - x->now : 0);
}

/* The repairs' rows a failed commit held are lost: each repair waiting or in flight writes
 * its row again (an upsert; due as it is now, at once for one in flight), so that a crash
 * before it is done does not forget it. One whose "done" was lost keeps its row: the next
 * start looks at it once more, harmlessly (its PutItem is conditional). */
static void repairs_rewrite(struct sink *s)
{
	struct rewrite_ctx x = {uv_now(s->loop), 0};

	s->repairs_lost = s->rewrite_repairs = false;
	if (s->repairs.n == 0)
		return;
	log_msg(LOG_INFO, SUBSYS,
	        "writing the rows of %zu message%s to look at again anew "
	        "after a failed commit",
	        s->repairs.n, s->repairs.n == 1 ? "" : "s");
	ht_each(&s->repairs, repair_rewrite, &x);
}

/* Whether a scan of the spool that last ran at loop time at and took took_ms may run again
 * at now (see STATS_RESCAN_MIN_MS). */
static bool rescan_due(uint64_t now, uint64_t at, uint64_t took_ms)
{
	uint64_t gap = took_ms * STATS_RESCAN_FACTOR;
	return now - at >= (gap > STATS_RESCAN_MIN_MS ? gap : STATS_RESCAN_MIN_MS);
}

static int resync_row(void *arg, int64_t seq, const char *conv, size_t conv_len, const char *sk,
                      uint32_t version, int64_t enqueued_ms)
{
	struct sink *s = arg;
	size_t depth = s->depth;
	int rc = sink_enqueue(s, conv, conv_len, sk, version, enqueued_ms);

	if (rc == -EINVAL)
		rc = 0; /* a row no start would take either */
	if (rc < 0)
		return rc;
	if (s->depth > depth) {
		s->resync_found++;
		if (s->resync_counts)
			s->resynced++;
	}
	s->resync_seq = seq;
	/* The slice ends once its time is up: the next one goes on after this row. */
	if (++s->resync_rows % RESYNC_CLOCK_ROWS == 0 && uv_hrtime() >= s->resync_slice_end)
		return 1;
	return 0;
}

/* One slice of the read sink_resync started: the rows after resync_seq, for about
 * RESYNC_SLICE_NS; then the next slice in the next loop turn, until the spool's end. */
static void resync_slice(struct sink *s)
{
	uint64_t t0 = uv_hrtime();
	int rc;

	s->resync_slice_end = t0 + RESYNC_SLICE_NS;
	s->resync_slices++;
	rc = store_spool_each(s->store, s->resync_seq, resync_row, s);
	s->resync_ns += uv_hrtime() - t0;
	if (rc > 0) {
		pump(s); /* what this slice found goes out meanwhile */
		return;
	}
	s->resyncing = false;
	s->resync_ran = true;
	s->resync_at = uv_now(s->loop);
	s->resync_ms = s->resync_ns / 1000000u;
	if (rc < 0) {
		s->lost = true;
		s->lost_rows = s->lost_rows || s->resync_counts;
		log_msg(LOG_ERROR, SUBSYS, "reading the spool again failed (%s); tried again later",
		        strerror(-rc));
		return;
	}
	/* Worth a warning when it found rows the sink had let go of. */
	log_msg(s->resync_counts && s->resync_found ? LOG_WARN : LOG_INFO, SUBSYS,
	        "read the spool again after %s: %" PRIu64 " rows sent again (%zu rows read in "
	        "%zu slices, %" PRIu64 " ms on the loop)",
	        s->resync_asked ? "rows were put back in it" : "a lost recording",
	        (uint64_t)s->resync_found, s->resync_rows, s->resync_slices, s->resync_ms);
	pump(s);
}

/* One slice of the statistics' count of the spool's bytes. */
static void bytes_slice(struct sink *s)
{
	uint64_t t0 = uv_hrtime(), bytes = 0;
	size_t rows = 0;
	int rc = store_spool_bytes(s->store, s->bytes_seq, BYTES_SLICE_ROWS, &rows, &bytes,
	                           &s->bytes_seq);

	s->bytes_ns += uv_hrtime() - t0;
	if (rc < 0) {
		s->bytes_counting = false; /* the last count stays; counted again when due */
		s->spool_bytes_valid = true;
		s->spool_bytes_at = uv_now(s->loop);
		return;
	}
	s->bytes_sum += bytes;
	if (rows == BYTES_SLICE_ROWS)
		return;
	s->bytes_counting = false;
	s->spool_bytes = s->bytes_sum;
	s->spool_bytes_valid = true;
	s->spool_bytes_at = uv_now(s->loop);
	s->spool_scan_ms = s->bytes_ns / 1000000u;
}

/* The next slices in the next loop turn, while a scan is under way or a read is asked for
 * (sink_reread, after the one under way). */
static void scan_arm(struct sink *s)
{
	if (!s->closing &&
	    (s->resyncing || s->bytes_counting || s->rewrite_repairs || (s->lost && s->resync_now)))
		uv_idle_start(&s->scan_idle, on_scan_idle);
	else
		uv_idle_stop(&s->scan_idle);
}

static void on_scan_idle(uv_idle_t *h)
{
	struct sink *s = h->data;

	if (s->closing) {
		s->resyncing = s->bytes_counting = false;
		uv_idle_stop(h);
		return;
	}
	if (s->rewrite_repairs)
		repairs_rewrite(s);
	if (s->resyncing)
		resync_slice(s);
	else if (s->lost && s->resync_now)
		sink_resync(s);
	if (s->bytes_counting)
		bytes_slice(s);
	scan_arm(s);
}

int sink_resync(struct sink *s)
{
	if (!s || !s->table || s->closing)
		return 0;
	if (s->repairs_lost) {
		/* On the next turn: the caller may be inside a commit that must leave no
		 * transaction open (dispatch_commit before retry_dead_letters' move). */
		s->repairs_lost = false;
		s->rewrite_repairs = true;
		uv_idle_start(&s->scan_idle, on_scan_idle);
	}
	if (s->resyncing)
		return 1; /* under way: the slices go on from the idle handle */
	if (!s->lost)
		return 0;
	if (s->resync_ran && !s->resync_now &&
	    !rescan_due(uv_now(s->loop), s->resync_at, s->resync_ms))
		return 1;
	/* Rows lost from now on may come before the read's place: lost again, for the next. */
	s->resync_asked = s->resync_now;
	/* Rows put back (retry_dead_letters) are sent for the first time: not "resent". */
	s->resync_counts = s->lost_rows;
	s->lost = s->resync_now = s->lost_rows = false;
	s->resyncing = true;
	s->resync_seq = 0;
	s->resync_ns = 0;
	s->resync_rows = s->resync_slices = s->resync_found = 0;
	resync_slice(s);
	scan_arm(s);
	return s->resyncing ? 1 : s->lost ? -EIO : 0;
}

void sink_spool_counted(struct sink *s, uint64_t items, uint64_t bytes, uint64_t took_ms)
{
	if (s && s->table) {
		/* The count before, for the first answers of a spool that grew past
		 * BYTES_SLICE_ROWS before any stats: its first count runs in slices too. */
		s->spool_bytes = bytes;
		s->spool_bytes_at = uv_now(s->loop);
		s->spool_scan_ms = took_ms;
		/* A small one is counted again at once by the first stats. */
		s->spool_bytes_valid = items > BYTES_SLICE_ROWS;
	}
}

void sink_reread(struct sink *s)
{
	if (s && s->table && !s->closing) {
		s->lost = s->resync_now = true;
		sink_resync(s);
	}
}

int sink_reconfigure(struct sink *s, const struct sink_config *cfg)
{
	if (!s)
		return 0;
	if (!cfg || cfg->batch_items < 1 || cfg->batch_items > DDBITEM_BATCH_MAX ||
	    cfg->retry_base_ms < 1 || cfg->retry_max_ms < cfg->retry_base_ms ||
	    cfg->spool_max_items < 1)
		return -EINVAL;
	s->cfg.retry_base_ms = cfg->retry_base_ms;
	s->cfg.retry_max_ms = cfg->retry_max_ms;
	s->cfg.batch_items = cfg->batch_items;
	s->cfg.spool_max_items = cfg->spool_max_items;
	s->cfg.expires_days = cfg->expires_days;
	/* A larger batch may take what is ready now. */
	pump(s);
	return 0;
}

/* --- stats ------------------------------------------------------------------------------ */

static int cmp_u32(const void *a, const void *b)
{
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
	return x < y ? -1 : x > y;
}

/* Nearest rank: the smallest sample with at least per_mille of them at or below it. */
static uint32_t percentile(const uint32_t *sorted, size_t n, unsigned per_mille)
{
	size_t rank = (n * per_mille + 999) / 1000;
	return sorted[rank > 0 ? rank - 1 : 0];
}

json_t *sink_stats_spool(struct sink *s)
{
	uint64_t items = 0, bytes = 0;
	json_t *oldest = json_null();

	if (s && s->table && s->depth > 0) {
		uint64_t now = uv_now(s->loop);
		int64_t age;

		bool due =
		    !s->spool_bytes_valid || rescan_due(now, s->spool_bytes_at, s->spool_scan_ms);
		if (due && !s->bytes_counting && s->depth <= BYTES_SLICE_ROWS) {
			/* The first count of a small spool (a large one at start was counted
			 * then: sink_spool_counted), or a later one: at once. */
			uint64_t t0 = uv_hrtime(), n = 0, b = 0;
			int64_t first = 0;
			if (store_spool_stats(s->store, &n, &b, &first) == 0) {
				s->spool_bytes = b;
				s->spool_bytes_valid = true;
			}
			s->spool_bytes_at = now;
			s->spool_scan_ms = (uv_hrtime() - t0) / 1000000u;
		} else if (due && !s->bytes_counting) {
			/* Counted again in slices: this answer has the last count (the start's,
			 * for a spool that grew large before the first stats: a count of a
			 * million rows at once held the loop 155 ms). */
			s->bytes_counting = true;
			s->bytes_seq = 0;
			s->bytes_sum = s->bytes_ns = 0;
			scan_arm(s);
		}
		items = s->depth;
		bytes = s->spool_bytes;
		age = wall_ms() - s->oldest->enqueued_ms;
		json_decref(oldest);
		oldest = json_integer(age > 0 ? age : 0);
	}
	return json_pack("{s:I, s:I, s:o}", "items", (json_int_t)items, "bytes", (json_int_t)bytes,
	                 "oldest_pending_ms", oldest);
}

json_t *sink_stats_sink(struct sink *s)
{
	json_t *lat, *last_error;
	bool remote = s && s->table;

	if (remote && s->nlat > 0) {
		uint32_t *v = malloc(s->nlat * sizeof(*v));
		if (!v)
			return NULL;
		memcpy(v, s->lat, s->nlat * sizeof(*v));
		qsort(v, s->nlat, sizeof(*v), cmp_u32);
		lat = json_pack("{s:I, s:I, s:I}", "p50", (json_int_t)percentile(v, s->nlat, 500),
		                "p99", (json_int_t)percentile(v, s->nlat, 990), "p999",
		                (json_int_t)percentile(v, s->nlat, 999));
		free(v);
	} else {
		lat = json_pack("{s:n, s:n, s:n}", "p50", "p99", "p999");
	}
	last_error = remote && s->last_error[0] ? json_string(s->last_error) : json_null();
	return json_pack(
	    "{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:o, s:o, s:I}", "kind",
	    remote ? "dynamodb" : "local", "writes_sent", (json_int_t)(remote ? s->writes_sent : 0),
	    "confirmed", (json_int_t)(remote ? s->confirmed : 0), "retried",
	    (json_int_t)(remote ? s->retried : 0), "failures",
	    (json_int_t)(remote ? s->failures : 0), "dead_lettered",
	    (json_int_t)(remote ? s->dead_lettered : 0), "unprocessed",
	    (json_int_t)(remote ? s->unprocessed : 0), "resent",
	    (json_int_t)(remote ? s->resynced : 0), "repaired",
	    (json_int_t)(remote ? s->repaired : 0), "repairs_waiting",
	    (json_int_t)(remote ? s->nrepairs + s->repairs_inflight : 0), "repairs_dropped",
	    (json_int_t)(remote ? s->repairs_dropped : 0), "answers_damaged",
	    (json_int_t)(remote ? s->answers_damaged : 0), "last_error", last_error, "latency_ms",
	    lat, "inflight", (json_int_t)(remote ? s->batches_inflight : 0));
}

/* --- Query and CreateTable jobs ------------------------------------------------------------ */

static void job_send(struct job *j);

static void on_job_closed(uv_handle_t *h)
{
	struct job *j = h->data;
	struct sink *s = j->s;
	json_decref(j->items);
	json_decref(j->start_key);
	free(j->conv);
	free(j);
	s->handles--;
	maybe_freed(s);
}

/* Takes j off the sink's list of jobs. */
static void job_unlink(struct job *j)
{
	struct sink *s = j->s;

	if (j->prev)
		j->prev->next = j->next;
	else
		s->jobs = j->next;
	if (j->next)
		j->next->prev = j->prev;
}

static void job_end(struct job *j, int status)
{
	if (j->ended)
		return;
	j->ended = true;
	job_unlink(j);
	uv_timer_stop(&j->timer);
	if (j->kind == JOB_QUERY)
		j->query_cb(j->arg, status, status == 0 ? j->items : NULL);
	else
		j->table_cb(j->arg, status);
	uv_close((uv_handle_t *)&j->timer, on_job_closed);
}

static void on_job_timer(uv_timer_t *t)
{
	job_send(t->data);
}

/* A retryable failure: again after a backoff, or the end after JOB_RETRIES. */
static void job_retry(struct job *j, const char *why, int status)
{
	struct sink *s = j->s;
	if (j->retries >= JOB_RETRIES) {
		log_msg(LOG_WARN, SUBSYS, "%s; giving up after %u attempts", why, j->retries + 1);
		job_end(j, status);
		return;
	}
	j->retries++;
	log_msg(LOG_DEBUG, SUBSYS, "%s; trying again", why);
	uv_timer_start(&j->timer, on_job_timer, backoff_ms(s, j->retries), 0);
}

static int job_query_page(struct job *j, const struct ddbclient_result *res)
{
	json_t *items = NULL, *last = NULL;
	struct error err;
	size_t n;

	if (ddbitem_query_parse(res->body, res->body_len, &items, &last, &err) != ERR_OK) {
		log_msg(LOG_WARN, SUBSYS, "Query: unreadable answer: %s", err.message);
		return -EIO;
	}
	n = json_array_size(items);
	if (json_array_size(j->items) + n > QUERY_MAX_ITEMS || json_array_extend(j->items, items)) {
		json_decref(items);
		json_decref(last);
		return json_array_size(j->items) + n > QUERY_MAX_ITEMS ? -EFBIG : -ENOMEM;
	}
	json_decref(items);
	json_decref(j->start_key);
	j->start_key = last;
	return 0;
}

static void on_job_done(const struct ddbclient_result *res, void *arg)
{
	struct job *j = arg;
	struct sink *s = j->s;
	char why[LAST_ERROR_MAX], type[128], message[64];
	enum outcome out;
	int rc;

	j->inflight = false;
	warn_if_damaged(s, res);
	if (res->canceled || s->finishing) {
		job_end(j, -ECANCELED);
		return;
	}
	out = classify(res, why, sizeof(why));
	if (j->kind == JOB_CREATE_TABLE && !j->describing && res->status == 400 &&
	    ddbitem_error_parse(res->body, res->body_len, type, sizeof(type), message,
	                        sizeof(message)) == 0 &&
	    strcmp(type, "ResourceInUseException") == 0) {
		j->exists = true;
		j->describing = true;
		job_send(j);
		return;
	}
	if (j->kind == JOB_CREATE_TABLE && j->describing && res->status == 400 &&
	    ddbitem_error_parse(res->body, res->body_len, type, sizeof(type), message,
	                        sizeof(message)) == 0 &&
	    strcmp(type, "ResourceNotFoundException") == 0)
		out = OUT_OK; /* just created: not visible yet; poll again */
	switch (out) {
	case OUT_OK:
		break;
	case OUT_CREDENTIALS:
		maybe_reload_credentials(s);
		job_retry(j, why, -EACCES);
		return;
	case OUT_RETRY:
		job_retry(j, why, res->timed_out ? -ETIMEDOUT : -EIO);
		return;
	case OUT_PERMANENT:
		log_msg(LOG_WARN, SUBSYS, "%s", why);
		job_end(j, -EINVAL);
		return;
	}
	if (j->kind == JOB_QUERY) {
		if ((rc = job_query_page(j, res)) < 0) {
			job_end(j, rc);
			return;
		}
		j->retries = 0;
		if (j->start_key)
			job_send(j);
		else
			job_end(j, 0);
		return;
	}
	if (!j->describing) {
		log_msg(LOG_INFO, SUBSYS, "table %s created; waiting until it is ACTIVE", s->table);
		j->describing = true;
		job_send(j);
		return;
	}
	if (res->status == 200) {
		json_t *doc = json_loadb(res->body, res->body_len, 0, NULL);
		const char *status = json_string_value(
		    json_object_get(json_object_get(doc, "Table"), "TableStatus"));
		bool active = status && strcmp(status, "ACTIVE") == 0;
		json_decref(doc);
		if (active) {
			job_end(j, j->exists ? -EEXIST : 0);
			return;
		}
	}
	if (uv_now(s->loop) >= j->deadline_ms) {
		log_msg(LOG_WARN, SUBSYS, "table %s not ACTIVE after %d s", s->table,
		        TABLE_WAIT_MS / 1000);
		job_end(j, -ETIMEDOUT);
		return;
	}
	uv_timer_start(&j->timer, on_job_timer, TABLE_POLL_MS, 0);
}

static void job_send(struct job *j)
{
	struct sink *s = j->s;
	json_t *req = NULL;
	char *body = NULL;
	size_t body_len = 0;
	struct error err;
	const char *op;
	int rc;

	if (j->kind == JOB_QUERY) {
		op = "Query";
		if (ddbitem_query_request(s->table, j->conv, j->start_key, &req, &err) != ERR_OK) {
			log_msg(LOG_WARN, SUBSYS, "Query: %s", err.message);
			job_end(j, -EINVAL);
			return;
		}
	} else if (!j->describing) {
		op = "CreateTable";
		if (ddbitem_create_table_request(s->table, &req, &err) != ERR_OK) {
			log_msg(LOG_WARN, SUBSYS, "CreateTable: %s", err.message);
			job_end(j, -EINVAL);
			return;
		}
	} else {
		op = "DescribeTable";
		req = json_pack("{s:s}", "TableName", s->table);
	}
	body = req ? json_text(req, &body_len) : NULL;
	json_decref(req);
	if (!body) {
		job_retry(j, "out of memory", -ENOMEM);
		return;
	}
	rc = ddbclient_call(s->client, op, body, body_len, on_job_done, j);
	free(body);
	if (rc == 0) {
		j->inflight = true;
	} else if (rc == -EMSGSIZE || rc == -EINVAL || rc == -ESHUTDOWN) {
		log_msg(LOG_WARN, SUBSYS, "%s cannot be sent: %s", op, strerror(-rc));
		job_end(j, rc);
	} else {
		char why[96];
		if (rc == -ENOKEY)
			maybe_reload_credentials(s);
		snprintf(why, sizeof(why), "%s: %s", op, strerror(-rc));
		job_retry(j, why, rc);
	}
}

static int job_start(struct sink *s, enum job_kind kind, struct job **out)
{
	struct job *j;

	if (!s || !s->table)
		return -ENOTSUP;
	if (s->closing)
		return -ESHUTDOWN;
	j = calloc(1, sizeof(*j));
	if (!j)
		return -ENOMEM;
	j->s = s;
	j->kind = kind;
	uv_timer_init(s->loop, &j->timer);
	j->timer.data = j;
	s->handles++;
	j->next = s->jobs;
	if (s->jobs)
		s->jobs->prev = j;
	s->jobs = j;
	*out = j;
	return 0;
}

int sink_query(struct sink *s, const char *conv, size_t conv_len, sink_query_cb cb, void *arg)
{
	struct job *j;
	int rc;

	if (!s || !cb || !conv || conv_len == 0 || conv_len > DDBITEM_PARTITION_KEY_MAX ||
	    memchr(conv, '\0', conv_len))
		return s && !s->table ? -ENOTSUP : -EINVAL;
	if ((rc = job_start(s, JOB_QUERY, &j)) < 0)
		return rc;
	j->query_cb = cb;
	j->arg = arg;
	j->conv = strndup(conv, conv_len);
	j->items = json_array();
	if (!j->conv || !j->items) {
		/* not started: end it without calling back */
		j->ended = true;
		job_unlink(j);
		uv_close((uv_handle_t *)&j->timer, on_job_closed);
		return -ENOMEM;
	}
	/* Sent from the timer so that cb never runs before this returns. */
	uv_timer_start(&j->timer, on_job_timer, 0, 0);
	return 0;
}

int sink_create_table(struct sink *s, void (*done)(void *arg, int status), void *arg)
{
	struct job *j;
	int rc;

	if (!s || !done)
		return -EINVAL;
	if ((rc = job_start(s, JOB_CREATE_TABLE, &j)) < 0)
		return rc;
	j->table_cb = done;
	j->arg = arg;
	j->deadline_ms = uv_now(s->loop) + TABLE_WAIT_MS;
	uv_timer_start(&j->timer, on_job_timer, 0, 0);
	return 0;
}

/* --- life ----------------------------------------------------------------------------- */

int sink_new(uv_loop_t *loop, struct store *store, const struct sink_config *cfg,
             const struct awsconf *aws, sink_settled_cb settled, void *settled_arg,
             struct sink **out)
{
	struct sink *s = NULL;
	struct ddbclient_options o;
	char endpoint[512], host[300], line[256];
	uint64_t seed;
	int rc;

	*out = NULL;
	if (!loop || !store || !cfg)
		return -EINVAL;
	if (cfg->table) {
		if (!ddbitem_table_name_valid(cfg->table)) {
			log_msg(LOG_ERROR, SUBSYS,
			        "invalid DynamoDB table name (3 to 255 of A-Z a-z 0-9 _ . -)");
			return -EINVAL;
		}
		if (cfg->batch_items < 1 || cfg->batch_items > DDBITEM_BATCH_MAX ||
		    cfg->max_batches_inflight < 1 || cfg->retry_base_ms < 1 ||
		    cfg->retry_max_ms < cfg->retry_base_ms) {
			log_msg(LOG_ERROR, SUBSYS,
			        "invalid sink settings: batch items 1..%d, at least one batch in "
			        "flight, 0 < retry base <= retry max",
			        DDBITEM_BATCH_MAX);
			return -EINVAL;
		}
		if (!aws || awsconf_endpoint(aws, endpoint, sizeof(endpoint)) < 0 ||
		    awsconf_host(aws, host, sizeof(host)) < 0) {
			log_msg(LOG_ERROR, SUBSYS,
			        "a DynamoDB table is set but no endpoint or region is configured "
			        "(AWS_REGION, AWS_ENDPOINT_URL_DYNAMODB)");
			return -EINVAL;
		}
	}
	s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	s->loop = loop;
	s->store = store;
	s->cfg = *cfg;
	s->cfg.table = NULL;
	s->settled = settled;
	s->settled_arg = settled_arg;
	seed = uv_hrtime() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)s;
	s->hash_seed = hash_bytes(0xcbf29ce484222325ULL, &seed, sizeof(seed));
	s->rng = s->hash_seed | 1;
	rc = -ENOMEM;
	if (ht_init(&s->convs) < 0 || ht_init(&s->entries) < 0 || ht_init(&s->repairs) < 0)
		goto fail;
	if (cfg->table) {
		if (!(s->table = strdup(cfg->table)))
			goto fail;
		ddbclient_options_defaults(&o);
		o.endpoint_url = endpoint;
		o.host = host;
		o.region = awsconf_signing_region(aws);
		o.connect_timeout_ms = cfg->connect_timeout_ms;
		o.timeout_ms = cfg->request_timeout_ms;
		o.ignore_crc32 = cfg->ignore_crc32;
		o.max_host_connections = (long)cfg->max_batches_inflight + 2;
		if ((rc = ddbclient_new(loop, &o, &s->client)) < 0) {
			log_msg(LOG_ERROR, SUBSYS, "cannot start the DynamoDB client: %s",
			        strerror(-rc));
			goto fail;
		}
		if (awsconf_has_credentials(aws)) {
			rc = ddbclient_set_credentials(s->client, aws->access_key_id,
			                               aws->secret_access_key, aws->session_token);
			if (rc < 0) {
				log_msg(LOG_ERROR, SUBSYS, "the AWS credentials were refused: %s",
				        strerror(-rc));
				ddbclient_close(s->client, NULL, NULL);
				s->client = NULL;
				goto fail;
			}
		} else {
			log_msg(LOG_ERROR, SUBSYS,
			        "no AWS credentials found; writes wait in the spool until they "
			        "appear");
		}
		snprintf(s->endpoint, sizeof(s->endpoint), "%s", endpoint);
		snprintf(s->region, sizeof(s->region), "%s", awsconf_signing_region(aws));
		log_msg(LOG_INFO, SUBSYS, "DynamoDB table %s at %s", s->table,
		        awsconf_describe(aws, line, sizeof(line)));
	}
	uv_timer_init(loop, &s->timer);
	uv_timer_init(loop, &s->close_timer);
	uv_idle_init(loop, &s->scan_idle);
	s->timer.data = s;
	s->close_timer.data = s;
	s->scan_idle.data = s;
	s->handles = 3;
	*out = s;
	return 0;
fail:
	free(s->convs.b);
	free(s->entries.b);
	free(s->repairs.b);
	free(s->table);
	free(s);
	return rc;
}

static void free_node(struct hnode *h)
{
	free(h);
}

/* Frees everything once the client and every handle are closed, then tells the owner. */
static void maybe_freed(struct sink *s)
{
	void (*cb)(void *);
	void *arg;

	if (!s->finishing || !s->client_closed || s->handles > 0)
		return;
	ht_free(&s->entries, free_node);
	ht_free(&s->convs, free_node);
	ht_free(&s->repairs, free_node); /* those queued (in flight ones ended canceled) */
	free(s->heap);
	free(s->table);
	cb = s->on_closed;
	arg = s->closed_arg;
	free(s);
	if (cb)
		cb(arg);
}

static void on_handle_closed(uv_handle_t *h)
{
	struct sink *s = h->data;
	s->handles--;
	maybe_freed(s);
}

static void on_client_closed(void *arg)
{
	struct sink *s = arg;
	s->client_closed = true;
	maybe_freed(s);
}

/* The end of sink_close: cancels what is left and closes every handle. */
static void on_close_timer(uv_timer_t *t)
{
	struct sink *s = t->data;
	size_t look;

	if (s->finishing)
		return;
	s->finishing = true;
	/* Rows a failed commit took with it, not written again yet: the stop's last commit
	 * (main.c) takes them, so that the next start looks at those repairs too. */
	if (s->repairs_lost || s->rewrite_repairs)
		repairs_rewrite(s);
	if (s->depth > 0)
		log_msg(LOG_WARN, SUBSYS,
		        "stopping with %zu write%s not confirmed; they stay in the spool for the "
		        "next start",
		        s->depth, s->depth == 1 ? "" : "s");
	if ((look = s->nrepairs + s->repairs_inflight) > 0)
		log_msg(LOG_INFO, SUBSYS,
		        "stopping with %zu message%s to look at again after a write without an "
		        "answer; the next start looks at them",
		        look, look == 1 ? "" : "s");
	uv_timer_stop(&s->timer);
	/* In-flight calls, batches and jobs alike, end canceled inside ddbclient_close. */
	if (s->client)
		ddbclient_close(s->client, on_client_closed, s);
	else
		s->client_closed = true;
	s->client = NULL;
	while (s->jobs)
		job_end(s->jobs, -ECANCELED); /* those waiting on their timer */
	uv_close((uv_handle_t *)&s->timer, on_handle_closed);
	uv_close((uv_handle_t *)&s->close_timer, on_handle_closed);
	uv_close((uv_handle_t *)&s->scan_idle, on_handle_closed);
}

void sink_close(struct sink *s, uint64_t deadline_ms, void (*on_closed)(void *arg), void *arg)
{
	if (!s)
		return;
	if (s->closing) {
		/* Already draining: a deadline of 0 (a second SIGTERM) ends the drain now; what
		 * is unsent stays in the spool. Harmless once the close has started. */
		if (deadline_ms == 0)
			uv_timer_start(&s->close_timer, on_close_timer, 0, 0);
		return;
	}
	s->closing = true;
	s->on_closed = on_closed;
	s->closed_arg = arg;
	if (!s->client || s->depth == 0 || deadline_ms == 0) {
		uv_timer_start(&s->close_timer, on_close_timer, 0, 0);
		return;
	}
	log_msg(LOG_INFO, SUBSYS,
	        "stopping: sending the %zu pending write%s for up to %" PRIu64 " ms", s->depth,
	        s->depth == 1 ? "" : "s", deadline_ms);
	uv_timer_start(&s->close_timer, on_close_timer, deadline_ms, 0);
	pump(s);
}
