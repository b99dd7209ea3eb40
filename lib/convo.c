/* One conversation: the log, the LLM view and its two positions, and every operation of
 * semantics.md on them. Pure logic; the caller passes the clock and the id generator.
 *
 * Invariants kept by every operation (checked by convo_check):
 * - ids of non-summary messages strictly increase in log order, and a summary's id is
 *   greater than every id before it (so lookups by id are binary searches);
 * - a summary always directly follows an assistant message (the last one it summarizes);
 * - first_llm == last_summary + 1: the LLM view is the tail after the last summary;
 * - for every consumer w, no message before scan_from[w] is pending for w. */
#include "convo.h"

#include "ddbitem.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "buf.h"
#include "ops.h"

/* A growing text buffer; after the first allocation failure every append is a no-op and
 * failed stays set, so callers check once at the end. */
struct tbuf {
	char *p;
	size_t len, cap;
	bool failed;
};

static void buf_add(struct tbuf *b, const char *s, size_t n)
{
	if (b->failed)
		return;
	if (n >= SIZE_MAX / 2 - b->len) {
		b->failed = true;
		return;
	}
	if (b->len + n + 1 > b->cap) {
		size_t cap = b->cap ? b->cap : 256;
		while (cap < b->len + n + 1)
			cap *= 2;
		char *p = realloc(b->p, cap);
		if (!p) {
			b->failed = true;
			return;
		}
		b->p = p;
		b->cap = cap;
	}
	if (n)
		memcpy(b->p + b->len, s, n);
	b->len += n;
	b->p[b->len] = '\0';
}

static void buf_str(struct tbuf *b, const char *s)
{
	if (s)
		buf_add(b, s, strlen(s));
}

static void buf_char(struct tbuf *b, char ch)
{
	buf_add(b, &ch, 1);
}

static void buf_i64(struct tbuf *b, int64_t v)
{
	char tmp[32];
	int n = snprintf(tmp, sizeof(tmp), "%" PRId64, v);
	buf_add(b, tmp, (size_t)n);
}

static void buf_size(struct tbuf *b, size_t v)
{
	char tmp[32];
	int n = snprintf(tmp, sizeof(tmp), "%zu", v);
	buf_add(b, tmp, (size_t)n);
}

struct convo *convo_new(const char *id, size_t id_len)
{
	/* The id lies right after the struct, in the same block: one allocation fewer, and
	 * the registry's lookup, which reads the struct, compares the id next to it. */
	struct convo *c;

	if (id_len > SIZE_MAX - sizeof(*c) - 1 || !(c = calloc(1, sizeof(*c) + id_len + 1)))
		return NULL;
	c->id = (char *)(c + 1);
	if (id_len)
		memcpy(c->id, id, id_len);
	c->id[id_len] = '\0';
	c->id_len = id_len;
	c->last_summary = -1;
	return c;
}

void convo_free(struct convo *c)
{
	if (!c)
		return;
	for (size_t i = 0; i < c->nlog; i++)
		message_free(c->log[i]);
	free(c->log);
	free(c);
}

static bool is_summary(const struct convo *c, size_t i)
{
	return c->log[i]->role == ROLE_SUMMARY;
}

static int id_cmp(const char *a, const char *b)
{
	return memcmp(a, b, ULID_LEN);
}

/* Makes room for n log entries; c is unchanged on failure. */
static int reserve(struct convo *c, size_t n)
{
	if (n <= c->cap)
		return 0;
	size_t cap = c->cap ? c->cap : 16;
	while (cap < n) {
		if (cap > SIZE_MAX / 2 / sizeof(*c->log))
			return -ENOMEM;
		cap *= 2;
	}
	struct message **log = realloc(c->log, cap * sizeof(*log));
	if (!log)
		return -ENOMEM;
	c->log = log;
	c->cap = cap;
	return 0;
}

/* Message i changed or appeared: every consumer must look at it again. */
static void mark_changed(struct convo *c, size_t i)
{
	for (int w = 0; w < CONSUMER_COUNT; w++) {
		if (c->scan_from[w] > i)
			c->scan_from[w] = i;
	}
}

/* The time of a change to something last changed at prev: the wall clock, or prev when
 * the clock is behind it (set back by NTP, a resumed VM, a host without a real-time
 * clock), so that a message's and a conversation's updated never go back: a later
 * version is never older than an earlier one. */
static int64_t change_ms(const struct convo_env *env, int64_t prev)
{
	return env->now_ms > prev ? env->now_ms : prev;
}

/* Value of a canonical Crockford character (ids here are already valid). */
static unsigned b32_value(char ch)
{
	static const char alphabet[] = "0123456789ABCDEFGHJKMNPQRSTVWXYZ";
	const char *p = memchr(alphabet, ch, 32);
	return p ? (unsigned)(p - alphabet) : 0;
}

/* The newest id of the conversation: its last entry, or its last summary when that was
 * inserted before messages created earlier. NULL when empty. */
static const char *max_id(const struct convo *c)
{
	if (!c->nlog)
		return NULL;
	const char *m = c->log[c->nlog - 1]->id;
	if (c->last_summary >= 0 && id_cmp(c->log[c->last_summary]->id, m) > 0)
		m = c->log[c->last_summary]->id;
	return m;
}

/* Next id from the daemon's generator, forced above every id of c. A conversation restored
 * from another host may hold ids ahead of this generator (clock skew); the generator is then
 * moved past them, which keeps it strictly increasing. */
static void next_id(const struct convo *c, const struct convo_env *env, char out[ULID_LEN + 1])
{
	struct ulid_gen *g = env->ulid;
	const char *max = max_id(c);

	ulid_gen_next(g, env->now_ms > 0 ? (uint64_t)env->now_ms : 0, out);
	if (!max || id_cmp(out, max) > 0)
		return;
	uint64_t hi = 0, lo = 0;
	for (int i = 0; i < ULID_LEN; i++) {
		hi = (hi << 5) | (lo >> 59);
		lo = (lo << 5) | b32_value(max[i]);
	}
	g->last_ms = hi >> 16;
	g->last[0] = (uint8_t)(hi >> 8);
	g->last[1] = (uint8_t)hi;
	for (int i = 0; i < 8; i++)
		g->last[2 + i] = (uint8_t)(lo >> (56 - 8 * i));
	g->started = true;
	ulid_gen_next(g, g->last_ms, out);
}

