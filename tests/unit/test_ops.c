/* Unit tests for lib/ops: the op table, the seed's worked example through JSON requests,
 * field validation of every conversation op (codes and messages), blank contents, results
 * and rollback when the answer cannot be built. */
#include "ops.h"
#include "test.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#define T0 INT64_C(1744815823057)

static struct ulid_gen gen;
static struct convo_env env;

static void env_init(int64_t now)
{
	uint8_t seed[32];
	for (int i = 0; i < 32; i++)
		seed[i] = (uint8_t)(i * 5 + 3);
	ulid_gen_init(&gen, seed);
	memset(&env, 0, sizeof(env));
	env.ulid = &gen;
	env.now_ms = now;
}

static long fail_after = -1;
static void *failing_malloc(size_t n)
{
	if (fail_after == 0)
		return NULL;
	if (fail_after > 0)
		fail_after--;
	return malloc(n);
}

static json_t *parse(const char *s)
{
	json_error_t e;
	json_t *j = json_loads(s, JSON_ALLOW_NUL | JSON_DECODE_ANY, &e);
	if (!j)
		fprintf(stderr, "bad test JSON: %s: %s\n", s, e.text);
	return j;
}

static char *dump(const json_t *j)
{
	return j ? json_dumps(j, JSON_COMPACT | JSON_ENCODE_ANY | JSON_ENSURE_ASCII) : NULL;
}

/* Runs one request as the daemon would: lookup, check, run. */
static enum error_code request(struct convo *c, const char *json, json_t **result, bool *changed,
                               struct error *e)
{
	json_t *req = parse(json);
	enum op op = ops_lookup(json_string_value(json_object_get(req, "op")),
	                        json_string_length(json_object_get(req, "op")));
	enum error_code rc;
	*result = NULL;
	*changed = true; /* ops_run must clear it */
	e->code = ERR_OK;
	e->message[0] = '\0';
	rc = ops_check(op, req, e);
	if (rc == ERR_OK)
		rc = ops_run(op, c, &env, req, result, changed, e);
	else
		*changed = false;
	json_decref(req);
	return rc;
}

/* The result of a request that must succeed (NULL and a failed check otherwise). */
static json_t *ok(struct convo *c, const char *json, int line)
{
	json_t *res;
	struct error e;
	bool changed;
	enum error_code rc = request(c, json, &res, &changed, &e);
	test_checks++;
	if (rc != ERR_OK || !res) {
		test_failures++;
		fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, line, json, error_code_str(rc),
		        e.message);
	}
	return res;
}
#define OK(c, json) ok((c), (json), __LINE__)

static void check_err(struct convo *c, const char *json, enum error_code want, const char *msg,
                      int line)
{
	json_t *res;
	struct error e;
	bool changed = true;
	char *before = c ? convo_describe(c) : NULL;
	enum error_code rc = request(c, json, &res, &changed, &e);
	char *after = c ? convo_describe(c) : NULL;
	test_checks++;
	if (rc != want || e.code != want || res || changed || (msg && strcmp(e.message, msg)) ||
	    (c && strcmp(before, after))) {
		test_failures++;
		fprintf(stderr, "%s:%d: %s\n  got:      %s \"%s\"%s\n  expected: %s \"%s\"\n",
		        __FILE__, line, json, error_code_str(rc), e.message,
		        (c && strcmp(before, after)) ? " (conversation changed)" : "",
		        error_code_str(want), msg ? msg : "");
	}
	json_decref(res);
	free(before);
	free(after);
}
#define ERR(c, json, want, msg) check_err((c), (json), (want), (msg), __LINE__)

/* ops_check alone, with no conversation at all. */
static void check_bad(const char *json, const char *msg, int line)
{
	json_t *req = parse(json);
	struct error e = {ERR_OK, ""};
	enum error_code rc = ops_check(ops_lookup(json_string_value(json_object_get(req, "op")),
	                                          json_string_length(json_object_get(req, "op"))),
	                               req, &e);
	test_checks++;
	if (rc != ERR_BAD_REQUEST || strcmp(e.message, msg)) {
		test_failures++;
		fprintf(stderr,
		        "%s:%d: %s\n  got:      %s \"%s\"\n  expected: bad_request \"%s\"\n",
		        __FILE__, line, json, error_code_str(rc), e.message, msg);
	}
	json_decref(req);
}
#define BAD(json, msg) check_bad((json), (msg), __LINE__)

static void check_json(json_t *j, const char *expected, int line)
{
	char *s = dump(j);
	test_checks++;
	if (!s || strcmp(s, expected) != 0) {
		test_failures++;
		fprintf(stderr, "%s:%d: JSON mismatch\n  got:      %s\n  expected: %s\n", __FILE__,
		        line, s ? s : "(null)", expected);
	}
	free(s);
	json_decref(j);
}
#define CHECK_JSON(j, expected) check_json((j), (expected), __LINE__)

