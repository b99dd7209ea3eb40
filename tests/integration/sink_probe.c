/* Drives daemon/sink.c against a DynamoDB-compatible endpoint (dynalite in the tests, maybe
 * behind tests/integration/faultproxy.py) the way the daemon does: messages written to a
 * local store in a temporary directory with their spool rows, committed, enqueued, and the
 * store's open transaction committed at the end of every loop turn (a uv_check handle)
 * before sink_kick. Runs until the sink is empty, then prints one JSON document on stdout
 * (sink stats, dead letters, and with --dump every message as the store holds it) and exits
 * 0 when every spool row is gone and the dead letters are as many as --expect-dead.
 *
 *   sink_probe --table T [--conversations N] [--messages M] [--updates K] [--payload B]
 *              [--big-message B] [--batch-items N] [--inflight N] [--retry-base-ms MS]
 *              [--retry-max-ms MS] [--request-timeout-ms MS] [--connect-timeout-ms MS]
 *              [--timeout-ms MS] [--expect-dead N] [--dump] [--query] [--create-table]
 *              [--state-dir DIR] [--resume] [--stop-after-ms MS] [--close-deadline-ms MS]
 *              [--log-level L] [--prefix P]
 *
 * --updates K: K rounds of set_metadata on every even-numbered message of every
 *   conversation, each started once a further share of the writes is confirmed, so that
 *   new versions are enqueued while older ones are in flight.
 * --big-message B: one more message of B content bytes in the first conversation, written
 *   to the store without the daemon's size check: DynamoDB must refuse it for good.
 * --prefix P: the conversations are P-0, P-1, ... (default probe-0, probe-1, ...).
 * --query: after the run, sink_query every conversation and compare with the store.
 * --stop-after-ms: close the sink after that long (deadline --close-deadline-ms) whatever
 *   is pending; with --state-dir and --resume, a later run sends what was left.
 * Without --state-dir the store lives in a new directory under $TMPDIR (else /tmp), removed
 * at the end. Prints "sink_probe: N items confirmed in S s: R items/s" on stderr.
 *
 * Built a second time as sink_alloc_probe (SINK_PROBE_ALLOC_FAIL, tests/unit/alloc_fail.h
 * forced into the sink's sources and lib/, jansson's and curl's allocators routed there
 * too), it takes --fail-at N: from the first sink_kick until the sink is empty and the
 * --query reads are done, the Nth allocation of the loop's thread is refused (0: none,
 * only counted). The sink must still confirm every write (no dead letter, no spool row
 * left: a confirmation whose recording was refused is sent again after sink_resync), a
 * query that failed for it is read again with nothing refused, and at the end
 * every allocation is freed. It prints "sink_alloc_probe: A allocations, refused R" on
 * stderr (R is 0 or 1). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "awsconf.h"
#include "buf.h"
#include "convo.h"
#include "ddbclient.h"
#include "ddbitem.h"
#include "log.h"
#include "sink.h"
#include "store.h"
#include "ulid.h"

#ifdef SINK_PROBE_ALLOC_FAIL
#include <curl/curl.h>

#include "ops.h"

/* curl's own allocations: counted as live (every one must be freed by the end) but never
 * refused. libcurl 7.88.1 does not survive refusals: one leaves a transfer that never ends,
 * a nearby one a division by zero inside curl (an ignored hash-table allocation failure). */
#undef malloc
#undef calloc
#undef realloc
#undef strdup
static void *curl_malloc(size_t n)
{
	void *p = malloc(n);
	if (p)
		alloc_fail.live++;
	return p;
}

static void *curl_calloc(size_t n, size_t size)
{
	void *p = calloc(n, size);
	if (p)
		alloc_fail.live++;
	return p;
}

static void *curl_realloc(void *old, size_t n)
{
	void *p = realloc(old, n);
	if (!old && p)
		alloc_fail.live++;
	else if (old && !p && n == 0)
		alloc_fail.live--;
	return p;
}

static char *curl_strdup(const char *s)
{
	char *p = strdup(s);
	if (p)
		alloc_fail.live++;
	return p;
}
#define malloc(n) test_malloc(n)
#define calloc(n, size) test_calloc(n, size)
#define realloc(p, n) test_realloc(p, n)
#define strdup(s) test_strdup(s)
#endif