/* The summary named id, knowing that every non-summary message before position q has a
 * smaller id. Summaries are sorted by id in log order and each one's id exceeds every id
 * before it, so the summary, if any, is at or before q and the walk back stops at the first
 * older summary: usually a few steps. */
static long find_summary(const struct convo *c, const char *id, size_t q)
{
	if (c->last_summary < 0 || id_cmp(id, c->log[c->last_summary]->id) > 0)
		return -1;
	size_t r = q < (size_t)c->last_summary ? q : (size_t)c->last_summary;
	for (;;) {
		if (is_summary(c, r)) {
			int cmp = id_cmp(c->log[r]->id, id);
			if (cmp == 0)
				return (long)r;
			if (cmp < 0)
				return -1;
		}
		if (r == 0)
			return -1;
		r--;
	}
}

long convo_find(const struct convo *c, const char *id, size_t id_len)
{
	if (!id || id_len != ULID_LEN || !c->nlog)
		return -1;
	/* Binary search over the non-summary messages; a probe that lands on a summary uses
	 * the nearest non-summary before it. Invariant: non-summaries in [0, lo) are smaller
	 * than id, those in [hi, nlog) greater. */
	size_t lo = 0, hi = c->nlog;
	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2, k = mid;
		while (k > lo && is_summary(c, k))
			k--;
		if (is_summary(c, k)) {
			lo = mid + 1;
			continue;
		}
		int cmp = id_cmp(c->log[k]->id, id);
		if (cmp == 0)
			return (long)k;
		if (cmp < 0)
			lo = mid + 1;
		else
			hi = k;
	}
	return find_summary(c, id, lo < c->nlog ? lo : c->nlog - 1);
}

/* Sum of lens, or TOO_LARGE when a text or the total does not fit. */
static enum error_code texts_bytes(const size_t *lens, size_t ntexts, size_t *total,
                                   struct error *err)
{
	size_t sum = 0;
	for (size_t i = 0; i < ntexts; i++) {
		if (lens[i] > UINT32_MAX || lens[i] > SIZE_MAX / 4 - sum)
			return error_set(err, ERR_TOO_LARGE, "contents: string too long");
		sum += lens[i];
	}
	*total = sum;
	return ERR_OK;
}

static enum error_code check_limits(const struct convo *c, const struct convo_env *env,
                                    size_t add_msgs, size_t add_bytes, struct error *err)
{
	const struct convo_limits *l = &env->limits;
	/* A change that adds no message (a merge) is never refused for the count, even where a
	 * restart under a lower limit left the conversation over it already. */
	if (l->max_messages && add_msgs && c->nlog + add_msgs > l->max_messages)
		return error_set(err, ERR_TOO_LARGE,
		                 "conversation: would exceed the limit of %zu messages",
		                 l->max_messages);
	if (l->max_bytes && (add_bytes > l->max_bytes || c->text_bytes > l->max_bytes - add_bytes))
		return error_set(err, ERR_TOO_LARGE,
		                 "conversation: would exceed the limit of %zu content bytes",
		                 l->max_bytes);
	return ERR_OK;
}

/* DynamoDB item limits (persistence.md, promise 4): a message whose item could never be
 * stored is refused before it is acknowledged. The exact check builds the item, so it
 * only runs when a cheap upper bound says the message may be near the limit. */
#define ITEM_BOUND_SAFE (DDBITEM_MAX_BYTES - 8192)
_Static_assert(MESSAGE_MERGES_MAX == DDBITEM_MAX_BYTES / 7, "message.h's bound on merges");

static size_t json_text_bound(const json_t *j)
{
	/* DynamoDB sizes a value by its UTF-8 bytes plus at most 3 bytes per container and
	 * 1 per element; twice the compact JSON text bounds that. */
	return j ? 2 * json_dumpb(j, NULL, 0, JSON_COMPACT) + 16 : 0;
}

/* True when j nests containers deeper than limit (stops early). */
static bool json_deeper_than(const json_t *j, int limit)
{
	const char *key;
	json_t *v;
	size_t i;

	if (!json_is_object(j) && !json_is_array(j))
		return false;
	if (limit <= 0)
		return true;
	if (json_is_array(j)) {
		json_array_foreach(j, i, v) if (json_deeper_than(v, limit - 1)) return true;
	} else {
		json_object_foreach((json_t *)j, key,
		                    v) if (json_deeper_than(v, limit - 1)) return true;
	}
	return false;
}

/* Upper bound on the item size of m after adding extra content bytes in nextra strings
 * and applying patch p (may be NULL); SIZE_MAX when aux nests deep enough to need the
 * exact depth check (aux sits 3 levels down in the item). */
static size_t item_bound(const struct convo *c, const struct message *m, size_t extra,
                         size_t nextra, const struct metadata_patch *p)
{
	if (json_deeper_than(m->aux, DDBITEM_MAX_DEPTH - 8) ||
	    (p && json_deeper_than(p->aux, DDBITEM_MAX_DEPTH - 8)))
		return SIZE_MAX;
	return 1024 + 2 * c->id_len + message_text_bytes(m) + extra +
	       2 * ((size_t)m->ncontents + nextra) + 32 * (size_t)m->nsummary_ids +
	       8 * ((size_t)m->merges + 1) + json_text_bound(m->aux) +
	       (p ? json_text_bound(p->aux) : 0);
}

/* The exact check of m's item. ERR_OK, ERR_TOO_LARGE or ERR_BAD_REQUEST (a value DynamoDB
 * cannot hold), ERR_INTERNAL on ENOMEM. */
static enum error_code item_check(const struct convo *c, const struct message *m, struct error *err)
{
	json_t *map = message_to_map(m);
	enum error_code rc;

	if (!map)
		return error_set(err, ERR_INTERNAL, "out of memory");
	rc = ddbitem_check(map, c->id, err);
	json_decref(map);
	return rc;
}

