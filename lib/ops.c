/* The JSON face of a conversation: field validation of the conversation ops of protocol.md
 * and their execution on a struct convo. An answer that cannot be built after the
 * conversation changed (ENOMEM) is rolled back, so a refused request changes nothing. */
#include "ops.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "buf.h"
#include "ddbitem.h"

static const char *const op_names[OP_COUNT] = {
    [OP_UNKNOWN] = "unknown",
    [OP_ADD_USER] = "add_user",
    [OP_ADD_ASSISTANT] = "add_assistant",
    [OP_ADD_MESSAGE] = "add_message",
    [OP_GET_MESSAGES] = "get_messages",
    [OP_GET_SUMMARY_INFO] = "get_summary_info",
    [OP_ADD_SUMMARY] = "add_summary",
    [OP_GET_LAST_SUMMARY] = "get_last_summary",
    [OP_TO_MESSAGES_MAP] = "to_messages_map",
    [OP_SET_METADATA] = "set_metadata",
    [OP_DESCRIBE] = "describe",
    [OP_FLUSH] = "flush",
    [OP_CLOSE] = "close",
    [OP_LIST] = "list",
    [OP_STATS] = "stats",
    [OP_PING] = "ping",
    [OP_DEAD_LETTERS] = "dead_letters",
    [OP_RETRY_DEAD_LETTERS] = "retry_dead_letters",
    [OP_CREATE_TABLE] = "create_table",
};

enum op ops_lookup(const char *s, size_t len)
{
	if (!s)
		return OP_UNKNOWN;
	for (int op = OP_UNKNOWN + 1; op < OP_COUNT; op++) {
		if (strlen(op_names[op]) == len && memcmp(s, op_names[op], len) == 0)
			return (enum op)op;
	}
	return OP_UNKNOWN;
}

const char *ops_name(enum op op)
{
	return (unsigned)op < OP_COUNT ? op_names[op] : op_names[OP_UNKNOWN];
}

bool ops_creates(enum op op)
{
	return op == OP_ADD_USER || op == OP_ADD_ASSISTANT || op == OP_ADD_MESSAGE;
}

bool ops_mutates(enum op op)
{
	return ops_creates(op) || op == OP_ADD_SUMMARY || op == OP_SET_METADATA;
}

bool ops_needs_conversation(enum op op)
{
	return (op >= OP_ADD_USER && op <= OP_DESCRIBE) || op == OP_CLOSE;
}

bool ops_takes_conversation(enum op op)
{
	return ops_needs_conversation(op) || op == OP_FLUSH || op == OP_UNKNOWN;
}

/* True if s[0..len) is empty or only code points with the Unicode White_Space property.
 * Invalid UTF-8 counts as content. */
static bool is_blank(const char *str, size_t len)
{
	const unsigned char *s = (const unsigned char *)str;
	size_t i = 0;

	while (i < len) {
		unsigned c = s[i];
		if (c < 0x80) {
			if (c != ' ' && (c < 9 || c > 13))
				return false;
			i++;
			continue;
		}
		uint32_t cp;
		size_t n;
		if (c >= 0xC2 && c <= 0xDF) {
			cp = c & 0x1F;
			n = 2;
		} else if (c >= 0xE0 && c <= 0xEF) {
			cp = c & 0x0F;
			n = 3;
		} else {
			return false; /* 4-byte sequences hold no white space; the rest is invalid
			               */
		}
		if (len - i < n)
			return false;
		for (size_t k = 1; k < n; k++) {
			if ((s[i + k] & 0xC0) != 0x80)
				return false;
			cp = (cp << 6) | (s[i + k] & 0x3F);
		}
		if (n == 3 && cp < 0x800)
			return false; /* an overlong form is invalid UTF-8, not white space */
		if (!(cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
		      cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000))
			return false;
		i += n;
	}
	return true;
}

/* Non-blank contents of a request, pointing into it; small requests need no allocation. */
#define SMALL 8
struct contents {
	const char **texts;
	size_t *lens;
	size_t n;
	const char *small_texts[SMALL];
	size_t small_lens[SMALL];
};

static void contents_free(struct contents *ct)
{
	if (ct->texts != ct->small_texts) {
		free(ct->texts);
		free(ct->lens);
	}
	ct->texts = ct->small_texts;
	ct->lens = ct->small_lens;
	ct->n = 0;
}

