/* Unit tests for daemon/store: round trips of conversations (positions, versions, seen
 * values, summaries, NUL bytes and non-ASCII), upserts, closed conversations, the spool,
 * dead letters, purge, transactions, reopening, broken files, an unwritable directory, a
 * full disk, synchronous=FULL not set back after a fold at durability machine, and a
 * micro-benchmark of the group commit. */
#include "store.h"

#include "ddbitem.h"
#include "msgrec.h"
#include "store_legacy.h"
#include "test.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <sqlite3.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define T0 INT64_C(1744815823057)

static char root[64];
static struct ulid_gen gen;

/* A conversation id with a NUL byte and non-ASCII characters. */
static const char conv_id[] = "conv\0\xc3\xa9\xe2\x9c\x93 id";
#define CONV_ID_LEN (sizeof(conv_id) - 1)

static void env_init(struct convo_env *env, int64_t now)
{
	uint8_t seed[32];
	for (int i = 0; i < 32; i++)
		seed[i] = (uint8_t)(i * 7 + 3);
	ulid_gen_init(&gen, seed);
	memset(env, 0, sizeof(*env));
	env->ulid = &gen;
	env->now_ms = now;
}

/* A fresh directory root/name; returns its path in a static buffer per call site. */
static void make_dir(char *out, size_t len, const char *name)
{
	snprintf(out, len, "%s/%s", root, name);
	if (mkdir(out, 0700) < 0)
		fprintf(stderr, "mkdir %s: %s\n", out, strerror(errno));
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
	(void)sb;
	(void)flag;
	(void)ftw;
	return remove(path);
}

static json_t *parse(const char *s)
{
	json_error_t e;
	json_t *j = json_loads(s, JSON_ALLOW_NUL, &e);
	if (!j)
		fprintf(stderr, "bad test JSON: %s: %s\n", s, e.text);
	return j;
}

/* Adds texts (NUL bytes allowed: lens given) and returns the resulting message. */
static struct message *add_n(struct convo *c, struct convo_env *env, enum role role,
                             const char *const *texts, const size_t *lens, size_t n)
{
	struct message *m = NULL;
	struct error e;
	bool merged;
	env->now_ms++;
	if (convo_add(c, env, role, texts, lens, n, NULL, &m, &merged, &e) != ERR_OK) {
		fprintf(stderr, "convo_add: %s\n", e.message);
		return NULL;
	}
	return m;
}

static struct message *add1(struct convo *c, struct convo_env *env, enum role role, const char *s)
{
	size_t len = strlen(s);
	return add_n(c, env, role, &s, &len, 1);
}

static struct message *summarize(struct convo *c, struct convo_env *env, const char *text,
                                 size_t len, const char *const *ids, size_t nids)
{
	struct message *m = NULL;
	struct error e;
	env->now_ms++;
	if (convo_add_summary(c, env, &text, &len, 1, ids, nids, NULL, 0, &m, &e) != ERR_OK) {
		fprintf(stderr, "convo_add_summary: %s\n", e.message);
		return NULL;
	}
	return m;
}

static void set_metadata(struct convo *c, struct convo_env *env, size_t i, const char *timing,
                         const char *aux)
{
	struct metadata_patch p;
	struct error e;
	json_t *t = timing ? parse(timing) : NULL, *a = aux ? parse(aux) : NULL;
	env->now_ms++;
	CHECK(message_patch_parse(t, a, "", &p, &e) == ERR_OK);
	CHECK(convo_set_metadata(c, env, i, &p, &e) == ERR_OK);
	json_decref(t);
	json_decref(a);
}

/* The client's incremental to_messages_map, which moves seen[CONSUMER_CLIENT]. */
static void client_take(struct convo *c)
{
	json_decref(convo_to_messages_map(c, true, true));
}

struct put_ctx {
	struct store *s;
	const struct convo *c;
	int rc;
	size_t n;
};

static void put_cb(void *arg, const struct message *m, size_t index)
{
	struct put_ctx *p = arg;
	(void)index;
	if (!p->rc)
		p->rc = store_put_message(p->s, p->c->id, p->c->id_len, m);
	p->n++;
}

/* Stores what the store consumer has not taken yet, as the daemon's group commit does,
 * without opening a transaction. Returns the number of messages, or -errno. */
static long put_pending(struct store *s, struct convo *c)
{
	struct put_ctx p = {s, c, 0, 0};
	convo_take(c, CONSUMER_STORE, false, put_cb, &p);
	if (!p.rc)
		p.rc = store_put_conversation(s, c);
	return p.rc ? p.rc : (long)p.n;
}

/* put_pending in a transaction of its own. */
static long save(struct store *s, struct convo *c)
{
	long n;
	if (store_begin(s) < 0)
		return -1;
	n = put_pending(s, c);
	if (n < 0) {
		store_rollback(s);
		return n;
	}
	return store_commit(s) < 0 ? -1 : n;
}

/* Makes every message pending again for the store consumer (after a failed write). */
static void forget_store(struct convo *c)
{
	for (size_t i = 0; i < c->nlog; i++)
		c->log[i]->seen[CONSUMER_STORE] = 0;
	c->scan_from[CONSUMER_STORE] = 0;
}

static struct store *open_store(const char *dir)
{
	struct store *s = NULL;
	char err[256];
	int rc = store_open(dir, DURABILITY_PROCESS, &s, err, sizeof(err));
	if (rc < 0)
		fprintf(stderr, "store_open %s: %d %s\n", dir, rc, err);
	return s;
}

static void sort_key_of(const struct message *m, char sk[DDBITEM_SK_MAX + 1])
{
	json_t *map = message_to_map(m);
	sk[0] = 0;
	CHECK(map && ddbitem_sort_key(map, sk, NULL) == ERR_OK);
	json_decref(map);
}

static bool same_json(json_t *a, json_t *b)
{
	bool same = (!a && !b) || (a && b && json_equal(a, b));
	json_decref(a);
	json_decref(b);
	return same;
}

/* Checks that loaded is orig as the store promises: everything equal, seen[STORE] and
 * seen[SINK] at the version, seen[CLIENT] as it was stored. */
static void check_same(const struct convo *orig, const struct convo *loaded, int line)
{
	int before = test_failures;
	char *d1, *d2;
	struct error e;

	CHECK(loaded != NULL);
	if (!loaded)
		goto out;
	CHECK(loaded->id_len == orig->id_len && memcmp(loaded->id, orig->id, orig->id_len) == 0);
	CHECK(loaded->nlog == orig->nlog);
	CHECK(loaded->first_llm == orig->first_llm);
	CHECK(loaded->last_summary == orig->last_summary);
	CHECK(loaded->text_bytes == orig->text_bytes);
	CHECK(loaded->updated_ms == orig->updated_ms);
	CHECK(convo_check(loaded, &e) == ERR_OK);
	for (size_t i = 0; i < orig->nlog && i < loaded->nlog; i++) {
		const struct message *a = orig->log[i], *b = loaded->log[i];
		CHECK_STR(b->id, a->id);
		CHECK(b->role == a->role && b->fake == a->fake && b->merges == a->merges);
		CHECK(b->version == a->version && b->updated_ms == a->updated_ms);
		for (int k = 0; k < TIMING_COUNT; k++)
			CHECK(message_timing(b, (enum timing_key)k) ==
			      message_timing(a, (enum timing_key)k));
		CHECK(b->ncontents == a->ncontents);
		for (uint32_t k = 0; k < a->ncontents && k < b->ncontents; k++)
			CHECK(b->contents[k]->len == a->contents[k]->len &&
			      memcmp(b->contents[k]->bytes, a->contents[k]->bytes,
			             a->contents[k]->len) == 0);
		CHECK(b->nsummary_ids == a->nsummary_ids);
		for (uint32_t k = 0; k < a->nsummary_ids && k < b->nsummary_ids; k++)
			CHECK_STR(b->summary_ids[k], a->summary_ids[k]);
		CHECK((!a->aux && !b->aux) || (a->aux && b->aux && json_equal(a->aux, b->aux)));
		CHECK(b->seen[CONSUMER_CLIENT] == a->seen[CONSUMER_CLIENT]);
		CHECK(b->seen[CONSUMER_STORE] == b->version);
		/* Neither spooled nor confirmed here: the flusher must take it again. */
		CHECK(b->seen[CONSUMER_SINK] <= b->version);
		CHECK(same_json(message_to_map(a), message_to_map(b)));
	}
	d1 = convo_describe(orig);
	d2 = convo_describe(loaded);
	CHECK_STR(d2, d1);
	free(d1);
	free(d2);
out:
	if (test_failures != before)
		fprintf(stderr, "  (conversation compared at line %d)\n", line);
}
#define CHECK_SAME(orig, loaded) check_same((orig), (loaded), __LINE__)

/* The sample: NUL bytes and non-ASCII in contents, a merge, metadata, two summaries, messages
 * after them, and the client's incremental map taken at several points. */
static struct convo *sample(struct convo_env *env)
{
	static const char nul_text[] = "Hello\0world";
	static const char nul_summary[] = "Summary\0with a NUL";
	const char *texts[2] = {"first \xe6\x97\xa5\xe6\x9c\xac", "second\0part"};
	size_t lens[2] = {strlen(texts[0]), 11};
	const char *p = nul_text;
	size_t len = sizeof(nul_text) - 1;
	char ids[4][ULID_LEN + 1];
	const char *sum1[2], *sum2[3];
	struct message *m;
	struct convo *c = convo_new(conv_id, CONV_ID_LEN);

	CHECK(c != NULL);
	if (!c)
		return NULL;
	CHECK((m = add_n(c, env, ROLE_USER, &p, &len, 1)) != NULL); /* 0 */
	memcpy(ids[0], m->id, sizeof(ids[0]));
	CHECK((m = add1(c, env, ROLE_ASSISTANT, "H\xc3\xa9llo \xe2\x9c\x93, how can I help?")));
	memcpy(ids[1], m->id, sizeof(ids[1]));
	CHECK(add1(c, env, ROLE_ASSISTANT, "A merged part.") == c->log[1]); /* merge: v2 */
	CHECK(c->log[1]->version == 2);
	CHECK((m = add_n(c, env, ROLE_USER, texts, lens, 2)) != NULL); /* 2 */
	memcpy(ids[2], m->id, sizeof(ids[2]));
	client_take(c);                                             /* client saw 0 and 1 (v2) */
	CHECK((m = add1(c, env, ROLE_ASSISTANT, "Sure.")) != NULL); /* 3 */
	memcpy(ids[3], m->id, sizeof(ids[3]));
	set_metadata(c, env, 0, "{\"playStart\":1744815823100,\"llmEnd\":1744815823200}",
	             "{\"k\":\"v\\u0000x\",\"n\":1.5,\"a\":[1,null,true],\"o\":{\"\\u00e9\":-7}}");
	CHECK(c->log[0]->version == 2 && c->log[0]->seen[CONSUMER_CLIENT] == 1);
	sum1[0] = ids[0];
	sum1[1] = ids[1];
	CHECK((m = summarize(c, env, nul_summary, sizeof(nul_summary) - 1, sum1, 2)) != NULL);
	CHECK(c->last_summary == 2 && c->log[2] == m); /* after message 1 */
	sum2[0] = m->id;
	sum2[1] = ids[2];
	sum2[2] = ids[3];
	client_take(c);
	CHECK(add1(c, env, ROLE_USER, "After the first summary.") != NULL); /* 5 */
	CHECK((m = summarize(c, env, "Second summary.", 15, sum2, 3)) != NULL);
	CHECK(c->last_summary == 5 && c->log[5] == m); /* between 4 and the user message */
	CHECK(add1(c, env, ROLE_ASSISTANT, "Fine.") != NULL);
	client_take(c);
	CHECK(add1(c, env, ROLE_ASSISTANT, "Merged after the client took it.") != NULL);
	CHECK(add1(c, env, ROLE_USER, "Last.") != NULL);
	CHECK(c->nlog == 9 && c->first_llm == 6);
	return c;
}

/* A small conversation of n alternating messages named id. */
static struct convo *small(struct convo_env *env, const char *id, int n)
{
	struct convo *c = convo_new(id, strlen(id));
	for (int i = 0; c && i < n; i++)
		CHECK(add1(c, env, i % 2 ? ROLE_ASSISTANT : ROLE_USER, i % 2 ? "answer" : "ask"));
	return c;
}

static void test_durability(void)
{
	enum durability d;
	CHECK(store_durability_parse("none", &d) == 0 && d == DURABILITY_NONE);
	CHECK(store_durability_parse("process", &d) == 0 && d == DURABILITY_PROCESS);
	CHECK(store_durability_parse("machine", &d) == 0 && d == DURABILITY_MACHINE);
	CHECK(store_durability_parse("Machine", &d) == -EINVAL);
	CHECK(store_durability_parse("", &d) == -EINVAL);
	CHECK_STR(store_durability_str(DURABILITY_MACHINE), "machine");
	CHECK_STR(store_durability_str(DURABILITY_NONE), "none");
}

static void test_round_trip(void)
{
	char dir[128], sk[DDBITEM_SK_MAX + 1];
	struct convo_env env;
	struct convo *c = NULL, *l = NULL;
	struct store *s;
	json_t *map = NULL;
	uint32_t version;
	int64_t updated;

	env_init(&env, T0);
	make_dir(dir, sizeof(dir), "round");
	CHECK((s = open_store(dir)) != NULL);
	if (!s)
		return;
	CHECK((c = sample(&env)) != NULL);
	CHECK(save(s, c) == 9);
	CHECK(store_load_conversation(s, conv_id, CONV_ID_LEN, &l) == 0);
	CHECK_SAME(c, l);
	/* Summaries come back where they were, by sort key. */
	CHECK(l && l->log[2]->role == ROLE_SUMMARY && l->log[5]->role == ROLE_SUMMARY);
	convo_free(l);
	l = NULL;

	/* Every row is under the sort key of ddbitem_sort_key. */
	for (size_t i = 0; i < c->nlog; i++) {
		sort_key_of(c->log[i], sk);
		CHECK(store_message_get(s, conv_id, CONV_ID_LEN, sk, &map, &version, &updated) ==
		      0);
		CHECK(version == c->log[i]->version && updated == c->log[i]->updated_ms);
		CHECK(same_json(map, message_to_map(c->log[i])));
		map = NULL;
	}
	CHECK(store_message_get(s, conv_id, CONV_ID_LEN, "nope", &map, &version, &updated) ==
	      -ENOENT);
	CHECK(map == NULL);
	/* The id with its NUL byte is the key, not its C-string prefix. */
	CHECK(store_load_conversation(s, conv_id, 4, &l) == -ENOENT && !l);
	CHECK(store_load_conversation(s, "missing", 7, &l) == -ENOENT && !l);

	/* An upsert of changed messages: a merge and new metadata. */
	CHECK(add1(c, &env, ROLE_USER, "Merged into the last user message.") == c->log[8]);
	set_metadata(c, &env, 3, NULL, "{\"stopped\":true}");
	CHECK(c->log[8]->version == 2 && c->log[3]->version == 2);
	CHECK(save(s, c) == 2);
	CHECK(store_load_conversation(s, conv_id, CONV_ID_LEN, &l) == 0);
	CHECK_SAME(c, l);
	convo_free(l);
	l = NULL;

	/* Reopening: the data is still there. */
	store_close(s);
	CHECK((s = open_store(dir)) != NULL);
	if (s) {
		CHECK(store_load_conversation(s, conv_id, CONV_ID_LEN, &l) == 0);
		CHECK_SAME(c, l);
		convo_free(l);
	}
	store_close(s);
	convo_free(c);
}

struct collect {
	char ids[8][32];
	size_t n, messages;
	int stop_after;
	const char *skip_id; /* store_load_open_except: the id passed over */
	size_t asked;        /* and how many ids it was asked about */
};

static bool skip_cb(void *arg, const char *id, size_t len)
{
	struct collect *k = arg;
	k->asked++;
	return len == strlen(k->skip_id) && memcmp(id, k->skip_id, len) == 0;
}

static int collect_cb(void *arg, struct convo *c)
{
	struct collect *k = arg;
	if (k->n < 8)
		snprintf(k->ids[k->n], sizeof(k->ids[0]), "%.*s", (int)c->id_len, c->id);
	k->n++;
	k->messages += c->nlog;
	convo_free(c);
	return k->stop_after && (int)k->n >= k->stop_after ? -ECANCELED : 0;
}