/* "i,j,..." log indexes of the messages of a to_messages_map result (consumed). */
static void check_indexes(struct convo *c, json_t *res, const char *expected, int line)
{
	char got[256] = "";
	size_t i, n = 0;
	json_t *m;
	json_array_foreach(json_object_get(res, "messages"), i, m)
	{
		const char *id = json_string_value(json_object_get(m, "id"));
		n += (size_t)snprintf(got + n, sizeof(got) - n, "%s%ld", i ? "," : "",
		                      convo_find(c, id, strlen(id)));
	}
	test_checks++;
	if (!res || strcmp(got, expected)) {
		test_failures++;
		fprintf(stderr, "%s:%d: messages [%s], expected [%s]\n", __FILE__, line, got,
		        expected);
	}
	json_decref(res);
}
#define CHECK_INDEXES(c, res, expected) check_indexes((c), (res), (expected), __LINE__)

static void test_table(void)
{
	static const char *const names[] = {
	    "add_user",
	    "add_assistant",
	    "add_message",
	    "get_messages",
	    "get_summary_info",
	    "add_summary",
	    "get_last_summary",
	    "to_messages_map",
	    "set_metadata",
	    "describe",
	    "flush",
	    "close",
	    "list",
	    "stats",
	    "ping",
	    "dead_letters",
	    "retry_dead_letters",
	    "create_table",
	};
	CHECK(sizeof(names) / sizeof(names[0]) == OP_COUNT - 1);
	for (int op = OP_ADD_USER; op < OP_COUNT && op - 1 < (int)(sizeof(names) / sizeof(names[0]));
	     op++) {
		CHECK_STR(ops_name((enum op)op), names[op - 1]);
		CHECK((int)ops_lookup(names[op - 1], strlen(names[op - 1])) == op);
		/* A name and more: a NUL, or its first bytes only. */
		char longer[32];
		size_t n = strlen(names[op - 1]);
		memcpy(longer, names[op - 1], n);
		memcpy(longer + n, "\0x", 3);
		CHECK(ops_lookup(longer, n + 1) == OP_UNKNOWN &&
		      ops_lookup(longer, n + 2) == OP_UNKNOWN);
		CHECK(ops_lookup(longer, n - 1) == OP_UNKNOWN);
	}
	CHECK(ops_lookup("Add_user", 8) == OP_UNKNOWN && ops_lookup("", 0) == OP_UNKNOWN);
	CHECK(ops_lookup("unknown", 7) == OP_UNKNOWN && ops_lookup(NULL, 0) == OP_UNKNOWN);
	CHECK_STR(ops_name(OP_UNKNOWN), "unknown");
	CHECK_STR(ops_name(OP_COUNT), "unknown");
	for (int op = OP_UNKNOWN; op < OP_COUNT; op++) {
		bool creates = op == OP_ADD_USER || op == OP_ADD_ASSISTANT || op == OP_ADD_MESSAGE;
		bool mutates = creates || op == OP_ADD_SUMMARY || op == OP_SET_METADATA;
		bool needs = (op >= OP_ADD_USER && op <= OP_DESCRIBE) || op == OP_CLOSE;
		CHECK(ops_creates((enum op)op) == creates);
		CHECK(ops_mutates((enum op)op) == mutates);
		CHECK(ops_needs_conversation((enum op)op) == needs);
	}
	struct error e;
	CHECK(ops_check(OP_UNKNOWN, NULL, &e) == ERR_UNKNOWN_OP);
	json_t *req = parse("{\"op\":\"ping\"}"), *res = (json_t *)&res;
	CHECK(ops_check(OP_PING, req, &e) == ERR_OK);
	struct convo *c = convo_new("c", 1);
	bool changed = true;
	for (int op = OP_FLUSH; op < OP_COUNT; op++) {
		CHECK(ops_run((enum op)op, c, &env, req, &res, &changed, &e) == ERR_INTERNAL);
		CHECK(res == NULL && !changed);
	}
	convo_free(c);
	json_decref(req);
}

