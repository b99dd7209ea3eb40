/* One message of a log: its storage, its metadata patches and its message map (semantics.md,
 * "Mapping the log"). m->aux is never modified in place, only replaced, so maps may share it. */
#include "message.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "buf.h"
#include "ops.h"

/* The wire names of the timing keys, in enum timing_key order: one list for both tables
 * below (the names, and the quoted keys message_write_map writes). */
#define TIMING_NAMES(X)                                                                            \
	X("creation")                                                                              \
	X("playStart") X("playEnd") X("listenStart") X("listenEnd") X("llmStart") X("llmEnd")

static const char *const timing_names[TIMING_COUNT] = {
#define NAME(name) name,
    TIMING_NAMES(NAME)
#undef NAME
};

const char *message_role_str(enum role r)
{
	switch (r) {
	case ROLE_USER:
		return "user";
	case ROLE_ASSISTANT:
		return "assistant";
	case ROLE_SUMMARY:
		return "summary";
	}
	return "unknown";
}

const char *message_timing_str(enum timing_key k)
{
	return (unsigned)k < TIMING_COUNT ? timing_names[k] : "unknown";
}

/* Timing key for name[0..len), or -1. */
static int timing_keyn(const char *name, size_t len)
{
	for (int k = 0; k < TIMING_COUNT; k++) {
		if (strlen(timing_names[k]) == len && memcmp(timing_names[k], name, len) == 0)
			return k;
	}
	return -1;
}

int message_timing_key(const char *name)
{
	return name ? timing_keyn(name, strlen(name)) : -1;
}

/* Fills a zeroed message. */
static void message_init(struct message *m, const char *id, enum role role, int64_t creation_ms)
{
	memcpy(m->id, id, ULID_LEN);
	m->id[ULID_LEN] = '\0';
	m->role = (uint8_t)role;
	m->version = 1;
	m->creation_ms = creation_ms;
	m->updated_ms = creation_ms;
}

bool message_json_whole(const json_t *v, int64_t lo, int64_t hi, int64_t *out)
{
	int64_t n;

	if (json_is_integer(v)) {
		n = json_integer_value(v);
	} else if (json_is_real(v)) {
		double d = json_real_value(v);
		/* Below 2^53: a real of 2^53 may have been written 2^53 + 1, which a double
		 * cannot hold (9007199254740993.0 reads as 2^53). */
		if (!(d > -9007199254740992.0 && d < 9007199254740992.0) ||
		    d != (double)(int64_t)d)
			return false;
		n = (int64_t)d;
	} else {
		return false;
	}
	if (n < lo || n > hi)
		return false;
	*out = n;
	return true;
}

int message_set_timing(struct message *m, enum timing_key k, int64_t v)
{
	if (k == TIMING_CREATION) {
		m->creation_ms = v;
		return 0;
	}
	if (!m->timing_more) {
		if (v < 0)
			return 0; /* unset already */
		if (!(m->timing_more = malloc((TIMING_COUNT - 1) * sizeof(*m->timing_more))))
			return -ENOMEM;
		for (int i = 0; i < TIMING_COUNT - 1; i++)
			m->timing_more[i] = -1;
	}
	m->timing_more[k - 1] = v;
	return 0;
}

void message_get_timing(const struct message *m, int64_t out[TIMING_COUNT])
{
	for (int k = 0; k < TIMING_COUNT; k++)
		out[k] = message_timing(m, (enum timing_key)k);
}

void message_restore_timing(struct message *m, const int64_t in[TIMING_COUNT])
{
	m->creation_ms = in[TIMING_CREATION];
	if (m->timing_more)
		memcpy(m->timing_more, in + 1, (TIMING_COUNT - 1) * sizeof(*m->timing_more));
}

struct message *message_new(const char *id, enum role role, int64_t creation_ms)
{
	struct message *m = calloc(1, sizeof(*m));
	if (m)
		message_init(m, id, role, creation_ms);
	return m;
}

/* The block of message_new_text: the message, then its contents array of one, then its
 * first text (each part's size keeps the next aligned). */