/* Before changing message i in a way that may push its item over the limit: a copy of it
 * to put back if it does (so putting it back cannot fail). *copy stays NULL when the
 * bound shows no check is needed. */
static enum error_code item_guard_begin(const struct convo *c, size_t i, size_t extra,
                                        size_t nextra, const struct metadata_patch *p,
                                        struct message **copy, struct error *err)
{
	const struct message *m = c->log[i];
	json_t *map;
	enum error_code rc;

	*copy = NULL;
	if (item_bound(c, m, extra, nextra, p) <= ITEM_BOUND_SAFE)
		return ERR_OK;
	map = message_to_map(m);
	if (!map)
		return error_set(err, ERR_INTERNAL, "out of memory");
	rc = message_from_map(map, m->version, copy, err);
	json_decref(map);
	if (rc != ERR_OK)
		return error_set(err, ERR_INTERNAL, "cannot copy message %s", m->id);
	(*copy)->updated_ms = m->updated_ms;
	memcpy((*copy)->seen, m->seen, sizeof(m->seen));
	return ERR_OK;
}

/* After the change: the exact check; over the limit, message i is put back as it was. */
static enum error_code item_guard_end(struct convo *c, size_t i, struct message *copy,
                                      struct error *err)
{
	enum error_code rc;

	if (!copy)
		return ERR_OK;
	rc = item_check(c, c->log[i], err);
	if (rc == ERR_OK) {
		message_free(copy);
		return ERR_OK;
	}
	message_free(c->log[i]);
	c->log[i] = copy;
	return rc;
}

static int append_texts(struct message *m, const char *const *texts, const size_t *lens,
                        size_t ntexts)
{
	for (size_t i = 0; i < ntexts; i++) {
		if (message_append_text(m, texts[i], lens[i]) < 0)
			return -ENOMEM;
	}
	return 0;
}

/* A new message with id, role, texts and patch; NULL on ENOMEM. */
static struct message *build_message(const struct convo *c, const struct convo_env *env,
                                     enum role role, const char *const *texts, const size_t *lens,
                                     size_t ntexts, const struct metadata_patch *patch)
{
	char id[ULID_LEN + 1];
	next_id(c, env, id);
	/* Every message has a first text: it goes in the message's own block. */
	struct message *m = ntexts ? message_new_text(id, role, env->now_ms, texts[0], lens[0])
	                           : message_new(id, role, env->now_ms);
	if (!m || (ntexts && append_texts(m, texts + 1, lens + 1, ntexts - 1) < 0) ||
	    (patch && message_patch_apply(m, patch) < 0)) {
		message_free(m);
		return NULL;
	}
	/* Created while the wall clock is behind the conversation's last change: updated keeps
	 * that time (creation keeps the clock's), so no item is older than the last change. */
	m->updated_ms = change_ms(env, c->updated_ms);
	return m;
}

enum error_code convo_add(struct convo *c, const struct convo_env *env, enum role role,
                          const char *const *texts, const size_t *lens, size_t ntexts,
                          const struct metadata_patch *patch, struct message **out, bool *merged,
                          struct error *err)
{
	struct message *fake = NULL, *m = NULL;
	enum error_code rc;
	size_t bytes = 0;

	if (role != ROLE_USER && role != ROLE_ASSISTANT)
		return error_set(err, ERR_BAD_REQUEST, "role: expected \"user\" or \"assistant\"");
	if (!ntexts)
		return error_set(err, ERR_BAD_REQUEST,
		                 "contents: expected at least one non-blank string");
	if ((rc = texts_bytes(lens, ntexts, &bytes, err)))
		return rc;

	bool view_empty = c->first_llm >= c->nlog;
	bool need_fake = role == ROLE_ASSISTANT && view_empty;
	struct message *last = view_empty ? NULL : c->log[c->nlog - 1];
	bool merge = last && last->role == role;
	size_t add_msgs = (need_fake ? 1 : 0) + (merge ? 0 : 1);
	if (need_fake)
		bytes += 3;
	if ((rc = check_limits(c, env, add_msgs, bytes, err)))
		return rc;

	if (merge) {
		uint32_t old_n = last->ncontents;
		struct message *copy = NULL;
		if (ntexts > UINT32_MAX - old_n || last->merges == UINT32_MAX)
			return error_set(err, ERR_TOO_LARGE, "contents: too many strings");
		if ((rc = item_guard_begin(c, c->nlog - 1, bytes, ntexts, patch, &copy, err)))
			return rc;
		if (append_texts(last, texts, lens, ntexts) < 0 ||
		    (patch && message_patch_apply(last, patch) < 0)) {
			message_truncate_contents(last, old_n);
			message_free(copy);
			return error_set(err, ERR_INTERNAL, "out of memory");
		}
		last->merges++;
		if ((rc = item_guard_end(c, c->nlog - 1, copy, err)))
			return rc;
		last = c->log[c->nlog - 1];
		last->version++;
		last->updated_ms = change_ms(env, last->updated_ms);
		mark_changed(c, c->nlog - 1);
		m = last;
	} else {
		static const char *const dots[] = {"..."};
		static const size_t dots_len[] = {3};
		if (reserve(c, c->nlog + add_msgs) < 0)
			return error_set(err, ERR_INTERNAL, "out of memory");
		if (need_fake) {
			fake = build_message(c, env, ROLE_USER, dots, dots_len, 1, NULL);
			if (!fake)
				return error_set(err, ERR_INTERNAL, "out of memory");
			fake->fake = true;
			/* Appended now so that the message's id is generated above the fake's. */
			c->log[c->nlog++] = fake;
		}
		m = build_message(c, env, role, texts, lens, ntexts, patch);
		if (m && item_bound(c, m, 0, 0, NULL) > ITEM_BOUND_SAFE &&
		    (rc = item_check(c, m, err)) != ERR_OK) {
			message_free(m);
			if (fake) {
				c->nlog--;
				message_free(fake);
			}
			return rc;
		}
		if (!m) {
			if (fake) {
				c->nlog--;
				message_free(fake);
			}
			return error_set(err, ERR_INTERNAL, "out of memory");
		}
		if (fake)
			mark_changed(c, c->nlog - 1);
		c->log[c->nlog++] = m;
		mark_changed(c, c->nlog - 1);
	}
	c->text_bytes += bytes;
	c->updated_ms = change_ms(env, c->updated_ms);
	if (out)
		*out = m;
	if (merged)
		*merged = merge;
	return ERR_OK;
}