static enum error_code contents_add(struct contents *ct, const json_t *s, const char *field,
                                    size_t index, struct error *err)
{
	size_t len = json_string_length(s);
	if (len > UINT32_MAX)
		return error_set(err, ERR_TOO_LARGE, "%s[%zu]: string too long", field, index);
	if (!is_blank(json_string_value(s), len)) {
		ct->texts[ct->n] = json_string_value(s);
		ct->lens[ct->n++] = len;
	}
	return ERR_OK;
}

/* contents of req: a string or a non-empty array of strings, blank strings dropped, at
 * least one left. Free with contents_free, also on failure. */
static enum error_code contents_parse(const json_t *req, struct contents *ct, struct error *err)
{
	const json_t *v = json_object_get(req, "contents"), *s;
	enum error_code rc;
	size_t i;

	ct->texts = ct->small_texts;
	ct->lens = ct->small_lens;
	ct->n = 0;
	if (!v)
		return error_set(err, ERR_BAD_REQUEST,
		                 "contents: missing; expected a string or an array of strings");
	if (json_is_string(v)) {
		if ((rc = contents_add(ct, v, "contents", 0, err)))
			return rc;
	} else if (json_is_array(v)) {
		size_t n = json_array_size(v);
		if (!n)
			return error_set(err, ERR_BAD_REQUEST,
			                 "contents: expected a string or a non-empty array of "
			                 "strings");
		if (n > SMALL) {
			ct->texts = malloc(n * sizeof(*ct->texts));
			ct->lens = malloc(n * sizeof(*ct->lens));
			if (!ct->texts || !ct->lens)
				return error_set(err, ERR_INTERNAL, "out of memory");
		}
		json_array_foreach(v, i, s)
		{
			if (!json_is_string(s))
				return error_set(err, ERR_BAD_REQUEST,
				                 "contents[%zu]: expected a string", i);
			if ((rc = contents_add(ct, s, "contents", i, err)))
				return rc;
		}
	} else {
		return error_set(err, ERR_BAD_REQUEST,
		                 "contents: expected a string or an array of strings");
	}
	if (!ct->n)
		return error_set(err, ERR_BAD_REQUEST,
		                 "contents: expected at least one non-blank string");
	return ERR_OK;
}

/* metadata of req ({"timing", "aux"}, both optional) as a patch. */
static enum error_code metadata_parse(const json_t *req, struct metadata_patch *p,
                                      struct error *err)
{
	const json_t *md = json_object_get(req, "metadata");
	const char *key;
	size_t klen;
	json_t *v;

	if (md && !json_is_object(md))
		return error_set(err, ERR_BAD_REQUEST,
		                 "metadata: expected an object with timing and/or aux");
	if (md) {
		json_object_keylen_foreach((json_t *)md, key, klen, v)
		{
			if (!(klen == 6 && memcmp(key, "timing", 6) == 0) &&
			    !(klen == 3 && memcmp(key, "aux", 3) == 0))
				return error_set(
				    err, ERR_BAD_REQUEST,
				    "metadata.%s: unknown key (expected timing or aux)", key);
		}
	}
	return message_patch_parse(md ? json_object_get(md, "timing") : NULL,
	                           md ? json_object_get(md, "aux") : NULL, "metadata.", p, err);
}

/* Optional boolean field name of req. */
static enum error_code bool_parse(const json_t *req, const char *name, bool dflt, bool *out,
                                  struct error *err)
{
	const json_t *v = json_object_get(req, name);
	*out = dflt;
	if (!v)
		return ERR_OK;
	if (!json_is_boolean(v))
		return error_set(err, ERR_BAD_REQUEST, "%s: expected true or false", name);
	*out = json_is_true(v);
	return ERR_OK;
}

/* A string that must fit a C string (the summary format parts). */
static enum error_code cstring_parse(const json_t *v, const char *field, const char *key,
                                     const char **out, struct error *err)
{
	if (!json_is_string(v))
		return error_set(err, ERR_BAD_REQUEST, "%s%s: expected a string", field, key);
	if (strlen(json_string_value(v)) != json_string_length(v))
		return error_set(err, ERR_BAD_REQUEST,
		                 "%s%s: expected a string without NUL characters", field, key);
	*out = json_string_value(v);
	return ERR_OK;
}

static const char *const format_keys[] = {
    "prefix",      "postfix",   "user_tag", "assistant_tag",
    "summary_tag", "separator", "closure",  "summary_closure",
};