struct message *message_new_text(const char *id, enum role role, int64_t creation_ms, const char *s,
                                 size_t len)
{
	struct message *m;
	struct text **slot, *t;

	if (len > UINT32_MAX || !(m = calloc(1, sizeof(*m) + sizeof(*slot) + sizeof(*t) + len + 1)))
		return NULL;
	message_init(m, id, role, creation_ms);
	slot = (struct text **)(m + 1);
	t = (struct text *)(slot + 1);
	t->len = (uint32_t)len;
	if (len)
		memcpy(t->bytes, s, len);
	slot[0] = t;
	m->contents = slot;
	m->ncontents = 1;
	m->inline_parts = MESSAGE_INLINE_ARRAY | MESSAGE_INLINE_TEXT;
	return m;
}

void message_truncate_contents(struct message *m, uint32_t n)
{
	while (m->ncontents > n) {
		if (--m->ncontents == 0 && (m->inline_parts & MESSAGE_INLINE_TEXT))
			m->inline_parts &= (uint8_t)~MESSAGE_INLINE_TEXT;
		else
			free(m->contents[m->ncontents]);
	}
}

void message_free(struct message *m)
{
	if (!m)
		return;
	message_truncate_contents(m, 0);
	if (!(m->inline_parts & MESSAGE_INLINE_ARRAY))
		free(m->contents);
	json_decref(m->aux);
	free(m->summary_ids);
	free(m->timing_more);
	free(m);
}

/* The contents array has no capacity field: its capacity is the smallest power of two
 * >= ncontents, so it is full exactly when ncontents is 0 or a power of two. Shrinking
 * ncontents (a rolled-back merge) keeps that true, and appends stay amortised O(1). */
static bool contents_full(uint32_t n)
{
	return (n & (n - 1)) == 0;
}

int message_append_text(struct message *m, const char *s, size_t len)
{
	if (len > UINT32_MAX || m->ncontents == UINT32_MAX)
		return -ENOMEM;
	if (contents_full(m->ncontents)) {
		size_t cap = m->ncontents ? (size_t)m->ncontents * 2 : 1;
		struct text **grown;
		if (m->inline_parts & MESSAGE_INLINE_ARRAY) {
			/* The array of one in the block: the grown one is a copy. */
			if (!(grown = malloc(cap * sizeof(*grown))))
				return -ENOMEM;
			memcpy(grown, m->contents, m->ncontents * sizeof(*grown));
			m->inline_parts &= (uint8_t)~MESSAGE_INLINE_ARRAY;
		} else if (!(grown = realloc(m->contents, cap * sizeof(*grown)))) {
			return -ENOMEM;
		}
		m->contents = grown;
	}
	struct text *t = malloc(sizeof(*t) + len + 1);
	if (!t)
		return -ENOMEM;
	t->len = (uint32_t)len;
	if (len)
		memcpy(t->bytes, s, len);
	t->bytes[len] = '\0';
	m->contents[m->ncontents++] = t;
	return 0;
}

size_t message_text_bytes(const struct message *m)
{
	size_t n = 0;
	for (uint32_t i = 0; i < m->ncontents; i++)
		n += m->contents[i]->len;
	return n;
}

/* Sets key to a new value, consuming it; fails on a NULL value as well. */
static int set_new(json_t *obj, const char *key, json_t *v)
{
	return v ? json_object_set_new_nocheck(obj, key, v) : -1;
}

/* Appends a new value to arr, consuming it. */
static int append_new(json_t *arr, json_t *v)
{
	return v ? json_array_append_new(arr, v) : -1;
}