static void test_closed(void)
{
	char dir[128];
	struct convo_env env;
	struct convo *a, *b, *e, *l = NULL;
	struct collect k = {.n = 0};
	struct store *s;

	env_init(&env, T0);
	make_dir(dir, sizeof(dir), "closed");
	if (!(s = open_store(dir)))
		return;
	a = small(&env, "alpha", 3);
	b = small(&env, "beta", 4);
	e = convo_new("empty", 5); /* a conversation row without messages */
	CHECK(save(s, b) == 4 && save(s, a) == 3 && save(s, e) == 0);
	CHECK(store_load_open(s, collect_cb, &k) == 0);
	CHECK(k.n == 3 && k.messages == 7);
	CHECK_STR(k.ids[0], "alpha");
	CHECK_STR(k.ids[1], "beta");
	CHECK_STR(k.ids[2], "empty");
	/* Passed over: asked about every open row, reads the others only. */
	memset(&k, 0, sizeof(k));
	k.skip_id = "beta";
	CHECK(store_load_open_except(s, skip_cb, collect_cb, &k) == 0);
	CHECK(k.asked == 3 && k.n == 2 && k.messages == 3);
	CHECK_STR(k.ids[0], "alpha");
	CHECK_STR(k.ids[1], "empty");

	CHECK(store_set_closed(s, "beta", 4, T0) == -EINVAL); /* outside a transaction */
	CHECK(store_begin(s) == 0);
	CHECK(store_set_closed(s, "beta", 4, T0) == 0);
	CHECK(store_set_closed(s, "nobody", 6, T0) == 0);
	CHECK(store_commit(s) == 0);
	memset(&k, 0, sizeof(k));
	CHECK(store_load_open(s, collect_cb, &k) == 0);
	CHECK(k.n == 2 && k.messages == 3);
	CHECK_STR(k.ids[0], "alpha");
	CHECK_STR(k.ids[1], "empty");
	/* A closed conversation still loads on demand. */
	CHECK(store_load_conversation(s, "beta", 4, &l) == 0);
	CHECK_SAME(b, l);
	convo_free(l);
	l = NULL;
	CHECK(store_load_conversation(s, "empty", 5, &l) == 0 && l && l->nlog == 0);
	convo_free(l);

	/* fn stops the walk. */
	memset(&k, 0, sizeof(k));
	k.stop_after = 1;
	CHECK(store_load_open(s, collect_cb, &k) == -ECANCELED && k.n == 1);

	/* Writing the conversation again opens it. */
	CHECK(store_begin(s) == 0 && store_put_conversation(s, b) == 0 && store_commit(s) == 0);
	memset(&k, 0, sizeof(k));
	CHECK(store_load_open(s, collect_cb, &k) == 0 && k.n == 3);
	store_close(s);
	convo_free(a);
	convo_free(b);
	convo_free(e);
}

struct spool_row {
	char conv[32];
	size_t conv_len;
	char sk[DDBITEM_SK_MAX + 1];
	uint32_t version;
	int64_t enqueued;
};

struct spool_list {
	struct spool_row rows[16];
	int64_t seq[16];
	size_t n;
	int stop_with; /* what spool_cb answers after each row (0: go on) */
};

static int spool_cb(void *arg, int64_t seq, const char *conv, size_t conv_len, const char *sk,
                    uint32_t version, int64_t enqueued_ms)
{
	struct spool_list *l = arg;
	if (l->n < 16 && conv_len < sizeof(l->rows[0].conv)) {
		l->seq[l->n] = seq;
		struct spool_row *r = &l->rows[l->n];
		memcpy(r->conv, conv, conv_len);
		r->conv_len = conv_len;
		snprintf(r->sk, sizeof(r->sk), "%s", sk);
		r->version = version;
		r->enqueued = enqueued_ms;
	}
	l->n++;
	return l->stop_with;
}

/* The spool read in slices of one row (what sink_resync does by time): each call goes on
 * after the row the last one stopped at. */
static void check_spool_slices(struct store *s, const struct spool_list *whole)
{
	struct spool_list one = {.n = 0, .stop_with = 1};
	int64_t after = 0;

	for (size_t i = 0; i < whole->n; i++) {
		one.n = 0;
		CHECK(store_spool_each(s, after, spool_cb, &one) == 1);
		CHECK(one.n == 1 && one.seq[0] > after && one.seq[0] == whole->seq[i]);
		CHECK_STR(one.rows[0].sk, whole->rows[i].sk);
		after = one.seq[0];
	}
	one.n = 0;
	CHECK(store_spool_each(s, after, spool_cb, &one) == 0 && one.n == 0);
	/* A negative answer stops the read and is what it returns. */
	one.stop_with = -ENOMEM;
	CHECK(store_spool_each(s, 0, spool_cb, &one) == -ENOMEM && one.n == 1);
	/* The bytes counted in slices of 1 and 2 rows add up to the whole count. */
	for (size_t step = 1; step <= 2; step++) {
		uint64_t items = 0, want = 0, sum = 0, bytes = 0;
		int64_t oldest = 0, last = -1;
		size_t rows = 0, slices = 0, total = 0;
		CHECK(store_spool_stats(s, &items, &want, &oldest) == 0 && items == whole->n);
		after = 0;
		do {
			CHECK(store_spool_bytes(s, after, step, &rows, &bytes, &last) == 0);
			CHECK(rows <= step && (rows ? last > after : last == after));
			sum += bytes;
			total += rows;
			after = last;
			slices++;
		} while (rows == step && slices < 10);
		CHECK(sum == want && total == whole->n);
		CHECK(slices == whole->n / step + 1);
	}
}

static struct spool_list spool_rows(struct store *s)
{
	struct spool_list l = {.n = 0};
	CHECK(store_spool_each(s, 0, spool_cb, &l) == 0);
	return l;
}

/* The confirmed version, read with SQLite directly; -1 when there is none. */
static int64_t confirmed_of(const char *dir, const char *conv, size_t conv_len, const char *sk)
{
	char path[160];
	sqlite3 *db = NULL;
	sqlite3_stmt *st = NULL;
	int64_t v = -1;
	snprintf(path, sizeof(path), "%s/convod.db", dir);
	if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL) == SQLITE_OK &&
	    sqlite3_prepare_v2(db,
	                       "SELECT version FROM confirmed WHERE conversation = ? AND sk = ?",
	                       -1, &st, NULL) == SQLITE_OK) {
		sqlite3_bind_blob(st, 1, conv, (int)conv_len, SQLITE_STATIC);
		sqlite3_bind_text(st, 2, sk, -1, SQLITE_STATIC);
		if (sqlite3_step(st) == SQLITE_ROW)
			v = sqlite3_column_int64(st, 0);
	}
	sqlite3_finalize(st);
	sqlite3_close(db);
	return v;
}

static size_t map_bytes(const struct message *m)
{
	json_t *map = message_to_map(m);
	char *t = map ? json_dumps(map, JSON_COMPACT) : NULL;
	size_t n = t ? strlen(t) : 0;
	free(t);
	json_decref(map);
	return n;
}

/* The spool row of conversation conv (a one-letter id here): its version, 0 if none. */
static uint32_t spooled_version(const struct spool_list *l, const char *conv)
{
	uint32_t v = 0;
	for (size_t i = 0; i < l->n && i < 16; i++)
		if (l->rows[i].conv_len == 1 && l->rows[i].conv[0] == conv[0])
			v = v ? UINT32_MAX : l->rows[i].version; /* two rows: not one */
	return v;
}

static void dead_letter_of(struct store *s, const char *conv, uint32_t version, int64_t at)
{
	CHECK(store_begin(s) == 0);
	CHECK(store_dead_letter(s, conv, 1, "01ARZ3NDEKTSV4RRFFQ69G5FB0", version, NULL, "E", at) ==
	      0);
	CHECK(store_commit(s) == 0);
}

/* retry_dead_letters' move in parts (store_dead_letters_retry_part): parts of 2 dead letters,
 * oldest first, each a transaction of its own; a message whose dead letters fall on both
 * sides of a part's end gets one spool row at the higher version; one made after the move
 * started (past its upto) is left for the next retry. s holds no dead letters. */
static void check_retry_parts(struct store *s)
{
	struct spool_list l = {.n = 0};
	size_t n, before = spool_rows(s).n;
	int64_t upto = -1, first_upto;
	bool more;
	json_t *dl;

	dead_letter_of(s, "a", 1, T0 + 90);
	dead_letter_of(s, "b", 1, T0 + 91);
	dead_letter_of(s, "a", 2, T0 + 92);
	dead_letter_of(s, "c", 1, T0 + 93);
	dead_letter_of(s, "d", 1, T0 + 94);
	CHECK(store_begin(s) == 0);
	CHECK(store_dead_letters_retry_part(s, T0 + 95, &upto, 2, &n, &more) == -EINVAL);
	CHECK(n == 0 && !more && upto == -1);
	store_rollback(s);

	CHECK(store_dead_letters_retry_part(s, T0 + 95, &upto, 2, &n, &more) == 0);
	CHECK(n == 2 && more && upto > 0);
	first_upto = upto;
	l = spool_rows(s);
	CHECK(l.n == before + 2 && spooled_version(&l, "a") == 1 && spooled_version(&l, "b") == 1);
	CHECK(spooled_version(&l, "c") == 0);
	dead_letter_of(s, "e", 1, T0 + 96); /* after the move started */

	CHECK(store_dead_letters_retry_part(s, T0 + 97, &upto, 2, &n, &more) == 0);
	CHECK(n == 2 && more && upto == first_upto);
	l = spool_rows(s);
	CHECK(l.n == before + 3 && spooled_version(&l, "a") == 2 && spooled_version(&l, "c") == 1);

	CHECK(store_dead_letters_retry_part(s, T0 + 98, &upto, 2, &n, &more) == 0);
	CHECK(n == 1 && !more);
	CHECK(store_dead_letters_retry_part(s, T0 + 98, &upto, 2, &n, &more) == 0);
	CHECK(n == 0 && !more);
	l = spool_rows(s);
	CHECK(l.n == before + 4 && spooled_version(&l, "d") == 1 && spooled_version(&l, "e") == 0);
	CHECK(store_dead_letters(s, 10, &dl) == 0 && json_array_size(dl) == 1);
	CHECK_STR(json_string_value(json_object_get(json_array_get(dl, 0), "conversation")), "e");
	json_decref(dl);

	/* A part as large as what is left ends the move exactly: nothing more. */
	upto = -1;
	CHECK(store_dead_letters_retry_part(s, T0 + 99, &upto, 1, &n, &more) == 0);
	CHECK(n == 1 && !more && upto > first_upto);
	l = spool_rows(s);
	CHECK(l.n == before + 5 && spooled_version(&l, "e") == 1);
	CHECK(store_dead_letters(s, 10, &dl) == 0 && json_array_size(dl) == 0);
	json_decref(dl);
	/* Nothing to move: upto becomes 0 and nothing is left. */
	upto = -1;
	CHECK(store_dead_letters_retry_part(s, T0 + 100, &upto, 2, &n, &more) == 0);
	CHECK(n == 0 && !more && upto == 0);
}

static void test_spool(void)
{
	char dir[128], sk0[DDBITEM_SK_MAX + 1], sk2[DDBITEM_SK_MAX + 1];
	struct convo_env env;
	struct convo *c;
	struct store *s;
	struct spool_list l;
	uint64_t items = 99, bytes = 99;
	int64_t oldest = 99;
	json_t *dl = NULL;
	size_t n = 0;

	env_init(&env, T0);
	make_dir(dir, sizeof(dir), "spool");
	if (!(s = open_store(dir)))
		return;
	CHECK((c = sample(&env)) != NULL);
	if (!c) {
		store_close(s);
		return;
	}
	CHECK(save(s, c) == 9);
	sort_key_of(c->log[0], sk0); /* version 2 */
	sort_key_of(c->log[2], sk2); /* the first summary */
	CHECK(store_spool_stats(s, &items, &bytes, &oldest) == 0);
	CHECK(items == 0 && bytes == 0 && oldest == 0);
	CHECK(store_spool_put(s, conv_id, CONV_ID_LEN, sk0, 1, 10, T0) == -EINVAL);

	CHECK(store_begin(s) == 0);
	CHECK(store_spool_put(s, conv_id, CONV_ID_LEN, sk0, 2, map_bytes(c->log[0]), T0 + 10) == 0);
	CHECK(store_spool_put(s, conv_id, CONV_ID_LEN, sk2, 1, map_bytes(c->log[2]), T0 + 20) == 0);
	CHECK(store_spool_put(s, conv_id, CONV_ID_LEN, sk0, 1, 7, T0 + 30) == 0); /* older */
	CHECK(store_spool_put(s, "other", 5, "01ARZ3NDEKTSV4RRFFQ69G5FAV", 3, 0, T0 + 40) == 0);
	CHECK(store_commit(s) == 0);
	l = spool_rows(s);
	CHECK(l.n == 3);
	CHECK(l.rows[0].conv_len == CONV_ID_LEN &&
	      memcmp(l.rows[0].conv, conv_id, CONV_ID_LEN) == 0);
	CHECK_STR(l.rows[0].sk, sk0);
	CHECK(l.rows[0].version == 2 && l.rows[0].enqueued == T0 + 10);
	CHECK_STR(l.rows[1].sk, sk2);
	CHECK(l.rows[1].version == 1 && l.rows[1].enqueued == T0 + 20);
	CHECK(l.rows[2].conv_len == 5 && memcmp(l.rows[2].conv, "other", 5) == 0);
	/* Bytes count the stored maps; the row of "other" has none. */
	CHECK(store_spool_stats(s, &items, &bytes, &oldest) == 0);
	CHECK(items == 3 && oldest == T0 + 10);
	CHECK(bytes == map_bytes(c->log[0]) + map_bytes(c->log[2]));

	/* A newer version raises the row; done with an older version keeps it. */
	CHECK(store_begin(s) == 0);
	CHECK(store_spool_put(s, conv_id, CONV_ID_LEN, sk0, 3, map_bytes(c->log[0]), T0 + 50) == 0);
	CHECK(store_spool_done(s, conv_id, CONV_ID_LEN, sk0, 2) == 0);
	CHECK(store_commit(s) == 0);
	l = spool_rows(s);
	CHECK(l.n == 3 && l.rows[0].version == 3 && l.rows[0].enqueued == T0 + 10);
	CHECK(confirmed_of(dir, conv_id, CONV_ID_LEN, sk0) == 2);
	CHECK(store_begin(s) == 0);
	CHECK(store_spool_done(s, conv_id, CONV_ID_LEN, sk0, 3) == 0);
	CHECK(store_spool_done(s, conv_id, CONV_ID_LEN, sk0, 1) == 0); /* late, older */
	CHECK(store_commit(s) == 0);
	l = spool_rows(s);
	CHECK(l.n == 2);
	CHECK_STR(l.rows[0].sk, sk2);
	CHECK(confirmed_of(dir, conv_id, CONV_ID_LEN, sk0) == 3);
	CHECK(store_spool_stats(s, &items, &bytes, &oldest) == 0);
	CHECK(items == 2 && oldest == T0 + 20 && bytes == map_bytes(c->log[2]));

	/* Dead letters: the row moves with the item and the error. */
	CHECK(store_begin(s) == 0);
	CHECK(store_dead_letter(s, conv_id, CONV_ID_LEN, sk2, 1, "{\"item\":1}",
	                        "ValidationException: too big", T0 + 60) == 0);
	CHECK(store_spool_put(s, "other", 5, "01ARZ3NDEKTSV4RRFFQ69G5FAV", 4, 0, T0 + 61) == 0);
	/* refused version 3 while 4 waits: the row stays */
	CHECK(store_dead_letter(s, "other", 5, "01ARZ3NDEKTSV4RRFFQ69G5FAV", 3, NULL, "E2",
	                        T0 + 62) == 0);
	CHECK(store_spool_put(s, conv_id, CONV_ID_LEN, sk0, 4, 1, T0 + 63) == 0);
	CHECK(store_dead_letter(s, conv_id, CONV_ID_LEN, sk0, 4, NULL, "E3", T0 + 64) == 0);
	CHECK(store_commit(s) == 0);
	l = spool_rows(s);
	CHECK(l.n == 1 && l.rows[0].conv_len == 5 && l.rows[0].version == 4);
	CHECK(store_dead_letters(s, 10, &dl) == 0);
	CHECK(json_array_size(dl) == 3);
	{
		json_t *d0 = json_array_get(dl, 0);
		json_t *cv = json_object_get(d0, "conversation");
		CHECK(json_string_length(cv) == CONV_ID_LEN &&
		      memcmp(json_string_value(cv), conv_id, CONV_ID_LEN) == 0);
		CHECK_STR(json_string_value(json_object_get(d0, "sk")), sk2);
		CHECK(json_integer_value(json_object_get(d0, "version")) == 1);
		CHECK_STR(json_string_value(json_object_get(d0, "error")),
		          "ValidationException: too big");
		CHECK(json_integer_value(json_object_get(d0, "at")) == T0 + 60);
		CHECK_STR(json_string_value(json_object_get(json_array_get(dl, 2), "error")), "E3");
	}
	json_decref(dl);
	CHECK(store_dead_letters(s, 2, &dl) == 0); /* the newest two, oldest first */
	CHECK(json_array_size(dl) == 2);
	CHECK_STR(json_string_value(json_object_get(json_array_get(dl, 0), "error")), "E2");
	CHECK_STR(json_string_value(json_object_get(json_array_get(dl, 1), "error")), "E3");
	json_decref(dl);

	/* Retry, outside a transaction: everything back in the spool, one row per message. */
	CHECK(store_dead_letters_retry(s, T0 + 70, &n) == 0 && n == 3);
	l = spool_rows(s);
	CHECK(l.n == 3);
	CHECK(l.rows[0].conv_len == 5 && l.rows[0].version == 4 && l.rows[0].enqueued == T0 + 40);
	CHECK_STR(l.rows[1].sk, sk2);
	CHECK(l.rows[1].version == 1 && l.rows[1].enqueued == T0 + 70);
	CHECK_STR(l.rows[2].sk, sk0);
	CHECK(l.rows[2].version == 4);
	check_spool_slices(s, &l);
	/* A row spooled after a read stopped is found by the next slice; gone, it is not. */
	{
		struct spool_list one = {.n = 0, .stop_with = 0};
		CHECK(store_begin(s) == 0);
		CHECK(store_spool_put(s, "late", 4, "01ARZ3NDEKTSV4RRFFQ69G5FAW", 1, 0, T0 + 71) ==
		      0);
		CHECK(store_commit(s) == 0);
		CHECK(store_spool_each(s, l.seq[2], spool_cb, &one) == 0 && one.n == 1);
		CHECK(one.seq[0] > l.seq[2] && one.rows[0].conv_len == 4);
		CHECK(store_begin(s) == 0);
		CHECK(store_spool_done(s, "late", 4, "01ARZ3NDEKTSV4RRFFQ69G5FAW", 1) == 0);
		CHECK(store_commit(s) == 0);
		one.n = 0;
		CHECK(store_spool_each(s, l.seq[2], spool_cb, &one) == 0 && one.n == 0);
	}
	CHECK(store_dead_letters(s, 10, &dl) == 0 && json_array_size(dl) == 0);
	json_decref(dl);
	/* never inside a transaction; a rolled back dead letter is not there to retry */
	CHECK(store_begin(s) == 0);
	CHECK(store_dead_letter(s, conv_id, CONV_ID_LEN, sk2, 1, NULL, "E4", T0 + 80) == 0);
	CHECK(store_dead_letters_retry(s, T0 + 81, &n) == -EINVAL && n == 0);
	store_rollback(s);
	CHECK(store_dead_letters_retry(s, T0 + 82, &n) == 0 && n == 0);
	CHECK(spool_rows(s).n == 3);
	check_retry_parts(s);
	store_close(s);

	/* The spool survives a restart (the 3 rows above, then the 5 of check_retry_parts). */
	if ((s = open_store(dir))) {
		l = spool_rows(s);
		CHECK(l.n == 8 && l.rows[2].version == 4 && spooled_version(&l, "a") == 2);
		store_close(s);
	}
	convo_free(c);
}

