/* Fuzz target for sequences of operations on one conversation through lib/ops.h, as the
 * daemon runs them (ops_check, then ops_run). The input is read as a program: its first
 * byte picks the limits, then each step picks an op and builds its JSON request from the
 * next bytes (contents, metadata, formats, the ids and versions of the last
 * get_summary_info, kept or corrupted, or a raw JSON request). After every step convo_check
 * must hold (the invariants of semantics.md), a refused request must have changed nothing,
 * and a few promises of semantics.md are checked against what the op answered. */
#include <string.h>

#include "buf.h"
#include "convo.h"
#include "fuzz.h"
#include "ops.h"
#include "ulid.h"

/* Strings the blank rule, the merge texts and the summary format care about. */
static const char *const dict[] = {
    "",
    " ",
    "\t\n",
    "\xc2\xa0",
    "\xe3\x80\x80",
    "Hi",
    "Hello!",
    "how are you",
    ".",
    "a\0b",
    "?",
    "\xe2\x80\x8b",
    "ok.",
    "\xf0\x9f\x98\x80",
    "[User]: x",
    "...",
};
static const size_t dict_len[] = {0, 1, 2, 2, 3, 2, 6, 11, 1, 3, 1, 3, 3, 4, 9, 3};

static const char *const timing_keys[] = {"playStart", "playEnd", "listenStart", "listenEnd",
                                          "llmStart",  "llmEnd",  "creation",    "bogus"};

/* A string from the dictionary or from the input (when it is valid UTF-8). */
static json_t *fuzz_string(struct fuzz_in *in)
{
	uint8_t b = fuzz_u8(in);
	json_t *s = NULL;

	if (b & 0x80) {
		size_t got;
		const uint8_t *p = fuzz_bytes(in, b & 0x3f, &got);
		s = json_stringn((const char *)p, got);
	}
	if (!s)
		s = json_stringn(dict[b % 16], dict_len[b % 16]);
	return s;
}

/* contents: a string, or an array of 0..4 strings (sometimes holding a non-string). */
static json_t *fuzz_contents(struct fuzz_in *in)
{
	uint8_t b = fuzz_u8(in);
	json_t *a;

	if (b < 96)
		return fuzz_string(in);
	if (b == 255)
		return json_integer(7);
	a = json_array();
	for (int i = 0; i < b % 5; i++)
		json_array_append_new(a, b % 37 == 0 && i == 1 ? json_null() : fuzz_string(in));
	return a;
}

/* A JSON value for aux: null (removes the key), scalars, or a small nested value. */
static json_t *fuzz_value(struct fuzz_in *in, int depth)
{
	uint8_t b = fuzz_u8(in);
	switch (b % 7) {
	case 0:
		return json_null();
	case 1:
		return json_integer((json_int_t)fuzz_u16(in) - 1000);
	case 2:
		return json_real((double)fuzz_u16(in) / 8.0);
	case 3:
		return json_boolean(b & 8);
	case 4:
		return depth < 3 ? json_pack("{s:o}", "k", fuzz_value(in, depth + 1))
		                 : json_string("deep");
	case 5:
		return depth < 3 ? json_pack("[o]", fuzz_value(in, depth + 1)) : json_array();
	default:
		return fuzz_string(in);
	}
}

static json_t *fuzz_timing(struct fuzz_in *in)
{
	uint8_t b = fuzz_u8(in);
	json_t *t = json_object();
	for (int i = 0; i < b % 3 + 1; i++) {
		uint8_t k = fuzz_u8(in);
		json_t *v = k & 0x80 ? json_integer(-(json_int_t)(k & 7))
		                     : json_integer((json_int_t)fuzz_u16(in) * 1000);
		if (k % 29 == 0) {
			json_decref(v);
			v = json_string("soon");
		}
		json_object_set_new(t, timing_keys[k % 8], v);
	}
	return t;
}

static json_t *fuzz_aux(struct fuzz_in *in)
{
	uint8_t b = fuzz_u8(in);
	json_t *a = json_object();
	static const char *const keys[] = {"stopped", "voice", "x", "lang"};
	for (int i = 0; i < b % 3 + 1; i++)
		json_object_set_new(a, keys[fuzz_u8(in) % 4], fuzz_value(in, 0));
	return a;
}