static const char **format_field(struct summary_format *f, size_t i)
{
	const char **fields[] = {
	    &f->prefix,      &f->postfix,   &f->user_tag, &f->assistant_tag,
	    &f->summary_tag, &f->separator, &f->closure,  &f->summary_closure,
	};
	return fields[i];
}

/* preamble, include_previous_summary and format of a get_summary_info request. */
static enum error_code summary_format_parse(const json_t *req, struct summary_format *f,
                                            struct error *err)
{
	const json_t *v;
	const char *key;
	size_t klen;
	json_t *val;
	enum error_code rc;

	convo_summary_format_default(f);
	if ((v = json_object_get(req, "preamble")) &&
	    (rc = cstring_parse(v, "", "preamble", &f->preamble, err)))
		return rc;
	if ((rc = bool_parse(req, "include_previous_summary", false, &f->include_previous_summary,
	                     err)))
		return rc;
	v = json_object_get(req, "format");
	if (!v)
		return ERR_OK;
	if (!json_is_object(v))
		return error_set(
		    err, ERR_BAD_REQUEST,
		    "format: expected an object (prefix, postfix, user_tag, "
		    "assistant_tag, summary_tag, separator, closure, summary_closure)");
	json_object_keylen_foreach((json_t *)v, key, klen, val)
	{
		size_t i = 0, n = sizeof(format_keys) / sizeof(format_keys[0]);
		while (i < n &&
		       !(strlen(format_keys[i]) == klen && memcmp(format_keys[i], key, klen) == 0))
			i++;
		if (i == n)
			return error_set(err, ERR_BAD_REQUEST,
			                 "format.%s: unknown key (expected prefix, postfix, "
			                 "user_tag, assistant_tag, summary_tag, separator, closure "
			                 "or summary_closure)",
			                 key);
		if ((rc = cstring_parse(val, "format.", format_keys[i], format_field(f, i), err)))
			return rc;
	}
	return ERR_OK;
}

/* format of a get_messages request. */
static enum error_code render_parse(const json_t *req, enum render_format *fmt, struct error *err)
{
	const json_t *v = json_object_get(req, "format");
	int r = RENDER_META;
	if (v && (!json_is_string(v) || strlen(json_string_value(v)) != json_string_length(v) ||
	          (r = convo_render_format(json_string_value(v))) < 0))
		return error_set(err, ERR_BAD_REQUEST,
		                 "format: expected \"meta\", \"bedrock\", \"anthropic\" or "
		                 "\"openai\"");
	*fmt = (enum render_format)r;
	return ERR_OK;
}

/* role of an add_message request. */
static enum error_code role_parse(const json_t *req, enum role *role, struct error *err)
{
	const json_t *v = json_object_get(req, "role");
	const char *s = json_string_value(v);
	if (s && json_string_length(v) == 4 && strcmp(s, "user") == 0)
		*role = ROLE_USER;
	else if (s && json_string_length(v) == 9 && strcmp(s, "assistant") == 0)
		*role = ROLE_ASSISTANT;
	else
		return error_set(err, ERR_BAD_REQUEST,
		                 v ? "role: expected \"user\" or \"assistant\""
		                   : "role: missing; expected \"user\" or \"assistant\"");
	return ERR_OK;
}

/* ids and versions of an add_summary request; ids point into req. Free both arrays (also on
 * failure). */
static enum error_code ids_parse(const json_t *req, const char ***ids, size_t *nids,
                                 int64_t **versions, size_t *nversions, struct error *err)
{
	const json_t *a = json_object_get(req, "ids"), *v = json_object_get(req, "versions"), *e;
	size_t i;

	*ids = NULL;
	*versions = NULL;
	*nids = *nversions = 0;
	if (!json_is_array(a) || !json_array_size(a))
		return error_set(err, ERR_BAD_REQUEST,
		                 a ? "ids: expected a non-empty array of message ids"
		                   : "ids: missing; expected the ids of get_summary_info");
	json_array_foreach(a, i, e)
	{
		if (!json_is_string(e) || !ulid_valid(json_string_value(e), json_string_length(e)))
			return error_set(err, ERR_BAD_REQUEST,
			                 "ids[%zu]: expected a message id (a 26-character ULID)",
			                 i);
	}
	if (v) {
		if (!json_is_array(v) || json_array_size(v) != json_array_size(a))
			return error_set(err, ERR_BAD_REQUEST,
			                 "versions: expected an array of integers, one per id");
		json_array_foreach(v, i, e)
		{
			int64_t n;
			if (!message_json_whole(e, 1, UINT32_MAX, &n))
				return error_set(err, ERR_BAD_REQUEST,
				                 "versions[%zu]: expected an integer >= 1", i);
		}
	}
	*ids = malloc(json_array_size(a) * sizeof(**ids));
	if (!*ids)
		return error_set(err, ERR_INTERNAL, "out of memory");
	for (i = 0; i < json_array_size(a); i++)
		(*ids)[i] = json_string_value(json_array_get(a, i));
	*nids = json_array_size(a);
	if (v) {
		*versions = malloc(json_array_size(v) * sizeof(**versions));
		if (!*versions)
			return error_set(err, ERR_INTERNAL, "out of memory");
		for (i = 0; i < json_array_size(v); i++) {
			int64_t n = 0;
			message_json_whole(json_array_get(v, i), 1, UINT32_MAX, &n);
			(*versions)[i] = n;
		}
		*nversions = json_array_size(v);
	}
	return ERR_OK;
}