void convo_summary_format_default(struct summary_format *f)
{
	f->preamble = "";
	f->include_previous_summary = false;
	f->prefix = "[";
	f->postfix = "]: ";
	f->user_tag = "User";
	f->assistant_tag = "Assistant";
	f->summary_tag = "Previous Dialogue";
	f->separator = " ";
	f->closure = "\n";
	f->summary_closure = "\n\n";
}

/* fmt(m) of semantics.md. */
static void format_message(struct tbuf *b, const struct message *m, const struct summary_format *f)
{
	const char *tag = m->role == ROLE_USER        ? f->user_tag
	                  : m->role == ROLE_ASSISTANT ? f->assistant_tag
	                                              : f->summary_tag;
	bool first = true;

	buf_str(b, f->prefix);
	buf_str(b, tag);
	buf_str(b, f->postfix);
	for (uint32_t i = 0; i < m->ncontents; i++) {
		const struct text *t = m->contents[i];
		if (!t->len)
			continue;
		if (!first)
			buf_str(b, f->separator);
		first = false;
		buf_add(b, t->bytes, t->len);
		char end = t->bytes[t->len - 1];
		if (end != '.' && end != '?' && end != '!')
			buf_char(b, '.');
	}
}

static int set_new(json_t *obj, const char *key, json_t *v)
{
	return v ? json_object_set_new_nocheck(obj, key, v) : -1;
}

static int append_new(json_t *arr, json_t *v)
{
	return v ? json_array_append_new(arr, v) : -1;
}

static json_t *contents_json(const struct message *m)
{
	json_t *arr = json_array();
	for (uint32_t i = 0; arr && i < m->ncontents; i++) {
		if (append_new(arr, json_stringn(m->contents[i]->bytes, m->contents[i]->len)) < 0) {
			json_decref(arr);
			return NULL;
		}
	}
	return arr;
}

static json_t *summary_item(const struct message *m, size_t index)
{
	json_t *o = json_object();
	if (!o || set_new(o, "id", json_stringn_nocheck(m->id, ULID_LEN)) < 0 ||
	    set_new(o, "role", json_string_nocheck(message_role_str(m->role))) < 0 ||
	    set_new(o, "contents", contents_json(m)) < 0 ||
	    set_new(o, "index", json_integer((json_int_t)index)) < 0 ||
	    set_new(o, "version", json_integer(m->version)) < 0) {
		json_decref(o);
		return NULL;
	}
	return o;
}

json_t *convo_summary_info(const struct convo *c, const struct summary_format *f)
{
	struct summary_format defaults;
	struct tbuf text = {0};
	json_t *res = NULL, *msgs, *ids, *versions;
	const struct message *prev = NULL;
	size_t last_a = c->nlog;

	if (!f) {
		convo_summary_format_default(&defaults);
		f = &defaults;
	}
	/* The view alternates, so this walk back takes at most two steps. */
	for (size_t i = c->nlog; i > c->first_llm; i--) {
		if (c->log[i - 1]->role == ROLE_ASSISTANT) {
			last_a = i - 1;
			break;
		}
	}
	if (last_a < c->nlog && c->last_summary >= 0)
		prev = c->log[c->last_summary];

	res = json_object();
	if (!res || set_new(res, "messages", msgs = json_array()) < 0 ||
	    set_new(res, "previous_summary", prev ? message_to_map(prev) : json_null()) < 0 ||
	    set_new(res, "ids", ids = json_array()) < 0 ||
	    set_new(res, "versions", versions = json_array()) < 0)
		goto fail;

	buf_str(&text, f->preamble);
	if (prev) {
		if (append_new(ids, json_stringn_nocheck(prev->id, ULID_LEN)) < 0 ||
		    append_new(versions, json_integer(prev->version)) < 0)
			goto fail;
		if (f->include_previous_summary) {
			format_message(&text, prev, f);
			buf_str(&text, f->summary_closure);
		}
	}
	bool first = true;
	for (size_t i = c->first_llm; last_a < c->nlog && i <= last_a; i++) {
		const struct message *m = c->log[i];
		if (m->fake || m->role == ROLE_SUMMARY)
			continue;
		if (append_new(msgs, summary_item(m, i)) < 0 ||
		    append_new(ids, json_stringn_nocheck(m->id, ULID_LEN)) < 0 ||
		    append_new(versions, json_integer(m->version)) < 0)
			goto fail;
		if (!first)
			buf_str(&text, f->closure);
		first = false;
		format_message(&text, m, f);
	}
	if (text.failed || set_new(res, "text", json_stringn(text.p ? text.p : "", text.len)) < 0)
		goto fail;
	free(text.p);
	return res;
fail:
	free(text.p);
	json_decref(res);
	return NULL;
}

/* Could the non-fake message at p ever have started an LLM view? Views start at the log's
 * beginning or right after a summary, possibly with a fake user message first. */
static bool view_start_ever(const struct convo *c, size_t p)
{
	if (p > 0 && c->log[p - 1]->fake)
		p--;
	return p == 0 || is_summary(c, p - 1);
}

/* The first non-fake message of the current LLM view (nlog if none). */
static size_t view_first_real(const struct convo *c)
{
	size_t f = c->first_llm;
	if (f < c->nlog && c->log[f]->fake)
		f++;
	return f;
}

/* Checks ids/versions as semantics.md says. Returns BAD_REQUEST for ids that never could be
 * valid (these win, as protocol.md orders codes) or CONFLICT for ids that were valid once;
 * on success *last is the position of the last named message. */
static enum error_code check_summary_ids(const struct convo *c, const char *const *ids, size_t nids,
                                         const int64_t *versions, size_t nversions, size_t *last,
                                         struct error *err)
{
	struct error conflict = {ERR_OK, ""};
	long prev = -1;