static int sql(const char *dir, const char *statements);
static int64_t query_int(const char *dir, const char *q);

/* seen[CONSUMER_SINK] after a load: taken only when confirmed, spooled or dead-lettered at
 * that version. */
struct repair_rows {
	size_t n;
	char conv[4][16], sk[4][DDBITEM_SK_MAX + 1];
	uint32_t version[4];
	int64_t due[4];
};

static int repair_cb(void *arg, const char *conv, size_t conv_len, const char *sk, uint32_t version,
                     int64_t due_ms)
{
	struct repair_rows *r = arg;
	if (r->n == 4 || conv_len >= sizeof(r->conv[0]))
		return -ERANGE;
	memcpy(r->conv[r->n], conv, conv_len);
	r->conv[r->n][conv_len] = '\0';
	snprintf(r->sk[r->n], sizeof(r->sk[0]), "%s", sk);
	r->version[r->n] = version;
	r->due[r->n++] = due_ms;
	return 0;
}

/* The repairs table: rows written in a transaction (none before its commit), read by due
 * time, one per (conversation, message, version), deleted one by one; they survive a
 * reopen. */
static void test_repairs(void)
{
	const char *a = "01ARZ3NDEKTSV4RRFFQ69G5FAV", *b = "01ARZ3NDEKTSV4RRFFQ69G5FAW";
	struct repair_rows r = {0};
	char dir[128];
	struct store *s;

	make_dir(dir, sizeof(dir), "repairs");
	if (!(s = open_store(dir)))
		return;
	CHECK(store_repair_put(s, "c1", 2, a, 1, T0) == -EINVAL); /* no transaction */
	CHECK(store_begin(s) == 0);
	CHECK(store_repair_put(s, "c1", 2, a, 1, T0 + 300) == 0);
	CHECK(store_repair_put(s, "c1", 2, a, 2, T0 + 100) == 0);
	CHECK(store_repair_put(s, "c2", 2, b, 1, T0 + 200) == 0);
	CHECK(store_repair_put(s, "c2", 2, b, 1, T0 + 250) == 0); /* the same: its due moves */
	CHECK(store_repair_each(s, repair_cb, &r) == 0 && r.n == 0);
	CHECK(store_commit(s) == 0);
	CHECK(store_repair_each(s, repair_cb, &r) == 0 && r.n == 3);
	CHECK(strcmp(r.conv[0], "c1") == 0 && strcmp(r.sk[0], a) == 0 && r.version[0] == 2 &&
	      r.due[0] == T0 + 100);
	CHECK(strcmp(r.conv[1], "c2") == 0 && strcmp(r.sk[1], b) == 0 && r.version[1] == 1 &&
	      r.due[1] == T0 + 250);
	CHECK(strcmp(r.conv[2], "c1") == 0 && r.version[2] == 1 && r.due[2] == T0 + 300);
	CHECK(store_begin(s) == 0);
	CHECK(store_repair_done(s, "c1", 2, a, 2) == 0);
	CHECK(store_repair_done(s, "c1", 2, b, 1) == 0); /* no such row: nothing */
	CHECK(store_commit(s) == 0);
	store_close(s);
	if (!(s = open_store(dir)))
		return;
	memset(&r, 0, sizeof(r));
	CHECK(store_repair_each(s, repair_cb, &r) == 0 && r.n == 2);
	CHECK(strcmp(r.conv[0], "c2") == 0 && strcmp(r.conv[1], "c1") == 0 && r.version[1] == 1);
	CHECK(store_begin(s) == 0);
	CHECK(store_repair_done(s, "c2", 2, b, 1) == 0);
	CHECK(store_repair_done(s, "c1", 2, a, 1) == 0);
	CHECK(store_commit(s) == 0);
	memset(&r, 0, sizeof(r));
	CHECK(store_repair_each(s, repair_cb, &r) == 0 && r.n == 0);
	store_close(s);
}

static void test_sink_seen(void)
{
	char dir[128], sk0[DDBITEM_SK_MAX + 1], sk1[DDBITEM_SK_MAX + 1], sk2[DDBITEM_SK_MAX + 1],
	    sk3[DDBITEM_SK_MAX + 1];
	struct convo_env env;
	struct convo *c, *l = NULL;
	struct store *s;

	env_init(&env, T0);
	make_dir(dir, sizeof(dir), "sinkseen");
	if (!(s = open_store(dir)))
		return;
	CHECK((c = sample(&env)) != NULL);
	if (!c) {
		store_close(s);
		return;
	}
	CHECK(save(s, c) > 0);
	CHECK(c->log[0]->version >= 2);
	sort_key_of(c->log[0], sk0);
	sort_key_of(c->log[1], sk1);
	sort_key_of(c->log[2], sk2);
	CHECK(store_begin(s) == 0);
	/* An older version spooled: the current one is still to take. */
	CHECK(store_spool_put(s, conv_id, CONV_ID_LEN, sk0, c->log[0]->version - 1, 1, T0) == 0);
	/* Confirmed at its version. */
	CHECK(store_spool_put(s, conv_id, CONV_ID_LEN, sk1, c->log[1]->version, 1, T0) == 0);
	CHECK(store_spool_done(s, conv_id, CONV_ID_LEN, sk1, c->log[1]->version) == 0);
	/* Spooled at its version. */
	CHECK(store_spool_put(s, conv_id, CONV_ID_LEN, sk2, c->log[2]->version, 1, T0) == 0);
	/* Dead-lettered at its version: it waits for retry_dead_letters, not for a flush. */
	CHECK(c->nlog > 3);
	sort_key_of(c->log[3], sk3);
	CHECK(store_spool_put(s, conv_id, CONV_ID_LEN, sk3, c->log[3]->version, 1, T0) == 0);
	CHECK(store_dead_letter(s, conv_id, CONV_ID_LEN, sk3, c->log[3]->version, NULL, "E", T0) ==
	      0);
	CHECK(store_commit(s) == 0);
	CHECK(spool_rows(s).n == 2);
	CHECK(store_load_conversation(s, conv_id, CONV_ID_LEN, &l) == 0);
	if (l) {
		CHECK(l->nlog == c->nlog);
		CHECK(l->log[0]->seen[CONSUMER_SINK] == c->log[0]->version - 1);
		CHECK(l->log[1]->seen[CONSUMER_SINK] == c->log[1]->version);
		CHECK(l->log[2]->seen[CONSUMER_SINK] == c->log[2]->version);
		CHECK(l->log[3]->seen[CONSUMER_SINK] == c->log[3]->version);
		for (size_t i = 4; i < l->nlog; i++)
			CHECK(l->log[i]->seen[CONSUMER_SINK] == 0);
	}
	convo_free(l);
	l = NULL;
	store_close(s);
	/* A store of schema 5 (no index of the dead letters) is upgraded, and reads the same. */
	CHECK(sql(dir, "DROP INDEX dead_letters_by_message; DROP TABLE repairs;"
	               " PRAGMA user_version=5") == SQLITE_OK);
	capture_begin();
	s = open_store(dir);
	{
		char *log = capture_end();
		CHECK(log && strstr(log, "upgraded from schema 5 to 7"));
		free(log);
	}
	if (!s) {
		convo_free(c);
		return;
	}
	CHECK(query_int(dir, "SELECT count(*) FROM sqlite_schema"
	                     " WHERE name = 'dead_letters_by_message'") == 1);
	CHECK(store_load_conversation(s, conv_id, CONV_ID_LEN, &l) == 0);
	if (l) {
		CHECK(l->log[3]->seen[CONSUMER_SINK] == c->log[3]->version);
		CHECK(l->log[4]->seen[CONSUMER_SINK] == 0);
	}
	convo_free(l);
	convo_free(c);
	store_close(s);
}

static void test_purge(void)
{
	char dir[128];
	struct convo_env env;
	struct convo *c[4], *l = NULL;
	const char *names[4] = {"p-old", "p-spooled", "p-recent", "p-open"};
	struct store *s;
	json_t *map = NULL;
	uint32_t v;
	int64_t u;
	size_t removed = 9;

	env_init(&env, T0);
	make_dir(dir, sizeof(dir), "purge");
	if (!(s = open_store(dir)))
		return;
	for (int i = 0; i < 4; i++) {
		c[i] = small(&env, names[i], 2);
		CHECK(save(s, c[i]) == 2);
	}
	CHECK(store_begin(s) == 0);
	CHECK(store_set_closed(s, "p-old", 5, 100) == 0);
	CHECK(store_set_closed(s, "p-spooled", 9, 100) == 0);
	CHECK(store_spool_put(s, "p-spooled", 9, c[1]->log[1]->id, 1, 1, T0) == 0);
	CHECK(store_set_closed(s, "p-recent", 8, 300) == 0);
	CHECK(store_commit(s) == 0);
	CHECK(store_purge_closed(s, 200, &removed) == 0 && removed == 1);
	CHECK(store_load_conversation(s, "p-old", 5, &l) == -ENOENT);
	CHECK(store_message_get(s, "p-old", 5, c[0]->log[0]->id, &map, &v, &u) == -ENOENT);
	for (int i = 1; i < 4; i++) {
		CHECK(store_load_conversation(s, names[i], strlen(names[i]), &l) == 0);
		CHECK_SAME(c[i], l);
		convo_free(l);
		l = NULL;
	}
	/* Once its spool row is done, the second one goes too; never inside a transaction. */
	CHECK(store_begin(s) == 0);
	CHECK(store_spool_done(s, "p-spooled", 9, c[1]->log[1]->id, 1) == 0);
	CHECK(store_purge_closed(s, 200, &removed) == -EINVAL && removed == 0);
	CHECK(store_commit(s) == 0);
	CHECK(store_purge_closed(s, 200, &removed) == 0 && removed == 1);
	CHECK(store_load_conversation(s, "p-spooled", 9, &l) == -ENOENT);
	CHECK(store_purge_closed(s, 200, &removed) == 0 && removed == 0);
	CHECK(store_purge_closed(s, 301, &removed) == 0 && removed == 1);
	CHECK(store_load_conversation(s, "p-open", 6, &l) == 0 && l && l->nlog == 2);
	convo_free(l);
	store_close(s);
	for (int i = 0; i < 4; i++)
		convo_free(c[i]);
}

static void test_transactions(void)
{
	char dir[128];
	struct convo_env env;
	struct convo *c, *l = NULL;
	struct store *s;
	uint64_t items, bytes;
	int64_t oldest;

	env_init(&env, T0);
	make_dir(dir, sizeof(dir), "txn");
	if (!(s = open_store(dir)))
		return;
	c = small(&env, "rolled", 3);
	CHECK(store_commit(s) == -EINVAL);
	store_rollback(s); /* no-op */
	CHECK(store_put_conversation(s, c) == -EINVAL);
	CHECK(store_put_message(s, "rolled", 6, c->log[0]) == -EINVAL);
	CHECK(store_spool_done(s, "rolled", 6, c->log[0]->id, 1) == -EINVAL);
	CHECK(store_dead_letter(s, "rolled", 6, c->log[0]->id, 1, NULL, "x", T0) == -EINVAL);
	CHECK(store_begin(s) == 0);
	CHECK(store_begin(s) == -EINVAL);
	CHECK(put_pending(s, c) == 3);
	CHECK(store_spool_put(s, "rolled", 6, c->log[0]->id, 1, 1, T0) == 0);
	/* Reads see what is committed: nothing of the open transaction. */
	CHECK(store_load_conversation(s, "rolled", 6, &l) == -ENOENT && !l);
	store_rollback(s);
	CHECK(store_load_conversation(s, "rolled", 6, &l) == -ENOENT && !l);
	CHECK(store_spool_stats(s, &items, &bytes, &oldest) == 0 && items == 0);
	/* A transaction can follow the rollback. */
	forget_store(c);
	CHECK(save(s, c) == 3);
	/* Closing with a transaction open rolls it back. */
	CHECK(store_begin(s) == 0);
	CHECK(store_set_closed(s, "rolled", 6, T0) == 0);
	store_close(s);
	if ((s = open_store(dir))) {
		struct collect k = {.n = 0};
		CHECK(store_load_open(s, collect_cb, &k) == 0 && k.n == 1 && k.messages == 3);
		store_close(s);
	}
	convo_free(c);
}

static void write_file(const char *path, long offset, const void *data, size_t len)
{
	int fd = open(path, O_WRONLY | O_CREAT, 0600);
	CHECK(fd >= 0);
	if (fd < 0)
		return;
	CHECK(pwrite(fd, data, len, offset) == (ssize_t)len);
	close(fd);
}

static int sql(const char *dir, const char *statements)
{
	char path[160];
	sqlite3 *db = NULL;
	int rc;
	snprintf(path, sizeof(path), "%s/convod.db", dir);
	rc = sqlite3_open(path, &db);
	if (rc == SQLITE_OK)
		rc = sqlite3_exec(db, statements, NULL, NULL, NULL);
	sqlite3_close(db);
	return rc;
}