/* message_id, timing and aux of a set_metadata request. */
static enum error_code set_metadata_parse(const json_t *req, const json_t **id,
                                          struct metadata_patch *p, struct error *err)
{
	*id = json_object_get(req, "message_id");
	if (!*id)
		return error_set(err, ERR_BAD_REQUEST,
		                 "message_id: missing; expected a message id");
	if (!json_is_string(*id) || !ulid_valid(json_string_value(*id), json_string_length(*id)))
		return error_set(err, ERR_BAD_REQUEST,
		                 "message_id: expected a message id (a 26-character ULID)");
	return message_patch_parse(json_object_get(req, "timing"), json_object_get(req, "aux"), "",
	                           p, err);
}

/* Contents that alone are over DynamoDB's item limit: too_large found while checking the
 * fields, so that it wins over their other problems (the exact check, with the rest of the
 * item, is made when the message is built). */
static enum error_code contents_size(enum error_code rc, const struct contents *ct,
                                     struct error *err)
{
	size_t total = 0;

	if (rc != ERR_OK)
		return rc;
	for (size_t i = 0; i < ct->n; i++)
		total += ct->lens[i];
	if (total > DDBITEM_MAX_BYTES)
		return error_set(err, ERR_TOO_LARGE,
		                 "contents: %zu bytes, over DynamoDB's item limit of %d bytes",
		                 total, DDBITEM_MAX_BYTES);
	return ERR_OK;
}

/* rc2 (with e2) if it comes before *rc in protocol.md's table (too_large first), so that
 * the first in the table wins whatever order the fields are checked in. */
static void keep_first(enum error_code *rc, struct error *err, enum error_code rc2,
                       const struct error *e2)
{
	if (rc2 != ERR_OK && (*rc == ERR_OK || rc2 < *rc)) {
		*rc = rc2;
		*err = *e2;
	}
}

enum error_code ops_check(enum op op, const json_t *req, struct error *err)
{
	struct contents ct;
	struct metadata_patch patch;
	struct summary_format f;
	enum render_format fmt = RENDER_META;
	enum role role;
	const json_t *id;
	const char **ids = NULL;
	int64_t *versions = NULL;
	size_t nids, nversions;
	bool b;
	enum error_code rc = ERR_OK;
	struct error e2;

	if (op <= OP_UNKNOWN || op >= OP_COUNT)
		return error_set(err, ERR_UNKNOWN_OP, "op: unknown operation");
	if (!json_is_object(req))
		return error_set(err, ERR_BAD_REQUEST, "request: expected an object");
	/* Every field is checked, even after a problem, for a too_large further on. */
	switch (op) {
	case OP_ADD_MESSAGE:
	case OP_ADD_USER:
	case OP_ADD_ASSISTANT:
		if (op == OP_ADD_MESSAGE)
			rc = role_parse(req, &role, err);
		keep_first(&rc, err, contents_size(contents_parse(req, &ct, &e2), &ct, &e2), &e2);
		contents_free(&ct);
		keep_first(&rc, err, metadata_parse(req, &patch, &e2), &e2);
		break;
	case OP_GET_MESSAGES:
		rc = render_parse(req, &fmt, err);
		break;
	case OP_GET_SUMMARY_INFO:
		rc = summary_format_parse(req, &f, err);
		break;
	case OP_ADD_SUMMARY:
		rc = contents_size(contents_parse(req, &ct, err), &ct, err);
		contents_free(&ct);
		keep_first(&rc, err, ids_parse(req, &ids, &nids, &versions, &nversions, &e2), &e2);
		free(ids);
		free(versions);
		break;
	case OP_TO_MESSAGES_MAP:
		if (!(rc = bool_parse(req, "incremental", true, &b, err)))
			rc = bool_parse(req, "exclude_last", true, &b, err);
		break;
	case OP_SET_METADATA:
		rc = set_metadata_parse(req, &id, &patch, err);
		break;
	default:
		/* get_last_summary, describe; and the daemon's own ops, which it checks. */
		break;
	}
	return rc;
}