static json_t *metadata_to_json(const struct message *m)
{
	json_t *md = json_object(), *timing = NULL;
	if (!md)
		goto fail;
	if (m->fake || m->merges) {
		json_t *attr = json_array();
		if (set_new(md, "attribute", attr) < 0)
			goto fail;
		if (m->fake && append_new(attr, json_string_nocheck("fake")) < 0)
			goto fail;
		for (uint32_t i = 0; i < m->merges; i++) {
			if (append_new(attr, json_string_nocheck("merged")) < 0)
				goto fail;
		}
	}
	if (m->nsummary_ids) {
		json_t *ids = json_array();
		if (set_new(md, "summaryIds", ids) < 0)
			goto fail;
		for (uint32_t i = 0; i < m->nsummary_ids; i++) {
			if (append_new(ids, json_stringn_nocheck(m->summary_ids[i], ULID_LEN)) < 0)
				goto fail;
		}
	}
	timing = json_object();
	if (set_new(md, "timing", timing) < 0)
		goto fail;
	for (int k = 0; k < TIMING_COUNT; k++) {
		int64_t v = message_timing(m, (enum timing_key)k);
		if (v >= 0 && set_new(timing, timing_names[k], json_integer(v)) < 0)
			goto fail;
	}
	if (m->aux && json_object_set_nocheck(md, "aux", m->aux) < 0)
		goto fail;
	return md;
fail:
	json_decref(md);
	return NULL;
}

void message_sort_key(const struct message *m, char out[MESSAGE_SK_MAX + 1])
{
	size_t n = 0, k;

	/* Copied, not printed: snprintf took 2.5% of the loop at a pipeline of 16 (a key per
	 * record the store writes). */
	if (m->role == ROLE_SUMMARY && m->nsummary_ids > 0) {
		const char *last = m->summary_ids[m->nsummary_ids - 1];
		n = strnlen(last, ULID_LEN);
		memcpy(out, last, n);
		out[n++] = '~';
	}
	k = strnlen(m->id, ULID_LEN);
	memcpy(out + n, m->id, k);
	out[n + k] = '\0';
}

json_t *message_to_map(const struct message *m)
{
	json_t *map = json_object(), *msg = NULL, *contents = NULL;
	if (!map)
		goto fail;
	if (set_new(map, "id", json_stringn_nocheck(m->id, ULID_LEN)) < 0)
		goto fail;
	msg = json_object();
	if (set_new(map, "message", msg) < 0)
		goto fail;
	if (set_new(msg, "role", json_string_nocheck(message_role_str(m->role))) < 0)
		goto fail;
	contents = json_array();
	if (set_new(msg, "contents", contents) < 0)
		goto fail;
	for (uint32_t i = 0; i < m->ncontents; i++) {
		const struct text *t = m->contents[i];
		if (append_new(contents, json_stringn(t->bytes, t->len)) < 0)
			goto fail;
	}
	if (set_new(map, "metadata", metadata_to_json(m)) < 0)
		goto fail;
	return map;
fail:
	json_decref(map);
	return NULL;
}

/* Appends a C string literal. */
#define PUT(b, lit) buf_append((b), (lit), sizeof(lit) - 1)

int message_write_contents(struct buf *b, const struct message *m)
{
	if (PUT(b, "[") < 0)
		return -ENOMEM;
	for (uint32_t i = 0; i < m->ncontents; i++) {
		int rc;
		if (i && PUT(b, ",") < 0)
			return -ENOMEM;
		if ((rc = buf_append_jstring(b, m->contents[i]->bytes, m->contents[i]->len)) < 0)
			return rc;
	}
	return PUT(b, "]");
}

/* Stores a string literal at o (room reserved) and moves o past it. */
#define RAW(o, lit) ((o) = (char *)memcpy((o), (lit), sizeof(lit) - 1) + sizeof(lit) - 1)

/* The timing keys of a map, quoted, with their colon: "creation": ... */
static const struct {
	const char *s;
	size_t n;
} timing_keys[TIMING_COUNT] = {
#define KEY(name) {"\"" name "\":", sizeof(name) + 2},
    TIMING_NAMES(KEY)
#undef KEY
};

/* Room a map takes past its contents and aux: what the writer reserves at once. */
#define MAP_HEAD_MAX                                                                               \
	(7 + ULID_LEN + 21 + 9 + 13) /* {"id":"…","message":{"role":"…","contents":            \
	                              */
#define MAP_TIMING_MAX (1 + 10 + TIMING_COUNT * (1 + 13 + 1 + 20) + 1)