struct opts {
	const char *table, *state_dir, *log_level;
	size_t conversations, messages, updates, payload, big_message, expect_dead;
	struct sink_config cfg;
	uint64_t timeout_ms, stop_after_ms, close_deadline_ms;
	unsigned long fail_at; /* sink_alloc_probe: --fail-at */
	bool alloc_mode;       /* sink_alloc_probe: arm the allocator */
	bool dump, query, create_table, resume, local;
};

struct probe {
	struct opts o;
	uv_loop_t loop;
	struct store *store;
	struct sink *sink;
	struct awsconf aws;
	struct ulid_gen ulid;
	struct convo **convs;
	char big_sk[DDBITEM_SK_MAX + 1];
	uv_check_t turn;
	uv_timer_t progress, deadline;
	size_t total;       /* writes expected to be confirmed or dead-lettered, in all */
	size_t rounds_done; /* --updates rounds applied */
	size_t settled;     /* settled callbacks */
	size_t queries_left, query_items, query_mismatch;
	size_t queries_refused; /* queries that failed for a refused allocation */
	bool queries_again;     /* they are being read again, nothing refused */
	json_t *final_stats;
	uint64_t t0, t_end;
	double cpu0, cpu_end; /* CPU seconds of this process at t0 and t_end */
	int table_status;
	bool table_done, finished, closed, failed, timed_out, queries_started;
	bool resync_pending; /* the sink lost rows and has not read the spool again yet */
};

/* The size of m's map, as the daemon gives it to store_spool_put. */
static size_t map_len(const struct message *m)
{
	struct buf b = {NULL, 0, 0};
	size_t n = message_write_map(&b, m) == 0 ? b.len : 0;
	buf_free(&b);
	return n;
}