/* What undo_apply needs to put a conversation back as it was before one mutation. */
struct undo {
	size_t nlog, first_llm, text_bytes, scan_from[CONSUMER_COUNT];
	long last_summary;
	int64_t updated_ms;
	long inserted;     /* position of an inserted summary, or -1 */
	struct message *m; /* message that may change in place (merge, set_metadata), or NULL */
	uint32_t ncontents, merges, version;
	int64_t timing[TIMING_COUNT], m_updated_ms;
	json_t *aux; /* reference to m's aux as it was */
};

static void undo_save(struct undo *u, const struct convo *c, struct message *m)
{
	u->nlog = c->nlog;
	u->first_llm = c->first_llm;
	u->text_bytes = c->text_bytes;
	memcpy(u->scan_from, c->scan_from, sizeof(u->scan_from));
	u->last_summary = c->last_summary;
	u->updated_ms = c->updated_ms;
	u->inserted = -1;
	u->m = m;
	u->aux = NULL;
	if (m) {
		u->ncontents = m->ncontents;
		u->merges = m->merges;
		u->version = m->version;
		message_get_timing(m, u->timing);
		u->m_updated_ms = m->updated_ms;
		u->aux = json_incref(m->aux);
	}
}

static void undo_release(struct undo *u)
{
	json_decref(u->aux);
	u->aux = NULL;
}

static void undo_apply(struct undo *u, struct convo *c)
{
	if (u->inserted >= 0) {
		size_t p = (size_t)u->inserted;
		message_free(c->log[p]);
		memmove(&c->log[p], &c->log[p + 1], (c->nlog - p - 1) * sizeof(*c->log));
		c->nlog--;
	}
	while (c->nlog > u->nlog)
		message_free(c->log[--c->nlog]);
	if (u->m) {
		struct message *m = u->m;
		message_truncate_contents(m, u->ncontents);
		m->merges = u->merges;
		m->version = u->version;
		message_restore_timing(m, u->timing);
		m->updated_ms = u->m_updated_ms;
		json_decref(m->aux);
		m->aux = u->aux;
		u->aux = NULL;
	}
	c->first_llm = u->first_llm;
	c->text_bytes = u->text_bytes;
	memcpy(c->scan_from, u->scan_from, sizeof(c->scan_from));
	c->last_summary = u->last_summary;
	c->updated_ms = u->updated_ms;
}

/* {"message": map of m, or null}; "merged" added when merged is not NULL. */
static json_t *message_result(const struct message *m, const bool *merged)
{
	json_t *res = json_object(), *map = m ? message_to_map(m) : json_null();
	if (!res || !map || json_object_set_new_nocheck(res, "message", map) < 0) {
		if (res)
			map = NULL; /* consumed by the failed set */
		json_decref(map);
		json_decref(res);
		return NULL;
	}
	if (merged && json_object_set_new_nocheck(res, "merged", json_boolean(*merged)) < 0) {
		json_decref(res);
		return NULL;
	}
	return res;
}

/* The result is built: nothing went missing in jansson, and emit (when given) took it. */
static bool delivered(const json_t *result, ops_emit_fn emit, void *emit_arg)
{
	if (!result || ops_json_alloc_failed())
		return false;
	return !emit || emit(emit_arg, result, NULL, NULL) >= 0;
}

struct add_result {
	const struct message *m;
	bool merged;
};

/* ops_write_fn of ops_add_direct: the text message_result's tree would have. */
static int write_add_result(struct buf *b, const void *ctx)
{
	const struct add_result *r = ctx;

	if (buf_append(b, "{\"message\":", 11) < 0 || message_write_map(b, r->m) < 0)
		return -ENOMEM;
	return r->merged ? buf_append(b, ",\"merged\":true}", 15)
	                 : buf_append(b, ",\"merged\":false}", 16);
}