int message_write_map(struct buf *b, const struct message *m)
{
	const char *role = message_role_str(m->role);
	size_t role_len = m->role == ROLE_USER ? 4 : m->role == ROLE_ASSISTANT ? 9 : strlen(role);
	size_t tail;
	bool first = true;
	char *o;
	int rc;

	/* Ids are ULIDs and role names plain ASCII: written without escaping. */
	if (buf_reserve(b, MAP_HEAD_MAX) < 0)
		return -ENOMEM;
	o = b->data + b->len;
	RAW(o, "{\"id\":\"");
	memcpy(o, m->id, ULID_LEN);
	o += ULID_LEN;
	RAW(o, "\",\"message\":{\"role\":\"");
	memcpy(o, role, role_len);
	o += role_len;
	RAW(o, "\",\"contents\":");
	b->len = (size_t)(o - b->data);
	if ((rc = message_write_contents(b, m)) < 0)
		return rc;
	/* },"metadata":{ attribute, summaryIds, timing } (aux and the last }} come after) */
	tail = 14 + (1 + 13 + 6 + 9 * (size_t)m->merges + 1) +
	       (1 + 14 + (2 + ULID_LEN + 1) * (size_t)m->nsummary_ids + 1) + MAP_TIMING_MAX;
	if (buf_reserve(b, tail) < 0)
		return -ENOMEM;
	o = b->data + b->len;
	RAW(o, "},\"metadata\":{");
	if (m->fake || m->merges) {
		RAW(o, "\"attribute\":[");
		if (m->fake)
			RAW(o, "\"fake\"");
		for (uint32_t i = 0; i < m->merges; i++) {
			if (m->fake || i)
				RAW(o, ",");
			RAW(o, "\"merged\"");
		}
		RAW(o, "]");
		first = false;
	}
	if (m->nsummary_ids) {
		if (!first)
			RAW(o, ",");
		RAW(o, "\"summaryIds\":[");
		for (uint32_t i = 0; i < m->nsummary_ids; i++) {
			if (i)
				RAW(o, ",");
			RAW(o, "\"");
			memcpy(o, m->summary_ids[i], ULID_LEN);
			o += ULID_LEN;
			RAW(o, "\"");
		}
		RAW(o, "]");
		first = false;
	}
	if (!first)
		RAW(o, ",");
	RAW(o, "\"timing\":{");
	first = true;
	for (int k = 0; k < TIMING_COUNT; k++) {
		int64_t v = message_timing(m, (enum timing_key)k);
		if (v < 0)
			continue;
		if (!first)
			RAW(o, ",");
		memcpy(o, timing_keys[k].s, timing_keys[k].n);
		o += timing_keys[k].n;
		o += buf_jint(o, v);
		first = false;
	}
	RAW(o, "}");
	b->len = (size_t)(o - b->data);
	if (m->aux) {
		if (PUT(b, ",\"aux\":") < 0)
			return -ENOMEM;
		if ((rc = buf_append_json(b, m->aux)) < 0)
			return rc;
	}
	return PUT(b, "}}");
}

/* Whether every real in v is one DynamoDB can hold (magnitude 1e-130 to below 1e126, or 0):
 * the item of a message holding another could never be written, so it is refused before
 * anything is acknowledged (persistence.md: refuse early what can never be stored). */
static bool aux_reals_storable(const json_t *v)
{
	const char *key;
	json_t *x;
	size_t i;

	if (json_is_real(v)) {
		double a = fabs(json_real_value(v));
		return a == 0 || (a >= 1e-130 && a < 1e126);
	}
	if (json_is_object(v)) {
		json_object_foreach((json_t *)v, key, x)
		{
			if (!aux_reals_storable(x))
				return false;
		}
	} else if (json_is_array(v)) {
		json_array_foreach(v, i, x)
		{
			if (!aux_reals_storable(x))
				return false;
		}
	}
	return true;
}

enum error_code message_patch_parse(const json_t *timing, const json_t *aux, const char *where,
                                    struct metadata_patch *p, struct error *err)
{
	const char *key;
	size_t klen;
	json_t *v;