/* store_open fails with rc and a message naming the file and containing what. */
static void check_open_fails(const char *dir, int rc, const char *what, int line)
{
	struct store *s = NULL;
	char err[256] = "untouched";
	int got = store_open(dir, DURABILITY_MACHINE, &s, err, sizeof(err));
	test_checks++;
	if (got != rc || s || !strstr(err, what) || !strstr(err, dir)) {
		test_failures++;
		fprintf(stderr, "%s:%d: store_open %s: %d \"%s\", expected %d and \"%s\"\n",
		        __FILE__, line, dir, got, err, rc, what);
	} else {
		printf("  store_open refused as expected: %s\n", err);
	}
	store_close(s);
}
#define CHECK_OPEN_FAILS(dir, rc, what) check_open_fails((dir), (rc), (what), __LINE__)

static void test_bad_files(void)
{
	char dir[128], path[160], garbage[16384];
	struct convo_env env;
	struct convo *c;
	struct store *s;

	for (size_t i = 0; i < sizeof(garbage); i++)
		garbage[i] = (char)(i * 31 + 7);
	env_init(&env, T0);

	make_dir(dir, sizeof(dir), "garbage");
	snprintf(path, sizeof(path), "%s/convod.db", dir);
	write_file(path, 0, garbage, sizeof(garbage));
	CHECK_OPEN_FAILS(dir, -EIO, "is not a convod database");

	/* A real database whose pages were overwritten. */
	make_dir(dir, sizeof(dir), "corrupt");
	snprintf(path, sizeof(path), "%s/convod.db", dir);
	if ((s = open_store(dir))) {
		for (int i = 0; i < 20; i++) {
			char id[16];
			snprintf(id, sizeof(id), "c%02d", i);
			c = small(&env, id, 6);
			CHECK(save(s, c) == 6);
			convo_free(c);
		}
		store_close(s);
	}
	write_file(path, 4096, garbage, sizeof(garbage));
	CHECK_OPEN_FAILS(dir, -EIO, "is not a convod database");

	make_dir(dir, sizeof(dir), "foreign");
	CHECK(sql(dir, "CREATE TABLE t(x); INSERT INTO t VALUES(1)") == SQLITE_OK);
	CHECK_OPEN_FAILS(dir, -EIO, "other tables");
	make_dir(dir, sizeof(dir), "foreign-app");
	CHECK(sql(dir, "PRAGMA application_id=42") == SQLITE_OK);
	CHECK_OPEN_FAILS(dir, -EIO, "another application");

	make_dir(dir, sizeof(dir), "newer");
	if ((s = open_store(dir)))
		store_close(s);
	CHECK(sql(dir, "PRAGMA user_version=99") == SQLITE_OK);
	CHECK_OPEN_FAILS(dir, -EIO, "newer convod");

	snprintf(dir, sizeof(dir), "%s/missing", root);
	CHECK_OPEN_FAILS(dir, -ENOENT, "state directory");
	snprintf(dir, sizeof(dir), "%s/garbage/convod.db", root);
	CHECK_OPEN_FAILS(dir, -ENOTDIR, "not a directory");
}

/* The first column of the first row of query q, read with SQLite directly; -1 on failure. */
static int64_t query_int(const char *dir, const char *q)
{
	char path[160];
	sqlite3 *db = NULL;
	sqlite3_stmt *st = NULL;
	int64_t n = -1;
	snprintf(path, sizeof(path), "%s/convod.db", dir);
	if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL) == SQLITE_OK &&
	    sqlite3_prepare_v2(db, q, -1, &st, NULL) == SQLITE_OK && sqlite3_step(st) == SQLITE_ROW)
		n = sqlite3_column_int64(st, 0);
	sqlite3_finalize(st);
	sqlite3_close(db);
	return n;
}

/* How many rows a table holds, read with SQLite directly; -1 on failure. */
static int64_t count_rows(const char *dir, const char *table)
{
	char q[64];
	snprintf(q, sizeof(q), "SELECT count(*) FROM %s", table);
	return query_int(dir, q);
}

/* Rows in the journal's two tables. */
static int64_t count_batches(const char *dir)
{
	return query_int(dir, "SELECT (SELECT count(*) FROM batches) +"
	                      " (SELECT count(*) FROM batches1)");
}

/* Copies from/name to to/name. 0 or -1. */
static int copy_file(const char *from, const char *to, const char *name)
{
	char a[192], b[192], chunk[65536];
	size_t n;
	int rc = 0;
	snprintf(a, sizeof(a), "%s/%s", from, name);
	snprintf(b, sizeof(b), "%s/%s", to, name);
	FILE *in = fopen(a, "rb"), *out = fopen(b, "wb");
	if (!in || !out)
		rc = -1;
	while (!rc && (n = fread(chunk, 1, sizeof(chunk), in)) > 0)
		if (fwrite(chunk, 1, n, out) != n)
			rc = -1;
	if (in && ferror(in))
		rc = -1;
	if (in)
		fclose(in);
	if (out && fclose(out) != 0)
		rc = -1;
	return rc;
}

/* Rows of segments that name conversation conv; -1 on failure. */
static int64_t segments_of(const char *dir, const char *conv)
{
	char path[160];
	sqlite3 *db = NULL;
	sqlite3_stmt *st = NULL;
	int64_t n = -1;
	snprintf(path, sizeof(path), "%s/convod.db", dir);
	if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL) == SQLITE_OK &&
	    sqlite3_prepare_v2(db, "SELECT count(*) FROM segments WHERE conversation = ?", -1, &st,
	                       NULL) == SQLITE_OK) {
		sqlite3_bind_blob(st, 1, conv, (int)strlen(conv), SQLITE_STATIC);
		if (sqlite3_step(st) == SQLITE_ROW)
			n = sqlite3_column_int64(st, 0);
	}
	sqlite3_finalize(st);
	sqlite3_close(db);
	return n;
}

static uint32_t loaded_version(struct store *s, const char *conv, size_t i)
{
	struct convo *l = NULL;
	uint32_t v = 0;
	if (store_load_conversation(s, conv, strlen(conv), &l) == 0 && l && i < l->nlog)
		v = l->log[i]->version;
	convo_free(l);
	return v;
}

/* The schema of convod before 3 (2 has the journal; 1 had none). */
static const char schema2_sql[] =
    "CREATE TABLE conversations(id BLOB PRIMARY KEY NOT NULL, updated INTEGER NOT NULL,"
    " closed INTEGER NOT NULL DEFAULT 0) WITHOUT ROWID;"
    "CREATE TABLE messages(conversation BLOB NOT NULL, sk TEXT NOT NULL,"
    " version INTEGER NOT NULL, updated INTEGER NOT NULL, client_seen INTEGER NOT NULL,"
    " confirmed INTEGER NOT NULL DEFAULT 0, map_bytes INTEGER NOT NULL, map TEXT NOT NULL,"
    " PRIMARY KEY(conversation, sk));"
    "CREATE TABLE journal(seq INTEGER PRIMARY KEY, conversation BLOB NOT NULL,"
    " sk TEXT NOT NULL, version INTEGER NOT NULL, updated INTEGER NOT NULL,"
    " client_seen INTEGER NOT NULL, map_bytes INTEGER NOT NULL, map TEXT NOT NULL);"
    "CREATE TABLE spool(seq INTEGER PRIMARY KEY, conversation BLOB NOT NULL, sk TEXT NOT NULL,"
    " version INTEGER NOT NULL, enqueued INTEGER NOT NULL, UNIQUE(sk, conversation));"
    "CREATE TABLE dead_letters(seq INTEGER PRIMARY KEY, conversation BLOB NOT NULL,"
    " sk TEXT NOT NULL, version INTEGER NOT NULL, item TEXT, error TEXT NOT NULL,"
    " at INTEGER NOT NULL);"
    "PRAGMA application_id=1668183652;";

/* Writes c as convod wrote it with schema `version` (1 or 2): the messages table, and with
 * 2 the later half of the messages in the journal, message 0 there at its version over an
 * older one in the table. Message 1 is confirmed, message 2 spooled. */
static void write_old_store(const char *dir, const struct convo *c, int version)
{
	char path[160], pragma[64];
	sqlite3 *db = NULL;
	sqlite3_stmt *msg = NULL, *jrn = NULL, *st = NULL;

	snprintf(path, sizeof(path), "%s/convod.db", dir);
	CHECK(sqlite3_open(path, &db) == SQLITE_OK);
	CHECK(sqlite3_exec(db, schema2_sql, NULL, NULL, NULL) == SQLITE_OK);
	if (version == 1)
		CHECK(sqlite3_exec(db, "DROP TABLE journal", NULL, NULL, NULL) == SQLITE_OK);
	snprintf(pragma, sizeof(pragma), "PRAGMA user_version=%d", version);
	CHECK(sqlite3_exec(db, pragma, NULL, NULL, NULL) == SQLITE_OK);
	CHECK(sqlite3_prepare_v2(db, "INSERT INTO conversations VALUES(?, ?, 0)", -1, &st,
	                         NULL) == SQLITE_OK);
	sqlite3_bind_blob(st, 1, c->id, (int)c->id_len, SQLITE_STATIC);
	sqlite3_bind_int64(st, 2, c->updated_ms);
	CHECK(sqlite3_step(st) == SQLITE_DONE);
	sqlite3_finalize(st);
	CHECK(sqlite3_prepare_v2(db,
	                         "INSERT INTO messages(conversation, sk, version, updated,"
	                         " client_seen, confirmed, map_bytes, map)"
	                         " VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
	                         -1, &msg, NULL) == SQLITE_OK);
	if (version == 2)
		CHECK(sqlite3_prepare_v2(db,
		                         "INSERT INTO journal(conversation, sk, version, updated,"
		                         " client_seen, map_bytes, map)"
		                         " VALUES(?1, ?2, ?3, ?4, ?5, ?7, ?8)",
		                         -1, &jrn, NULL) == SQLITE_OK);
	for (size_t i = 0; i < c->nlog; i++) {
		const struct message *m = c->log[i];
		json_t *map = message_to_map(m);
		char *text = json_dumps(map, JSON_COMPACT | JSON_ENCODE_ANY);
		char sk[DDBITEM_SK_MAX + 1];
		sort_key_of(m, sk);
		for (int pass = 0; pass < 2; pass++) {
			/* pass 0: the table (message 0 one version older when the journal
			 * has it); pass 1: the journal */
			bool in_journal = version == 2 && (i >= c->nlog / 2 || i == 0);
			sqlite3_stmt *w = pass ? jrn : msg;
			uint32_t v = m->version;
			if (pass == 1 && !in_journal)
				continue;
			if (pass == 0 && in_journal && i != 0)
				continue;
			if (pass == 0 && in_journal)
				v--;
			sqlite3_bind_blob(w, 1, c->id, (int)c->id_len, SQLITE_STATIC);
			sqlite3_bind_text(w, 2, sk, -1, SQLITE_STATIC);
			sqlite3_bind_int64(w, 3, v);
			sqlite3_bind_int64(w, 4, m->updated_ms);
			sqlite3_bind_int64(w, 5, m->seen[CONSUMER_CLIENT] > v ? v : m->seen[CONSUMER_CLIENT]);
			sqlite3_bind_int64(w, 6, i == 1 ? m->version : 0);
			sqlite3_bind_int64(w, 7, (sqlite3_int64)strlen(text));
			sqlite3_bind_text(w, 8, text, -1, SQLITE_STATIC);
			CHECK(sqlite3_step(w) == SQLITE_DONE);
			sqlite3_reset(w);
		}
		if (i == 2) {
			CHECK(sqlite3_prepare_v2(db, "INSERT INTO spool VALUES(NULL, ?, ?, ?, 5)", -1,
			                         &st, NULL) == SQLITE_OK);
			sqlite3_bind_blob(st, 1, c->id, (int)c->id_len, SQLITE_STATIC);
			sqlite3_bind_text(st, 2, sk, -1, SQLITE_STATIC);
			sqlite3_bind_int64(st, 3, m->version);
			CHECK(sqlite3_step(st) == SQLITE_DONE);
			sqlite3_finalize(st);
		}
		free(text);
		json_decref(map);
	}
	sqlite3_finalize(msg);
	sqlite3_finalize(jrn);
	sqlite3_close(db);
}

/* Message records go to one journal row per commit and stay pending in memory; a fold
 * cycle starts once so many are pending (16384 here, 32768 by default), writes one segment per
 * conversation a few conversations after each commit, and deletes its journal rows at its
 * end. Reads merge segments, pending records and the open transaction's, the newest version
 * of each message winning. close folds everything; a crash leaves journal rows that the
 * next start folds. Schema 1 and 2 files are upgraded. */