static int64_t wall_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static double cpu_seconds(void)
{
	struct rusage ru;
	getrusage(RUSAGE_SELF, &ru);
	return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
	       (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
}

static void die(const char *what, int rc)
{
	fprintf(stderr, "sink_probe: %s: %s\n", what, rc ? strerror(rc < 0 ? -rc : rc) : "failed");
	exit(2);
}

static int64_t confirmed_now(struct probe *p)
{
	json_t *st = sink_stats_sink(p->sink);
	int64_t n = json_integer_value(json_object_get(st, "confirmed")) +
	            json_integer_value(json_object_get(st, "dead_lettered"));
	json_decref(st);
	return n;
}

/* Commits the open transaction, and tells the sink how that went, as the daemon does:
 * after a failed commit what it recorded there is lost (sink_lost), after one that
 * succeeded (or nothing to commit) it reads the spool again if it lost something. */
static void commit(struct probe *p)
{
	int rc;
	if (store_in_transaction(p->store) && (rc = store_commit(p->store)) < 0) {
#ifdef SINK_PROBE_ALLOC_FAIL
		if (alloc_fail.failed) {
			/* What the sink recorded is lost: its rows stay, read again below at the
			 * next turn. */
			fprintf(stderr, "sink_probe: commit refused: %s\n", strerror(-rc));
			sink_lost(p->sink);
			p->resync_pending = true;
			return;
		}
#endif
		die("store_commit", rc);
	}
	rc = sink_resync(p->sink);
	p->resync_pending = rc != 0;
#ifdef SINK_PROBE_ALLOC_FAIL
	if (rc < 0 && alloc_fail.failed)
		return; /* refused: tried again at a later turn */
#endif
	if (rc < 0)
		die("sink_resync", rc);
}

static void begin(struct probe *p)
{
	int rc;
	if (!store_in_transaction(p->store) && (rc = store_begin(p->store)) < 0)
		die("store_begin", rc);
}

/* The conversation id of index i: "probe-i" unless --prefix said otherwise. */
static const char *prefix = "probe";

static void conv_id(size_t i, char *buf, size_t size)
{
	snprintf(buf, size, "%s-%zu", prefix, i);
}

/* Content of message j of conversation i (the test recomputes it). */
static char *content(const struct opts *o, size_t i, size_t j, size_t *len)
{
	char head[64];
	int n = snprintf(head, sizeof(head), "conversation %zu message %zu", i, j);
	char *s = malloc((size_t)n + o->payload + 1);
	if (!s)
		die("malloc", ENOMEM);
	memcpy(s, head, (size_t)n);
	for (size_t k = 0; k < o->payload; k++)
		s[n + k] = (char)('a' + (i + j + k) % 26);
	*len = (size_t)n + o->payload;
	s[*len] = '\0';
	return s;
}

struct pending_write {
	const char *conv;
	size_t conv_len;
	const char *sk;
	uint32_t version;
};

static void enqueue(struct probe *p, const char *conv, size_t conv_len, const char *sk,
                    uint32_t version, int64_t now)
{
	int rc = sink_enqueue(p->sink, conv, conv_len, sk, version, now);
	if (rc < 0)
		die("sink_enqueue", rc);
}

/* Writes every message of the workload, commits, then enqueues (as the daemon does). */
static void write_workload(struct probe *p)
{
	struct convo_env env = {.ulid = &p->ulid};
	struct error err;
	int64_t now = wall_ms();
	int rc;

	p->convs = calloc(p->o.conversations, sizeof(*p->convs));
	if (!p->convs)
		die("calloc", ENOMEM);
	begin(p);
	for (size_t i = 0; i < p->o.conversations; i++) {
		char id[64];
		struct convo *c;
		conv_id(i, id, sizeof(id));
		c = p->convs[i] = convo_new(id, strlen(id));
		if (!c)
			die("convo_new", ENOMEM);
		for (size_t j = 0; j < p->o.messages; j++) {
			size_t len;
			char *text = content(&p->o, i, j, &len);
			const char *texts[1] = {text};
			size_t lens[1] = {len};
			struct metadata_patch patch;
			struct message *m;
			bool merged;
			json_t *aux =
			    json_pack("{s:I, s:I, s:f, s:[s, I], s:{s:b, s:n}}", "i", (json_int_t)i,
			              "j", (json_int_t)j, "pi", 3.25, "tags", "probe",
			              (json_int_t)j, "nested", "ok", 1, "none");
			json_t *timing = json_pack("{s:I}", "playStart", (json_int_t)(1000 + j));
			if (!aux || !timing ||
			    message_patch_parse(timing, aux, "", &patch, &err) != ERR_OK)
				die("message_patch_parse", EINVAL);
			env.now_ms = now;
			if (convo_add(c, &env, j % 2 ? ROLE_ASSISTANT : ROLE_USER, texts, lens, 1,
			              &patch, &m, &merged, &err) != ERR_OK ||
			    merged)
				die(err.message, EINVAL);
			json_decref(aux);
			json_decref(timing);
			free(text);
			if ((rc = store_put_message(p->store, id, strlen(id), m)) < 0 ||
			    (rc = store_spool_put(p->store, id, strlen(id), m->id, m->version,
			                          map_len(m), now)) < 0)
				die("store write", rc);
		}
		if (i == 0 && p->o.big_message) {
			/* built by hand: convo_add would refuse it, as the daemon does */
			char *big = malloc(p->o.big_message), mid[ULID_LEN + 1];
			struct message *m;
			if (!big)
				die("malloc", ENOMEM);
			memset(big, 'x', p->o.big_message);
			ulid_gen_next(&p->ulid, (uint64_t)now, mid);
			m = message_new(mid, ROLE_USER, now);
			if (!m || message_append_text(m, big, p->o.big_message) < 0)
				die("message_new", ENOMEM);
			free(big);
			m->version = 1;
			m->updated_ms = now;
			if (convo_restore_append(c, m) < 0)
				die("convo_restore_append", ENOMEM);
			snprintf(p->big_sk, sizeof(p->big_sk), "%s", m->id);
			if ((rc = store_put_message(p->store, id, strlen(id), m)) < 0 ||
			    (rc = store_spool_put(p->store, id, strlen(id), m->id, m->version,
			                          map_len(m), now)) < 0)
				die("store write", rc);
		}
		if ((rc = store_put_conversation(p->store, c)) < 0)
			die("store_put_conversation", rc);
	}
	commit(p);
	for (size_t i = 0; i < p->o.conversations; i++) {
		struct convo *c = p->convs[i];
		for (size_t k = 0; k < c->nlog; k++) {
			enqueue(p, c->id, c->id_len, c->log[k]->id, c->log[k]->version, now);
			p->total++;
		}
	}
}

/* One --updates round: set_metadata on every even-numbered message. */
static void update_round(struct probe *p)
{
	struct convo_env env = {.ulid = &p->ulid, .now_ms = wall_ms()};
	struct error err;
	struct metadata_patch patch;
	json_t *aux;
	int rc;
#ifdef SINK_PROBE_ALLOC_FAIL
	/* The updates stand for the daemon's requests: nothing of theirs is refused. */
	bool armed = alloc_fail.armed;
	alloc_fail.armed = false;
#endif

	aux = json_pack("{s:I}", "round", (json_int_t)(p->rounds_done + 1));
	if (!aux || message_patch_parse(NULL, aux, "", &patch, &err) != ERR_OK)
		die("message_patch_parse", EINVAL);
	begin(p);
	for (size_t i = 0; i < p->o.conversations; i++) {
		struct convo *c = p->convs[i];
		for (size_t j = 0; j < p->o.messages; j += 2) {
			struct message *m = c->log[j];
			if (convo_set_metadata(c, &env, j, &patch, &err) != ERR_OK)
				die(err.message, EINVAL);
			if ((rc = store_put_message(p->store, c->id, c->id_len, m)) < 0 ||
			    (rc = store_spool_put(p->store, c->id, c->id_len, m->id, m->version,
			                          map_len(m), env.now_ms)) < 0)
				die("store write", rc);
		}
	}
	json_decref(aux);
	commit(p);
	for (size_t i = 0; i < p->o.conversations; i++) {
		struct convo *c = p->convs[i];
		for (size_t j = 0; j < p->o.messages; j += 2)
			enqueue(p, c->id, c->id_len, c->log[j]->id, c->log[j]->version, env.now_ms);
	}
	p->rounds_done++;
#ifdef SINK_PROBE_ALLOC_FAIL
	alloc_fail.armed = armed;
#endif
	sink_kick(p->sink);
}

static int resume_row(void *arg, int64_t seq, const char *conv, size_t conv_len, const char *sk,
                      uint32_t version, int64_t enqueued_ms)
{
	struct probe *p = arg;
	(void)seq;
	int rc = sink_enqueue(p->sink, conv, conv_len, sk, version, enqueued_ms);
	if (rc == 0)
		p->total++;
	return rc;
}

static void on_closed(void *arg)
{
	struct probe *p = arg;
	p->closed = true;
	p->sink = NULL; /* freed: the last commit has no sink to tell */
	uv_close((uv_handle_t *)&p->turn, NULL);
	uv_close((uv_handle_t *)&p->progress, NULL);
	uv_close((uv_handle_t *)&p->deadline, NULL);
}

/* Done sending (or stopped): snapshot the stats, then close the sink. */
static void finish(struct probe *p, uint64_t deadline)
{
	if (p->finished)
		return;
	p->finished = true;
#ifdef SINK_PROBE_ALLOC_FAIL
	alloc_fail.armed = false;
#endif
	if (!p->t_end) {
		p->t_end = uv_hrtime();
		p->cpu_end = cpu_seconds();
	}
	uv_timer_stop(&p->progress);
	uv_timer_stop(&p->deadline);
	commit(p);
	p->final_stats = json_pack("{s:o, s:o}", "spool", sink_stats_spool(p->sink), "sink",
	                           sink_stats_sink(p->sink));
	sink_close(p->sink, deadline, on_closed, p);
}

static void start_queries(struct probe *p);

static void on_query(void *arg, int status, const json_t *items)
{
	struct probe *p = arg;
	size_t i;
	json_t *item;

	p->queries_left--;
#ifdef SINK_PROBE_ALLOC_FAIL
	/* The probe's own checks below allocate nothing refused. */
	bool armed = alloc_fail.armed;
	alloc_fail.armed = false;
	if (status < 0 && alloc_fail.failed && !p->queries_again) {
		/* Refused: it is read again below, nothing refused. */
		p->queries_refused++;
	} else
#endif
	    if (status < 0) {
		fprintf(stderr, "sink_probe: query failed: %s\n", strerror(-status));
		p->failed = true;
	} else {
		json_array_foreach(items, i, item)
		{
			const char *conv;
			json_t *map = NULL, *stored = NULL;
			uint32_t v = 0, sv = 0;
			int64_t u = 0, su = 0;
			struct error err;
			char sk[DDBITEM_SK_MAX + 1];

			p->query_items++;
			if (ddbitem_to_map(item, &conv, &map, &v, &u, &err) != ERR_OK ||
			    ddbitem_sort_key(map, sk, &err) != ERR_OK ||
			    store_message_get(p->store, conv, strlen(conv), sk, &stored, &sv, &su) <
			        0 ||
			    !json_equal(map, stored) || v != sv || u != su) {
				p->query_mismatch++;
				fprintf(stderr,
				        "sink_probe: query item %zu differs from the store\n", i);
			}
			json_decref(map);
			json_decref(stored);
		}
	}
#ifdef SINK_PROBE_ALLOC_FAIL
	alloc_fail.armed = armed;
#endif
	if (p->queries_left > 0)
		return;
#ifdef SINK_PROBE_ALLOC_FAIL
	if (p->queries_refused && !p->queries_again) {
		alloc_fail.armed = false;
		p->queries_again = true;
		p->query_items = p->query_mismatch = 0;
		start_queries(p);
		return;
	}
#endif
	finish(p, 0);
}

static void start_queries(struct probe *p)
{
	p->queries_left = p->o.conversations;
	for (size_t i = 0; i < p->o.conversations; i++) {
		char id[64];
		int rc;
		conv_id(i, id, sizeof(id));
		if ((rc = sink_query(p->sink, id, strlen(id), on_query, p)) < 0) {
#ifdef SINK_PROBE_ALLOC_FAIL
			if (alloc_fail.failed) {
				on_query(p, rc, NULL); /* refused: read again at the end */
				continue;
			}
#endif
			die("sink_query", rc);
		}
	}
}

/* End of a loop turn: commit what the sink wrote, then let it send. */
static void on_turn(uv_check_t *h)
{
	struct probe *p = h->data;

	commit(p);
	sink_kick(p->sink);
	if (p->finished)
		return;
	if (p->queries_left || p->rounds_done < p->o.updates || sink_depth(p->sink) > 0 ||
	    p->resync_pending)
		return;
	if (p->o.query && p->o.conversations) {
		if (!p->t_end) {
			p->t_end = uv_hrtime();
			p->cpu_end = cpu_seconds();
		}
		if (!p->queries_started) {
			p->queries_started = true;
			start_queries(p);
		}
		return;
	}
	finish(p, 0);
}

static void on_progress(uv_timer_t *t)
{
	struct probe *p = t->data;
	int64_t done;

	if (p->rounds_done >= p->o.updates)
		return;
	done = confirmed_now(p);
	/* round r starts once (r + 1) / (updates + 2) of the first writes are settled */
	if ((size_t)done * (p->o.updates + 2) >= (p->rounds_done + 1) * p->total)
		update_round(p);
}

static void on_deadline(uv_timer_t *t)
{
	struct probe *p = t->data;
	if (p->o.stop_after_ms && !p->o.timeout_ms) {
		finish(p, p->o.close_deadline_ms);
		return;
	}
	p->timed_out = true;
	fprintf(stderr, "sink_probe: not done after %" PRIu64 " ms (%zu pending)\n",
	        p->o.timeout_ms, sink_depth(p->sink));
	finish(p, p->o.close_deadline_ms);
}

static void on_table(void *arg, int status)
{
	struct probe *p = arg;
	p->table_done = true;
	p->table_status = status;
}

static size_t num(const char *s, const char *name)
{
	char *end;
	unsigned long long v;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || *end || !*s) {
		fprintf(stderr, "sink_probe: %s: not a number: %s\n", name, s);
		exit(2);
	}
	return (size_t)v;
}