	for (int k = 0; k < TIMING_COUNT; k++)
		p->timing[k] = -1;
	p->aux = NULL;
	if (!where)
		where = "";
	if (timing) {
		if (!json_is_object(timing))
			return error_set(err, ERR_BAD_REQUEST, "%stiming: expected an object",
			                 where);
		json_object_keylen_foreach((json_t *)timing, key, klen, v)
		{
			int k = timing_keyn(key, klen);
			if (k < 0)
				return error_set(err, ERR_BAD_REQUEST,
				                 "%stiming.%s: unknown timing key (expected "
				                 "playStart, playEnd, listenStart, listenEnd, "
				                 "llmStart or llmEnd)",
				                 where, key);
			if (k == TIMING_CREATION)
				return error_set(err, ERR_BAD_REQUEST,
				                 "%stiming.creation: set by the daemon, cannot be "
				                 "set",
				                 where);
			if (!message_json_whole(v, 0, INT64_MAX, &p->timing[k]))
				return error_set(err, ERR_BAD_REQUEST,
				                 "%stiming.%s: expected an integer >= 0 "
				                 "(Unix milliseconds)",
				                 where, key);
		}
	}
	if (aux) {
		if (!json_is_object(aux))
			return error_set(err, ERR_BAD_REQUEST, "%saux: expected an object", where);
		if (!aux_reals_storable(aux))
			return error_set(
			    err, ERR_BAD_REQUEST,
			    "%saux: " MESSAGE_AUX_RANGE " (1e-130 to 1e126 in magnitude)", where);
		if (json_object_size(aux))
			p->aux = (json_t *)aux;
	}
	return ERR_OK;
}

bool message_patch_changes(const struct message *m, const struct metadata_patch *p)
{
	const char *key;
	size_t klen;
	json_t *v;

	for (int k = 0; k < TIMING_COUNT; k++) {
		if (p->timing[k] >= 0 && p->timing[k] != message_timing(m, (enum timing_key)k))
			return true;
	}
	if (!p->aux)
		return false;
	json_object_keylen_foreach(p->aux, key, klen, v)
	{
		json_t *old = m->aux ? json_object_getn(m->aux, key, klen) : NULL;
		if (json_is_null(v) ? old != NULL : (!old || !json_equal(old, v)))
			return true;
	}
	return false;
}

int message_patch_apply(struct message *m, const struct metadata_patch *p)
{
	const char *key;
	size_t klen;
	json_t *v, *aux = NULL;

	if (p->aux) {
		/* Built aside (a shallow copy: nested values are never modified in place) and
		 * swapped in only once complete, so that ENOMEM leaves m as it was. */
		aux = m->aux ? json_copy(m->aux) : json_object();
		if (!aux)
			return -ENOMEM;
		json_object_keylen_foreach(p->aux, key, klen, v)
		{
			if (json_is_null(v)) {
				json_object_deln(aux, key, klen);
				continue;
			}
			json_t *copy = json_deep_copy(v);
			if (!copy || json_object_setn_new_nocheck(aux, key, klen, copy) < 0) {
				json_decref(aux);
				return -ENOMEM;
			}
		}
	}
	/* Only the first key set can fail (making the array): m is unchanged then. */
	for (int k = TIMING_CREATION + 1; k < TIMING_COUNT; k++) {
		if (p->timing[k] >= 0 &&
		    message_set_timing(m, (enum timing_key)k, p->timing[k]) < 0) {
			json_decref(aux);
			return -ENOMEM;
		}
	}
	if (p->aux) {
		json_decref(m->aux);
		m->aux = aux;
		if (!json_object_size(aux)) {
			json_decref(aux);
			m->aux = NULL;
		}
	}
	return 0;
}

/* Field name of obj if it has that JSON type, else NULL. */
static const json_t *get_typed(const json_t *obj, const char *name, json_type type)
{
	const json_t *v = json_object_get(obj, name);
	return v && json_typeof(v) == type ? v : NULL;
}

static enum error_code parse_id_list(const json_t *ids, struct message *m, struct error *err)
{
	size_t n = json_array_size(ids);
	if (n > UINT32_MAX)
		return error_set(err, ERR_BAD_REQUEST, "metadata.summaryIds: too many ids");
	if (!n)
		return ERR_OK;
	m->summary_ids = malloc(n * sizeof(*m->summary_ids));
	if (!m->summary_ids)
		return error_set(err, ERR_INTERNAL, "out of memory");
	for (size_t i = 0; i < n; i++) {
		const json_t *s = json_array_get(ids, i);
		if (!json_is_string(s) || !ulid_valid(json_string_value(s), json_string_length(s)))
			return error_set(err, ERR_BAD_REQUEST,
			                 "metadata.summaryIds[%zu]: expected a ULID", i);
		memcpy(m->summary_ids[i], json_string_value(s), ULID_LEN + 1);
		m->nsummary_ids++;
	}
	return ERR_OK;
}