	if (!nids)
		return error_set(err, ERR_BAD_REQUEST, "ids: expected a non-empty array of ids");
	if (nversions && nversions != nids)
		return error_set(err, ERR_BAD_REQUEST,
		                 "versions: expected one version per id (%zu ids, %zu versions)",
		                 nids, nversions);
	for (size_t i = 0; i < nids; i++) {
		if (!ids[i] || strnlen(ids[i], ULID_LEN + 1) != ULID_LEN ||
		    !ulid_valid(ids[i], ULID_LEN))
			return error_set(err, ERR_BAD_REQUEST,
			                 "ids[%zu]: expected a message id (a 26-character ULID)",
			                 i);
		long p = convo_find(c, ids[i], ULID_LEN);
		if (p < 0)
			return error_set(err, ERR_BAD_REQUEST,
			                 "ids[%zu]: no message %s in this conversation", i, ids[i]);
		const struct message *m = c->log[p];
		if (nversions) {
			if (versions[i] < 1 || versions[i] > (int64_t)m->version)
				return error_set(
				    err, ERR_BAD_REQUEST,
				    "versions[%zu]: message %s never had version %" PRId64, i,
				    ids[i], versions[i]);
			if (versions[i] != (int64_t)m->version && !conflict.code)
				error_set(
				    &conflict, ERR_CONFLICT,
				    "versions[%zu]: message %s changed since (version %" PRId64
				    ", now %" PRIu32 ")",
				    i, ids[i], versions[i], m->version);
		}
		if (m->role == ROLE_SUMMARY) {
			if (i > 0)
				return error_set(err, ERR_BAD_REQUEST,
				                 "ids[%zu]: a summary id can only come first", i);
			if (p != c->last_summary && !conflict.code)
				error_set(&conflict, ERR_CONFLICT,
				          "ids[0]: summary %s is no longer the last summary",
				          ids[i]);
			continue;
		}
		if (m->fake)
			return error_set(err, ERR_BAD_REQUEST,
			                 "ids[%zu]: %s is a fake message, never summarized", i,
			                 ids[i]);
		if (prev < 0) {
			if (!view_start_ever(c, (size_t)p))
				return error_set(err, ERR_BAD_REQUEST,
				                 "ids[%zu]: %s does not start an LLM view", i,
				                 ids[i]);
			if ((size_t)p != view_first_real(c) && !conflict.code)
				error_set(&conflict, ERR_CONFLICT,
				          "ids[%zu]: %s no longer starts the LLM view (summarized "
				          "since)",
				          i, ids[i]);
		} else if (p <= prev) {
			return error_set(err, ERR_BAD_REQUEST,
			                 "ids[%zu]: %s is not after ids[%zu] in the log", i, ids[i],
			                 i - 1);
		} else if (p > prev + 1) {
			/* A summary inserted since sits right after one of the named messages. */
			if (!is_summary(c, (size_t)prev + 1))
				return error_set(err, ERR_BAD_REQUEST,
				                 "ids[%zu]: a message is missing before %s", i,
				                 ids[i]);
			if (!conflict.code)
				error_set(&conflict, ERR_CONFLICT,
				          "ids[%zu]: a summary was added before %s since", i,
				          ids[i]);
		}
		prev = p;
	}
	if (prev < 0)
		return error_set(err, ERR_BAD_REQUEST,
		                 "ids: expected at least one message id after the summary id");
	if (c->log[prev]->role != ROLE_ASSISTANT)
		return error_set(err, ERR_BAD_REQUEST,
		                 "ids[%zu]: the last id must name an assistant message", nids - 1);
	if (conflict.code) {
		if (err)
			*err = conflict;
		return ERR_CONFLICT;
	}
	*last = (size_t)prev;
	return ERR_OK;
}

enum error_code convo_add_summary(struct convo *c, const struct convo_env *env,
                                  const char *const *texts, const size_t *lens, size_t ntexts,
                                  const char *const *ids, size_t nids, const int64_t *versions,
                                  size_t nversions, struct message **out, struct error *err)
{
	struct message *s = NULL;
	enum error_code rc;
	size_t bytes = 0, last = 0;

	if ((rc = texts_bytes(lens, ntexts, &bytes, err)))
		return rc;
	if ((rc = check_limits(c, env, 1, bytes, err)))
		return rc;
	if (!ntexts)
		return error_set(err, ERR_BAD_REQUEST,
		                 "contents: expected at least one non-blank string");
	if (nids > UINT32_MAX)
		return error_set(err, ERR_BAD_REQUEST, "ids: too many ids");
	if ((rc = check_summary_ids(c, ids, nids, versions, nversions, &last, err)))
		return rc;

	if (reserve(c, c->nlog + 1) < 0)
		goto nomem;
	s = build_message(c, env, ROLE_SUMMARY, texts, lens, ntexts, NULL);
	if (!s)
		goto nomem;
	s->summary_ids = malloc(nids * sizeof(*s->summary_ids));
	if (!s->summary_ids)
		goto nomem;
	for (size_t i = 0; i < nids; i++) {
		memcpy(s->summary_ids[i], ids[i], ULID_LEN);
		s->summary_ids[i][ULID_LEN] = '\0';
	}
	s->nsummary_ids = (uint32_t)nids;
	if (item_bound(c, s, 0, 0, NULL) > ITEM_BOUND_SAFE && (rc = item_check(c, s, err))) {
		message_free(s);
		return rc;
	}

	size_t p = last + 1;
	memmove(&c->log[p + 1], &c->log[p], (c->nlog - p) * sizeof(*c->log));
	c->log[p] = s;
	c->nlog++;
	c->last_summary = (long)p;
	c->first_llm = p + 1;
	c->text_bytes += bytes;
	c->updated_ms = change_ms(env, c->updated_ms);
	mark_changed(c, p);
	if (out)
		*out = s;
	return ERR_OK;
nomem:
	message_free(s);
	return error_set(err, ERR_INTERNAL, "out of memory");
}