static void test_worked_example(void)
{
	struct convo *c = convo_new("call-42", 7);
	char expect[2048], buf[1024];
	json_t *r;

	env_init(T0);
	r = OK(c,
	       "{\"op\":\"add_assistant\",\"conversation\":\"call-42\",\"contents\":\"Hello!\"}");
	snprintf(expect, sizeof(expect),
	         "{\"message\":{\"id\":\"%s\",\"message\":{\"role\":\"assistant\",\"contents\":"
	         "[\"Hello!\"]},\"metadata\":{\"timing\":{\"creation\":%" PRId64 "}}},"
	         "\"merged\":false}",
	         c->log[1]->id, T0);
	CHECK_JSON(r, expect);
	CHECK(c->nlog == 2 && c->log[0]->fake);

	env.now_ms = T0 + 1;
	r = OK(c, "{\"op\":\"add_user\",\"conversation\":\"call-42\",\"contents\":\"Hi, there\"}");
	CHECK(json_is_false(json_object_get(r, "merged")));
	json_decref(r);
	env.now_ms = T0 + 3;
	r = OK(c,
	       "{\"op\":\"add_user\",\"conversation\":\"call-42\",\"contents\":\"how are you\"}");
	snprintf(expect, sizeof(expect),
	         "{\"message\":{\"id\":\"%s\",\"message\":{\"role\":\"user\",\"contents\":"
	         "[\"Hi, there\",\"how are you\"]},\"metadata\":{\"attribute\":[\"merged\"],"
	         "\"timing\":{\"creation\":%" PRId64 "}}},\"merged\":true}",
	         c->log[2]->id, T0 + 1);
	CHECK_JSON(r, expect);
	env.now_ms = T0 + 6;
	json_decref(OK(c, "{\"op\":\"add_assistant\",\"conversation\":\"call-42\","
	                  "\"contents\":[\"I am fine,\",\"and you?\"]}"));
	json_decref(OK(c, "{\"op\":\"add_message\",\"conversation\":\"call-42\",\"role\":\"user\","
	                  "\"contents\":[\"Good, \",\"thank you!\"]}"));
	CHECK(c->nlog == 5);

	json_t *info = OK(c, "{\"op\":\"get_summary_info\",\"conversation\":\"call-42\"}");
	CHECK_INDEXES(c, json_incref(info), "1,2,3");
	CHECK_STR(json_string_value(json_object_get(info, "text")),
	          "[Assistant]: Hello!\n[User]: Hi, there. how are you.\n[Assistant]: I am fine,. "
	          "and you?");
	CHECK(json_is_null(json_object_get(info, "previous_summary")));
	char *ids = dump(json_object_get(info, "ids"));
	char *versions = dump(json_object_get(info, "versions"));
	CHECK_STR(versions, "[1,2,1]");
	snprintf(expect, sizeof(expect), "[\"%s\",\"%s\",\"%s\"]", c->log[1]->id, c->log[2]->id,
	         c->log[3]->id);
	CHECK_STR(ids, expect);
	json_decref(info);

	env.now_ms = T0 + 20;
	snprintf(buf, sizeof(buf),
	         "{\"op\":\"add_summary\",\"conversation\":\"call-42\",\"contents\":\"...\","
	         "\"ids\":%s,\"versions\":%s}",
	         ids, versions);
	r = OK(c, buf);
	snprintf(expect, sizeof(expect),
	         "{\"message\":{\"id\":\"%s\",\"message\":{\"role\":\"summary\",\"contents\":"
	         "[\"...\"]},\"metadata\":{\"summaryIds\":%s,\"timing\":{\"creation\":%" PRId64
	         "}}}}",
	         c->log[4]->id, ids, T0 + 20);
	CHECK_JSON(r, expect);
	CHECK(c->last_summary == 4 && c->first_llm == 5 && c->nlog == 6);
	/* the same request again: no longer valid */
	ERR(c, buf, ERR_CONFLICT, NULL);
	free(ids);
	free(versions);

	r = OK(c, "{\"op\":\"get_messages\",\"conversation\":\"call-42\",\"format\":\"openai\"}");
	CHECK_JSON(r, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":"
	              "\"Good, \"},{\"type\":\"text\",\"text\":\"thank you!\"}]}],"
	              "\"summary\":[\"...\"]}");
	env.now_ms = T0 + 21;
	json_decref(OK(c, "{\"op\":\"add_assistant\",\"conversation\":\"call-42\","
	                  "\"contents\":\"How can I help you?\"}"));
	CHECK_INDEXES(c, OK(c, "{\"op\":\"to_messages_map\",\"conversation\":\"call-42\"}"),
	              "0,1,2,3,4,5");
	env.now_ms = T0 + 22;
	r = OK(c, "{\"op\":\"add_assistant\",\"conversation\":\"call-42\","
	          "\"contents\":\"Are you still there?\"}");
	CHECK(json_is_true(json_object_get(r, "merged")));
	json_decref(r);
	env.now_ms = T0 + 23;
	json_decref(OK(c, "{\"op\":\"add_user\",\"conversation\":\"call-42\","
	                  "\"contents\":\"Yes, but I do not need help!\"}"));
	env.now_ms = T0 + 24;
	snprintf(buf, sizeof(buf),
	         "{\"op\":\"set_metadata\",\"conversation\":\"call-42\",\"message_id\":\"%s\","
	         "\"aux\":{\"stopped\":true},\"timing\":{\"playStart\":%" PRId64 "}}",
	         c->log[7]->id, T0 + 23);
	json_t *res;
	struct error e;
	bool changed = false;
	CHECK(request(c, buf, &res, &changed, &e) == ERR_OK && changed);
	snprintf(
	    expect, sizeof(expect),
	    "{\"message\":{\"id\":\"%s\",\"message\":{\"role\":\"user\",\"contents\":"
	    "[\"Yes, but I do not need help!\"]},\"metadata\":{\"timing\":{\"creation\":%" PRId64
	    ",\"playStart\":%" PRId64 "},\"aux\":{\"stopped\":true}}}}",
	    c->log[7]->id, T0 + 23, T0 + 23);
	CHECK_JSON(res, expect);
	/* the same metadata again changes nothing */
	CHECK(request(c, buf, &res, &changed, &e) == ERR_OK && !changed);
	json_decref(res);
	CHECK(c->log[7]->version == 2);

	CHECK_INDEXES(c,
	              OK(c, "{\"op\":\"to_messages_map\",\"conversation\":\"call-42\","
	                    "\"incremental\":true,\"exclude_last\":false}"),
	              "6,7");
	CHECK_INDEXES(c,
	              OK(c, "{\"op\":\"to_messages_map\",\"conversation\":\"call-42\","
	                    "\"exclude_last\":false}"),
	              "");
	CHECK_INDEXES(c,
	              OK(c, "{\"op\":\"to_messages_map\",\"conversation\":\"call-42\","
	                    "\"incremental\":false}"),
	              "0,1,2,3,4,5,6,7");
	r = OK(c, "{\"op\":\"get_last_summary\",\"conversation\":\"call-42\"}");
	CHECK_STR(json_string_value(json_object_get(json_object_get(r, "message"), "id")),
	          c->log[4]->id);
	json_decref(r);

	r = OK(c, "{\"op\":\"describe\",\"conversation\":\"call-42\"}");
	char *d = convo_describe(c);
	CHECK(json_object_size(r) == 1);
	CHECK_STR(json_string_value(json_object_get(r, "text")), d);
	CHECK(d && strstr(d, "\n4   ^   [summary] {'...'}") && strstr(d, "\n5   *   [user]") &&
	      strstr(d, "{aux={\"stopped\":true}, timing=[{creation=") &&
	      strstr(d, "\n.  - -> index 8.\n"));
	free(d);
	json_decref(r);
	struct error ce;
	CHECK(convo_check(c, &ce) == ERR_OK);
	convo_free(c);
}