static enum error_code parse_attributes(const json_t *attr, struct message *m, struct error *err)
{
	size_t i;
	json_t *a;

	if (!json_is_array(attr))
		return error_set(err, ERR_BAD_REQUEST,
		                 "metadata.attribute: expected an array of strings");
	json_array_foreach(attr, i, a)
	{
		const char *s = json_string_value(a);
		if (s && strcmp(s, "fake") == 0 && i == 0)
			m->fake = true;
		else if (s && strcmp(s, "merged") == 0 && m->merges < UINT32_MAX)
			m->merges++;
		else
			return error_set(err, ERR_BAD_REQUEST,
			                 "metadata.attribute[%zu]: expected \"fake\" (first, once) "
			                 "or \"merged\"",
			                 i);
	}
	return ERR_OK;
}

/* Timing of a stored map: like a patch, but creation is required and other keys are kept. */
static enum error_code parse_stored_timing(const json_t *timing, struct message *m,
                                           struct error *err)
{
	const char *key;
	size_t klen;
	json_t *v;

	if (!json_is_object(timing))
		return error_set(err, ERR_BAD_REQUEST, "metadata.timing: expected an object");
	json_object_keylen_foreach((json_t *)timing, key, klen, v)
	{
		int k = timing_keyn(key, klen);
		if (k < 0)
			return error_set(err, ERR_BAD_REQUEST, "metadata.timing.%s: unknown key",
			                 key);
		if (!json_is_integer(v) || json_integer_value(v) < 0)
			return error_set(err, ERR_BAD_REQUEST,
			                 "metadata.timing.%s: expected an integer >= 0", key);
		if (message_set_timing(m, (enum timing_key)k, json_integer_value(v)) < 0)
			return error_set(err, ERR_INTERNAL, "out of memory");
	}
	if (m->creation_ms < 0)
		return error_set(err, ERR_BAD_REQUEST, "metadata.timing.creation: missing");
	return ERR_OK;
}

enum error_code message_from_map(const json_t *map, uint32_t version, struct message **out,
                                 struct error *err)
{
	struct message *m = NULL;
	enum error_code rc;
	const json_t *id, *msg, *role_j, *contents, *md, *v;
	int role = -1;
	size_t i;
	json_t *c;

	*out = NULL;
	if (!json_is_object(map))
		return error_set(err, ERR_BAD_REQUEST, "message: expected an object");
	id = get_typed(map, "id", JSON_STRING);
	if (!id || !ulid_valid(json_string_value(id), json_string_length(id)))
		return error_set(err, ERR_BAD_REQUEST, "id: expected a ULID");
	msg = get_typed(map, "message", JSON_OBJECT);
	if (!msg)
		return error_set(err, ERR_BAD_REQUEST, "message: expected an object");
	role_j = get_typed(msg, "role", JSON_STRING);
	for (int r = ROLE_USER; role_j && r <= ROLE_SUMMARY; r++) {
		if (strcmp(json_string_value(role_j), message_role_str(r)) == 0)
			role = r;
	}
	if (role < 0)
		return error_set(err, ERR_BAD_REQUEST,
		                 "message.role: expected \"user\", \"assistant\" or \"summary\"");
	contents = get_typed(msg, "contents", JSON_ARRAY);
	if (!contents || !json_array_size(contents))
		return error_set(err, ERR_BAD_REQUEST,
		                 "message.contents: expected a non-empty array of strings");
	md = get_typed(map, "metadata", JSON_OBJECT);
	if (!md)
		return error_set(err, ERR_BAD_REQUEST, "metadata: expected an object");