struct message *convo_last_summary(const struct convo *c)
{
	return c->last_summary >= 0 ? c->log[c->last_summary] : NULL;
}

enum error_code convo_set_metadata(struct convo *c, const struct convo_env *env, size_t i,
                                   const struct metadata_patch *patch, struct error *err)
{
	if (i >= c->nlog)
		return error_set(err, ERR_INTERNAL, "message index %zu out of range", i);
	struct message *m = c->log[i];
	struct message *copy = NULL;
	enum error_code rc;
	if (!patch || !message_patch_changes(m, patch))
		return ERR_OK;
	if ((rc = item_guard_begin(c, i, 0, 0, patch, &copy, err)))
		return rc;
	if (message_patch_apply(m, patch) < 0) {
		message_free(copy);
		return error_set(err, ERR_INTERNAL, "out of memory");
	}
	if ((rc = item_guard_end(c, i, copy, err)))
		return rc;
	m = c->log[i];
	m->version++;
	m->updated_ms = change_ms(env, m->updated_ms);
	c->updated_ms = change_ms(env, c->updated_ms);
	mark_changed(c, i);
	return ERR_OK;
}

bool convo_pending(const struct message *m, enum consumer who)
{
	return m->seen[who] != m->version;
}

/* End (exclusive) of what an incremental take may pass. */
static size_t take_end(const struct convo *c, bool exclude_last)
{
	return exclude_last && c->nlog ? c->nlog - 1 : c->nlog;
}

/* After everything in [scan_from, end) was taken: nothing before end is pending, and when
 * end is the last (excluded) message and it is not pending either, nothing at all is. */
static void advance_scan(struct convo *c, enum consumer who, size_t end)
{
	if (end < c->nlog && !convo_pending(c->log[end], who))
		end = c->nlog;
	c->scan_from[who] = end;
}

size_t convo_take(struct convo *c, enum consumer who, bool exclude_last,
                  void (*fn)(void *arg, const struct message *m, size_t index), void *arg)
{
	size_t end = take_end(c, exclude_last), n = 0;
	for (size_t i = c->scan_from[who]; i < end; i++) {
		struct message *m = c->log[i];
		if (!convo_pending(m, who))
			continue;
		if (fn)
			fn(arg, m, i);
		m->seen[who] = m->version;
		n++;
	}
	advance_scan(c, who, end);
	if (who == CONSUMER_CLIENT && n)
		c->client_takes++;
	return n;
}

/* The messages to_messages_map returns are those of [*from, end) that map_wanted keeps: the
 * whole log, or those the client has not taken (marked only once the answer is out). */
static size_t map_range(const struct convo *c, bool incremental, bool exclude_last, size_t *from)
{
	*from = incremental ? c->scan_from[CONSUMER_CLIENT] : 0;
	return incremental ? take_end(c, exclude_last) : c->nlog;
}

static bool map_wanted(const struct convo *c, bool incremental, size_t i)
{
	return !incremental || convo_pending(c->log[i], CONSUMER_CLIENT);
}

json_t *convo_to_messages_map_build(const struct convo *c, bool incremental, bool exclude_last)
{
	json_t *res = json_object(), *arr = json_array();
	size_t i, end = map_range(c, incremental, exclude_last, &i);

	if (!res || !arr)
		goto fail;
	for (; i < end; i++) {
		if (map_wanted(c, incremental, i) && append_new(arr, message_to_map(c->log[i])) < 0)
			goto fail;
	}
	if (json_object_set_nocheck(res, "messages", arr) < 0)
		goto fail;
	json_decref(arr);
	return res;
fail:
	json_decref(arr);
	json_decref(res);
	return NULL;
}

/* Writes {"messages":[ and the maps of the messages of [from, end) that keep(c, i, arg)
 * allows, comma-separated, leaving the array open: the start of both direct writers. */
static int write_map_list(const struct convo *c, struct buf *b, size_t from, size_t end,
                          bool (*keep)(const struct convo *c, bool arg, size_t i), bool arg)
{
	bool first = true;
	int rc;

	if (buf_append(b, "{\"messages\":[", 13) < 0)
		return -ENOMEM;
	for (size_t i = from; i < end; i++) {
		if (!keep(c, arg, i))
			continue;
		if (!first && buf_append(b, ",", 1) < 0)
			return -ENOMEM;
		first = false;
		if ((rc = message_write_map(b, c->log[i])) < 0)
			return rc;
	}
	return 0;
}

int convo_write_messages_map(const struct convo *c, bool incremental, bool exclude_last,
                             struct buf *b)
{
	size_t from, end = map_range(c, incremental, exclude_last, &from);
	int rc = write_map_list(c, b, from, end, map_wanted, incremental);

	return rc < 0 ? rc : buf_append(b, "]}", 2);
}

void convo_to_messages_map_taken(struct convo *c, bool exclude_last)
{
	convo_take(c, CONSUMER_CLIENT, exclude_last, NULL, NULL);
}

json_t *convo_to_messages_map(struct convo *c, bool incremental, bool exclude_last)
{
	json_t *res = convo_to_messages_map_build(c, incremental, exclude_last);
	if (res && incremental)
		convo_to_messages_map_taken(c, exclude_last);
	return res;
}

int convo_render_format(const char *name)
{
	static const char *const names[] = {
	    [RENDER_META] = "meta",
	    [RENDER_BEDROCK] = "bedrock",
	    [RENDER_ANTHROPIC] = "anthropic",
	    [RENDER_OPENAI] = "openai",
	};
	for (int i = 0; name && i < (int)(sizeof(names) / sizeof(names[0])); i++) {
		if (strcmp(name, names[i]) == 0)
			return i;
	}
	return -1;
}