static void parse(int argc, char **argv, struct opts *o)
{
	sink_config_defaults(&o->cfg);
	o->conversations = 4;
	o->messages = 50;
	o->timeout_ms = 120000;
	o->close_deadline_ms = 0;
	o->log_level = "warn";
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
		bool flag = true;
#define OPT(name) (strcmp(a, name) == 0 && v && (flag = false, i++, true))
		if (OPT("--table"))
			o->table = v;
		else if (OPT("--state-dir"))
			o->state_dir = v;
		else if (OPT("--log-level"))
			o->log_level = v;
		else if (OPT("--conversations"))
			o->conversations = num(v, a);
		else if (OPT("--messages"))
			o->messages = num(v, a);
		else if (OPT("--updates"))
			o->updates = num(v, a);
		else if (OPT("--payload"))
			o->payload = num(v, a);
		else if (OPT("--big-message"))
			o->big_message = num(v, a);
		else if (OPT("--expect-dead"))
			o->expect_dead = num(v, a);
		else if (OPT("--batch-items"))
			o->cfg.batch_items = num(v, a);
		else if (OPT("--inflight"))
			o->cfg.max_batches_inflight = num(v, a);
		else if (OPT("--retry-base-ms"))
			o->cfg.retry_base_ms = num(v, a);
		else if (OPT("--retry-max-ms"))
			o->cfg.retry_max_ms = num(v, a);
		else if (OPT("--request-timeout-ms"))
			o->cfg.request_timeout_ms = (long)num(v, a);
		else if (OPT("--connect-timeout-ms"))
			o->cfg.connect_timeout_ms = (long)num(v, a);
		else if (OPT("--timeout-ms"))
			o->timeout_ms = num(v, a);
		else if (OPT("--stop-after-ms"))
			o->stop_after_ms = num(v, a);
		else if (OPT("--close-deadline-ms"))
			o->close_deadline_ms = num(v, a);
		else if (OPT("--prefix")) {
			if (!*v || strlen(v) > 40) {
				fprintf(stderr, "sink_probe: --prefix: 1 to 40 bytes\n");
				exit(2);
			}
			prefix = v;
		} else if (OPT("--fail-at")) {
			o->fail_at = num(v, a);
			o->alloc_mode = true;
		} else if (strcmp(a, "--dump") == 0)
			o->dump = true;
		else if (strcmp(a, "--query") == 0)
			o->query = true;
		else if (strcmp(a, "--create-table") == 0)
			o->create_table = true;
		else if (strcmp(a, "--resume") == 0)
			o->resume = true;
		else if (strcmp(a, "--local") == 0)
			o->local = true;
		else {
			fprintf(stderr, "sink_probe: unknown or incomplete option %s\n", a);
			exit(2);
		}
		(void)flag;
#undef OPT
	}
	if (!o->table && !o->local) {
		fprintf(stderr, "sink_probe: --table is required\n");
		exit(2);
	}
	if (o->stop_after_ms) {
		o->timeout_ms = 0;
		o->query = false;
		o->updates = 0;
	}