/* Adds the non-blank contents ct (with patch, which may be NULL) and delivers the result:
 * written through emit when given (no tree), else as a tree into *result (ops_run). When
 * it cannot be delivered the add is undone and ERR_INTERNAL returned. */
static enum error_code add_deliver(struct convo *c, const struct convo_env *env, enum role role,
                                   const struct contents *ct, const struct metadata_patch *patch,
                                   json_t **result, bool *changed, struct error *err,
                                   ops_emit_fn emit, void *emit_arg)
{
	struct add_result r = {NULL, false};
	struct message *m = NULL;
	struct undo u;
	enum error_code rc;
	bool ok;

	undo_save(&u, c, c->nlog ? c->log[c->nlog - 1] : NULL);
	rc = convo_add(c, env, role, ct->texts, ct->lens, ct->n, patch, &m, &r.merged, err);
	r.m = m;
	if (!rc) {
		if (emit) {
			/* Not written at all when jansson lost something (metadata's aux). */
			ok = !ops_json_alloc_failed() &&
			     emit(emit_arg, NULL, write_add_result, &r) >= 0;
		} else {
			*result = message_result(m, &r.merged);
			ok = *result && !ops_json_alloc_failed();
			if (!ok) {
				json_decref(*result);
				*result = NULL;
			}
		}
		if (!ok) {
			undo_apply(&u, c);
			rc = error_set(err, ERR_INTERNAL, "out of memory");
		}
	}
	undo_release(&u);
	if (!rc && changed)
		*changed = true;
	return rc;
}

static enum error_code run_add(enum op op, struct convo *c, const struct convo_env *env,
                               const json_t *req, json_t **result, bool *changed, struct error *err,
                               ops_emit_fn emit, void *emit_arg)
{
	struct contents ct;
	struct metadata_patch patch;
	enum role role = op == OP_ADD_ASSISTANT ? ROLE_ASSISTANT : ROLE_USER;
	enum error_code rc;

	ct.texts = ct.small_texts;
	ct.lens = ct.small_lens;
	if ((op == OP_ADD_MESSAGE && (rc = role_parse(req, &role, err))) ||
	    (rc = contents_parse(req, &ct, err)) || (rc = metadata_parse(req, &patch, err)))
		goto out;
	rc = add_deliver(c, env, role, &ct, &patch, result, changed, err, emit, emit_arg);
out:
	contents_free(&ct);
	return rc;
}

enum error_code ops_add_direct(struct convo *c, const struct convo_env *env,
                               const struct ops_add_args *a, ops_emit_fn emit, void *emit_arg,
                               bool *changed, struct error *err)
{
	struct contents ct;
	enum error_code rc = ERR_OK;

	ct.texts = ct.small_texts;
	ct.lens = ct.small_lens;
	ct.n = 0;
	if (changed)
		*changed = false;
	ops_json_alloc_reset();
	if (a->ntexts > SMALL) {
		ct.texts = malloc(a->ntexts * sizeof(*ct.texts));
		ct.lens = malloc(a->ntexts * sizeof(*ct.lens));
		if (!ct.texts || !ct.lens) {
			rc = error_set(err, ERR_INTERNAL, "out of memory");
			goto out;
		}
	}
	for (size_t i = 0; i < a->ntexts; i++) {
		if (a->lens[i] > UINT32_MAX) {
			rc = error_set(err, ERR_TOO_LARGE, "contents[%zu]: string too long", i);
			goto out;
		}
		if (!is_blank(a->texts[i], a->lens[i])) {
			ct.texts[ct.n] = a->texts[i];
			ct.lens[ct.n++] = a->lens[i];
		}
	}
	if (!ct.n) {
		rc = error_set(err, ERR_BAD_REQUEST, "contents: expected at least one non-blank string");
		goto out;
	}
	rc = add_deliver(c, env, a->role, &ct, NULL, NULL, changed, err, emit, emit_arg);
out:
	contents_free(&ct);
	return rc;
}

bool ops_text_blank(const char *s, size_t len)
{
	return is_blank(s, len);
}

static enum error_code run_add_summary(struct convo *c, const struct convo_env *env,
                                       const json_t *req, json_t **result, bool *changed,
                                       struct error *err, ops_emit_fn emit, void *emit_arg)
{
	struct contents ct;
	struct message *m = NULL;
	const char **ids = NULL;
	int64_t *versions = NULL;
	size_t nids = 0, nversions = 0;
	struct undo u;
	enum error_code rc;