/* One message of the view in a provider format: each content string one text block. */
static json_t *render(const struct message *m, enum render_format fmt)
{
	if (fmt == RENDER_META)
		return message_to_map(m);
	json_t *o = json_object(), *content = json_array();
	if (!o || !content ||
	    set_new(o, "role", json_string_nocheck(message_role_str(m->role))) < 0)
		goto fail;
	for (uint32_t i = 0; i < m->ncontents; i++) {
		json_t *block = json_object();
		if (append_new(content, block) < 0)
			goto fail;
		if (fmt != RENDER_BEDROCK &&
		    set_new(block, "type", json_string_nocheck("text")) < 0)
			goto fail;
		if (set_new(block, "text",
		            json_stringn(m->contents[i]->bytes, m->contents[i]->len)) < 0)
			goto fail;
	}
	if (set_new(o, "content", content) < 0) {
		content = NULL;
		goto fail;
	}
	return o;
fail:
	json_decref(content);
	json_decref(o);
	return NULL;
}

json_t *convo_get_messages(const struct convo *c, enum render_format fmt)
{
	const struct message *s = convo_last_summary(c);
	json_t *res = json_object(), *arr = json_array();
	if (!res || !arr)
		goto fail;
	for (size_t i = c->first_llm; i < c->nlog; i++) {
		if (!is_summary(c, i) && append_new(arr, render(c->log[i], fmt)) < 0)
			goto fail;
	}
	if (json_object_set_nocheck(res, "messages", arr) < 0)
		goto fail;
	json_decref(arr);
	arr = NULL;
	if (set_new(res, "summary", s ? contents_json(s) : json_null()) < 0)
		goto fail;
	return res;
fail:
	json_decref(arr);
	json_decref(res);
	return NULL;
}

/* The LLM view leaves summaries out (the last one's contents follow it). */
static bool view_wanted(const struct convo *c, bool unused, size_t i)
{
	(void)unused;
	return !is_summary(c, i);
}

int convo_write_messages(const struct convo *c, struct buf *b)
{
	const struct message *s = convo_last_summary(c);
	int rc = write_map_list(c, b, c->first_llm, c->nlog, view_wanted, false);

	if (rc < 0)
		return rc;
	if (buf_append(b, "],\"summary\":", 12) < 0)
		return -ENOMEM;
	if (!s)
		rc = buf_append(b, "null", 4);
	else
		rc = message_write_contents(b, s);
	if (rc < 0)
		return rc;
	return buf_append(b, "}", 1);
}

/* Content bytes for describe: raw, except NUL bytes, written as \0 so the text stays a C
 * string. */
static void describe_text(struct tbuf *b, const struct text *t)
{
	size_t start = 0;
	for (size_t i = 0; i < t->len; i++) {
		if (t->bytes[i] == '\0') {
			buf_add(b, t->bytes + start, i - start);
			buf_str(b, "\\0");
			start = i + 1;
		}
	}
	buf_add(b, t->bytes + start, t->len - start);
}

/* The "{...}" metadata of a describe row, in the seed's order. */
static void describe_metadata(struct tbuf *b, const struct message *m)
{
	bool any = false;

	buf_char(b, '{');
	if (m->fake || m->merges) {
		buf_str(b, "attribute=[");
		if (m->fake)
			buf_str(b, "fake");
		for (uint32_t i = 0; i < m->merges; i++)
			buf_str(b, i || m->fake ? ", merged" : "merged");
		buf_char(b, ']');
		any = true;
	}
	if (m->nsummary_ids) {
		buf_str(b, any ? ", summaryIds=[" : "summaryIds=[");
		for (uint32_t i = 0; i < m->nsummary_ids; i++) {
			if (i)
				buf_str(b, ", ");
			buf_add(b, m->summary_ids[i], ULID_LEN);
		}
		buf_char(b, ']');
		any = true;
	}
	if (m->aux) {
		char *s = json_dumps(m->aux, JSON_COMPACT);
		if (!s) {
			b->failed = true;
			return;
		}
		buf_str(b, any ? ", aux=" : "aux=");
		buf_str(b, s);
		free(s);
		any = true;
	}
	buf_str(b, any ? ", timing=[" : "timing=[");
	bool first = true;
	for (int k = 0; k < TIMING_COUNT; k++) {
		int64_t v = message_timing(m, (enum timing_key)k);
		if (v < 0)
			continue;
		buf_str(b, first ? "{" : ", {");
		first = false;
		buf_str(b, message_timing_str((enum timing_key)k));
		buf_char(b, '=');
		buf_i64(b, v);
		buf_char(b, '}');
	}
	buf_str(b, "]}");
}

char *convo_describe(const struct convo *c)
{
	struct tbuf b = {0};
	size_t first_pending = c->nlog;

	buf_str(&b, "META MESSAGES ('*' -> first message to LLM, '-' -> next message to convert "
	            "into a Map, '^' -> last summary message):\n");
	for (size_t i = 0; i < c->nlog; i++) {
		const struct message *m = c->log[i];
		bool pending = convo_pending(m, CONSUMER_CLIENT);
		char head[64];
		if (pending && first_pending == c->nlog)
			first_pending = i;
		int n = snprintf(head, sizeof(head), "%-4zu%c%c%c [", i,
		                 i == c->first_llm            ? '*'
		                 : (long)i == c->last_summary ? '^'
		                                              : ' ',
		                 pending ? '-' : ' ', ' ');
		buf_add(&b, head, (size_t)n);
		buf_str(&b, message_role_str(m->role));
		buf_str(&b, "] {");
		for (uint32_t j = 0; j < m->ncontents; j++) {
			buf_str(&b, j ? " '" : "'");
			describe_text(&b, m->contents[j]);
			buf_char(&b, '\'');
		}
		buf_str(&b, "} -- '");
		buf_add(&b, m->id, ULID_LEN);
		buf_str(&b, "' ");
		describe_metadata(&b, m);
		buf_str(&b, i + 1 < c->nlog ? ",\n" : ".\n");
	}
	buf_str(&b, ".  - -> index ");
	buf_size(&b, first_pending);
	buf_str(&b, ".\n");
	if (b.failed) {
		free(b.p);
		return NULL;
	}
	return b.p;
}

int convo_restore_append(struct convo *c, struct message *m)
{
	if (!m)
		return -EINVAL;
	if (reserve(c, c->nlog + 1) < 0) {
		message_free(m);
		return -ENOMEM;
	}
	c->log[c->nlog++] = m;
	return 0;
}