#ifndef SINK_PROBE_ALLOC_FAIL
	if (o->alloc_mode) {
		fprintf(stderr, "sink_probe: --fail-at needs sink_alloc_probe\n");
		exit(2);
	}
#endif
	if (o->resume && !o->state_dir) {
		fprintf(stderr, "sink_probe: --resume needs --state-dir\n");
		exit(2);
	}
	o->cfg.table = o->table;
}

static void on_local_closed(void *arg)
{
	*(bool *)arg = true;
}

static void on_local_query(void *arg, int status, const json_t *items)
{
	(void)arg;
	(void)status;
	(void)items;
	fprintf(stderr, "sink_probe: the local sink ran a query callback\n");
	exit(1);
}

#define LOCAL_CHECK(cond)                                                                          \
	do {                                                                                       \
		checks++;                                                                          \
		if (!(cond)) {                                                                     \
			fprintf(stderr, "sink_probe: local: check failed: %s\n", #cond);           \
			failed++;                                                                  \
		}                                                                                  \
	} while (0)

/* --local: the embedded default (no table) sends nothing and says so. */
static int run_local(struct probe *p)
{
	struct sink_config cfg;
	json_t *sp, *sk;
	bool closed = false;
	int checks = 0, failed = 0;

	sink_config_defaults(&cfg);
	LOCAL_CHECK(sink_new(&p->loop, p->store, &cfg, NULL, NULL, NULL, &p->sink) == 0);
	if (!p->sink)
		return 1;
	LOCAL_CHECK(!sink_remote(p->sink));
	LOCAL_CHECK(sink_enqueue(p->sink, "c", 1, "01ARZ3NDEKTSV4RRFFQ69G5FAV", 1, 1) == -ENOTSUP);
	LOCAL_CHECK(sink_depth(p->sink) == 0 && sink_pending(p->sink, "c", 1) == 0);
	LOCAL_CHECK(!sink_full(p->sink));
	LOCAL_CHECK(sink_query(p->sink, "c", 1, on_local_query, NULL) == -ENOTSUP);
	LOCAL_CHECK(sink_reload_credentials(p->sink) == 0);
	sp = sink_stats_spool(p->sink);
	sk = sink_stats_sink(p->sink);
	LOCAL_CHECK(json_integer_value(json_object_get(sp, "items")) == 0 &&
	            json_is_null(json_object_get(sp, "oldest_pending_ms")));
	LOCAL_CHECK(strcmp(json_string_value(json_object_get(sk, "kind")), "local") == 0);
	LOCAL_CHECK(json_integer_value(json_object_get(sk, "writes_sent")) == 0 &&
	            json_is_null(json_object_get(sk, "last_error")) &&
	            json_is_null(json_object_get(json_object_get(sk, "latency_ms"), "p50")));
	json_decref(sp);
	json_decref(sk);
	sink_kick(p->sink);
	sink_close(p->sink, 1000, on_local_closed, &closed);
	uv_run(&p->loop, UV_RUN_DEFAULT);
	LOCAL_CHECK(closed);
	fprintf(stderr, "sink_probe local: %d checks, %d failed\n", checks, failed);
	return failed ? 1 : 0;
}

/* Every message of the workload as the store holds it. */
static json_t *dump_messages(struct probe *p)
{
	json_t *out = json_array();
	for (size_t i = 0; out && i < p->o.conversations; i++) {
		struct convo *c = p->convs[i];
		for (size_t k = 0; k < c->nlog; k++) {
			json_t *map = NULL;
			uint32_t v;
			int64_t u;
			if (store_message_get(p->store, c->id, c->id_len, c->log[k]->id, &map, &v,
			                      &u) < 0)
				die("store_message_get", EIO);
			json_array_append_new(
			    out, json_pack("{s:s, s:s, s:I, s:I, s:o}", "conversation", c->id, "sk",
			                   c->log[k]->id, "version", (json_int_t)v, "updated",
			                   (json_int_t)u, "map", map));
		}
	}
	return out;
}

static void remove_state(const char *dir)
{
	const char *names[] = {"convod.db", "convod.db-wal", "convod.db-shm"};
	char path[4096];
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
		unlink(path);
	}
	rmdir(dir);
}