static void test_journal(void)
{
	char dir[128], sk[DDBITEM_SK_MAX + 1];
	struct convo_env env;
	struct convo *c, *big, *l = NULL, *old;
	struct collect k;
	struct store *s;
	json_t *map = NULL;
	uint32_t v = 0;
	int64_t u, most = 0, least_after = INT64_MAX;
	uint64_t items, bytes, sum = 0;
	struct store_stats st0, st;
	char crash[128];

	env_init(&env, T0);
	make_dir(dir, sizeof(dir), "journal");
	if (!(s = open_store(dir)))
		return;
	store_set_fold_records(s, 16384);
	c = small(&env, "j", 2);
	CHECK(save(s, c) == 2);
	CHECK(count_batches(dir) == 1 && count_rows(dir, "segments") == 0);
	set_metadata(c, &env, 0, "{\"playStart\":1744815823100}", NULL); /* version 2 */
	CHECK(save(s, c) == 1);
	CHECK(count_batches(dir) == 2);
	/* Pending records merged: the newest version of message 0 wins. */
	CHECK(store_load_conversation(s, "j", 1, &l) == 0 && l);
	CHECK_SAME(c, l);
	convo_free(l);
	l = NULL;
	sort_key_of(c->log[0], sk);
	CHECK(store_message_get(s, "j", 1, sk, &map, &v, &u) == 0 && v == 2);
	json_decref(map);
	/* Reads see what is committed, not the open transaction; a rollback forgets it. */
	set_metadata(c, &env, 0, NULL, "{\"k\":1}"); /* version 3 */
	CHECK(store_begin(s) == 0 && put_pending(s, c) == 1);
	CHECK(loaded_version(s, "j", 0) == 2);
	CHECK(store_message_get(s, "j", 1, sk, &map, &v, &u) == 0 && v == 2);
	json_decref(map);
	store_rollback(s);
	CHECK(loaded_version(s, "j", 0) == 2);
	CHECK(store_message_get(s, "j", 1, sk, &map, &v, &u) == 0 && v == 2);
	json_decref(map);
	forget_store(c);
	CHECK(save(s, c) == 2);
	CHECK(store_load_conversation(s, "j", 1, &l) == 0 && l);
	CHECK_SAME(c, l);
	convo_free(l);
	l = NULL;
	CHECK(store_spool_stats(s, &items, &bytes, &u) == 0 && items == 0);

	/* 20,000 records in commits of 100: cycles start at 16,384 pending records, so the
	 * journal never holds much more than two cycles' worth; segments appear, and what is
	 * read is right at every point. */
	store_stats(s, &st0);
	CHECK(st0.commits == 3 && st0.turns == st0.commits && st0.records == 5);
	CHECK(st0.inline_commits == 0 && st0.pending == st0.records && st0.fold_records == 0);
	big = small(&env, "big", 0);
	for (int t = 0; big && t < 200; t++) {
		for (int i = 0; i < 100; i++)
			CHECK(add1(big, &env, i % 2 ? ROLE_ASSISTANT : ROLE_USER, "x"));
		if (t % 7 == 0)
			set_metadata(big, &env, (size_t)t, NULL, "{\"again\":true}");
		long n_saved = save(s, big);
		CHECK(n_saved == (t % 7 == 0 && t > 0 ? 101 : 100));
		sum += n_saved > 0 ? (uint64_t)n_saved : 0;
		int64_t n = count_batches(dir);
		if (n > most)
			most = n;
		if (t >= 170 && n < least_after)
			least_after = n;
		if (t % 50 == 49) {
			CHECK(store_load_conversation(s, "big", 3, &l) == 0 && l);
			CHECK_SAME(big, l);
			convo_free(l);
			l = NULL;
		}
	}
	printf("journal: at most %" PRId64 " journal rows, %" PRId64 " after the first cycle, %"
	       PRId64 " segments\n",
	       most, least_after, count_rows(dir, "segments"));
	CHECK(most >= 16384 / 101 && most <= 2 * 16384 / 100 + 3);
	/* The statistics: one commit per save, its records, a cycle ended, and every record
	 * either pending or folded (a cycle's records count in both until it ends). */
	store_stats(s, &st);
	CHECK(st.commits == st0.commits + 200 && st.turns == st.commits);
	CHECK(st.records == st0.records + sum && sum == 200 * 100 + 28);
	CHECK(st.commit_ns > st0.commit_ns && st.commit_max_ns > 0 &&
	      st.commit_max_ns <= st.commit_ns);
	CHECK(st.fold_cycles >= 1 && st.fold_segments >= st.fold_cycles);
	CHECK(st.fold_records >= 16384 && st.fold_records + st.pending >= st.records);
	CHECK(st.pending < st.records && st.db_bytes > 0 && st.wal_pages > 0);
	CHECK(least_after < most);
	CHECK(segments_of(dir, "big") >= 1);
	sort_key_of(big->log[7], sk); /* changed after it was folded: the newest wins */
	CHECK(store_message_get(s, "big", 3, sk, &map, &v, &u) == 0 && v == big->log[7]->version);
	json_decref(map);
	sort_key_of(big->log[100], sk); /* folded, unchanged since */
	CHECK(store_message_get(s, "big", 3, sk, &map, &v, &u) == 0 && v == 1);
	CHECK(same_json(map, message_to_map(big->log[100])));
	store_close(s); /* folds */
	CHECK(count_batches(dir) == 0);

	/* A crash leaves rows in the journal: the next start folds them before loading. The
	 * crash is the files copied while the store is open, after a commit (no fork: under
	 * valgrind a child that exits without freeing fails on its leaks). */
	make_dir(crash, sizeof(crash), "journal-crash");
	if ((s = open_store(dir))) {
		CHECK(store_load_conversation(s, "big", 3, &l) == 0 && l);
		CHECK_SAME(big, l);
		convo_free(l);
		l = NULL;
		set_metadata(c, &env, 1, NULL, "{\"crash\":true}");
		add1(c, &env, ROLE_USER, "after");
		CHECK(save(s, c) == 2);
		CHECK(count_batches(dir) == 1);
		CHECK(copy_file(dir, crash, "convod.db") == 0);
		CHECK(copy_file(dir, crash, "convod.db-wal") == 0);
		store_close(s);
	}
	CHECK(count_batches(crash) == 1);
	if ((s = open_store(crash))) {
		CHECK(count_batches(crash) == 0);
		memset(&k, 0, sizeof(k));
		CHECK(store_load_open(s, collect_cb, &k) == 0 && k.n == 2 &&
		      k.messages == big->nlog + 3);
		CHECK(store_load_conversation(s, "j", 1, &l) == 0 && l);
		CHECK(l && l->nlog == 3 && l->log[1]->version == 2);
		CHECK_SAME(c, l);
		convo_free(l);
		l = NULL;
		store_close(s);
	}

	/* Schema 2 (the journal merged over the messages table) and 1 are upgraded. */
	for (int version = 1; version <= 2; version++) {
		char name[32], sk1[DDBITEM_SK_MAX + 1], sk2[DDBITEM_SK_MAX + 1];
		snprintf(name, sizeof(name), "schema-%d", version);
		make_dir(dir, sizeof(dir), name);
		old = sample(&env);
		if (!old)
			continue;
		write_old_store(dir, old, version);
		sort_key_of(old->log[1], sk1);
		sort_key_of(old->log[2], sk2);
		if ((s = open_store(dir))) {
			CHECK(count_rows(dir, "messages") == -1 && count_rows(dir, "journal") == -1);
			CHECK(count_rows(dir, "segments") == 1);
			CHECK(store_load_conversation(s, conv_id, CONV_ID_LEN, &l) == 0 && l);
			CHECK_SAME(old, l);
			if (l) {
				CHECK(l->log[1]->seen[CONSUMER_SINK] == old->log[1]->version);
				CHECK(l->log[2]->seen[CONSUMER_SINK] == old->log[2]->version);
				CHECK(l->log[3]->seen[CONSUMER_SINK] == 0);
			}
			convo_free(l);
			l = NULL;
			CHECK(confirmed_of(dir, conv_id, CONV_ID_LEN, sk1) == old->log[1]->version);
			CHECK(store_spool_stats(s, &items, &bytes, &u) == 0 && items == 1 &&
			      bytes == map_bytes(old->log[2]) && u == 5);
			store_close(s);
		}
		convo_free(old);
	}
	convo_free(big);
	convo_free(c);
}

/* Schema 3 files (records of JSON maps, in segments and in batches a crash left) are
 * opened as schema 4 and read the same; new records are packed and the two kinds mix. */
static void test_schema3(void)
{
	char dir[128], crash[128], sk[DDBITEM_SK_MAX + 1];
	struct convo_env env;
	struct convo *c, *l = NULL, *l2 = NULL;
	struct store *s;
	json_t *map = NULL, *want;
	uint32_t v;
	int64_t u;

	env_init(&env, T0);
	make_dir(dir, sizeof(dir), "schema-3");
	make_dir(crash, sizeof(crash), "schema-3-crash");
	if (!(s = open_store(dir)))
		return;
	c = sample(&env);
	CHECK(c && save(s, c) == (long)c->nlog);
	/* The crash copy keeps its records in batches; the closed store folds them. */
	CHECK(copy_file(dir, crash, "convod.db") == 0);
	CHECK(copy_file(dir, crash, "convod.db-wal") == 0);
	store_close(s);
	CHECK(unpack_rows(dir, "segments") == (long)c->nlog);
	CHECK(unpack_rows(crash, "batches") == (long)c->nlog);
	for (int i = 0; i < 2; i++) {
		const char *d = i ? crash : dir;
		if (!(s = open_store(d)))
			continue;
		CHECK(store_load_conversation(s, conv_id, CONV_ID_LEN, &l) == 0 && l);
		CHECK_SAME(c, l);
		/* A message's map, as the sink reads it, is the one in memory. */
		sort_key_of(c->log[0], sk);
		CHECK(store_message_get(s, conv_id, CONV_ID_LEN, sk, &map, &v, &u) == 0 && map);
		want = message_to_map(c->log[0]);
		CHECK(json_equal(map, want) && v == c->log[0]->version);
		json_decref(want);
		json_decref(map);
		map = NULL;
		/* New versions, packed, among the JSON ones. */
		if (l) {
			set_metadata(l, &env, 0, "{\"playEnd\":1744815823300}", NULL);
			CHECK(add1(l, &env, ROLE_ASSISTANT, "One more.") != NULL);
			CHECK(save(s, l) == 2);
			CHECK(store_load_conversation(s, conv_id, CONV_ID_LEN, &l2) == 0 && l2);
			CHECK_SAME(l, l2);
		}
		convo_free(l);
		convo_free(l2);
		l = l2 = NULL;
		store_close(s);
		CHECK(query_int(d, "PRAGMA user_version") == 7);
	}
	convo_free(c);
}

/* Schema 4 files (one table of batches) are upgraded: the second table is added, and the
 * batches a crash left are folded as before. */
static void test_schema4(void)
{
	struct convo_env env;
	struct store *s;
	struct convo *c, *l = NULL;
	char dir[2][128], sk[DDBITEM_SK_MAX + 1];
	json_t *map = NULL;
	uint32_t v = 0;
	int64_t u;

	env_init(&env, T0);
	make_dir(dir[0], sizeof(dir[0]), "schema-4");
	make_dir(dir[1], sizeof(dir[1]), "schema-4-crash");
	if (!(s = open_store(dir[0])))
		return;
	c = small(&env, "s4", 4);
	CHECK(save(s, c) == 4);
	set_metadata(c, &env, 2, NULL, "{\"v\":2}");
	CHECK(save(s, c) == 1);
	CHECK(copy_file(dir[0], dir[1], "convod.db") == 0);
	CHECK(copy_file(dir[0], dir[1], "convod.db-wal") == 0);
	store_close(s);
	for (int k = 0; k < 2; k++) {
		CHECK(sql(dir[k], "INSERT INTO batches SELECT * FROM batches1; DROP TABLE batches1;"
		                  "DROP INDEX dead_letters_by_message; DROP TABLE repairs;"
		                  "PRAGMA user_version=4") == SQLITE_OK);
		CHECK(count_rows(dir[k], "batches") == (k ? 2 : 0));
		capture_begin();
		s = open_store(dir[k]);
		char *log = capture_end();
		CHECK(log && strstr(log, "upgraded from schema 4 to 7"));
		free(log);
		if (!s)
			continue;
		CHECK(query_int(dir[k], "PRAGMA user_version") == 7);
		CHECK(query_int(dir[k], "SELECT count(*) FROM sqlite_schema"
		                        " WHERE name = 'dead_letters_by_message'") == 1);
		CHECK(count_batches(dir[k]) == 0 && count_rows(dir[k], "segments") == 1);
		CHECK(store_load_conversation(s, "s4", 2, &l) == 0 && l);
		CHECK_SAME(c, l);
		convo_free(l);
		l = NULL;
		sort_key_of(c->log[2], sk);
		CHECK(store_message_get(s, "s4", 2, sk, &map, &v, &u) == 0 && v == 2);
		CHECK(same_json(map, message_to_map(c->log[2])));
		/* And it writes to both tables in turns. */
		store_set_idle_fold(s, false);
		store_set_fold_records(s, 1);
		l = small(&env, k ? "more1" : "more0", 10);
		for (int i = 0; i < 2; i++) {
			forget_store(l);
			CHECK(save(s, l) == 10);
		}
		convo_free(l);
		l = NULL;
		CHECK(count_rows(dir[k], "batches") == 1 && count_rows(dir[k], "batches1") == 1);
		store_close(s);
		CHECK(count_batches(dir[k]) == 0);
	}
	convo_free(c);
}

/* Changes the records of conversation conv's segments behind the store's back: kind 0 cuts
 * the row, 1-5 spoil a field of the first record (1 and 2 as a record of a JSON map), 6 drops
 * the next-to-last record (an assistant message, which breaks the view), 7 cuts the first
 * record's packed map by a byte, 8 gives it an unknown role. */
static void damage_segment(const char *dir, const char *conv, int kind)
{
	char path[160];
	sqlite3 *db = NULL;
	sqlite3_stmt *rd = NULL, *wr = NULL;
	struct buf in = {NULL, 0, 0}, out = {NULL, 0, 0};
	struct msgrec r[64];
	size_t n = 0, pos = 0;
	int64_t seq = 0;
	char role[256];

	snprintf(path, sizeof(path), "%s/convod.db", dir);
	CHECK(sqlite3_open(path, &db) == SQLITE_OK);
	CHECK(sqlite3_prepare_v2(db, "SELECT seq, data FROM segments WHERE conversation = ?",
	                         -1, &rd, NULL) == SQLITE_OK);
	sqlite3_bind_blob(rd, 1, conv, (int)strlen(conv), SQLITE_STATIC);
	CHECK(sqlite3_step(rd) == SQLITE_ROW);
	seq = sqlite3_column_int64(rd, 0);
	buf_append(&in, sqlite3_column_blob(rd, 1), (size_t)sqlite3_column_bytes(rd, 1));
	sqlite3_finalize(rd);
	while (n < 64 && msgrec_next(in.data, in.len, &pos, &r[n]) == 1)
		n++;
	CHECK(n >= 3);
	switch (kind) {
	case 1:
		r[0].map = "{\"id\":";
		r[0].map_len = 6;
		r[0].packed = false;
		break;
	case 2:
		r[0].map = "{\"id\":\"nope\"}";
		r[0].map_len = 13;
		r[0].packed = false;
		break;
	case 3:
		r[0].sk_len--;
		break;
	case 4:
		r[0].client_seen = r[0].version + 1;
		break;
	case 5:
		r[0].version = 0;
		break;
	case 6:
		memmove(&r[n - 2], &r[n - 1], sizeof(r[0]));
		n--;
		break;
	case 7:
		CHECK(r[0].packed);
		r[0].map_len--;
		break;
	case 8:
		CHECK(r[0].packed && r[0].map_len > 0 && r[0].map_len <= sizeof(role));
		role[0] = 3;
		memcpy(role + 1, r[0].map + 1, r[0].map_len - 1);
		r[0].map = role;
		break;
	}
	for (size_t i = 0; i < n; i++)
		CHECK(msgrec_append(&out, &r[i]) == 0);
	if (kind == 0)
		out.len -= 3;
	CHECK(sqlite3_prepare_v2(db, "UPDATE segments SET data = ? WHERE seq = ?", -1, &wr, NULL) ==
	      SQLITE_OK);
	sqlite3_bind_blob(wr, 1, out.data, (int)out.len, SQLITE_STATIC);
	sqlite3_bind_int64(wr, 2, seq);
	CHECK(sqlite3_step(wr) == SQLITE_DONE);
	sqlite3_finalize(wr);
	sqlite3_close(db);
	buf_free(&in);
	buf_free(&out);
}

/* Records changed behind the store's back: the reads fail with -EIO, nothing crashes. A
 * journal row damaged in the middle costs its records from there on, and the start goes
 * on. */
static void test_bad_rows(void)
{
	char dir[128], sk[DDBITEM_SK_MAX + 1];
	struct convo_env env;
	struct convo *c = NULL, *l = NULL;
	struct collect k;
	struct store *s;
	json_t *map = NULL;
	uint32_t v;
	int64_t u;

	env_init(&env, T0);
	for (int kind = 0; kind <= 8; kind++) {
		char name[32];
		snprintf(name, sizeof(name), "bad-row-%d", kind);
		make_dir(dir, sizeof(dir), name);
		if (!(s = open_store(dir)))
			continue;
		c = small(&env, "victim", 4);
		CHECK(save(s, c) == 4);
		store_close(s); /* folds the records into a segment */
		damage_segment(dir, "victim", kind);
		if (!(s = open_store(dir))) {
			convo_free(c);
			continue;
		}
		CHECK(store_load_conversation(s, "victim", 6, &l) == -EIO && !l);
		memset(&k, 0, sizeof(k));
		CHECK(store_load_open(s, collect_cb, &k) == -EIO && k.n == 0);
		if (kind == 1 || kind == 7) {
			sort_key_of(c->log[0], sk);
			CHECK(store_message_get(s, "victim", 6, sk, &map, &v, &u) == -EIO && !map);
		}
		store_close(s);
		convo_free(c);
	}

	/* A journal row cut in its second record: the first one is kept. */
	make_dir(dir, sizeof(dir), "bad-journal");
	if ((s = open_store(dir))) {
		char crash[128];
		c = small(&env, "cut", 2);
		CHECK(save(s, c) == 2);
		make_dir(crash, sizeof(crash), "bad-journal-crash");
		CHECK(copy_file(dir, crash, "convod.db") == 0);
		CHECK(copy_file(dir, crash, "convod.db-wal") == 0);
		store_close(s);
		CHECK(sql(crash, "UPDATE batches SET data = substr(data, 1, length(data) - 10);"
		                 "UPDATE batches1 SET data = substr(data, 1, length(data) - 10)") ==
		      SQLITE_OK);
		capture_begin();
		s = open_store(crash);
		char *log = capture_end();
		CHECK(s != NULL);
		CHECK(log && strstr(log, "damaged after 1 records"));
		free(log);
		if (s) {
			CHECK(store_load_conversation(s, "cut", 3, &l) == 0 && l && l->nlog == 1);
			convo_free(l);
			store_close(s);
		}
		convo_free(c);
	}
}

static void test_unwritable(void)
{
	char dir[128];
	pid_t pid;
	int status = 0;

	make_dir(dir, sizeof(dir), "unwritable");
	CHECK(chmod(dir, 0555) == 0);
	if (geteuid() != 0) {
		CHECK_OPEN_FAILS(dir, -EACCES, "not writable");
		return;
	}
	/* root writes anyway: try as nobody in a child. */
	CHECK(chmod(root, 0755) == 0);
	fflush(stdout);
	fflush(stderr);
	pid = fork();
	if (pid == 0) {
		struct store *s = NULL;
		char err[256] = "";
		int rc;
		if (setgid(65534) < 0 || setuid(65534) < 0)
			_exit(77);
		rc = store_open(dir, DURABILITY_PROCESS, &s, err, sizeof(err));
		printf("  as uid 65534: %d %s\n", rc, err);
		fflush(stdout);
		_exit(rc == -EACCES && !s && strstr(err, dir) && strstr(err, "not writable") ? 0
		                                                                             : 1);
	}
	CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status));
	if (WIFEXITED(status) && WEXITSTATUS(status) == 77)
		printf("  skipped the unwritable directory case: cannot switch to uid 65534\n");
	else
		CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	CHECK(chmod(root, 0700) == 0);
}