enum error_code convo_restore_finish(struct convo *c, struct error *err)
{
	c->last_summary = -1;
	c->text_bytes = 0;
	c->updated_ms = 0;
	for (int w = 0; w < CONSUMER_COUNT; w++)
		c->scan_from[w] = c->nlog;
	for (size_t i = 0; i < c->nlog; i++) {
		const struct message *m = c->log[i];
		if (m->role == ROLE_SUMMARY)
			c->last_summary = (long)i;
		c->text_bytes += message_text_bytes(m);
		if (m->updated_ms > c->updated_ms)
			c->updated_ms = m->updated_ms;
		for (int w = 0; w < CONSUMER_COUNT; w++) {
			if (c->scan_from[w] == c->nlog && convo_pending(m, (enum consumer)w))
				c->scan_from[w] = i;
		}
	}
	c->first_llm = (size_t)(c->last_summary + 1);
	/* What the rules never leave in a log (ops drop blank strings; convo_add trusts its
	 * caller, so convo_check does not look): a stored one was not written by convod. */
	for (size_t i = 0; i < c->nlog; i++) {
		const struct message *m = c->log[i];
		for (uint32_t k = 0; k < m->ncontents; k++) {
			if (ops_text_blank(m->contents[k]->bytes, m->contents[k]->len))
				return error_set(err, ERR_INTERNAL,
				                 "invariant: message %zu holds a blank string", i);
		}
	}
	return convo_check(c, err);
}

enum error_code convo_check(const struct convo *c, struct error *err)
{
	const char *max = NULL, *last_plain = NULL;
	long last_summary = -1;
	size_t bytes = 0;
	int next_role = ROLE_USER; /* of the next message other than a summary */

	if (c->nlog > c->cap || (c->nlog && !c->log))
		return error_set(err, ERR_INTERNAL, "invariant: log size");
	for (size_t i = 0; i < c->nlog; i++) {
		const struct message *m = c->log[i];
		if (!m || m->role > ROLE_SUMMARY || !m->ncontents || !m->version)
			return error_set(err, ERR_INTERNAL,
			                 "invariant: message %zu has no role, contents or version",
			                 i);
		if (!ulid_valid(m->id, strlen(m->id)))
			return error_set(err, ERR_INTERNAL, "invariant: message %zu has a bad id",
			                 i);
		if (m->fake && m->role != ROLE_USER)
			return error_set(err, ERR_INTERNAL, "invariant: fake message %zu not user",
			                 i);
		/* A fake is "..." put before an assistant message that would start a view: at the
		 * log's start or right after a summary, never last. */
		if (m->fake && ((i && c->log[i - 1]->role != ROLE_SUMMARY) || i + 1 == c->nlog ||
		                m->ncontents != 1 || m->contents[0]->len != 3 ||
		                memcmp(m->contents[0]->bytes, "...", 3) != 0))
			return error_set(
			    err, ERR_INTERNAL,
			    "invariant: fake message %zu not a \"...\" starting a view", i);
		/* The whole log alternates, summaries aside (summarized turns included). */
		if (m->role != ROLE_SUMMARY) {
			if (m->role != next_role)
				return error_set(err, ERR_INTERNAL,
				                 "invariant: roles do not alternate at %zu", i);
			next_role = next_role == ROLE_USER ? ROLE_ASSISTANT : ROLE_USER;
		}
		if (m->creation_ms < 0)
			return error_set(err, ERR_INTERNAL,
			                 "invariant: message %zu has no creation time", i);
		if (m->role == ROLE_SUMMARY) {
			if (!i || c->log[i - 1]->role != ROLE_ASSISTANT)
				return error_set(err, ERR_INTERNAL,
				                 "invariant: summary %zu does not follow an "
				                 "assistant message",
				                 i);
			if (id_cmp(m->id, max) <= 0)
				return error_set(err, ERR_INTERNAL,
				                 "invariant: summary %zu id not above earlier ids",
				                 i);
			last_summary = (long)i;
		} else {
			if (last_plain && id_cmp(m->id, last_plain) <= 0)
				return error_set(err, ERR_INTERNAL,
				                 "invariant: message ids not increasing at %zu", i);
			last_plain = m->id;
		}
		if (!max || id_cmp(m->id, max) > 0)
			max = m->id;
		bytes += message_text_bytes(m);
		for (int w = 0; w < CONSUMER_COUNT; w++) {
			if (m->seen[w] > m->version)
				return error_set(err, ERR_INTERNAL,
				                 "invariant: message %zu seen at a future version",
				                 i);
			if (i < c->scan_from[w] && convo_pending(m, (enum consumer)w))
				return error_set(
				    err, ERR_INTERNAL,
				    "invariant: message %zu pending before scan_from[%d]", i, w);
		}
	}
	if (last_summary != c->last_summary)
		return error_set(err, ERR_INTERNAL, "invariant: last summary position");
	if (c->first_llm != (size_t)(c->last_summary + 1) || c->first_llm > c->nlog)
		return error_set(err, ERR_INTERNAL, "invariant: first LLM message position");
	for (int w = 0; w < CONSUMER_COUNT; w++) {
		if (c->scan_from[w] > c->nlog)
			return error_set(err, ERR_INTERNAL, "invariant: scan_from[%d] out of range",
			                 w);
	}
	if (bytes != c->text_bytes)
		return error_set(err, ERR_INTERNAL, "invariant: text_bytes %zu, contents hold %zu",
		                 c->text_bytes, bytes);
	for (size_t i = c->first_llm; i < c->nlog; i++) {
		const struct message *m = c->log[i];
		if (m->role == ROLE_SUMMARY)
			return error_set(err, ERR_INTERNAL, "invariant: summary %zu in the view",
			                 i);
		if (i == c->first_llm && m->role != ROLE_USER)
			return error_set(err, ERR_INTERNAL,
			                 "invariant: the view does not start with a user message");
		if (i > c->first_llm && m->role == c->log[i - 1]->role)
			return error_set(err, ERR_INTERNAL,
			                 "invariant: roles do not alternate at %zu", i);
	}
	return ERR_OK;
}