/* Adds timing and/or aux to obj (the metadata object, or a set_metadata request). */
static void fuzz_patch(struct fuzz_in *in, json_t *obj)
{
	uint8_t b = fuzz_u8(in);
	if (b & 1)
		json_object_set_new(obj, "timing", fuzz_timing(in));
	if (b & 2)
		json_object_set_new(obj, "aux", fuzz_aux(in));
	if (b == 0xff)
		json_object_set_new(obj, "extra", json_true());
}

/* What the conversation holds, to tell whether a refused request changed anything. */
static char *fingerprint(const struct convo *c)
{
	json_t *fp = json_array();
	char *s;

	for (size_t i = 0; i < c->nlog; i++) {
		const struct message *m = c->log[i];
		json_array_append_new(fp, message_to_map(m));
		json_array_append_new(fp, json_pack("[i,i,i,i,I]", (int)m->version, (int)m->seen[0],
		                                    (int)m->seen[1], (int)m->seen[2],
		                                    (json_int_t)m->updated_ms));
	}
	json_array_append_new(fp,
	                      json_pack("[I,I,I,I,I,I,I]", (json_int_t)c->first_llm,
	                                (json_int_t)c->last_summary, (json_int_t)c->text_bytes,
	                                (json_int_t)c->updated_ms, (json_int_t)c->scan_from[0],
	                                (json_int_t)c->scan_from[1], (json_int_t)c->scan_from[2]));
	s = json_dumps(fp, JSON_COMPACT | JSON_ENCODE_ANY);
	json_decref(fp);
	if (!s)
		abort();
	return s;
}

struct state {
	struct convo *c;
	struct convo_env env;
	json_t *info_ids, *info_versions; /* of the last get_summary_info, or NULL */
	bool info_fresh;                  /* nothing changed since that get_summary_info */
};

/* An id of the log (index from the input), a made-up one, or a malformed one. */
static json_t *fuzz_message_id(struct state *st, struct fuzz_in *in)
{
	uint8_t b = fuzz_u8(in);
	char id[ULID_LEN + 1];

	if (st->c->nlog && b < 200)
		return json_string(st->c->log[b % st->c->nlog]->id);
	if (b < 240) {
		ulid_gen_next(st->env.ulid, (uint64_t)st->env.now_ms, id);
		return json_string(id);
	}
	return json_string(b & 1 ? "not-an-id" : "01ARZ3NDEKTSV4RRFFQ69G5FA");
}

/* The ids/versions of the last get_summary_info, kept or changed in one way. */
static void fuzz_summary_ids(struct state *st, struct fuzz_in *in, json_t *req, bool *pristine)
{
	uint8_t how = fuzz_u8(in), where = fuzz_u8(in);
	json_t *ids = st->info_ids ? json_deep_copy(st->info_ids) : json_array();
	json_t *versions = st->info_versions ? json_deep_copy(st->info_versions) : json_array();
	size_t n = json_array_size(ids);

	*pristine = how < 128;
	if (!*pristine) {
		switch (how % 8) {
		case 0: /* drop one */
			if (n) {
				json_array_remove(ids, where % n);
				json_array_remove(versions, where % n);
			}
			break;
		case 1: /* swap two */
			if (n > 1) {
				size_t i = where % (n - 1);
				json_t *a = json_incref(json_array_get(ids, i));
				json_array_set(ids, i, json_array_get(ids, i + 1));
				json_array_set_new(ids, i + 1, a);
			}
			break;
		case 2: /* an older or newer version */
			if (n) {
				json_int_t v =
				    json_integer_value(json_array_get(versions, where % n));
				json_array_set_new(versions, where % n,
				                   json_integer(where & 0x80 ? v + 1 : v - 1));
			}
			break;
		case 3: /* some other id */
			json_array_insert_new(ids, n ? where % (n + 1) : 0,
			                      fuzz_message_id(st, in));
			json_array_insert_new(versions, n ? where % (n + 1) : 0, json_integer(1));
			break;
		case 4: /* truncated to a prefix */
			while (json_array_size(ids) > (n ? where % n : 0)) {
				json_array_remove(ids, json_array_size(ids) - 1);
				json_array_remove(versions, json_array_size(versions) - 1);
			}
			break;
		case 5: /* versions of another length */
			json_array_append_new(versions, json_integer(1));
			break;
		default:
			break;
		}
	}
	json_object_set_new(req, "ids", ids);
	if (how & 0x40 && how % 8 != 7)
		json_object_set_new(req, "versions", versions);
	else
		json_decref(versions);
}