static void test_contents(void)
{
	struct convo *c = convo_new("c", 1);
	json_t *r;
	env_init(1000);

	ERR(c, "{\"op\":\"add_user\"}", ERR_BAD_REQUEST,
	    "contents: missing; expected a string or an array of strings");
	ERR(c, "{\"op\":\"add_user\",\"contents\":5}", ERR_BAD_REQUEST,
	    "contents: expected a string or an array of strings");
	ERR(c, "{\"op\":\"add_user\",\"contents\":null}", ERR_BAD_REQUEST,
	    "contents: expected a string or an array of strings");
	ERR(c, "{\"op\":\"add_user\",\"contents\":{\"a\":\"b\"}}", ERR_BAD_REQUEST,
	    "contents: expected a string or an array of strings");
	ERR(c, "{\"op\":\"add_user\",\"contents\":[]}", ERR_BAD_REQUEST,
	    "contents: expected a string or a non-empty array of strings");
	ERR(c, "{\"op\":\"add_user\",\"contents\":[\"a\",1]}", ERR_BAD_REQUEST,
	    "contents[1]: expected a string");
	ERR(c, "{\"op\":\"add_user\",\"contents\":\"\"}", ERR_BAD_REQUEST,
	    "contents: expected at least one non-blank string");
	/* every White_Space character, alone and together */
	static const char *const blanks[] = {
	    "\\t",     "\\n",     "\\u000b", "\\f",     "\\r",     " ",       "\\u0085",
	    "\\u00a0", "\\u1680", "\\u2000", "\\u2001", "\\u2002", "\\u2003", "\\u2004",
	    "\\u2005", "\\u2006", "\\u2007", "\\u2008", "\\u2009", "\\u200a", "\\u2028",
	    "\\u2029", "\\u202f", "\\u205f", "\\u3000",
	};
	char req[512], all[256] = "";
	for (size_t i = 0; i < sizeof(blanks) / sizeof(blanks[0]); i++) {
		snprintf(req, sizeof(req), "{\"op\":\"add_assistant\",\"contents\":\"%s\"}",
		         blanks[i]);
		ERR(c, req, ERR_BAD_REQUEST, "contents: expected at least one non-blank string");
		strcat(all, blanks[i]);
	}
	snprintf(req, sizeof(req), "{\"op\":\"add_user\",\"contents\":[\"%s\",\"\",\" \\u3000\"]}",
	         all);
	ERR(c, req, ERR_BAD_REQUEST, "contents: expected at least one non-blank string");
	ERR(c,
	    "{\"op\":\"add_summary\",\"contents\":[\" "
	    "\"],\"ids\":[\"01ARZ3NDEKTSV4RRFFQ69G5FAV\"]}",
	    ERR_BAD_REQUEST, "contents: expected at least one non-blank string");
	CHECK(c->nlog == 0);

	/* not White_Space: zero-width space, NUL, U+180E, U+FEFF; kept exactly as given */
	r = OK(c, "{\"op\":\"add_user\",\"contents\":[\"\\u200b\",\" \",\"\\u0000\",\"  x \","
	          "\"\\u180e\",\"\\ufeff\",\"a\\u0000b\",\"\\ud83d\\ude00\"]}");
	CHECK_JSON(json_incref(json_object_get(json_object_get(r, "message"), "message")),
	           "{\"role\":\"user\",\"contents\":[\"\\u200B\",\"\\u0000\",\"  x \",\"\\u180E\","
	           "\"\\uFEFF\",\"a\\u0000b\",\"\\uD83D\\uDE00\"]}");
	json_decref(r);
	CHECK(c->log[0]->ncontents == 7 && c->log[0]->contents[5]->len == 3);
	CHECK(c->text_bytes == 3 + 1 + 4 + 3 + 3 + 3 + 4);
	/* blanks inside an array are dropped, the rest merged */
	r = OK(c, "{\"op\":\"add_user\",\"contents\":[\"\",\"more\",\"\\u2003\"]}");
	CHECK(json_is_true(json_object_get(r, "merged")));
	json_decref(r);
	CHECK(c->log[0]->ncontents == 8);
	CHECK_STR(c->log[0]->contents[7]->bytes, "more");
	/* many strings */
	char big[4096] = "{\"op\":\"add_assistant\",\"contents\":[";
	for (int i = 0; i < 100; i++)
		strcat(big, i ? ",\"s\"" : "\"s\"");
	strcat(big, "]}");
	r = OK(c, big);
	CHECK(json_array_size(json_object_get(
	          json_object_get(json_object_get(r, "message"), "message"), "contents")) == 100);
	json_decref(r);
	convo_free(c);
}