int main(int argc, char **argv)
{
	struct probe p;
	char err[AWSCONF_ERRBUF_SIZE], serr[512], tmpdir[3100];
	const char *dir;
	uint8_t seed[32];
	enum log_level level;
	uint64_t items = 0, bytes = 0;
	int64_t oldest = 0;
	json_t *dead = NULL, *doc;
	size_t ndead;
	double secs;
	int rc, status = 0;

	memset(&p, 0, sizeof(p));
#ifdef SINK_PROBE_ALLOC_FAIL
	/* Before anything allocates: jansson's and curl's allocations are counted too. */
	ops_json_alloc_init(test_malloc, test_free);
	if (curl_global_init_mem(CURL_GLOBAL_DEFAULT, curl_malloc, test_free, curl_realloc,
	                         curl_strdup, curl_calloc) != CURLE_OK)
		die("curl_global_init_mem", EIO);
	alloc_fail.one_thread = true;
	alloc_fail.thread = pthread_self();
#endif
	parse(argc, argv, &p.o);
	if (log_level_parse(p.o.log_level, &level) == 0)
		log_set_level(level);
	for (size_t i = 0; i < sizeof(seed); i++)
		seed[i] = (uint8_t)(rand() ^ (int)i);
	ulid_gen_init(&p.ulid, seed);
	if (ddbclient_global_init() < 0)
		die("ddbclient_global_init", EIO);
	if ((rc = awsconf_load(&p.aws, err)) < 0) {
		fprintf(stderr, "sink_probe: awsconf: %s\n", err);
		return 2;
	}
	dir = p.o.state_dir;
	if (!dir) {
		const char *base = getenv("TMPDIR");
		snprintf(tmpdir, sizeof(tmpdir), "%s/sink-probe-XXXXXX",
		         base && base[0] && strlen(base) < 3000 ? base : "/tmp");
		if (!(dir = mkdtemp(tmpdir)))
			die("mkdtemp", errno);
	}
	if ((rc = store_open(dir, DURABILITY_NONE, &p.store, serr, sizeof(serr))) < 0) {
		fprintf(stderr, "sink_probe: %s\n", serr);
		return 2;
	}
	uv_loop_init(&p.loop);
	if (p.o.local) {
		status = run_local(&p);
		store_close(p.store);
		if (!p.o.state_dir)
			remove_state(dir);
		awsconf_free(&p.aws);
		if (uv_loop_close(&p.loop) != 0)
			die("uv_loop_close: handles left open", EBUSY);
		ddbclient_global_cleanup();
		return status;
	}
	if ((rc = sink_new(&p.loop, p.store, &p.o.cfg, &p.aws, NULL, NULL, &p.sink)) < 0)
		die("sink_new", rc);
	if (!sink_remote(p.sink))
		die("sink_remote", EINVAL);

	if (p.o.create_table) {
		if ((rc = sink_create_table(p.sink, on_table, &p)) < 0)
			die("sink_create_table", rc);
		while (!p.table_done)
			uv_run(&p.loop, UV_RUN_ONCE);
		fprintf(stderr, "sink_probe: create table: %s\n",
		        p.table_status == 0 ? "created" : strerror(-p.table_status));
		if (p.table_status < 0 && p.table_status != -EEXIST)
			return 1;
	}

	if (p.o.resume) {
		if ((rc = store_spool_each(p.store, 0, resume_row, &p)) < 0)
			die("store_spool_each", rc);
		p.o.conversations = 0;
	} else {
		write_workload(&p);
	}
	fprintf(stderr, "sink_probe: %zu writes enqueued\n", p.total);

	uv_check_init(&p.loop, &p.turn);
	p.turn.data = &p;
	uv_check_start(&p.turn, on_turn);
	uv_timer_init(&p.loop, &p.progress);
	p.progress.data = &p;
	uv_timer_start(&p.progress, on_progress, 2, 2);
	uv_timer_init(&p.loop, &p.deadline);
	p.deadline.data = &p;
	if (p.o.timeout_ms || p.o.stop_after_ms)
		uv_timer_start(&p.deadline, on_deadline,
		               p.o.stop_after_ms ? p.o.stop_after_ms : p.o.timeout_ms, 0);
	p.t0 = uv_hrtime();
	p.cpu0 = cpu_seconds();
#ifdef SINK_PROBE_ALLOC_FAIL
	alloc_fail.calls = 0;
	alloc_fail.fail_at = p.o.fail_at;
	alloc_fail.failed = false;
	alloc_fail.armed = p.o.alloc_mode;
#endif
	sink_kick(p.sink);
	uv_run(&p.loop, UV_RUN_DEFAULT);
	if (!p.closed)
		die("the loop ended before the sink closed", EPROTO);
	commit(&p);

	secs = (double)(p.t_end - p.t0) / 1e9;
	{
		json_int_t confirmed = json_integer_value(
		    json_object_get(json_object_get(p.final_stats, "sink"), "confirmed"));
		double cpu = p.cpu_end - p.cpu0;
		fprintf(stderr,
		        "sink_probe: %" JSON_INTEGER_FORMAT
		        " items confirmed in %.3f s: %.0f items/s "
		        "(this process: %.3f CPU s, %.1f us per item)\n",
		        confirmed, secs, secs > 0 ? (double)confirmed / secs : 0.0, cpu,
		        confirmed > 0 ? cpu * 1e6 / (double)confirmed : 0.0);
	}
	if (store_spool_stats(p.store, &items, &bytes, &oldest) < 0 ||
	    store_dead_letters(p.store, 1000, &dead) < 0)
		die("reading the store", EIO);
	ndead = json_array_size(dead);
	doc = json_pack("{s:o, s:o, s:I, s:f, s:f, s:I, s:I}", "stats", p.final_stats,
	                "dead_letters", dead, "spool_rows", (json_int_t)items, "seconds", secs,
	                "cpu_seconds", p.cpu_end - p.cpu0, "query_items", (json_int_t)p.query_items,
	                "query_mismatch", (json_int_t)p.query_mismatch);
	if (p.o.dump && doc)
		json_object_set_new(doc, "messages", dump_messages(&p));
	if (!doc || json_dumpf(doc, stdout, JSON_COMPACT) < 0)
		die("printing the result", EIO);
	putchar('\n');
	json_decref(doc);

	if (p.o.stop_after_ms) {
		fprintf(stderr, "sink_probe: stopped with %" PRIu64 " spool rows left\n", items);
	} else if (p.timed_out || p.failed || items != 0 || ndead != p.o.expect_dead ||
	           p.query_mismatch) {
		fprintf(stderr,
		        "sink_probe: FAILED: %" PRIu64
		        " spool rows left, %zu dead letters (expected "
		        "%zu), %zu query mismatches%s\n",
		        items, ndead, p.o.expect_dead, p.query_mismatch,
		        p.timed_out ? ", timed out" : "");
		status = 1;
	} else {
		fprintf(stderr, "sink_probe: OK\n");
	}

	for (size_t i = 0; p.convs && i < p.o.conversations; i++)
		convo_free(p.convs[i]);
	free(p.convs);
	store_close(p.store);
	if (!p.o.state_dir)
		remove_state(dir);
	awsconf_free(&p.aws);
	if (uv_loop_close(&p.loop) != 0)
		die("uv_loop_close: handles left open", EBUSY);
	ddbclient_global_cleanup();
#ifdef SINK_PROBE_ALLOC_FAIL
	curl_global_cleanup(); /* the curl_global_init_mem above */
	fprintf(
	    stderr,
	    "sink_alloc_probe: %lu allocations, refused %d, %zu queries refused, %ld not freed\n",
	    alloc_fail.calls, alloc_fail.failed ? 1 : 0, p.queries_refused, (long)alloc_fail.live);
	if (alloc_fail.live != 0)
		status = 1;
#endif
	return status;
}