	ct.texts = ct.small_texts;
	ct.lens = ct.small_lens;
	if ((rc = contents_parse(req, &ct, err)) ||
	    (rc = ids_parse(req, &ids, &nids, &versions, &nversions, err)))
		goto out;
	undo_save(&u, c, NULL);
	rc = convo_add_summary(c, env, ct.texts, ct.lens, ct.n, ids, nids, versions, nversions, &m,
	                       err);
	if (!rc && !delivered(*result = message_result(m, NULL), emit, emit_arg)) {
		json_decref(*result);
		*result = NULL;
		u.inserted = c->last_summary;
		undo_apply(&u, c);
		rc = error_set(err, ERR_INTERNAL, "out of memory");
	}
	undo_release(&u);
	if (!rc && changed)
		*changed = true;
out:
	contents_free(&ct);
	free(ids);
	free(versions);
	return rc;
}

static enum error_code run_set_metadata(struct convo *c, const struct convo_env *env,
                                        const json_t *req, json_t **result, bool *changed,
                                        struct error *err, ops_emit_fn emit, void *emit_arg)
{
	struct metadata_patch patch;
	const json_t *id;
	struct undo u;
	enum error_code rc;

	if ((rc = set_metadata_parse(req, &id, &patch, err)))
		return rc;
	long i = convo_find(c, json_string_value(id), json_string_length(id));
	if (i < 0)
		return error_set(err, ERR_NOT_FOUND,
		                 "message_id: no message %s in this conversation",
		                 json_string_value(id));
	struct message *m = c->log[i];
	undo_save(&u, c, m);
	rc = convo_set_metadata(c, env, (size_t)i, &patch, err);
	if (!rc && !delivered(*result = message_result(m, NULL), emit, emit_arg)) {
		json_decref(*result);
		*result = NULL;
		undo_apply(&u, c);
		rc = error_set(err, ERR_INTERNAL, "out of memory");
	}
	if (!rc && changed)
		*changed = m->version != u.version;
	undo_release(&u);
	return rc;
}

/* ops_write_fn of get_messages in the meta format: room for the usual answer at once (the
 * text and ~150 bytes a message around it), then the view. */
static int write_view(struct buf *b, const void *ctx)
{
	const struct convo *c = ctx;

	if (buf_reserve(b, c->text_bytes + 160 * c->nlog + 64) < 0)
		return -ENOMEM;
	return convo_write_messages(c, b);
}

struct map_ctx {
	const struct convo *c;
	bool incremental, exclude_last;
};

/* ops_write_fn of to_messages_map: its result's text, the messages not marked yet. */
static int write_map_result(struct buf *b, const void *ctx)
{
	const struct map_ctx *m = ctx;

	return convo_write_messages_map(m->c, m->incremental, m->exclude_last, b);
}

/* get_messages and to_messages_map once their options are read: written straight into the
 * answer through emit where a writer exists (no tree of the whole view), else built as a
 * tree and delivered (or returned in *result, without emit). */
static enum error_code run_read(enum op op, struct convo *c, const struct ops_read_args *a,
                                json_t **result, struct error *err, ops_emit_fn emit,
                                void *emit_arg)
{
	struct map_ctx m = {c, a->incremental, a->exclude_last};

	if (op == OP_GET_MESSAGES) {
		if (emit && a->format == RENDER_META) {
			if (emit(emit_arg, NULL, write_view, c) < 0)
				goto oom;
			return ERR_OK;
		}
		*result = convo_get_messages(c, a->format);
		if (!delivered(*result, emit, emit_arg))
			goto oom;
		return ERR_OK;
	}
	if (emit) {
		if (emit(emit_arg, NULL, write_map_result, &m) < 0)
			goto oom;
	} else {
		*result = convo_to_messages_map_build(c, a->incremental, a->exclude_last);
		if (!delivered(*result, NULL, NULL))
			goto oom;
	}
	/* Taken only once the client has them. */
	if (a->incremental)
		convo_to_messages_map_taken(c, a->exclude_last);
	return ERR_OK;
oom:
	json_decref(*result);
	*result = NULL;
	return error_set(err, ERR_INTERNAL, "out of memory");
}

enum error_code ops_read_direct(enum op op, struct convo *c, const struct ops_read_args *a,
                                ops_emit_fn emit, void *emit_arg, struct error *err)
{
	json_t *result = NULL;
	enum error_code rc;

	if (!c || (op != OP_GET_MESSAGES && op != OP_TO_MESSAGES_MAP) ||
	    (unsigned)a->format > RENDER_OPENAI)
		return error_set(err, ERR_INTERNAL, "%s: not a read of a conversation",
		                 ops_name(op));
	ops_json_alloc_reset();
	rc = run_read(op, c, a, &result, err, emit, emit_arg);
	json_decref(result);
	return rc;
}