static void test_validation(void)
{
	/* ops_check needs no conversation */
	BAD("{\"op\":\"add_message\",\"contents\":\"x\"}",
	    "role: missing; expected \"user\" or \"assistant\"");
	BAD("{\"op\":\"add_message\",\"role\":\"summary\",\"contents\":\"x\"}",
	    "role: expected \"user\" or \"assistant\"");
	BAD("{\"op\":\"add_message\",\"role\":\"User\",\"contents\":\"x\"}",
	    "role: expected \"user\" or \"assistant\"");
	BAD("{\"op\":\"add_message\",\"role\":1,\"contents\":\"x\"}",
	    "role: expected \"user\" or \"assistant\"");
	BAD("{\"op\":\"add_message\",\"role\":\"user\\u0000\",\"contents\":\"x\"}",
	    "role: expected \"user\" or \"assistant\"");
	BAD("{\"op\":\"add_message\",\"role\":\"user\"}",
	    "contents: missing; expected a string or an array of strings");
	BAD("{\"op\":\"add_user\",\"contents\":\"x\",\"metadata\":[]}",
	    "metadata: expected an object with timing and/or aux");
	BAD("{\"op\":\"add_user\",\"contents\":\"x\",\"metadata\":null}",
	    "metadata: expected an object with timing and/or aux");
	BAD("{\"op\":\"add_user\",\"contents\":\"x\",\"metadata\":{\"attribute\":[]}}",
	    "metadata.attribute: unknown key (expected timing or aux)");
	BAD("{\"op\":\"add_user\",\"contents\":\"x\",\"metadata\":{\"timing\":{\"creation\":1}}}",
	    "metadata.timing.creation: set by the daemon, cannot be set");
	BAD("{\"op\":\"add_user\",\"contents\":\"x\",\"metadata\":{\"timing\":{\"playEnd\":-5}}}",
	    "metadata.timing.playEnd: expected an integer >= 0 (Unix milliseconds)");
	BAD("{\"op\":\"add_user\",\"contents\":\"x\",\"metadata\":{\"timing\":{\"playEnd\":2.5}}}",
	    "metadata.timing.playEnd: expected an integer >= 0 (Unix milliseconds)");
	BAD("{\"op\":\"add_user\",\"contents\":\"x\",\"metadata\":{\"timing\":{\"later\":2}}}",
	    "metadata.timing.later: unknown timing key (expected playStart, playEnd, listenStart, "
	    "listenEnd, llmStart or llmEnd)");
	BAD("{\"op\":\"add_user\",\"contents\":\"x\",\"metadata\":{\"timing\":[]}}",
	    "metadata.timing: expected an object");
	BAD("{\"op\":\"add_assistant\",\"contents\":\"x\",\"metadata\":{\"aux\":true}}",
	    "metadata.aux: expected an object");

	BAD("{\"op\":\"get_messages\",\"format\":\"xml\"}",
	    "format: expected \"meta\", \"bedrock\", \"anthropic\" or \"openai\"");
	BAD("{\"op\":\"get_messages\",\"format\":{}}",
	    "format: expected \"meta\", \"bedrock\", \"anthropic\" or \"openai\"");
	BAD("{\"op\":\"get_summary_info\",\"preamble\":5}", "preamble: expected a string");
	BAD("{\"op\":\"get_summary_info\",\"preamble\":\"a\\u0000b\"}",
	    "preamble: expected a string without NUL characters");
	BAD("{\"op\":\"get_summary_info\",\"include_previous_summary\":\"yes\"}",
	    "include_previous_summary: expected true or false");
	BAD("{\"op\":\"get_summary_info\",\"format\":\"meta\"}",
	    "format: expected an object (prefix, postfix, user_tag, assistant_tag, summary_tag, "
	    "separator, closure, summary_closure)");
	BAD("{\"op\":\"get_summary_info\",\"format\":{\"suffix\":\"x\"}}",
	    "format.suffix: unknown key (expected prefix, postfix, user_tag, assistant_tag, "
	    "summary_tag, separator, closure or summary_closure)");
	BAD("{\"op\":\"get_summary_info\",\"format\":{\"closure\":1}}",
	    "format.closure: expected a string");
	BAD("{\"op\":\"get_summary_info\",\"format\":{\"summary_closure\":\"\\u0000\"}}",
	    "format.summary_closure: expected a string without NUL characters");

	BAD("{\"op\":\"add_summary\",\"contents\":\"s\"}",
	    "ids: missing; expected the ids of get_summary_info");
	BAD("{\"op\":\"add_summary\",\"contents\":\"s\",\"ids\":[]}",
	    "ids: expected a non-empty array of message ids");
	BAD("{\"op\":\"add_summary\",\"contents\":\"s\",\"ids\":\"01ARZ3NDEKTSV4RRFFQ69G5FAV\"}",
	    "ids: expected a non-empty array of message ids");
	BAD("{\"op\":\"add_summary\",\"contents\":\"s\",\"ids\":[\"01ARZ3NDEKTSV4RRFFQ69G5FAV\",1]"
	    "}",
	    "ids[1]: expected a message id (a 26-character ULID)");
	BAD("{\"op\":\"add_summary\",\"contents\":\"s\",\"ids\":[\"01arz3ndektsv4rrffq69g5fav\"]}",
	    "ids[0]: expected a message id (a 26-character ULID)");
	BAD("{\"op\":\"add_summary\",\"ids\":[\"01ARZ3NDEKTSV4RRFFQ69G5FAV\"]}",
	    "contents: missing; expected a string or an array of strings");
	BAD("{\"op\":\"add_summary\",\"contents\":\"s\",\"ids\":[\"01ARZ3NDEKTSV4RRFFQ69G5FAV\"],"
	    "\"versions\":[1,2]}",
	    "versions: expected an array of integers, one per id");
	BAD("{\"op\":\"add_summary\",\"contents\":\"s\",\"ids\":[\"01ARZ3NDEKTSV4RRFFQ69G5FAV\"],"
	    "\"versions\":1}",
	    "versions: expected an array of integers, one per id");
	BAD("{\"op\":\"add_summary\",\"contents\":\"s\",\"ids\":[\"01ARZ3NDEKTSV4RRFFQ69G5FAV\"],"
	    "\"versions\":[0]}",
	    "versions[0]: expected an integer >= 1");
	BAD("{\"op\":\"add_summary\",\"contents\":\"s\",\"ids\":[\"01ARZ3NDEKTSV4RRFFQ69G5FAV\"],"
	    "\"versions\":[1.5]}",
	    "versions[0]: expected an integer >= 1");
	BAD("{\"op\":\"add_summary\",\"contents\":\"s\",\"ids\":[\"01ARZ3NDEKTSV4RRFFQ69G5FAV\"],"
	    "\"versions\":[4294967296]}",
	    "versions[0]: expected an integer >= 1");

	BAD("{\"op\":\"to_messages_map\",\"incremental\":\"true\"}",
	    "incremental: expected true or false");
	BAD("{\"op\":\"to_messages_map\",\"exclude_last\":0}",
	    "exclude_last: expected true or false");

	BAD("{\"op\":\"set_metadata\"}", "message_id: missing; expected a message id");
	BAD("{\"op\":\"set_metadata\",\"message_id\":7}",
	    "message_id: expected a message id (a 26-character ULID)");
	BAD("{\"op\":\"set_metadata\",\"message_id\":\"abc\"}",
	    "message_id: expected a message id (a 26-character ULID)");
	BAD("{\"op\":\"set_metadata\",\"message_id\":\"01ARZ3NDEKTSV4RRFFQ69G5FAV\","
	    "\"timing\":{\"creation\":5}}",
	    "timing.creation: set by the daemon, cannot be set");
	BAD("{\"op\":\"set_metadata\",\"message_id\":\"01ARZ3NDEKTSV4RRFFQ69G5FAV\",\"aux\":[1]}",
	    "aux: expected an object");
	BAD("{\"op\":\"set_metadata\",\"message_id\":\"01ARZ3NDEKTSV4RRFFQ69G5FAV\","
	    "\"timing\":{\"llmStart\":\"now\"}}",
	    "timing.llmStart: expected an integer >= 0 (Unix milliseconds)");

	/* valid requests pass ops_check; unknown top-level fields are ignored */
	static const char *const good[] = {
	    "{\"op\":\"add_user\",\"contents\":\"x\",\"extra\":[1],"
	    "\"metadata\":{\"timing\":{\"listenStart\":1,\"listenEnd\":2},\"aux\":{\"a\":null}}}",
	    "{\"op\":\"add_message\",\"role\":\"assistant\",\"contents\":[\"x\"]}",
	    "{\"op\":\"get_messages\",\"format\":\"anthropic\"}",
	    "{\"op\":\"get_messages\"}",
	    "{\"op\":\"get_summary_info\",\"preamble\":\"p\",\"include_previous_summary\":true,"
	    "\"format\":{\"prefix\":\"\",\"postfix\":\"\",\"user_tag\":\"\",\"assistant_tag\":\"\","
	    "\"summary_tag\":\"\",\"separator\":\"\",\"closure\":\"\",\"summary_closure\":\"\"}}",
	    "{\"op\":\"add_summary\",\"contents\":\"s\",\"ids\":[\"01ARZ3NDEKTSV4RRFFQ69G5FAV\"],"
	    "\"versions\":[3]}",
	    "{\"op\":\"get_last_summary\"}",
	    "{\"op\":\"to_messages_map\",\"incremental\":false,\"exclude_last\":false}",
	    "{\"op\":\"set_metadata\",\"message_id\":\"01ARZ3NDEKTSV4RRFFQ69G5FAV\"}",
	    "{\"op\":\"describe\"}",
	};
	for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
		json_t *req = parse(good[i]);
		struct error e = {ERR_OK, ""};
		enum op op = ops_lookup(json_string_value(json_object_get(req, "op")),
		                        json_string_length(json_object_get(req, "op")));
		CHECK(op != OP_UNKNOWN && ops_check(op, req, &e) == ERR_OK);
		json_decref(req);
	}
	json_t *arr = parse("[]");
	struct error e;
	CHECK(ops_check(OP_ADD_USER, arr, &e) == ERR_BAD_REQUEST);
	json_decref(arr);
}