	m = message_new(json_string_value(id), (enum role)role, 0);
	if (!m)
		return error_set(err, ERR_INTERNAL, "out of memory");
	m->version = version;
	m->creation_ms = -1;
	json_array_foreach(contents, i, c)
	{
		if (!json_is_string(c)) {
			rc = error_set(err, ERR_BAD_REQUEST,
			               "message.contents[%zu]: expected a string", i);
			goto fail;
		}
		if (message_append_text(m, json_string_value(c), json_string_length(c)) < 0) {
			rc = error_set(err, ERR_INTERNAL, "out of memory");
			goto fail;
		}
	}
	if ((v = json_object_get(md, "attribute")) && (rc = parse_attributes(v, m, err)))
		goto fail;
	if ((v = json_object_get(md, "summaryIds"))) {
		if (role != ROLE_SUMMARY || !json_is_array(v)) {
			rc = error_set(err, ERR_BAD_REQUEST,
			               "metadata.summaryIds: expected an array of ids, on "
			               "summaries only");
			goto fail;
		}
		if ((rc = parse_id_list(v, m, err)))
			goto fail;
	}
	if ((rc = parse_stored_timing(json_object_get(md, "timing"), m, err)))
		goto fail;
	if ((v = json_object_get(md, "aux"))) {
		if (!json_is_object(v)) {
			rc = error_set(err, ERR_BAD_REQUEST, "metadata.aux: expected an object");
			goto fail;
		}
		if (json_object_size(v)) {
			m->aux = json_deep_copy(v);
			if (!m->aux) {
				rc = error_set(err, ERR_INTERNAL, "out of memory");
				goto fail;
			}
		}
	}
	m->updated_ms = m->creation_ms;
	*out = m;
	return ERR_OK;
fail:
	message_free(m);
	return rc;
}

/* ---- the packed map ----
 *   u8 flags: role (bits 0-1), fake (bit 2), aux present (bit 3)
 *   varint merges
 *   varint ncontents (>= 1), then each: varint length, bytes
 *   u8 timing keys set (bit k for timing[k]; bit 0, creation, always), then each: varint
 *   varint nsummary_ids, then each: its ULID_LEN characters
 *   aux when present: its compact JSON text, to the end (the map's length bounds it)
 */
#define PACK_ROLE 0x03u
#define PACK_FAKE 0x04u
#define PACK_AUX 0x08u

int message_pack(struct buf *b, const struct message *m)
{
	unsigned char flags =
	    (unsigned char)(m->role | (m->fake ? PACK_FAKE : 0) | (m->aux ? PACK_AUX : 0));
	unsigned char keys = 0;

	for (int k = 0; k < TIMING_COUNT; k++)
		keys |= (unsigned char)(message_timing(m, (enum timing_key)k) >= 0 ? 1u << k : 0);
	if (buf_append(b, &flags, 1) < 0 || buf_append_varint(b, m->merges) < 0 ||
	    buf_append_varint(b, m->ncontents) < 0)
		return -ENOMEM;
	for (uint32_t i = 0; i < m->ncontents; i++)
		if (buf_append_varint(b, m->contents[i]->len) < 0 ||
		    buf_append(b, m->contents[i]->bytes, m->contents[i]->len) < 0)
			return -ENOMEM;
	if (buf_append(b, &keys, 1) < 0)
		return -ENOMEM;
	for (int k = 0; k < TIMING_COUNT; k++) {
		int64_t v = message_timing(m, (enum timing_key)k);
		if (v >= 0 && buf_append_varint(b, (uint64_t)v) < 0)
			return -ENOMEM;
	}
	if (buf_append_varint(b, m->nsummary_ids) < 0)
		return -ENOMEM;
	for (uint32_t i = 0; i < m->nsummary_ids; i++)
		if (buf_append(b, m->summary_ids[i], ULID_LEN) < 0)
			return -ENOMEM;
	return m->aux ? buf_append_json(b, m->aux) : 0;
}

/* A varint at *p of at most max. */
static bool get_count(const char **p, const char *end, uint64_t max, uint64_t *v)
{
	return buf_get_varint(p, end, v) == 0 && *v <= max;
}

/* A varint at *p of at most what is left after it divided by size. */
static bool get_room(const char **p, const char *end, size_t size, uint64_t *v)
{
	return buf_get_varint(p, end, v) == 0 && *v <= (uint64_t)(end - *p) / size;
}