static void test_disk_full(void)
{
	char dir[128], big[8193];
	struct convo_env env;
	struct convo *c, *l = NULL;
	struct store *s;
	const char *p = big;
	size_t len = sizeof(big), nlog;
	int rc = 0;

	memset(big, 'x', sizeof(big) - 1);
	big[sizeof(big) - 1] = 0;
	len = sizeof(big) - 1;
	env_init(&env, T0);
	make_dir(dir, sizeof(dir), "full");
	if (!(s = open_store(dir)))
		return;
	c = small(&env, "full", 2);
	CHECK(save(s, c) == 2);
	CHECK(store_set_size_limit(s, 1) == 0); /* no growth beyond the current size */

	/* Messages that do not fit fail the commit with -ENOSPC, rolled back. */
	CHECK(store_begin(s) == 0);
	for (int i = 0; i < 64 && !rc; i++) {
		struct message *m = add_n(c, &env, i % 2 ? ROLE_ASSISTANT : ROLE_USER, &p, &len, 1);
		CHECK(m != NULL);
		if (m)
			rc = store_put_message(s, "full", 4, m);
	}
	CHECK(rc == 0);
	CHECK(store_commit(s) == -ENOSPC);
	CHECK(store_load_conversation(s, "full", 4, &l) == 0 && l && l->nlog == 2);
	convo_free(l);
	l = NULL;
	/* Rows that do not fit: the same. */
	CHECK(store_begin(s) == 0);
	for (int i = 0; i < 64 && !rc; i++)
		rc = store_dead_letter(s, "full", 4, "01ARZ3NDEKTSV4RRFFQ69G5FAV", 1, big, "E", T0);
	CHECK(rc == 0);
	CHECK(store_put_conversation(s, c) == 0);
	CHECK(store_commit(s) == -ENOSPC); /* and rolled back */
	{
		json_t *dl = NULL;
		CHECK(store_dead_letters(s, 10, &dl) == 0 && json_array_size(dl) == 0);
		json_decref(dl);
	}
	CHECK(store_load_conversation(s, "full", 4, &l) == 0 && l && l->nlog == 2);
	convo_free(l);
	l = NULL;
	CHECK(store_begin(s) == 0); /* the transaction is over */
	rc = (int)put_pending(s, c);
	CHECK(rc > 0);
	CHECK(store_commit(s) == -ENOSPC);

	/* Room again: the same writes go through. */
	CHECK(store_set_size_limit(s, 0) == 0);
	forget_store(c);
	nlog = c->nlog;
	CHECK(save(s, c) == (long)nlog);
	CHECK(store_load_conversation(s, "full", 4, &l) == 0);
	CHECK_SAME(c, l);
	convo_free(l);
	store_close(s);
	convo_free(c);
}

static int wakes;
static void on_wake(void *arg)
{
	(void)arg;
	__atomic_add_fetch(&wakes, 1, __ATOMIC_SEQ_CST);
}

/* The writer thread: transactions submitted without waiting are written in order and
 * reported (wake, store_progress); a failure voids what was submitted after it until it is
 * acknowledged, and nothing of it is stored; the writes go on after the acknowledgement.
 * At durability machine every commit goes through the thread. */
static void test_async(void)
{
	char dir[128], big[8192];
	struct convo_env env;
	struct convo *c[4], *l = NULL;
	struct store_progress p;
	struct store *s = NULL;
	uint64_t seq[4] = {0};
	char err[256];
	const char *bp = big;
	size_t blen = sizeof(big);

	memset(big, 'z', sizeof(big));
	env_init(&env, T0);
	make_dir(dir, sizeof(dir), "async");
	CHECK(store_open(dir, DURABILITY_MACHINE, &s, err, sizeof(err)) == 0);
	if (!s)
		return;
	store_set_wake(s, on_wake, NULL);
	for (int i = 0; i < 4; i++) {
		char id[16];
		snprintf(id, sizeof(id), "a%d", i);
		c[i] = small(&env, id, 3);
		CHECK(store_begin(s) == 0 && put_pending(s, c[i]) == 3);
		CHECK(store_submit(s, &seq[i]) == 0);
		CHECK(!store_in_transaction(s));
	}
	CHECK(seq[0] > 0 && seq[1] == seq[0] + 1 && seq[3] == seq[0] + 3);
	CHECK(store_submit(s, &seq[0]) == -EINVAL); /* none open */
	CHECK(store_sync(s) == 0);
	store_progress(s, &p);
	CHECK(p.committed >= seq[3] && !p.failed);
	/* The writer calls wake after marking its jobs done, outside its lock: store_sync may
	 * return first when the sync went in the same group (seen once under valgrind). */
	for (int t = 0; t < 10000 && !__atomic_load_n(&wakes, __ATOMIC_SEQ_CST); t++)
		usleep(1000);
	CHECK(__atomic_load_n(&wakes, __ATOMIC_SEQ_CST) >= 1);
	for (int i = 0; i < 4; i++) {
		CHECK(store_load_conversation(s, c[i]->id, c[i]->id_len, &l) == 0);
		CHECK_SAME(c[i], l);
		convo_free(l);
		l = NULL;
	}

	/* A full disk: the failed one and the one after it are void. */
	CHECK(store_set_size_limit(s, 1) == 0);
	for (int i = 0; i < 2; i++) {
		for (int k = 0; k < 40; k++)
			CHECK(add_n(c[i], &env, k % 2 ? ROLE_USER : ROLE_ASSISTANT, &bp, &blen, 1));
		CHECK(store_begin(s) == 0 && put_pending(s, c[i]) == 40);
		CHECK(store_submit(s, &seq[i]) == 0);
	}
	store_sync(s);
	store_progress(s, &p);
	CHECK(p.failed && p.error == -ENOSPC && p.committed < seq[0]);
	for (int i = 0; i < 2; i++) {
		CHECK(store_load_conversation(s, c[i]->id, c[i]->id_len, &l) == 0);
		CHECK(l && l->nlog == 3); /* as it was before */
		convo_free(l);
		l = NULL;
	}
	/* Submitted before the acknowledgement: void too, even with room again. */
	CHECK(store_set_size_limit(s, 0) == 0);
	CHECK(store_begin(s) == 0 && store_put_conversation(s, c[2]) == 0);
	CHECK(store_submit(s, &seq[2]) == 0);
	store_sync(s);
	store_progress(s, &p);
	CHECK(p.failed && p.committed < seq[0]);
	store_failure_ack(s);
	store_progress(s, &p);
	CHECK(!p.failed);
	/* After it, written again (everything, as a daemon that put memory back would). */
	for (int i = 0; i < 2; i++) {
		forget_store(c[i]);
		CHECK(store_begin(s) == 0 && put_pending(s, c[i]) == 43);
		CHECK(store_submit(s, &seq[i]) == 0);
	}
	CHECK(store_sync(s) == 0);
	store_progress(s, &p);
	CHECK(!p.failed && p.committed >= seq[1]);
	for (int i = 0; i < 2; i++) {
		CHECK(store_load_conversation(s, c[i]->id, c[i]->id_len, &l) == 0);
		CHECK_SAME(c[i], l);
		convo_free(l);
		l = NULL;
	}

	/* Idle: the writer folds what is pending (the journal empties), in its own time, and
	 * then the WAL is checkpointed (far below the size that starts one otherwise). */
	CHECK(count_batches(dir) > 0);
	CHECK(store_begin(s) == 0 && store_idle(s) == -EINVAL);
	store_rollback(s);
	uint64_t rounds = store_checkpoints(s);
	CHECK(store_idle(s) == 0);
	for (int t = 0; t < 6000 && count_batches(dir) != 0; t++) /* 60 s at most */
		usleep(10000);
	CHECK(count_batches(dir) == 0);
	for (int t = 0; t < 6000 && store_checkpoints(s) == rounds; t++)
		usleep(10000);
	CHECK(store_checkpoints(s) > rounds);
	for (int i = 0; i < 4; i++) {
		CHECK(store_load_conversation(s, c[i]->id, c[i]->id_len, &l) == 0);
		CHECK(l && l->nlog == c[i]->nlog);
		convo_free(l);
		l = NULL;
	}
	store_close(s);
	for (int i = 0; i < 4; i++)
		convo_free(c[i]);
}

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Waits until seq is written, by polling: a job someone waits for (store_sync) would change
 * what the writer does. */
static bool committed_by(struct store *s, uint64_t seq)
{
	struct store_progress p;

	for (int t = 0; t < 20000; t++) {
		store_progress(s, &p);
		if (p.committed >= seq || p.failed)
			return p.committed >= seq;
		usleep(500);
	}
	return false;
}

/* Submits, without waiting, a transaction of a new conversation of n messages (n records)
 * in c[*k]; returns its seq. */
static uint64_t submit_new(struct store *s, struct convo_env *env, struct convo **c, int *k, int n)
{
	char id[16];
	uint64_t seq = 0;

	snprintf(id, sizeof(id), "co%d", *k);
	c[*k] = small(env, id, n);
	CHECK(store_begin(s) == 0 && put_pending(s, c[*k]) == n);
	CHECK(store_submit(s, &seq) == 0);
	++*k;
	return seq;
}

/* At durability machine, after a commit of several records the writer waits for the next
 * cohort (cohort_wait in store.c): for three quarters as many records, within a window
 * counted from that commit's end, widened here to 1 s so that this thread's timing does not
 * decide what happens. Every case and its counters (store_stats, the `stats` op). */
static void test_cohort(void)
{
	char dir[128], err[256];
	struct convo_env env;
	struct convo *c[12] = {0}, *l = NULL;
	struct store_stats a, b;
	struct store *s = NULL;
	uint64_t seq, seq2, t0;
	int k = 0;

	env_init(&env, T0);
	make_dir(dir, sizeof(dir), "cohort");
	CHECK(store_open(dir, DURABILITY_MACHINE, &s, err, sizeof(err)) == 0);
	if (!s)
		return;
	store_set_cohort_wait(s, 2000000000u);
	/* Eight records: no commit before them, so no wait. */
	CHECK(committed_by(s, submit_new(s, &env, c, &k, 8)));
	store_stats(s, &a);
	CHECK(a.cohort_waits == 0 && a.cohort_short == 0 && a.cohort_ns == 0);
	/* Two records, and 150 ms later five: the writer waits for six (three quarters of
	 * eight) and writes both transactions in one commit. (It waited at least 40 ms: the
	 * 110 more are for a writer slow to wake on a loaded host, under valgrind.) */
	seq = submit_new(s, &env, c, &k, 2);
	usleep(150000);
	seq2 = submit_new(s, &env, c, &k, 5);
	CHECK(seq2 == seq + 1 && committed_by(s, seq2));
	store_stats(s, &b);
	CHECK(b.cohort_waits == 1 && b.cohort_short == 0);
	CHECK(b.cohort_ns >= 40000000u && b.cohort_ns < 2000000000u);
	CHECK(b.commits == a.commits + 1 && b.turns == a.turns + 2 && b.records == a.records + 7);
	/* Four records alone: it waits for five (of seven) in vain, until the window closes.
	 * (The window is 2 s from the last commit, so that a test thread late to take t0 still
	 * sees at least 500 ms of it; a wait the writer skips sees none.) */
	t0 = now_ns();
	CHECK(committed_by(s, submit_new(s, &env, c, &k, 4)));
	CHECK(now_ns() - t0 >= 500000000u);
	store_stats(s, &a);
	CHECK(a.cohort_waits == 2 && a.cohort_short == 1 && a.commits == b.commits + 1);
	CHECK(a.cohort_ns >= b.cohort_ns + 500000000u);
	/* Right after a wait that fell short it does not wait: two records, fewer than the three
	 * it would wait for, are written at once. */
	t0 = now_ns();
	CHECK(committed_by(s, submit_new(s, &env, c, &k, 2)));
	CHECK(now_ns() - t0 < 1000000000u);
	/* Eight records after a commit of two: more than the one it would wait for, no wait. */
	CHECK(committed_by(s, submit_new(s, &env, c, &k, 8)));
	store_stats(s, &b);
	CHECK(b.cohort_waits == 2 && b.cohort_short == 1 && b.commits == a.commits + 2);
	/* A thread waiting for its own commit (store_commit) is not kept waiting for others. */
	t0 = now_ns();
	c[k] = small(&env, "co-sync", 1);
	CHECK(store_begin(s) == 0 && put_pending(s, c[k++]) == 1 && store_commit(s) == 0);
	CHECK(now_ns() - t0 < 1000000000u);
	store_stats(s, &a);
	CHECK(a.cohort_waits == 2 && a.commits == b.commits + 1);
	for (int i = 0; i < k; i++) {
		CHECK(store_load_conversation(s, c[i]->id, c[i]->id_len, &l) == 0);
		CHECK_SAME(c[i], l);
		convo_free(l);
		l = NULL;
	}
	store_close(s);
	for (int i = 0; i < k; i++)
		convo_free(c[i]);

	/* At durability process nothing waits. */
	k = 0;
	make_dir(dir, sizeof(dir), "cohort-process");
	CHECK(store_open(dir, DURABILITY_PROCESS, &s, err, sizeof(err)) == 0);
	if (!s)
		return;
	store_set_cohort_wait(s, 2000000000u);
	CHECK(committed_by(s, submit_new(s, &env, c, &k, 8)));
	t0 = now_ns();
	CHECK(committed_by(s, submit_new(s, &env, c, &k, 2)));
	CHECK(now_ns() - t0 < 1000000000u);
	store_stats(s, &a);
	CHECK(a.cohort_waits == 0 && a.cohort_short == 0 && a.cohort_ns == 0);
	store_close(s);
	for (int i = 0; i < k; i++)
		convo_free(c[i]);
}

/* A fold cycle's batches are deleted after it ends, by the next commit or idle step of the
 * writer; a crash before they are gone leaves the newest batches, which the next start
 * folds again, into segments after those that already hold them: the newest version still
 * wins, and no message is doubled. The batches replayed here lie in both tables, the older
 * one in the second: the start reads them in the order they were committed. */
static void test_dead_batches(void)
{
	struct convo_env env;
	struct store *s;
	struct convo *c, *l = NULL;
	struct collect k;
	char dir[128], old[128], q[640], sk[DDBITEM_SK_MAX + 1];
	json_t *map = NULL;
	uint32_t v = 0;
	int64_t u;

	env_init(&env, T0);
	make_dir(dir, sizeof(dir), "dead");
	make_dir(old, sizeof(old), "dead-old");
	if (!(s = open_store(dir)))
		return;
	c = small(&env, "d", 4);
	CHECK(save(s, c) == 4);
	set_metadata(c, &env, 0, NULL, "{\"again\":true}"); /* version 2 */
	CHECK(save(s, c) == 1);
	CHECK(count_batches(dir) == 2);
	/* Both batches, as a crash after their cycle ended would leave them. */
	CHECK(copy_file(dir, old, "convod.db") == 0);
	CHECK(copy_file(dir, old, "convod.db-wal") == 0);
	store_close(s); /* folds both and deletes them */
	CHECK(count_batches(dir) == 0 && count_rows(dir, "segments") == 1);
	snprintf(q, sizeof(q),
	         "ATTACH '%s/convod.db' AS o;"
	         "CREATE TEMP VIEW b AS SELECT * FROM o.batches UNION ALL SELECT * FROM o.batches1;"
	         "INSERT INTO batches1 SELECT * FROM b ORDER BY seq LIMIT 1;"
	         "INSERT INTO batches SELECT * FROM b ORDER BY seq LIMIT -1 OFFSET 1",
	         old);
	CHECK(sql(dir, q) == SQLITE_OK);
	CHECK(count_rows(dir, "batches") == 1 && count_rows(dir, "batches1") == 1);
	CHECK(query_int(dir, "SELECT (SELECT seq FROM batches1) < (SELECT seq FROM batches)") == 1);
	if ((s = open_store(dir))) {
		CHECK(count_batches(dir) == 0 && count_rows(dir, "segments") == 2);
		memset(&k, 0, sizeof(k));
		CHECK(store_load_open(s, collect_cb, &k) == 0 && k.n == 1 && k.messages == 4);
		CHECK(store_load_conversation(s, "d", 1, &l) == 0 && l);
		CHECK_SAME(c, l);
		convo_free(l);
		sort_key_of(c->log[0], sk);
		CHECK(store_message_get(s, "d", 1, sk, &map, &v, &u) == 0 && v == 2);
		CHECK(same_json(map, message_to_map(c->log[0]))); /* frees both */
		store_close(s);
	}
	convo_free(c);
}