static void test_results(void)
{
	struct convo *c = convo_new("c", 1);
	char buf[512];
	json_t *r;
	env_init(500);

	r = OK(c, "{\"op\":\"get_last_summary\"}");
	CHECK_JSON(r, "{\"message\":null}");
	r = OK(c, "{\"op\":\"get_messages\"}");
	CHECK_JSON(r, "{\"messages\":[],\"summary\":null}");
	r = OK(c, "{\"op\":\"to_messages_map\"}");
	CHECK_JSON(r, "{\"messages\":[]}");
	r = OK(c, "{\"op\":\"get_summary_info\",\"preamble\":\"Summarize:\"}");
	CHECK_JSON(r, "{\"messages\":[],\"previous_summary\":null,\"ids\":[],\"versions\":[],"
	              "\"text\":\"Summarize:\"}");
	/* metadata on add applies to the new message, version 1 */
	r = OK(c,
	       "{\"op\":\"add_message\",\"role\":\"user\",\"contents\":\"q\","
	       "\"metadata\":{\"timing\":{\"listenEnd\":7},\"aux\":{\"lang\":\"en\",\"x\":null}}}");
	snprintf(buf, sizeof(buf),
	         "{\"message\":{\"id\":\"%s\",\"message\":{\"role\":\"user\",\"contents\":[\"q\"]},"
	         "\"metadata\":{\"timing\":{\"creation\":500,\"listenEnd\":7},\"aux\":{\"lang\":"
	         "\"en\"}}},\"merged\":false}",
	         c->log[0]->id);
	CHECK_JSON(r, buf);
	CHECK(c->log[0]->version == 1);
	/* and to the merged one, counted once */
	env.now_ms = 501;
	r = OK(c,
	       "{\"op\":\"add_user\",\"contents\":\"r\",\"metadata\":{\"aux\":{\"lang\":null}}}");
	snprintf(buf, sizeof(buf),
	         "{\"message\":{\"id\":\"%s\",\"message\":{\"role\":\"user\",\"contents\":[\"q\","
	         "\"r\"]},\"metadata\":{\"attribute\":[\"merged\"],\"timing\":{\"creation\":500,"
	         "\"listenEnd\":7}}},\"merged\":true}",
	         c->log[0]->id);
	CHECK_JSON(r, buf);
	CHECK(c->log[0]->version == 2 && c->log[0]->updated_ms == 501);

	/* set_metadata: unknown message, a null aux value removes a key */
	ERR(c, "{\"op\":\"set_metadata\",\"message_id\":\"01ARZ3NDEKTSV4RRFFQ69G5FAV\"}",
	    ERR_NOT_FOUND,
	    "message_id: no message 01ARZ3NDEKTSV4RRFFQ69G5FAV in this conversation");
	snprintf(buf, sizeof(buf),
	         "{\"op\":\"set_metadata\",\"message_id\":\"%s\",\"aux\":{\"k\":[1,{\"d\":2}]}}",
	         c->log[0]->id);
	json_decref(OK(c, buf));
	CHECK(c->log[0]->version == 3);
	snprintf(buf, sizeof(buf),
	         "{\"op\":\"set_metadata\",\"message_id\":\"%s\",\"aux\":{\"k\":null}}",
	         c->log[0]->id);
	r = OK(c, buf);
	CHECK(json_object_get(json_object_get(json_object_get(r, "message"), "metadata"), "aux") ==
	      NULL);
	json_decref(r);
	CHECK(c->log[0]->version == 4 && c->log[0]->aux == NULL);
	ERR(c,
	    "{\"op\":\"set_metadata\",\"message_id\":\"01ARZ3NDEKTSV4RRFFQ69G5FAV\","
	    "\"timing\":{\"x\":1}}",
	    ERR_BAD_REQUEST, NULL); /* bad_request wins over not_found */

	/* get_summary_info with a format, through JSON */
	json_decref(OK(c, "{\"op\":\"add_assistant\",\"contents\":[\"Sure\",\"why not?\"]}"));
	r = OK(c, "{\"op\":\"get_summary_info\",\"preamble\":\">\",\"format\":{\"prefix\":\"(\","
	          "\"postfix\":\") \",\"user_tag\":\"me\",\"separator\":\"+\",\"closure\":\"|\"}}");
	CHECK_STR(json_string_value(json_object_get(r, "text")),
	          ">(me) q.+r.|(Assistant) Sure.+why not?");
	json_decref(r);

	/* limits */
	env.limits.max_messages = 2;
	ERR(c, "{\"op\":\"add_user\",\"contents\":\"x\"}", ERR_TOO_LARGE,
	    "conversation: would exceed the limit of 2 messages");
	env.limits.max_messages = 0;
	env.limits.max_bytes = 10;
	ERR(c, "{\"op\":\"add_assistant\",\"contents\":\"0123456789\"}", ERR_TOO_LARGE,
	    "conversation: would exceed the limit of 10 content bytes");
	env.limits.max_bytes = 0;
	convo_free(c);
}