enum error_code message_unpack(const char *data, size_t len, const char *id, uint32_t version,
                               struct message **out, struct error *err)
{
	const char *p = data, *end = data + len, *what = "cut short";
	struct message *m = NULL;
	unsigned char flags, keys;
	uint64_t n, v, merges;

	*out = NULL;
	if (p == end)
		goto bad;
	flags = (unsigned char)*p++;
	what = "an unknown role or flag";
	if ((flags & PACK_ROLE) > ROLE_SUMMARY || (flags & ~(PACK_ROLE | PACK_FAKE | PACK_AUX)))
		goto bad;
	what = "cut short";
	if (buf_get_varint(&p, end, &merges) != 0)
		goto bad;
	/* A count past what any stored message can have is damage: taken as it is, a few
	 * bytes would turn into billions of "merged" strings in every answer and item made of
	 * the message (found by fuzz_records: 16 million from a 387-byte row, 2 GB). */
	what = "more merges than a storable message has";
	if (merges > MESSAGE_MERGES_MAX)
		goto bad;
	what = "cut short";
	/* Each content takes at least its length byte: a count past that is damage, not an
	 * allocation to attempt. */
	if (!get_room(&p, end, 1, &n))
		goto bad;
	what = "no contents";
	if (!n)
		goto bad;
	for (uint64_t i = 0; i < n; i++) {
		what = "cut short";
		if (!get_room(&p, end, 1, &v))
			goto bad;
		what = "contents: invalid UTF-8";
		if (!buf_utf8_valid(p, (size_t)v))
			goto bad;
		/* The first text goes in the message's own block. */
		if (i == 0 &&
		    !(m = message_new_text(id, (enum role)(flags & PACK_ROLE), 0, p, (size_t)v)))
			goto oom;
		if (i > 0 && message_append_text(m, p, (size_t)v) < 0)
			goto oom;
		p += v;
	}
	m->version = version;
	m->fake = flags & PACK_FAKE;
	m->merges = (uint32_t)merges;
	what = "cut short";
	if (p == end)
		goto bad;
	keys = (unsigned char)*p++;
	what = "timing: no creation time, or an unknown key";
	if (!(keys & 1u) || keys >> TIMING_COUNT)
		goto bad;
	for (int k = 0; k < TIMING_COUNT; k++) {
		what = "cut short";
		if ((keys & (1u << k)) && !get_count(&p, end, INT64_MAX, &v))
			goto bad;
		if ((keys & (1u << k)) && message_set_timing(m, (enum timing_key)k, (int64_t)v) < 0)
			goto oom;
	}
	if (!get_room(&p, end, ULID_LEN, &n))
		goto bad;
	what = "summary ids: on a summary only, ULIDs";
	if (n && m->role != ROLE_SUMMARY)
		goto bad;
	if (n && !(m->summary_ids = malloc((size_t)n * sizeof(*m->summary_ids))))
		goto oom;
	for (uint64_t i = 0; i < n; i++, p += ULID_LEN) {
		if (!ulid_valid(p, ULID_LEN))
			goto bad;
		memcpy(m->summary_ids[i], p, ULID_LEN);
		m->summary_ids[i][ULID_LEN] = '\0';
		m->nsummary_ids++;
	}
	if (flags & PACK_AUX) {
		json_error_t je;
		bool no_memory;
		m->aux = ops_json_loadb(p, (size_t)(end - p), JSON_ALLOW_NUL, &je, &no_memory);
		/* jansson reports a failed allocation as a syntax error, or drops a byte of a
		 * string: that is memory, not damage (test_alloc_fail's restore_refused). */
		if (no_memory)
			goto oom;
		what = "aux: not a non-empty object";
		if (!json_is_object(m->aux) || !json_object_size(m->aux))
			goto bad;
	} else if (p != end) {
		what = "bytes after its end";
		goto bad;
	}
	m->updated_ms = m->creation_ms;
	*out = m;
	return ERR_OK;
bad:
	message_free(m);
	return error_set(err, ERR_BAD_REQUEST, "packed message: %s", what);
oom:
	message_free(m);
	return error_set(err, ERR_INTERNAL, "out of memory");
}