/* store_stats' dead_batches: the journal rows of ended fold cycles not deleted yet. With the
 * writer's fold between jobs off, cycles start and end inside commits (once 4 cycles' worth
 * is pending; one conversation, so a cycle is one step), and the first commit after a cycle
 * ended empties that cycle's table: the journal loses all the rows the count said at once,
 * the count grows by a cycle's batches when one ends, the two tables take turns (one holds
 * the ended cycle's batches, the other the commit's), and an idle store empties both. */
static void test_dead_count(void)
{
	struct convo_env env;
	struct store *s;
	struct convo *c;
	struct store_stats st;
	char dir[128];
	uint64_t dead = 0, most = 0, cycles = 0, ended = 0;
	int64_t rows = 0;
	int last_table = -1;

	env_init(&env, T0);
	make_dir(dir, sizeof(dir), "dead-count");
	if (!(s = open_store(dir)))
		return;
	store_set_idle_fold(s, false);
	store_set_fold_records(s, 40);
	c = small(&env, "dc", 0);
	for (int t = 0; c && t < 120; t++) {
		for (int i = 0; i < 10; i++)
			CHECK(add1(c, &env, i % 2 ? ROLE_ASSISTANT : ROLE_USER, "x"));
		CHECK(save(s, c) == 10);
		int64_t n = count_batches(dir), n0 = count_rows(dir, "batches"),
		        n1 = count_rows(dir, "batches1");
		store_stats(s, &st);
		CHECK(n == rows + 1 - (int64_t)dead); /* one batch written, the dead ones gone */
		if (st.fold_cycles == cycles) {
			CHECK(st.dead_batches == 0);
		} else {
			int table = n0 == (int64_t)st.dead_batches ? 0 : 1;
			CHECK(st.fold_cycles == cycles + 1 && st.dead_batches > 0);
			/* The ended cycle's table, and the other one with this commit's batch. */
			CHECK((table == 0 && n1 == 1) ||
			      (n1 == (int64_t)st.dead_batches && n0 == 1));
			CHECK(table != last_table);
			last_table = table;
			ended++;
		}
		CHECK(st.dead_batches <= (uint64_t)n);
		dead = st.dead_batches;
		cycles = st.fold_cycles;
		rows = n;
		most = dead > most ? dead : most;
	}
	printf("dead batches: at most %" PRIu64 " after %" PRIu64 " cycles, %" PRId64
	       " journal rows at the end\n",
	       most, ended, rows);
	CHECK(ended >= 5 && most >= 4);
	/* Idle: everything is folded and every folded row deleted. */
	CHECK(store_idle(s) == 0);
	for (int t = 0; t < 6000; t++) { /* 60 s at most */
		store_stats(s, &st);
		if (st.dead_batches == 0 && st.pending == 0 && count_batches(dir) == 0)
			break;
		usleep(10000);
	}
	CHECK(st.dead_batches == 0 && st.pending == 0 && count_batches(dir) == 0);
	store_close(s);
	convo_free(c);
}

/* Fills the file system of dir with a file named filler (written until it fails). */
static void fill_fs(const char *dir)
{
	char path[192], chunk[4096];
	int fd;

	memset(chunk, 1, sizeof(chunk));
	snprintf(path, sizeof(path), "%s/filler", dir);
	if ((fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600)) < 0)
		return;
	while (write(fd, chunk, sizeof(chunk)) > 0)
		;
	close(fd);
}

/* A start on a full disk after a crash that left batches in both tables (those of an ended
 * cycle and the next one's): they stay pending, reads see them. Once there is room, the
 * first cycle takes both tables' batches; the commit that starts it finds no table free for
 * its batch, so it finishes that cycle and empties both (batch_table). A commit that would
 * empty a dead table on a full disk fails and leaves that table and its count as they were;
 * the same commit goes through once there is room. Every message is there, in its newest
 * version, after another crash and after a clean stop. A 1 MB tmpfs is the full disk:
 * skipped without the right to mount one. */
static void test_full_start(void)
{
	struct convo_env env;
	struct store *s;
	struct convo *c[5] = {NULL}, *l = NULL;
	struct store_stats st0, st;
	const char *names[] = {"convod.db", "convod.db-wal", "convod.db-shm"};
	char dir[128], fs[128], crash[128], path[192], sk[DDBITEM_SK_MAX + 1];
	json_t *map = NULL;
	uint32_t v = 0;
	int64_t u;

	env_init(&env, T0);
	make_dir(dir, sizeof(dir), "full-start");
	make_dir(fs, sizeof(fs), "full-start-fs");
	make_dir(crash, sizeof(crash), "full-start-crash");
	if (mount("tmpfs", fs, "tmpfs", 0, "size=1m") < 0) {
		printf("full start: skipped, cannot mount a tmpfs: %s\n", strerror(errno));
		return;
	}
	if (!(s = open_store(dir)))
		goto out;
	/* Cycles start in a commit once 4 records are pending, and fold at least 64 records a
	 * step: "a" (70 records) is one step, "a" and "b" together two. */
	store_set_idle_fold(s, false);
	store_set_fold_records(s, 1);
	c[0] = small(&env, "a", 70);
	c[1] = small(&env, "b", 2);
	c[2] = small(&env, "c", 2);
	c[3] = small(&env, "d", 2);
	c[4] = small(&env, "e", 2);
	CHECK(save(s, c[0]) == 70);
	set_metadata(c[1], &env, 1, NULL, "{\"v\":2}"); /* version 2 of b's answer */
	CHECK(save(s, c[1]) == 2); /* a's cycle starts and ends; b's batch in the other table */
	store_stats(s, &st);
	CHECK(st.fold_cycles == 1 && st.dead_batches == 1 && st.pending == 2);
	CHECK(count_rows(dir, "batches") == 1 && count_rows(dir, "batches1") == 1);
	for (int i = 0; i < 3; i++)
		CHECK(copy_file(dir, fs, names[i]) == 0);
	store_close(s);

	/* The crash's files on a full disk: the start cannot fold them. */
	fill_fs(fs);
	capture_begin();
	s = open_store(fs);
	char *log = capture_end();
	CHECK(s != NULL);
	CHECK(log && strstr(log, "the disk is full"));
	free(log);
	if (!s)
		goto out;
	CHECK(count_rows(fs, "batches") == 1 && count_rows(fs, "batches1") == 1);
	for (int i = 0; i < 2; i++) {
		CHECK(store_load_conversation(s, c[i]->id, 1, &l) == 0 && l);
		CHECK_SAME(c[i], l);
		convo_free(l);
		l = NULL;
	}

	/* Room again. */
	snprintf(path, sizeof(path), "%s/filler", fs);
	CHECK(unlink(path) == 0);
	store_set_idle_fold(s, false);
	store_set_fold_records(s, 1);
	store_stats(s, &st0);
	CHECK(st0.pending == 72 && st0.fold_cycles == 0);
	CHECK(save(s, c[2]) == 2);
	store_stats(s, &st);
	CHECK(st.fold_cycles == 1 && st.fold_records == 72 && st.pending == 2);
	CHECK(st.dead_batches == 0);
	CHECK(count_rows(fs, "batches") == 1 && count_rows(fs, "batches1") == 0);
	CHECK(count_rows(fs, "segments") == 3); /* a's again */

	/* d joins c's table; e's commit folds both, its batch goes to the other table. */
	CHECK(save(s, c[3]) == 2 && save(s, c[4]) == 2);
	store_stats(s, &st);
	CHECK(st.fold_cycles == 2 && st.dead_batches == 2);
	CHECK(count_rows(fs, "batches") == 2 && count_rows(fs, "batches1") == 1);
	/* The next commit would empty the dead table: not on a full disk. */
	fill_fs(fs);
	set_metadata(c[4], &env, 0, NULL, "{\"v\":2}");
	CHECK(save(s, c[4]) < 0);
	store_stats(s, &st);
	CHECK(st.dead_batches == 2);
	CHECK(count_rows(fs, "batches") == 2 && count_rows(fs, "batches1") == 1);
	CHECK(unlink(path) == 0);
	forget_store(c[4]);
	CHECK(save(s, c[4]) == 2);
	store_stats(s, &st);
	CHECK(st.dead_batches == 0 && st.fold_cycles == 2);
	CHECK(count_rows(fs, "batches") == 0 && count_rows(fs, "batches1") == 2);

	/* Another crash, then a clean stop. */
	for (int i = 0; i < 2; i++)
		CHECK(copy_file(fs, crash, names[i]) == 0);
	store_close(s);
	CHECK(count_batches(fs) == 0);
	for (int k = 0; k < 2; k++) {
		if (!(s = open_store(k ? fs : crash)))
			continue;
		CHECK(count_batches(k ? fs : crash) == 0);
		for (int i = 0; i < 5; i++) {
			CHECK(store_load_conversation(s, c[i]->id, 1, &l) == 0 && l);
			CHECK_SAME(c[i], l);
			convo_free(l);
			l = NULL;
		}
		sort_key_of(c[1]->log[1], sk);
		CHECK(store_message_get(s, "b", 1, sk, &map, &v, &u) == 0 && v == 2);
		CHECK(same_json(map, message_to_map(c[1]->log[1])));
		sort_key_of(c[4]->log[0], sk);
		CHECK(store_message_get(s, "e", 1, sk, &map, &v, &u) == 0 && v == 2);
		CHECK(same_json(map, message_to_map(c[4]->log[0])));
		store_close(s);
	}
out:
	for (int i = 0; i < 5; i++)
		convo_free(c[i]);
	umount2(fs, MNT_DETACH);
}

/* n commits of one message of text each to c, user and assistant alternating (a user
 * message first in an empty conversation), each submitted and waited for. */
static void commit_each(struct store *s, struct convo *c, struct convo_env *env, const char *text,
                        int n)
{
	for (int i = 0; c && i < n; i++) {
		uint64_t seq;
		CHECK(add1(c, env, c->nlog % 2 ? ROLE_ASSISTANT : ROLE_USER, text));
		CHECK(store_begin(s) == 0 && put_pending(s, c) == 1);
		CHECK(store_submit(s, &seq) == 0);
		CHECK(store_sync(s) == 0);
	}
}

/* Commits n 8 kB messages to a new store of durability `machine` in dir tag, one a
 * commit, with the WAL sizes set (store_set_wal_pages); checks that the conversation reads
 * back whole. Returns the WAL file's size at the end (its high-water mark), or -1, and the
 * store's stats at the end in *out (its checkpoints were 0 at the start). */
static long long commit_big(const char *tag, int machine, int n, int checkpoint, int hard,
                            int catch_up, struct store_stats *out)
{
	static char text[8000];
	struct convo_env env;
	struct store *s = NULL;
	struct convo *c, *l = NULL;
	char dir[128], err[256], wal[192];
	struct stat st;
	long long size = -1;

	memset(text, 'w', sizeof(text) - 1);
	env_init(&env, T0);
	make_dir(dir, sizeof(dir), tag);
	CHECK(store_open(dir, machine ? DURABILITY_MACHINE : DURABILITY_PROCESS, &s, err,
	                 sizeof(err)) == 0);
	if (!s)
		return -1;
	store_set_wal_pages(s, checkpoint, hard, catch_up);
	/* A new store: opening it ran no checkpoint. */
	CHECK(store_checkpoints(s) == 0);
	c = convo_new("w", 1);
	commit_each(s, c, &env, text, n);
	store_stats(s, out);
	snprintf(wal, sizeof(wal), "%s/convod.db-wal", dir);
	CHECK(stat(wal, &st) == 0);
	size = (long long)st.st_size;
	printf("%s: %" PRIu64 " checkpoints (%" PRIu64 " catch-ups, %" PRIu64
	       " at the bound), %" PRIu64 " writebacks, the WAL file ended at %lld bytes\n",
	       tag, out->checkpoints, out->catch_ups, out->bound_waits, out->wal_writebacks, size);
	CHECK(store_load_conversation(s, "w", 1, &l) == 0);
	CHECK_SAME(c, l);
	convo_free(l);
	store_close(s);
	convo_free(c);
	return size;
}

/* The WAL bound: past it the writer checkpoints itself (after the thread's round) and the
 * next commit starts the WAL over, whether the commit that crossed it was the writer's
 * (machine) or the loop's own (process: the loop only flags it, and the writer takes the
 * checkpoint between jobs). Both sizes are equal here, so the checkpoint thread is never
 * asked and nothing else keeps the WAL short: 600 commits of an 8 kB message write about
 * 1,800 pages, in a WAL bounded at 50. */
/* Waits until the writer folded everything committed (store_set_fold_records(s, 1): it
 * folds once it has no job). */
static bool folded(struct store *s)
{
	struct store_stats st;

	for (int t = 0; t < 20000; t++) {
		store_stats(s, &st);
		if (st.pending == 0)
			return true;
		usleep(500);
	}
	return false;
}

/* After a failed commit: acknowledges the failure and writes c (the failed commit's, 3
 * records) again, which must commit synced. */
static void write_again_synced(struct store *s, struct convo *c)
{
	struct store_stats st0, st1;
	uint64_t seq;

	store_failure_ack(s);
	forget_store(c);
	CHECK(store_begin(s) == 0 && put_pending(s, c) == 3);
	store_stats(s, &st0);
	CHECK(store_submit(s, &seq) == 0);
	CHECK(committed_by(s, seq));
	store_stats(s, &st1);
	CHECK(st1.wal_syncs > st0.wal_syncs);
}

/* Everything folded (store_idle), the journal emptied, and each of c[0..k) as written. */
static void all_folded_as_written(struct store *s, const char *dir, struct convo **c, int k)
{
	struct convo *l = NULL;

	CHECK(store_idle(s) == 0);
	for (int t = 0; t < 60000 && count_batches(dir) != 0; t++) /* 60 s at most */
		usleep(1000);
	CHECK(count_batches(dir) == 0);
	for (int i = 0; i < k; i++) {
		CHECK(store_load_conversation(s, c[i]->id, c[i]->id_len, &l) == 0);
		CHECK_SAME(c[i], l);
		convo_free(l);
		l = NULL;
	}
}

/* At durability machine the fold's own transactions run at synchronous=NORMAL, and FULL is
 * set back after each. When that fails, the next transaction sets it first: its commit is
 * synced (store.wal_syncs). When it cannot, that transaction fails with -EIO rather than
 * commit unsynced, and the writer does not spin on the fold meanwhile; once FULL can be set
 * again, the next transaction is synced, and everything is folded and kept. */
static void test_sync_restore(void)
{
	char dir[128], err[256];
	struct convo_env env;
	struct convo *c[8] = {0};
	struct store_progress p;
	struct store_stats st0, st1;
	struct store *s = NULL;
	uint64_t seq;
	unsigned failures;
	int k = 0;

	env_init(&env, T0);
	make_dir(dir, sizeof(dir), "sync-restore");
	CHECK(store_open(dir, DURABILITY_MACHINE, &s, err, sizeof(err)) == 0);
	if (!s)
		return;
	store_set_fold_records(s, 1);

	/* Set back by the next transaction. */
	store_fail_sync_full(s, true);
	seq = submit_new(s, &env, c, &k, 3);
	CHECK(committed_by(s, seq));
	CHECK(folded(s));
	failures = store_fail_sync_full(s, false);
	CHECK(failures >= 1);
	store_stats(s, &st0);
	seq = submit_new(s, &env, c, &k, 3);
	CHECK(committed_by(s, seq));
	store_stats(s, &st1);
	printf("sync restore: %u failures injected, then a commit: %" PRIu64 " WAL syncs\n",
	       failures, st1.wal_syncs - st0.wal_syncs);
	CHECK(st1.wal_syncs > st0.wal_syncs);
	CHECK(folded(s));

	/* Not set back: the next transaction fails, and nothing is written meanwhile. */
	store_fail_sync_full(s, true);
	seq = submit_new(s, &env, c, &k, 3);
	CHECK(committed_by(s, seq));
	CHECK(folded(s));
	usleep(100000);
	seq = submit_new(s, &env, c, &k, 3);
	CHECK(!committed_by(s, seq));
	store_progress(s, &p);
	CHECK(p.failed && p.error == -EIO && p.committed < seq);
	failures = store_fail_sync_full(s, false);
	printf("sync restore refused: %u failures injected in 100 ms\n", failures);
	CHECK(failures >= 2 && failures < 10);
	write_again_synced(s, c[k - 1]);
	all_folded_as_written(s, dir, c, k);
	store_close(s);
	for (int i = 0; i < k; i++)
		convo_free(c[i]);
}