/* Builds the request of one step; *op says which op runs it. */
static json_t *fuzz_request(struct state *st, struct fuzz_in *in, enum op *op, bool *pristine)
{
	static const enum op ops[] = {
	    OP_ADD_USER,        OP_ADD_ASSISTANT,    OP_ADD_USER,         OP_ADD_ASSISTANT,
	    OP_ADD_MESSAGE,     OP_GET_SUMMARY_INFO, OP_ADD_SUMMARY,      OP_SET_METADATA,
	    OP_TO_MESSAGES_MAP, OP_GET_MESSAGES,     OP_GET_LAST_SUMMARY, OP_DESCRIBE,
	};
	static const char *const formats[] = {"meta", "bedrock", "anthropic", "openai", "xml"};
	uint8_t b = fuzz_u8(in);
	json_t *req = json_object();

	*pristine = false;
	if (b >= 0xf0) {
		/* A raw request: the fuzzer writes the JSON itself; an op from the input. */
		size_t got;
		const uint8_t *p = fuzz_bytes(in, fuzz_u8(in), &got);
		json_t *raw = json_loadb((const char *)p, got, JSON_ALLOW_NUL, NULL);
		*op = ops[b % 12];
		if (json_is_object(raw)) {
			json_decref(req);
			return raw;
		}
		json_decref(raw);
		return req;
	}
	*op = ops[b % 12];
	if (*op == OP_ADD_MESSAGE) {
		static const char *const roles[] = {"user", "assistant", "summary", "User"};
		json_object_set_new(req, "role", json_string(roles[fuzz_u8(in) % 4]));
	}
	switch (*op) {
	case OP_ADD_MESSAGE:
	case OP_ADD_USER:
	case OP_ADD_ASSISTANT:
		json_object_set_new(req, "contents", fuzz_contents(in));
		if (b & 0x80) {
			json_t *md = json_object();
			fuzz_patch(in, md);
			json_object_set_new(req, "metadata", md);
		}
		break;
	case OP_GET_SUMMARY_INFO:
		if (b & 0x80) {
			json_object_set_new(req, "preamble", fuzz_string(in));
			json_object_set_new(req, "include_previous_summary",
			                    json_boolean(b & 0x40));
			json_object_set_new(req, "format",
			                    json_pack("{s:o, s:o}", "prefix", fuzz_string(in),
			                              "closure", fuzz_string(in)));
		}
		break;
	case OP_ADD_SUMMARY:
		json_object_set_new(req, "contents", fuzz_contents(in));
		fuzz_summary_ids(st, in, req, pristine);
		break;
	case OP_SET_METADATA:
		json_object_set_new(req, "message_id", fuzz_message_id(st, in));
		fuzz_patch(in, req);
		break;
	case OP_TO_MESSAGES_MAP:
		if (b & 0x80)
			json_object_set_new(req, "incremental", json_boolean(b & 0x40));
		if (b & 0x20)
			json_object_set_new(req, "exclude_last", json_boolean(b & 0x10));
		break;
	case OP_GET_MESSAGES:
		if (b & 0x80)
			json_object_set_new(req, "format", json_string(formats[fuzz_u8(in) % 5]));
		break;
	default:
		break;
	}
	return req;
}