/* Every jansson allocation failure in turn while running mutating ops: either the op
 * succeeds, or it fails with internal and the conversation is exactly as before. */
static void test_rollback(void)
{
	struct convo *c = convo_new("c", 1);
	char buf[512];
	env_init(100);
	json_decref(OK(c, "{\"op\":\"add_user\",\"contents\":\"u\"}"));
	json_decref(OK(c, "{\"op\":\"add_assistant\",\"contents\":\"a\"}"));

	char summary[512];
	snprintf(summary, sizeof(summary),
	         "{\"op\":\"add_summary\",\"contents\":\"s\",\"ids\":[\"%s\",\"%s\"]}",
	         c->log[0]->id, c->log[1]->id);
	snprintf(buf, sizeof(buf),
	         "{\"op\":\"set_metadata\",\"message_id\":\"%s\",\"aux\":{\"a\":[1,2]},"
	         "\"timing\":{\"playEnd\":3}}",
	         c->log[1]->id);
	const char *reqs[] = {
	    "{\"op\":\"add_assistant\",\"contents\":\"more\",\"metadata\":{\"aux\":{\"m\":1}}}",
	    buf,
	    "{\"op\":\"add_user\",\"contents\":[\"x\",\"y\"],\"metadata\":{\"aux\":{\"n\":2}}}",
	    summary,
	    "{\"op\":\"add_assistant\",\"contents\":\"after\"}",
	    "{\"op\":\"to_messages_map\",\"exclude_last\":false}",
	};
	int clean = 1, all_done = 1, failed = 0;
	for (size_t k = 0; k < sizeof(reqs) / sizeof(reqs[0]); k++) {
		json_t *req = parse(reqs[k]);
		enum op op = ops_lookup(json_string_value(json_object_get(req, "op")),
		                        json_string_length(json_object_get(req, "op")));
		bool done = false;
		for (long n = 0; n < 400 && !done; n++) {
			char *before = convo_describe(c), *after;
			size_t nlog = c->nlog;
			uint32_t v1 = c->log[1]->version;
			json_t *res = NULL;
			bool changed = true;
			struct error e;
			env.now_ms++;
			fail_after = n;
			json_set_alloc_funcs(failing_malloc, free);
			enum error_code rc = ops_run(op, c, &env, req, &res, &changed, &e);
			json_set_alloc_funcs(malloc, free);
			fail_after = -1;
			if (rc == ERR_OK) {
				done = true;
			} else {
				after = convo_describe(c);
				if (rc != ERR_INTERNAL || res || changed || strcmp(before, after) ||
				    nlog != c->nlog || v1 != c->log[1]->version)
					clean = 0;
				failed++;
				free(after);
			}
			json_decref(res);
			free(before);
		}
		if (!done)
			all_done = 0;
		json_decref(req);
	}
	CHECK(clean && all_done && failed > 0);
	CHECK(c->nlog == 5 && c->last_summary == 2 && c->log[4]->role == ROLE_ASSISTANT);
	CHECK(c->log[1]->version == 3 && c->log[1]->aux != NULL);
	struct error e;
	CHECK(convo_check(c, &e) == ERR_OK);
	convo_free(c);
}

int main(void)
{
	env_init(0);
	test_table();
	test_worked_example();
	test_contents();
	test_validation();
	test_results();
	test_rollback();
	return test_done("ops");
}