/* The same refusal with a fold cycle under way: the writer's idle step folded part of a
 * cycle (unsynced), then could not set synchronous=FULL back. The next commit's transaction
 * fails to begin (-EIO), and its rollback leaves the fold where that step left it: once
 * FULL can be set again, the commit is written again, synced, the cycle ends, and every
 * conversation is as written. */
static void test_sync_lost_mid_fold(void)
{
	char dir[128], err[256];
	struct convo_env env;
	struct convo *c[8] = {0};
	struct store_progress p;
	struct store_stats st;
	struct store *s = NULL;
	uint64_t seq;
	unsigned failures;
	int k = 0, t;

	env_init(&env, T0);
	make_dir(dir, sizeof(dir), "sync-mid-fold");
	CHECK(store_open(dir, DURABILITY_MACHINE, &s, err, sizeof(err)) == 0);
	if (!s)
		return;
	/* Seven conversations of 300 records start a cycle of 2100, whose first idle step
	 * (STORE_FOLD_IDLE_STEP, 1024 records) folds four of them. */
	store_set_fold_records(s, 2000);
	store_fail_sync_full(s, true);
	for (int i = 0; i < 7; i++)
		seq = submit_new(s, &env, c, &k, 300);
	CHECK(committed_by(s, seq));
	/* The step's own setting back failed, then the next step's (at its start and after
	 * it gave up). */
	failures = 0;
	for (t = 0; t < 20000 && failures < 2; t++) {
		failures += store_fail_sync_full(s, true);
		usleep(500);
	}
	store_stats(s, &st);
	printf("sync lost mid-fold: %" PRIu64 " of 2100 records folded, %" PRIu64 " cycles ended\n",
	       st.fold_records, st.fold_cycles);
	CHECK(st.fold_records >= 1024 && st.fold_records < 2100 && st.fold_cycles == 0);
	CHECK(failures >= 2 && st.pending == 2100); /* the cycle's records stay until it ends */

	seq = submit_new(s, &env, c, &k, 3);
	CHECK(!committed_by(s, seq));
	store_progress(s, &p);
	CHECK(p.failed && p.error == -EIO && p.committed < seq);
	failures = store_fail_sync_full(s, false);
	CHECK(failures >= 1);
	write_again_synced(s, c[k - 1]);
	all_folded_as_written(s, dir, c, k);
	store_stats(s, &st);
	/* Each record folded once: the failed transaction put the cycle back where it was. */
	CHECK(st.pending == 0 && st.fold_cycles >= 1 && st.fold_records == 2103);
	store_close(s);
	for (int i = 0; i < k; i++)
		convo_free(c[i]);
}

static void test_wal_bound(void)
{
	struct store_stats st;

	/* At machine the commit that crossed it checkpoints: 50 pages and that commit. At
	 * process the loop may commit a few more before the writer takes over. Every
	 * checkpoint is a wait at the bound: the thread is never asked, so nothing catches up. */
	CHECK(commit_big("wal-bound-process", 0, 600, 50, 50, 0, &st) < 500LL * (4096 + 24));
	CHECK(st.bound_waits > 0 && st.bound_waits == st.checkpoints && st.catch_ups == 0);
	CHECK(commit_big("wal-bound-machine", 1, 600, 50, 50, 0, &st) < 60LL * (4096 + 24));
	CHECK(st.bound_waits > 0 && st.bound_waits == st.checkpoints && st.catch_ups == 0);
}

/* At durability process the checkpoint thread starts the WAL's writeback every so many pages
 * of WAL (8 here), without anyone waiting for it; at machine, where every commit syncs, it
 * never does. The data reads back as written either way. */
static void test_wal_writeback(void)
{
	static char text[8000];

	memset(text, 'b', sizeof(text) - 1);
	for (int machine = 0; machine < 2; machine++) {
		struct convo_env env;
		struct store_stats st;
		struct store *s = NULL;
		struct convo *c, *l = NULL;
		char dir[128], err[256];

		env_init(&env, T0);
		make_dir(dir, sizeof(dir), machine ? "writeback-machine" : "writeback-process");
		CHECK(store_open(dir, machine ? DURABILITY_MACHINE : DURABILITY_PROCESS, &s, err,
		                 sizeof(err)) == 0);
		if (!s)
			continue;
		store_set_wal_writeback(s, 8);
		c = convo_new("wb", 2);
		commit_each(s, c, &env, text, 60);
		store_stats(s, &st);
		/* Each commit adds three pages or more: 20 asks at least, some of them served
		 * together, none twice; the thread serves them in its own time. */
		CHECK(st.wal_pages >= 180);
		for (int t = 0; t < 1000 && !machine && st.wal_writebacks == 0; t++) {
			usleep(10000);
			store_stats(s, &st);
		}
		if (machine)
			CHECK(st.wal_writebacks == 0);
		else
			CHECK(st.wal_writebacks > 0 && st.wal_writebacks <= st.wal_pages / 8);
		CHECK(store_load_conversation(s, "wb", 2, &l) == 0);
		CHECK_SAME(c, l);
		convo_free(l);
		store_close(s);
		convo_free(c);
	}
}

/* Uses up every file descriptor this process may open (the soft limit lowered to just past
 * the highest one open, the gaps below filled); returns how many it filled, or -1 where
 * the limit cannot be lowered (under valgrind, which keeps descriptors of its own). */
static int fds_exhaust(struct rlimit *old, int *filled, int max)
{
	struct rlimit lim;
	int top = -1, n = 0, fd;

	if (getrlimit(RLIMIT_NOFILE, old) < 0)
		return -1;
	for (fd = 0; fd < 4096; fd++)
		if (fcntl(fd, F_GETFD) >= 0)
			top = fd;
	lim = *old;
	lim.rlim_cur = (rlim_t)top + 1;
	if (setrlimit(RLIMIT_NOFILE, &lim) < 0)
		return -1;
	while (n < max && (fd = dup(2)) >= 0)
		filled[n++] = fd;
	return n;
}

static void fds_restore(const struct rlimit *old, const int *filled, int n)
{
	for (int i = 0; i < n; i++)
		close(filled[i]);
	setrlimit(RLIMIT_NOFILE, old);
}

/* The WAL's writeback needs a descriptor of its own, which the checkpoint thread opens at
 * its first writeback: while none can be opened, nothing is started, commits go on, and
 * the next ask opens it. */
static void test_wal_writeback_no_fd(void)
{
	static char text[8000];
	struct convo_env env;
	struct store_stats st;
	struct store *s = NULL;
	struct convo *c, *l = NULL;
	struct rlimit old;
	char dir[128], err[256];
	int filled[4096], n;

	memset(text, 'f', sizeof(text) - 1);
	env_init(&env, T0);
	make_dir(dir, sizeof(dir), "writeback-no-fd");
	CHECK(store_open(dir, DURABILITY_PROCESS, &s, err, sizeof(err)) == 0);
	if (!s)
		return;
	store_set_wal_writeback(s, 0);
	c = convo_new("nf", 2);
	/* First commits, without writebacks: SQLite has the WAL open before the descriptors
	 * run out, and the thread has none yet. */
	commit_each(s, c, &env, text, 2);
	store_stats(s, &st);
	CHECK(st.wal_writebacks == 0);
	store_set_wal_writeback(s, 8);
	if ((n = fds_exhaust(&old, filled, 4096)) < 0) {
		printf("writeback without a descriptor: RLIMIT_NOFILE cannot be lowered here "
		       "(valgrind?), not run\n");
	} else {
		CHECK(open("/dev/null", O_RDONLY) < 0 && errno == EMFILE);
		commit_each(s, c, &env, text, 30);
		/* The thread's asks came and went without a descriptor. */
		usleep(200000);
		store_stats(s, &st);
		fds_restore(&old, filled, n);
		printf("writeback without a descriptor: %d filled, %" PRIu64 " WAL pages, %" PRIu64
		       " writebacks\n",
		       n, st.wal_pages, st.wal_writebacks);
		CHECK(st.wal_pages >= 90 && st.wal_writebacks == 0);
		/* Descriptors again: the next ask opens one. */
		commit_each(s, c, &env, text, 10);
		store_stats(s, &st);
		for (int t = 0; t < 1000 && st.wal_writebacks == 0; t++) {
			usleep(10000);
			store_stats(s, &st);
		}
		CHECK(st.wal_writebacks > 0);
	}
	CHECK(store_load_conversation(s, "nf", 2, &l) == 0);
	CHECK_SAME(c, l);
	convo_free(l);
	store_close(s);
	convo_free(c);
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Continuous commits with the WAL past its checkpoint size and the hard bound out of reach:
 * the checkpoint thread's rounds alone never reach the WAL's end while commits go on, so
 * it is the commit after the last round (checkpoint_catch_up) that lets the WAL start over.
 * 1,500 commits of an 8 kB message write about 4,500 pages; without the catch-up the WAL
 * never started over (its file ended at 28-31 MB). Here every round is followed by a catch-up,
 * however much it left (the default, 256 pages, depends on how fast the disk syncs next to the
 * commits). */
static void test_wal_catch_up(void)
{
	static char text[8000];

	memset(text, 'c', sizeof(text) - 1);
	for (int machine = 0; machine < 2; machine++) {
		const char *tag = machine ? "catch-up-machine" : "catch-up-process";
		struct convo_env env;
		struct store_stats st;
		struct store *s = NULL;
		struct convo *c, *l = NULL;
		char dir[128], err[256];
		uint64_t last = 0, most = 0;
		int n = 0, restarts = 0;
		double t0 = now_s();

		env_init(&env, T0);
		make_dir(dir, sizeof(dir), tag);
		CHECK(store_open(dir, machine ? DURABILITY_MACHINE : DURABILITY_PROCESS, &s, err,
		                 sizeof(err)) == 0);
		if (!s)
			continue;
		store_set_wal_pages(s, 100, 1000000, 1000000);
		c = convo_new("w", 1);
		/* 1,500 commits, or more while the thread has not yet caught up three times: a
		 * round's sync of the database may wait for a disk busy with others' writes
		 * (CI: the first round had not ended when 1,500 commits at process had), and
		 * the commits go on meanwhile. Past 1,500 a commit every millisecond: a machine
		 * busy with other work then still gives the thread the time for its rounds. */
		while (n < 1500 || (restarts < 3 && n < 6000 && now_s() - t0 < 60)) {
			if (n >= 1500)
				usleep(1000);
			commit_each(s, c, &env, text, 1);
			n++;
			store_stats(s, &st);
			restarts += st.wal_pages < last;
			last = st.wal_pages;
			most = st.wal_pages > most ? st.wal_pages : most;
		}
		printf("%s: %d commits, %" PRIu64 " checkpoints (%" PRIu64 " catch-ups, %" PRIu64
		       " at the bound), the WAL started over %d times, at most %" PRIu64 " pages\n",
		       tag, n, st.checkpoints, st.catch_ups, st.bound_waits, restarts, most);
		/* Rounds of the thread, each followed by a catch-up, and the WAL started over
		 * after them; the bound out of reach. Without the catch-up, the rounds never
		 * reached the WAL's end while commits went on: it never started over, and grew
		 * to the 4,500 pages that 1,500 commits write. */
		CHECK(st.catch_ups > 0 && st.checkpoints > st.catch_ups && st.bound_waits == 0);
		CHECK(restarts >= 3);
		CHECK(store_load_conversation(s, "w", 1, &l) == 0);
		CHECK_SAME(c, l);
		convo_free(l);
		store_close(s);
		convo_free(c);
	}
}

/* Bytes this process has written so far (Linux /proc/self/io), or -1. */
static long long written_bytes(void)
{
	FILE *f = fopen("/proc/self/io", "r");
	char line[128];
	long long n = -1;
	while (f && fgets(line, sizeof(line), f)) {
		if (sscanf(line, "wchar: %lld", &n) == 1)
			break;
	}
	if (f)
		fclose(f);
	return n;
}

/* 100 conversations; each transaction stores one new message of each, as a loop turn
 * serving 100 clients would, with its conversation row and spool row. */
static void test_bench(void)
{
	enum { NCONV = 100 };
	const char *env_n = getenv("STORE_BENCH_MESSAGES");
	long total = env_n ? atol(env_n) : 100000;
	long per = total / NCONV;
	struct convo *c[NCONV] = {NULL};
	char dir[128], text[160];
	struct convo_env env;
	struct collect k = {.n = 0};
	struct store *s;
	double t0, t1;
	long long w0, w1;
	int rc = 0;

	if (per < 1)
		per = 1;
	env_init(&env, T0);
	make_dir(dir, sizeof(dir), "bench");
	if (!(s = open_store(dir)))
		return;
	for (int i = 0; i < NCONV; i++) {
		char id[32];
		snprintf(id, sizeof(id), "bench-%03d", i);
		CHECK((c[i] = convo_new(id, strlen(id))) != NULL);
	}
	/* Ids in the order a daemon would hand them out: turn by turn. */
	for (long j = 0; j < per; j++) {
		for (int i = 0; i < NCONV && c[i]; i++) {
			snprintf(text, sizeof(text),
			         "Message %ld of conversation %d: a sentence of ordinary length "
			         "as a voice assistant hears or says it.",
			         j, i);
			CHECK(add1(c[i], &env, j % 2 ? ROLE_ASSISTANT : ROLE_USER, text));
		}
	}
	w0 = written_bytes();
	t0 = now_s();
	for (long j = 0; j < per && !rc; j++) {
		rc = store_begin(s);
		for (int i = 0; i < NCONV && !rc; i++) {
			const struct message *m = c[i]->log[j];
			rc = store_put_message(s, c[i]->id, c[i]->id_len, m);
			if (!rc)
				rc = store_put_conversation(s, c[i]);
			if (!rc)
				rc = store_spool_put(s, c[i]->id, c[i]->id_len, m->id, m->version,
				                     100, T0);
		}
		rc = rc ? (store_rollback(s), rc) : store_commit(s);
	}
	t1 = now_s();
	w1 = written_bytes();
	CHECK(rc == 0);
	/* The checkpoint thread kept up: it ran, and the WAL never outgrew the size past which
	 * the writer checkpoints itself (32,000 pages) by more than a few transactions. */
	{
		char wal[192];
		struct stat st;
		snprintf(wal, sizeof(wal), "%s/convod.db-wal", dir);
		for (int t = 0; t < 6000 && store_checkpoints(s) == 0; t++)
			usleep(10000); /* a round may still run (the first starts at 64 MB) */
		CHECK(store_checkpoints(s) > 0);
		CHECK(stat(wal, &st) == 0);
		printf("store bench: the WAL ended at %lld bytes\n", (long long)st.st_size);
		/* STORE_WAL_HARD_PAGES, plus the commit that crossed it */
		CHECK(st.st_size < (off_t)34000 * (4096 + 24));
	}
	printf("store bench: %ld messages in %ld transactions of %d (durability process): "
	       "%.2f s, %.0f messages/s, %.0f bytes written per message\n",
	       per * NCONV, per, NCONV, t1 - t0, (double)(per * NCONV) / (t1 - t0),
	       w0 >= 0 && w1 >= 0 ? (double)(w1 - w0) / (double)(per * NCONV) : -1.0);
	CHECK(store_load_open(s, collect_cb, &k) == 0);
	CHECK(k.n == NCONV && k.messages == (size_t)(per * NCONV));
	printf("store bench: reloaded %zu conversations, %zu messages in %.2f s\n", k.n, k.messages,
	       now_s() - t1);
	store_close(s);
	for (int i = 0; i < NCONV; i++)
		convo_free(c[i]);
}

int main(void)
{
	const char *tmp = getenv("TMPDIR");
	if (!tmp || !*tmp || strlen(tmp) > 40) /* the paths built below stay short */
		tmp = "/tmp";
	snprintf(root, sizeof(root), "%s/test_store.XXXXXX", tmp);
	if (!mkdtemp(root)) {
		perror("mkdtemp");
		return 1;
	}
	test_durability();
	test_round_trip();
	test_closed();
	test_spool();
	test_repairs();
	test_sink_seen();
	test_purge();
	test_transactions();
	test_journal();
	test_dead_batches();
	test_dead_count();
	test_full_start();
	test_schema3();
	test_schema4();
	test_bad_files();
	test_bad_rows();
	test_unwritable();
	test_disk_full();
	test_async();
	test_cohort();
	test_sync_restore();
	test_sync_lost_mid_fold();
	test_wal_bound();
	test_wal_catch_up();
	test_wal_writeback();
	test_wal_writeback_no_fd();
	test_bench();
	nftw(root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
	return test_done("store");
}