/* Promises of semantics.md about what an op that succeeded answered. */
static void check_result(struct state *st, enum op op, const json_t *req, const json_t *res,
                         size_t nlog_before, bool pristine)
{
	const struct convo *c = st->c;

	switch (op) {
	case OP_ADD_USER:
	case OP_ADD_ASSISTANT:
	case OP_ADD_MESSAGE: {
		bool merged = json_is_true(json_object_get(res, "merged"));
		const char *role = json_string_value(json_object_get(
		    json_object_get(json_object_get(res, "message"), "message"), "role"));
		const char *want = op == OP_ADD_USER ? "user"
		                   : op == OP_ADD_ASSISTANT
		                       ? "assistant"
		                       : json_string_value(json_object_get(req, "role"));
		FUZZ_REQUIRE(role && strcmp(role, want) == 0, "added as %s, asked %s", role, want);
		if (merged)
			FUZZ_REQUIRE(c->nlog == nlog_before, "a merge added messages");
		else
			FUZZ_REQUIRE(c->nlog == nlog_before + 1 ||
			                 (c->nlog == nlog_before + 2 && c->log[c->nlog - 2]->fake),
			             "an add made %zu messages", c->nlog - nlog_before);
		FUZZ_REQUIRE(strcmp(json_string_value(
		                        json_object_get(json_object_get(res, "message"), "id")),
		                    c->log[c->nlog - 1]->id) == 0,
		             "the added message is not the last of the log");
		break;
	}
	case OP_GET_SUMMARY_INFO: {
		const json_t *ids = json_object_get(res, "ids"),
		             *v = json_object_get(res, "versions");
		FUZZ_REQUIRE(json_array_size(ids) == json_array_size(v),
		             "get_summary_info: %zu ids, %zu versions", json_array_size(ids),
		             json_array_size(v));
		json_decref(st->info_ids);
		json_decref(st->info_versions);
		st->info_ids = json_deep_copy(ids);
		st->info_versions = json_deep_copy(v);
		st->info_fresh = true;
		break;
	}
	case OP_ADD_SUMMARY:
		FUZZ_REQUIRE(c->last_summary >= 0 && c->first_llm == (size_t)c->last_summary + 1,
		             "the positions did not move to the new summary");
		FUZZ_REQUIRE(c->nlog == nlog_before + 1, "add_summary made %zu messages",
		             c->nlog - nlog_before);
		break;
	case OP_GET_MESSAGES: {
		const json_t *f = json_object_get(req, "format");
		if (!f || strcmp(json_string_value(f), "meta") == 0)
			FUZZ_REQUIRE(json_array_size(json_object_get(res, "messages")) ==
			                 c->nlog - c->first_llm,
			             "get_messages: %zu messages, the view holds %zu",
			             json_array_size(json_object_get(res, "messages")),
			             c->nlog - c->first_llm);
		FUZZ_REQUIRE(json_is_null(json_object_get(res, "summary")) == (c->last_summary < 0),
		             "get_messages: summary null and last summary disagree");
		break;
	}
	case OP_TO_MESSAGES_MAP: {
		/* An incremental call returns each change once: asking again gives nothing. */
		const json_t *inc = json_object_get(req, "incremental");
		if (!inc || json_is_true(inc)) {
			json_t *again = convo_to_messages_map(
			    st->c, true, !json_is_false(json_object_get(req, "exclude_last")));
			FUZZ_REQUIRE(again, "to_messages_map failed");
			FUZZ_REQUIRE(json_array_size(json_object_get(again, "messages")) == 0,
			             "an incremental to_messages_map returned %zu messages twice",
			             json_array_size(json_object_get(again, "messages")));
			json_decref(again);
		} else {
			FUZZ_REQUIRE(json_array_size(json_object_get(res, "messages")) == c->nlog,
			             "a full to_messages_map misses messages");
		}
		break;
	}
	default:
		break;
	}
	(void)pristine;
}

/* The direct writers of get_messages and to_messages_map write what jansson would for the
 * same trees. */