static enum error_code run(enum op op, struct convo *c, const struct convo_env *env,
                           const json_t *req, json_t **result, bool *changed, struct error *err,
                           ops_emit_fn emit, void *emit_arg)
{
	struct summary_format f;
	struct ops_read_args ra = {RENDER_META, true, true};
	enum error_code rc;
	char *text;

	*result = NULL;
	if (changed)
		*changed = false;
	if (!c || !json_is_object(req))
		return error_set(err, ERR_INTERNAL, "%s: no conversation or request", ops_name(op));
	switch (op) {
	case OP_ADD_USER:
	case OP_ADD_ASSISTANT:
	case OP_ADD_MESSAGE:
		return run_add(op, c, env, req, result, changed, err, emit, emit_arg);
	case OP_ADD_SUMMARY:
		return run_add_summary(c, env, req, result, changed, err, emit, emit_arg);
	case OP_SET_METADATA:
		return run_set_metadata(c, env, req, result, changed, err, emit, emit_arg);
	case OP_GET_MESSAGES:
		if ((rc = render_parse(req, &ra.format, err)))
			return rc;
		return run_read(op, c, &ra, result, err, emit, emit_arg);
	case OP_GET_SUMMARY_INFO:
		if ((rc = summary_format_parse(req, &f, err)))
			return rc;
		*result = convo_summary_info(c, &f);
		break;
	case OP_GET_LAST_SUMMARY:
		*result = message_result(convo_last_summary(c), NULL);
		break;
	case OP_TO_MESSAGES_MAP:
		if ((rc = bool_parse(req, "incremental", true, &ra.incremental, err)) ||
		    (rc = bool_parse(req, "exclude_last", true, &ra.exclude_last, err)))
			return rc;
		return run_read(op, c, &ra, result, err, emit, emit_arg);
	case OP_DESCRIBE:
		text = convo_describe(c);
		if (text) {
			*result = json_object();
			if (*result &&
			    json_object_set_new_nocheck(*result, "text", json_string(text)) < 0) {
				json_decref(*result);
				*result = NULL;
			}
			free(text);
		}
		break;
	default:
		return error_set(err, ERR_INTERNAL, "%s: not a conversation op", ops_name(op));
	}
	if (delivered(*result, emit, emit_arg))
		return ERR_OK;
	json_decref(*result);
	*result = NULL;
	return error_set(err, ERR_INTERNAL, "out of memory");
}

enum error_code ops_run(enum op op, struct convo *c, const struct convo_env *env, const json_t *req,
                        json_t **result, bool *changed, struct error *err)
{
	ops_json_alloc_reset();
	return run(op, c, env, req, result, changed, err, NULL, NULL);
}

enum error_code ops_run_emit(enum op op, struct convo *c, const struct convo_env *env,
                             const json_t *req, ops_emit_fn emit, void *emit_arg, bool *changed,
                             struct error *err)
{
	json_t *result = NULL;
	enum error_code rc;

	ops_json_alloc_reset();
	rc = run(op, c, env, req, &result, changed, err, emit, emit_arg);
	json_decref(result);
	return rc;
}

static void *(*json_inner_malloc)(size_t) = malloc;
static bool json_alloc_failed;

static void *json_counted_malloc(size_t n)
{
	void *p = json_inner_malloc(n);
	if (!p)
		json_alloc_failed = true;
	return p;
}

void ops_json_alloc_init(void *(*m)(size_t), void (*f)(void *))
{
	json_inner_malloc = m;
	json_set_alloc_funcs(json_counted_malloc, f);
}

bool ops_json_alloc_failed(void)
{
	return json_alloc_failed;
}

void ops_json_alloc_reset(void)
{
	json_alloc_failed = false;
}

json_t *ops_json_loadb(const char *s, size_t n, size_t flags, json_error_t *e, bool *oom)
{
	bool before = json_alloc_failed;
	json_t *j;

	json_alloc_failed = false;
	j = json_loadb(s, n, flags, e);
	*oom = json_alloc_failed;
	json_alloc_failed = before || *oom;
	if (*oom) {
		json_decref(j);
		j = NULL;
	}
	return j;
}