static void check_writers(const struct convo *c)
{
	struct buf direct = {NULL, 0, 0}, tree = {NULL, 0, 0};
	json_t *v = convo_get_messages(c, RENDER_META);
	int rc1, rc2;

	if (!v)
		return;
	rc1 = convo_write_messages(c, &direct);
	rc2 = buf_append_json(&tree, v);
	FUZZ_REQUIRE(rc1 == rc2, "convo_write_messages %d, the tree %d", rc1, rc2);
	FUZZ_REQUIRE(rc1 != 0 || (direct.len == tree.len &&
	                          memcmp(direct.data, tree.data, tree.len) == 0),
	             "convo_write_messages wrote %.*s\nthe tree is %.*s", (int)direct.len,
	             direct.data, (int)tree.len, tree.data);
	for (int k = 0; k < 4; k++) {
		bool incremental = k & 1, exclude_last = k & 2;
		json_t *map = convo_to_messages_map_build(c, incremental, exclude_last);
		if (!map)
			continue;
		direct.len = tree.len = 0;
		rc1 = convo_write_messages_map(c, incremental, exclude_last, &direct);
		rc2 = buf_append_json(&tree, map);
		FUZZ_REQUIRE(
		    rc1 == rc2 && (rc1 != 0 || (direct.len == tree.len &&
		                                memcmp(direct.data, tree.data, tree.len) == 0)),
		    "convo_write_messages_map(%d, %d) wrote %.*s\nthe tree is %.*s", incremental,
		    exclude_last, (int)direct.len, direct.data, (int)tree.len, tree.data);
		json_decref(map);
	}
	for (size_t i = 0; i < c->nlog; i++) {
		json_t *m = message_to_map(c->log[i]);
		direct.len = tree.len = 0;
		if (!m)
			continue;
		rc1 = message_write_map(&direct, c->log[i]);
		rc2 = buf_append_json(&tree, m);
		FUZZ_REQUIRE(rc1 == rc2 && (rc1 != 0 || (direct.len == tree.len &&
		                                         memcmp(direct.data, tree.data,
		                                                tree.len) == 0)),
		             "message_write_map differs from message_to_map at %zu", i);
		json_decref(m);
	}
	json_decref(v);
	buf_free(&direct);
	buf_free(&tree);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static const uint8_t seed[32] = {1};
	struct fuzz_in in = {data, size};
	struct ulid_gen gen;
	struct state st = {0};
	struct error err = {ERR_OK, ""};
	int steps = 0;
	uint8_t limits;

	ulid_gen_init(&gen, seed);
	st.c = convo_new("fuzz", 4);
	if (!st.c)
		return 0;
	st.env.ulid = &gen;
	st.env.now_ms = 1744815823057;
	/* The first byte: roomy limits, or small ones that the steps will run into. */
	limits = fuzz_u8(&in);
	st.env.limits.max_messages = limits & 0x80 ? 2 + (limits & 15) : 48;
	st.env.limits.max_bytes = limits & 0x80 ? 16 + (size_t)(limits >> 4 & 7) * 24 : 4096;
	while (in.n && steps++ < 200) {
		enum op op;
		bool pristine = false, changed = false;
		json_t *req = fuzz_request(&st, &in, &op, &pristine), *res = NULL;
		char *before = fingerprint(st.c);
		size_t nlog = st.c->nlog;
		enum error_code rc;
		uint8_t tick = fuzz_u8(&in);

		/* The clock mostly moves on, and now and then steps back. */
		st.env.now_ms += tick < 250 ? tick : -(int64_t)(tick - 240) * 1000;
		rc = ops_check(op, req, &err);
		FUZZ_REQUIRE(rc == ERR_OK || rc == ERR_BAD_REQUEST || rc == ERR_TOO_LARGE,
		             "ops_check: %s: %s", error_code_str(rc), err.message);
		if (rc == ERR_OK) {
			rc = ops_run(op, st.c, &st.env, req, &res, &changed, &err);
			FUZZ_REQUIRE(rc != ERR_INTERNAL && rc != ERR_PARSE_ERROR &&
			                 rc != ERR_UNKNOWN_OP,
			             "%s: %s: %s", ops_name(op), error_code_str(rc), err.message);
			/* A summary of what get_summary_info just named, unchanged since, must be
			 * taken (limits aside). */
			if (op == OP_ADD_SUMMARY && pristine && st.info_fresh &&
			    json_array_size(st.info_ids) > 0)
				FUZZ_REQUIRE(rc == ERR_OK || rc == ERR_TOO_LARGE ||
				                 (rc == ERR_BAD_REQUEST &&
				                  strncmp(err.message, "contents", 8) == 0),
				             "add_summary of fresh ids refused: %s: %s",
				             error_code_str(rc), err.message);
		}
		FUZZ_REQUIRE(convo_check(st.c, &err) == ERR_OK, "after %s: %s", ops_name(op),
		             err.message);
		check_writers(st.c);
		if (rc != ERR_OK) {
			char *after = fingerprint(st.c);
			FUZZ_REQUIRE(strcmp(before, after) == 0,
			             "a refused %s changed the conversation", ops_name(op));
			free(after);
			FUZZ_REQUIRE(!res, "a refused request with a result");
		} else {
			FUZZ_REQUIRE(json_is_object(res), "%s: no result", ops_name(op));
			if (ops_mutates(op)) {
				char *after = fingerprint(st.c);
				FUZZ_REQUIRE(changed == (strcmp(before, after) != 0),
				             "%s: changed says %d", ops_name(op), changed);
				free(after);
				if (changed)
					st.info_fresh = false;
			}
			check_result(&st, op, req, res, nlog, pristine);
		}
		free(before);
		json_decref(res);
		json_decref(req);
	}
	json_decref(st.info_ids);
	json_decref(st.info_versions);
	convo_free(st.c);
	return 0;
}
