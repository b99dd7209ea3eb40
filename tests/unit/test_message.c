/* Unit tests for lib/message: storage, the message map, metadata patches (parse, change
 * detection, apply, allocation failure), rebuilding a message from its map, and the packed
 * map (round trips, and every cut and byte flip of one read without a crash). */
#include "buf.h"
#include "ddbitem.h"
#include "message.h"
#include "test.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ID1 "01JRZJ166HZFPP405DV1QQB2X8"
#define ID2 "01JRZJ166HZFPP405DV1QQB2X9"
#define ID3 "01JRZJ166J2WRMF990535EVSQS"

/* jansson allocator that fails once fail_after allocations have succeeded (-1: never). */
static long fail_after = -1;
static void *failing_malloc(size_t n)
{
	if (fail_after == 0)
		return NULL;
	if (fail_after > 0)
		fail_after--;
	return malloc(n);
}

static char *dump(const json_t *j)
{
	return j ? json_dumps(j, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
}

/* CHECK_STR on the compact dump of j, which is released. */
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

static json_t *parse(const char *s)
{
	json_error_t e;
	json_t *j = json_loads(s, JSON_ALLOW_NUL | JSON_DECODE_ANY, &e);
	if (!j)
		fprintf(stderr, "bad test JSON: %s: %s\n", s, e.text);
	return j;
}

static void test_names(void)
{
	CHECK_STR(message_role_str(ROLE_USER), "user");
	CHECK_STR(message_role_str(ROLE_ASSISTANT), "assistant");
	CHECK_STR(message_role_str(ROLE_SUMMARY), "summary");
	const char *names[] = {"creation",  "playStart", "playEnd", "listenStart",
	                       "listenEnd", "llmStart",  "llmEnd"};
	for (int k = 0; k < TIMING_COUNT; k++) {
		CHECK_STR(message_timing_str((enum timing_key)k), names[k]);
		CHECK(message_timing_key(names[k]) == k);
	}
	CHECK(message_timing_key("playstart") == -1);
	CHECK(message_timing_key("") == -1);
	CHECK(message_timing_key(NULL) == -1);
}

static void test_storage(void)
{
	struct message *m = message_new(ID1, ROLE_USER, 1234);
	CHECK(m != NULL);
	if (!m)
		return;
	CHECK_STR(m->id, ID1);
	CHECK(m->role == ROLE_USER && m->version == 1 && !m->fake && !m->merges);
	CHECK(message_timing(m, TIMING_CREATION) == 1234 && m->updated_ms == 1234);
	for (int k = 1; k < TIMING_COUNT; k++)
		CHECK(message_timing(m, k) == -1);
	CHECK(m->aux == NULL && m->ncontents == 0 && message_text_bytes(m) == 0);

	/* many appends keep every string; one holds NUL bytes */
	CHECK(message_append_text(m, "a\0b", 3) == 0);
	char buf[16];
	int ok = 1;
	for (int i = 1; i < 1000; i++) {
		int n = snprintf(buf, sizeof(buf), "s%d", i);
		if (message_append_text(m, buf, (size_t)n) != 0)
			ok = 0;
	}
	CHECK(ok);
	CHECK(m->ncontents == 1000);
	CHECK(m->contents[0]->len == 3 && memcmp(m->contents[0]->bytes, "a\0b", 4) == 0);
	CHECK_STR(m->contents[999]->bytes, "s999");
	CHECK(m->contents[999]->bytes[4] == '\0');
	size_t expect = 3;
	for (int i = 1; i < 1000; i++)
		expect += (size_t)snprintf(buf, sizeof(buf), "s%d", i);
	CHECK(message_text_bytes(m) == expect);
	CHECK(message_append_text(m, "", 0) == 0 && m->contents[1000]->len == 0);
	message_free(m);
	message_free(NULL);
}

/* message_new_text: the first text and the array of one in the message's block; appends
 * move the array out, truncation never frees the block's text, and the same message comes
 * out as built the usual way (ASan and valgrind see a wrong free or a leak here). */
static void test_inline_text(void)
{
	struct message *m = message_new_text(ID1, ROLE_ASSISTANT, 77, "a\0b", 3);
	struct message *plain = message_new(ID1, ROLE_ASSISTANT, 77);
	char buf[16];

	CHECK(m != NULL && plain != NULL);
	if (!m || !plain) {
		message_free(m);
		message_free(plain);
		return;
	}
	CHECK(m->inline_parts == (MESSAGE_INLINE_ARRAY | MESSAGE_INLINE_TEXT));
	CHECK(plain->inline_parts == 0);
	CHECK(m->ncontents == 1 && m->contents[0]->len == 3 &&
	      memcmp(m->contents[0]->bytes, "a\0b", 4) == 0);
	CHECK(m->role == ROLE_ASSISTANT && m->version == 1 &&
	      message_timing(m, TIMING_CREATION) == 77);
	CHECK(message_append_text(plain, "a\0b", 3) == 0);
	for (int i = 1; i < 40; i++) {
		int n = snprintf(buf, sizeof(buf), "s%d", i);
		CHECK(message_append_text(m, buf, (size_t)n) == 0);
		CHECK(message_append_text(plain, buf, (size_t)n) == 0);
	}
	CHECK(m->inline_parts == MESSAGE_INLINE_TEXT && m->ncontents == 40);
	CHECK(message_text_bytes(m) == message_text_bytes(plain));
	{
		json_t *a = message_to_map(m), *b = message_to_map(plain);
		CHECK(a && b && json_equal(a, b));
		json_decref(a);
		json_decref(b);
	}
	/* A rolled-back merge keeps the first text; down to none, it is only forgotten. */
	message_truncate_contents(m, 1);
	CHECK(m->ncontents == 1 && m->inline_parts == MESSAGE_INLINE_TEXT &&
	      m->contents[0]->len == 3);
	message_truncate_contents(m, 0);
	CHECK(m->ncontents == 0 && m->inline_parts == 0);
	CHECK(message_append_text(m, "again", 5) == 0);
	CHECK_STR(m->contents[0]->bytes, "again");
	message_free(m);
	message_free(plain);

	/* Freed at once, and with its array still in the block after a truncation. */
	message_free(message_new_text(ID2, ROLE_USER, 1, "", 0));
	m = message_new_text(ID2, ROLE_USER, 1, "x", 1);
	CHECK(m != NULL);
	if (m) {
		message_truncate_contents(m, 0);
		CHECK(m->inline_parts == MESSAGE_INLINE_ARRAY);
		message_free(m);
	}
	CHECK(message_new_text(ID3, ROLE_USER, 1, "x", (size_t)UINT32_MAX + 1) == NULL);
}

static void test_map(void)
{
	struct message *m = message_new(ID1, ROLE_USER, 1744815823057);
	message_append_text(m, "...", 3);
	m->fake = true;
	CHECK_JSON(
	    message_to_map(m),
	    "{\"id\":\"" ID1 "\",\"message\":{\"role\":\"user\",\"contents\":[\"...\"]},"
	    "\"metadata\":{\"attribute\":[\"fake\"],\"timing\":{\"creation\":1744815823057}}}");
	message_free(m);

	m = message_new(ID2, ROLE_ASSISTANT, 5);
	message_append_text(m, "Hello!", 6);
	message_append_text(m, "x\0y", 3);
	m->merges = 2;
	CHECK(message_set_timing(m, TIMING_PLAY_END, 9) == 0);
	CHECK(message_set_timing(m, TIMING_PLAY_START, 7) == 0);
	m->aux = parse("{\"stopped\":true,\"n\":[1,{\"a\":null}]}");
	CHECK_JSON(
	    message_to_map(m),
	    "{\"id\":\"" ID2 "\",\"message\":{\"role\":\"assistant\",\"contents\":"
	    "[\"Hello!\",\"x\\u0000y\"]},\"metadata\":{\"attribute\":[\"merged\",\"merged\"],"
	    "\"timing\":{\"creation\":5,\"playStart\":7,\"playEnd\":9},"
	    "\"aux\":{\"stopped\":true,\"n\":[1,{\"a\":null}]}}}");
	message_free(m);

	m = message_new(ID3, ROLE_SUMMARY, 6);
	message_append_text(m, "sum", 3);
	m->summary_ids = malloc(2 * sizeof(*m->summary_ids));
	memcpy(m->summary_ids[0], ID1, ULID_LEN + 1);
	memcpy(m->summary_ids[1], ID2, ULID_LEN + 1);
	m->nsummary_ids = 2;
	CHECK_JSON(message_to_map(m),
	           "{\"id\":\"" ID3 "\",\"message\":{\"role\":\"summary\",\"contents\":[\"sum\"]},"
	           "\"metadata\":{\"summaryIds\":[\"" ID1 "\",\"" ID2 "\"],"
	           "\"timing\":{\"creation\":6}}}");
	message_free(m);
}

/* message_patch_parse of the JSON texts timing/aux (NULL = absent). */
static enum error_code parse_patch(const char *timing, const char *aux, const char *where,
                                   struct metadata_patch *p, struct error *e, json_t **hold)
{
	json_t *t = timing ? parse(timing) : NULL, *a = aux ? parse(aux) : NULL;
	enum error_code rc = message_patch_parse(t, a, where, p, e);
	json_decref(t);
	*hold = a; /* p->aux borrows from it */
	return rc;
}

static void check_patch_error(const char *timing, const char *aux, const char *where,
                              const char *message, int line)
{
	struct metadata_patch p;
	struct error e = {ERR_OK, ""};
	json_t *hold;
	enum error_code rc = parse_patch(timing, aux, where, &p, &e, &hold);
	test_checks++;
	if (rc != ERR_BAD_REQUEST || e.code != ERR_BAD_REQUEST || strcmp(e.message, message)) {
		test_failures++;
		fprintf(stderr, "%s:%d: patch error: rc %d, message \"%s\", expected \"%s\"\n",
		        __FILE__, line, rc, e.message, message);
	}
	json_decref(hold);
}
#define CHECK_PATCH_ERROR(t, a, w, msg) check_patch_error((t), (a), (w), (msg), __LINE__)

static void test_patch_parse(void)
{
	struct metadata_patch p;
	struct error e;
	json_t *hold;

	CHECK(parse_patch(NULL, NULL, "", &p, &e, &hold) == ERR_OK);
	CHECK(p.aux == NULL);
	for (int k = 0; k < TIMING_COUNT; k++)
		CHECK(p.timing[k] == -1);
	CHECK(parse_patch("{\"playStart\":0,\"llmEnd\":1744815823080}", "{\"k\":1}", "", &p, &e,
	                  &hold) == ERR_OK);
	CHECK(p.timing[TIMING_PLAY_START] == 0 && p.timing[TIMING_LLM_END] == 1744815823080);
	CHECK(p.timing[TIMING_CREATION] == -1 && p.timing[TIMING_PLAY_END] == -1);
	CHECK(p.aux == hold);
	json_decref(hold);
	/* an empty aux patches nothing */
	CHECK(parse_patch("{}", "{}", "", &p, &e, &hold) == ERR_OK && p.aux == NULL);
	json_decref(hold);

	CHECK_PATCH_ERROR("[]", NULL, "metadata.", "metadata.timing: expected an object");
	CHECK_PATCH_ERROR("null", NULL, "", "timing: expected an object");
	CHECK_PATCH_ERROR("{\"start\":1}", NULL, "metadata.",
	                  "metadata.timing.start: unknown timing key (expected playStart, playEnd, "
	                  "listenStart, listenEnd, llmStart or llmEnd)");
	CHECK_PATCH_ERROR("{\"creation\":1}", NULL, "",
	                  "timing.creation: set by the daemon, cannot be set");
	CHECK_PATCH_ERROR("{\"playEnd\":-1}", NULL, "",
	                  "timing.playEnd: expected an integer >= 0 (Unix milliseconds)");
	CHECK_PATCH_ERROR("{\"playEnd\":1.5}", NULL, "",
	                  "timing.playEnd: expected an integer >= 0 (Unix milliseconds)");
	CHECK_PATCH_ERROR("{\"playEnd\":9007199254740994.0}", NULL, "",
	                  "timing.playEnd: expected an integer >= 0 (Unix milliseconds)");
	CHECK_PATCH_ERROR("{\"playEnd\":\"5\"}", NULL, "",
	                  "timing.playEnd: expected an integer >= 0 (Unix milliseconds)");
	CHECK_PATCH_ERROR("{\"playEnd\":null}", NULL, "",
	                  "timing.playEnd: expected an integer >= 0 (Unix milliseconds)");
	CHECK_PATCH_ERROR(NULL, "[1]", "metadata.", "metadata.aux: expected an object");
	CHECK_PATCH_ERROR(NULL, "\"x\"", "", "aux: expected an object");
	/* a key with a NUL byte is not "playStart" (built by hand: the parser refuses it) */
	json_t *t = json_object();
	json_object_setn_new(t, "playStart\0x", 11, json_integer(1));
	e.code = ERR_OK;
	CHECK(message_patch_parse(t, NULL, "", &p, &e) == ERR_BAD_REQUEST);
	CHECK_STR(e.message, "timing.playStart: unknown timing key (expected playStart, playEnd, "
	                     "listenStart, listenEnd, llmStart or llmEnd)");
	json_decref(t);
}

static void test_patch_apply(void)
{
	struct message *m = message_new(ID1, ROLE_USER, 100);
	struct metadata_patch p;
	struct error e;
	json_t *hold;

	message_append_text(m, "hi", 2);
	/* nothing to change */
	parse_patch(NULL, NULL, "", &p, &e, &hold);
	CHECK(!message_patch_changes(m, &p));
	CHECK(parse_patch(NULL, "{\"gone\":null}", "", &p, &e, &hold) == ERR_OK);
	CHECK(!message_patch_changes(m, &p)); /* removing an absent key */
	CHECK(message_patch_apply(m, &p) == 0 && m->aux == NULL);
	json_decref(hold);

	parse_patch("{\"playStart\":200}", "{\"stopped\":true,\"n\":{\"a\":[1]}}", "", &p, &e,
	            &hold);
	CHECK(message_patch_changes(m, &p));
	CHECK(message_patch_apply(m, &p) == 0);
	json_decref(hold); /* the message keeps its own copy */
	CHECK(message_timing(m, TIMING_PLAY_START) == 200 &&
	      message_timing(m, TIMING_CREATION) == 100);
	CHECK(m->version == 1 && m->updated_ms == 100); /* apply leaves these to the caller */
	CHECK_JSON(json_incref(m->aux), "{\"stopped\":true,\"n\":{\"a\":[1]}}");

	/* the same values again change nothing */
	parse_patch("{\"playStart\":200}", "{\"n\":{\"a\":[1]}}", "", &p, &e, &hold);
	CHECK(!message_patch_changes(m, &p));
	json_decref(hold);
	parse_patch("{\"playStart\":201}", NULL, "", &p, &e, &hold);
	CHECK(message_patch_changes(m, &p));
	parse_patch(NULL, "{\"n\":{\"a\":[2]}}", "", &p, &e, &hold);
	CHECK(message_patch_changes(m, &p));
	json_decref(hold);
	parse_patch(NULL, "{\"new\":0}", "", &p, &e, &hold);
	CHECK(message_patch_changes(m, &p));
	json_decref(hold);

	/* set one key, remove another */
	parse_patch(NULL, "{\"stopped\":null,\"k\":\"v\"}", "", &p, &e, &hold);
	CHECK(message_patch_changes(m, &p));
	json_t *before = json_incref(m->aux);
	CHECK(message_patch_apply(m, &p) == 0);
	json_decref(hold);
	CHECK_JSON(json_incref(m->aux), "{\"n\":{\"a\":[1]},\"k\":\"v\"}");
	/* the old object was replaced, not modified (maps may share it) */
	CHECK_JSON(before, "{\"stopped\":true,\"n\":{\"a\":[1]}}");

	/* removing every key leaves aux unset */
	parse_patch(NULL, "{\"n\":null,\"k\":null}", "", &p, &e, &hold);
	CHECK(message_patch_apply(m, &p) == 0);
	json_decref(hold);
	CHECK(m->aux == NULL);
	CHECK_JSON(message_to_map(m),
	           "{\"id\":\"" ID1 "\",\"message\":{\"role\":\"user\",\"contents\":[\"hi\"]},"
	           "\"metadata\":{\"timing\":{\"creation\":100,\"playStart\":200}}}");

	/* allocation failure at every step: -ENOMEM and m exactly as before */
	parse_patch("{\"playEnd\":300}", NULL, "", &p, &e, &hold);
	message_patch_apply(m, &p);
	json_t *patch_aux = parse("{\"a\":{\"deep\":[1,2,3]},\"b\":\"x\",\"c\":null}");
	m->aux = parse("{\"c\":1,\"z\":2}");
	p.aux = patch_aux;
	p.timing[TIMING_PLAY_END] = 301;
	char *want = dump(m->aux);
	int failures = 0, unchanged = 1;
	for (long n = 0; n < 40; n++) {
		fail_after = n;
		json_set_alloc_funcs(failing_malloc, free);
		json_t *old = m->aux;
		int rc = message_patch_apply(m, &p);
		json_set_alloc_funcs(malloc, free);
		fail_after = -1;
		if (rc == 0)
			break;
		failures++;
		char *got = dump(m->aux);
		if (rc != -ENOMEM || m->aux != old || message_timing(m, TIMING_PLAY_END) != 300 ||
		    strcmp(got, want))
			unchanged = 0;
		free(got);
	}
	CHECK(failures > 0);
	CHECK(unchanged);
	CHECK(message_timing(m, TIMING_PLAY_END) == 301);
	CHECK_JSON(json_incref(m->aux), "{\"z\":2,\"a\":{\"deep\":[1,2,3]},\"b\":\"x\"}");
	free(want);
	json_decref(patch_aux);
	message_free(m);
}

/* m packed, then unpacked with id and version 7: the map of m, or NULL (then reported). */
static char *pack_round_trip(const struct message *m, const char *id, int line)
{
	struct buf b = {NULL, 0, 0};
	struct message *back = NULL;
	struct error e = {0};
	enum error_code rc = ERR_INTERNAL;
	char *text = NULL;

	if (message_pack(&b, m) == 0)
		rc = message_unpack(b.data, b.len, id, 7, &back, &e);
	if (rc == ERR_OK && back->version == 7 &&
	    back->updated_ms == message_timing(m, TIMING_CREATION)) {
		json_t *map = message_to_map(back);
		text = dump(map);
		json_decref(map);
	}
	if (!text)
		fprintf(stderr, "%s:%d: packed round trip failed: %s\n", __FILE__, line,
		        rc ? e.message : "");
	message_free(back);
	buf_free(&b);
	return text;
}

/* to_map -> from_map -> to_map gives the same map; so does pack -> unpack -> to_map. */
static void check_round_trip(struct message *m, int line)
{
	struct message *back = NULL;
	struct error e;
	json_t *map = message_to_map(m);
	char *a = dump(map);
	enum error_code rc = message_from_map(map, 7, &back, &e);
	json_t *map2 = back ? message_to_map(back) : NULL;
	char *b = dump(map2);
	char *c = pack_round_trip(m, m->id, line);
	test_checks++;
	if (rc != ERR_OK || !back || back->version != 7 || !a || !b || strcmp(a, b) ||
	    back->updated_ms != message_timing(m, TIMING_CREATION) || !c || strcmp(a, c)) {
		test_failures++;
		fprintf(stderr, "%s:%d: round trip failed: %s\n  %s\n  %s\n  %s\n", __FILE__, line,
		        rc ? e.message : "", a ? a : "(null)", b ? b : "(null)", c ? c : "(null)");
	}
	free(a);
	free(b);
	free(c);
	json_decref(map);
	json_decref(map2);
	message_free(back);
}

static void check_from_map_error(const char *json, const char *message, int line)
{
	struct message *m = (struct message *)&m;
	struct error e = {ERR_OK, ""};
	json_t *j = parse(json);
	enum error_code rc = message_from_map(j, 1, &m, &e);
	test_checks++;
	if (rc != ERR_BAD_REQUEST || m != NULL || strcmp(e.message, message)) {
		test_failures++;
		fprintf(stderr, "%s:%d: from_map: rc %d, \"%s\", expected \"%s\"\n", __FILE__, line,
		        rc, e.message, message);
	}
	message_free(m);
	json_decref(j);
}
#define CHECK_FROM_MAP_ERROR(j, msg) check_from_map_error((j), (msg), __LINE__)

static void test_from_map(void)
{
	struct message *m = message_new(ID1, ROLE_USER, 10);
	message_append_text(m, "...", 3);
	m->fake = true;
	check_round_trip(m, __LINE__);
	message_append_text(m, "a\0b", 3);
	m->merges = 3;
	CHECK(message_set_timing(m, TIMING_LISTEN_END, 0) == 0);
	m->aux = parse("{\"x\":[true,null,1.5,\"s\"]}");
	check_round_trip(m, __LINE__);
	message_free(m);

	m = message_new(ID3, ROLE_SUMMARY, 20);
	message_append_text(m, "summary", 7);
	m->summary_ids = malloc(2 * sizeof(*m->summary_ids));
	memcpy(m->summary_ids[0], ID1, ULID_LEN + 1);
	memcpy(m->summary_ids[1], ID2, ULID_LEN + 1);
	m->nsummary_ids = 2;
	check_round_trip(m, __LINE__);
	message_free(m);

	CHECK_FROM_MAP_ERROR("[]", "message: expected an object");
	CHECK_FROM_MAP_ERROR("{\"id\":\"x\",\"message\":{\"role\":\"user\",\"contents\":[\"a\"]},"
	                     "\"metadata\":{\"timing\":{\"creation\":1}}}",
	                     "id: expected a ULID");
	CHECK_FROM_MAP_ERROR("{\"id\":\"" ID1 "\",\"metadata\":{\"timing\":{\"creation\":1}}}",
	                     "message: expected an object");
	CHECK_FROM_MAP_ERROR("{\"id\":\"" ID1
	                     "\",\"message\":{\"role\":\"bot\",\"contents\":[\"a\"]},"
	                     "\"metadata\":{\"timing\":{\"creation\":1}}}",
	                     "message.role: expected \"user\", \"assistant\" or \"summary\"");
	CHECK_FROM_MAP_ERROR("{\"id\":\"" ID1 "\",\"message\":{\"role\":\"user\",\"contents\":[]},"
	                     "\"metadata\":{\"timing\":{\"creation\":1}}}",
	                     "message.contents: expected a non-empty array of strings");
	CHECK_FROM_MAP_ERROR("{\"id\":\"" ID1 "\",\"message\":{\"role\":\"user\",\"contents\":[1]},"
	                     "\"metadata\":{\"timing\":{\"creation\":1}}}",
	                     "message.contents[0]: expected a string");
	CHECK_FROM_MAP_ERROR("{\"id\":\"" ID1
	                     "\",\"message\":{\"role\":\"user\",\"contents\":[\"a\"]}}",
	                     "metadata: expected an object");
	CHECK_FROM_MAP_ERROR("{\"id\":\"" ID1
	                     "\",\"message\":{\"role\":\"user\",\"contents\":[\"a\"]},"
	                     "\"metadata\":{\"timing\":{\"playStart\":1}}}",
	                     "metadata.timing.creation: missing");
	CHECK_FROM_MAP_ERROR("{\"id\":\"" ID1
	                     "\",\"message\":{\"role\":\"user\",\"contents\":[\"a\"]},"
	                     "\"metadata\":{\"timing\":{\"creation\":1,\"when\":2}}}",
	                     "metadata.timing.when: unknown key");
	CHECK_FROM_MAP_ERROR(
	    "{\"id\":\"" ID1 "\",\"message\":{\"role\":\"user\",\"contents\":[\"a\"]},"
	    "\"metadata\":{\"attribute\":[\"fake\",\"fake\"],"
	    "\"timing\":{\"creation\":1}}}",
	    "metadata.attribute[1]: expected \"fake\" (first, once) or \"merged\"");
	/* convod writes fake first: a list in another order is no log it wrote. */
	CHECK_FROM_MAP_ERROR(
	    "{\"id\":\"" ID1 "\",\"message\":{\"role\":\"user\",\"contents\":[\"...\"]},"
	    "\"metadata\":{\"attribute\":[\"merged\",\"fake\"],"
	    "\"timing\":{\"creation\":1}}}",
	    "metadata.attribute[1]: expected \"fake\" (first, once) or \"merged\"");
	CHECK_FROM_MAP_ERROR("{\"id\":\"" ID1
	                     "\",\"message\":{\"role\":\"user\",\"contents\":[\"a\"]},"
	                     "\"metadata\":{\"summaryIds\":[],\"timing\":{\"creation\":1}}}",
	                     "metadata.summaryIds: expected an array of ids, on summaries only");
	CHECK_FROM_MAP_ERROR(
	    "{\"id\":\"" ID1 "\",\"message\":{\"role\":\"summary\",\"contents\":[\"a\"]},"
	    "\"metadata\":{\"summaryIds\":[\"nope\"],\"timing\":{\"creation\":1}}}",
	    "metadata.summaryIds[0]: expected a ULID");
	CHECK_FROM_MAP_ERROR("{\"id\":\"" ID1
	                     "\",\"message\":{\"role\":\"user\",\"contents\":[\"a\"]},"
	                     "\"metadata\":{\"aux\":5,\"timing\":{\"creation\":1}}}",
	                     "metadata.aux: expected an object");
}

/* message_unpack of data[0..len) fails with ERR_BAD_REQUEST and a message containing what. */
static void check_unpack_error(const char *data, size_t len, const char *what, int line)
{
	struct message *m = (struct message *)&m;
	struct error e = {0};
	enum error_code rc = message_unpack(data, len, ID1, 1, &m, &e);
	test_checks++;
	if (rc != ERR_BAD_REQUEST || m || !strstr(e.message, what)) {
		test_failures++;
		fprintf(stderr, "%s:%d: unpack: %d \"%s\", expected \"%s\"\n", __FILE__, line, rc,
		        e.message, what);
	}
	if (rc == ERR_OK)
		message_free(m);
}
#define CHECK_UNPACK_ERROR(data, what)                                                             \
	check_unpack_error((data), sizeof(data) - 1, (what), __LINE__)

/* Merges past MESSAGE_MERGES_MAX are damage to message_unpack (a 5-byte count made 16
 * million strings of a 387-byte row); up to it they are read. And the bound is above any
 * message the daemon accepts: one more merge makes an item DynamoDB cannot hold, which
 * ddbitem_check refuses (and so convo.c's item guard). */
static void check_merges_bound(void)
{
	struct buf b = {NULL, 0, 0};
	struct message *m = NULL;
	struct error e = {0};
	json_t *map;

	for (uint64_t merges = MESSAGE_MERGES_MAX; merges <= MESSAGE_MERGES_MAX + 1; merges++) {
		b.len = 0;
		CHECK(buf_append(&b, "\x00", 1) == 0 && buf_append_varint(&b, merges) == 0 &&
		      buf_append(&b, "\x01\x01x\x01\x01\x00", 6) == 0);
		if (merges > MESSAGE_MERGES_MAX) {
			check_unpack_error(b.data, b.len, "more merges", __LINE__);
			continue;
		}
		CHECK(message_unpack(b.data, b.len, ID1, 1, &m, &e) == ERR_OK && m &&
		      m->merges == MESSAGE_MERGES_MAX);
	}
	/* The first count refused, on a message built in memory: too large for an item. */
	if (m) {
		m->merges = MESSAGE_MERGES_MAX + 1;
		map = message_to_map(m);
		CHECK(map && ddbitem_check(map, "c", &e) == ERR_TOO_LARGE);
		json_decref(map);
		message_free(m);
	}
	buf_free(&b);
}

/* The packed map: a third of the JSON's size for a short text; every field's refusal; and
 * every cut and every byte value at every place of a full one read without a crash. */
static void test_pack(void)
{
	static const char text40[] = "What is the weather like in Lyon today?!";
	struct buf json = {NULL, 0, 0}, b = {NULL, 0, 0};
	struct message *m = message_new(ID1, ROLE_USER, 1744815823057), *back;
	struct error e;
	long ok = 0, refused = 0;

	message_append_text(m, text40, sizeof(text40) - 1);
	CHECK(message_write_map(&json, m) == 0 && message_pack(&b, m) == 0);
	printf("  a 40-byte text: JSON map %zu bytes, packed %zu\n", json.len, b.len);
	CHECK(b.len * 3 <= json.len && b.len == 1 + 1 + 1 + 1 + 40 + 1 + 6 + 1);
	message_free(m);

	/* Refusals, one field at a time (flags, merges, contents, timing, ids, aux). */
	CHECK_UNPACK_ERROR("", "cut short");
	CHECK_UNPACK_ERROR("\x00", "cut short");     /* no merge count */
	CHECK_UNPACK_ERROR("\x00\xff", "cut short"); /* a merge count cut */
	CHECK_UNPACK_ERROR("\x03\x00\x01\x01x\x01\x01\x00", "an unknown role or flag");
	CHECK_UNPACK_ERROR("\x10\x00\x01\x01x\x01\x01\x00", "an unknown role or flag");
	CHECK_UNPACK_ERROR("\x00\x00\x00\x01\x01\x00", "no contents");
	CHECK_UNPACK_ERROR("\x00\x00\x01\x02x", "cut short");
	CHECK_UNPACK_ERROR("\x00\x00\x01\x01\xff\x01\x01\x00", "invalid UTF-8");
	CHECK_UNPACK_ERROR("\x00\x00\x01\x02\xc3\x01\x01\x00", "invalid UTF-8");
	CHECK_UNPACK_ERROR("\x00\x00\x01\x01x\x02\x01\x00", "no creation time");
	CHECK_UNPACK_ERROR("\x00\x00\x01\x01x\x81\x01\x01\x00", "unknown key");
	CHECK_UNPACK_ERROR("\x00\x00\x01\x01x\x01\x01\x01" ID2, "on a summary only");
	CHECK_UNPACK_ERROR("\x02\x00\x01\x01x\x01\x01\x01"
	                   "01JRZJ166HZFPP405DV1QQB2XU",
	                   "ULIDs");
	CHECK_UNPACK_ERROR("\x08\x00\x01\x01x\x01\x01\x00[]", "aux");
	CHECK_UNPACK_ERROR("\x08\x00\x01\x01x\x01\x01\x00{}", "aux");
	CHECK_UNPACK_ERROR("\x08\x00\x01\x01x\x01\x01\x00{\"a", "aux");
	CHECK_UNPACK_ERROR("\x08\x00\x01\x01x\x01\x01\x00", "aux");
	CHECK_UNPACK_ERROR("\x08\x00\x01\x01x\x01\x01\x00{\"a\":1}!", "aux");
	CHECK_UNPACK_ERROR("\x00\x00\x01\x01x\x01\x01\x00!", "bytes after its end");
	CHECK_UNPACK_ERROR("\x00\xff\xff\xff\xff\x10\x01\x01x\x01\x01\x00", "more merges");
	CHECK_UNPACK_ERROR("\x00\x00\x01\x01x\x01\xff\xff\xff\xff\xff\xff\xff\xff\x80\x01\x00",
	                   "cut short"); /* creation over INT64_MAX */
	check_merges_bound();
	/* The smallest one. */
	CHECK(message_unpack("\x00\x00\x01\x00\x01\x00\x00", 7, ID1, 1, &back, &e) == ERR_OK &&
	      back && back->ncontents == 1 && back->contents[0]->len == 0 &&
	      message_timing(back, TIMING_CREATION) == 0);
	message_free(back);

	/* A full one: fake, merged, NULs, every timing, aux; and a summary. */
	m = message_new(ID3, ROLE_SUMMARY, 1744815823057);
	message_append_text(m, "a\0b", 3);
	message_append_text(m, "\xe6\x97\xa5", 3);
	m->fake = true;
	m->merges = 300;
	for (int k = 1; k < TIMING_COUNT; k++)
		CHECK(message_set_timing(m, k, (int64_t)k << (8 * k)) == 0);
	m->aux = parse("{\"k\":\"v\\u0000x\",\"o\":{\"n\":[1.5,null]}}");
	m->summary_ids = malloc(2 * sizeof(*m->summary_ids));
	memcpy(m->summary_ids[0], ID1, ULID_LEN + 1);
	memcpy(m->summary_ids[1], ID2, ULID_LEN + 1);
	m->nsummary_ids = 2;
	check_round_trip(m, __LINE__);
	b.len = 0;
	CHECK(message_pack(&b, m) == 0);
	for (size_t cut = 0; cut < b.len; cut++) {
		back = (struct message *)&back;
		CHECK(message_unpack(b.data, cut, ID3, 1, &back, &e) == ERR_BAD_REQUEST && !back);
	}
	for (size_t at = 0; at < b.len; at++) {
		for (int v = 0; v < 256; v++) {
			char *copy = malloc(b.len);
			memcpy(copy, b.data, b.len);
			copy[at] = (char)v;
			back = NULL;
			if (message_unpack(copy, b.len, ID3, 1, &back, &e) == ERR_OK) {
				json_t *map = message_to_map(back);
				ok++;
				CHECK(back && map);
				json_decref(map);
			} else {
				refused++;
				CHECK(!back);
			}
			message_free(back);
			free(copy);
		}
	}
	printf("  byte flips of a %zu-byte packed map: %ld read, %ld refused\n", b.len, ok,
	       refused);
	CHECK(ok > 0 && refused > 0);
	message_free(m);
	buf_free(&b);
	buf_free(&json);
}

/* message_sort_key copies what it used to print with "%s~%s" and "%s": the same keys, a
 * summary's of the full MESSAGE_SK_MAX bytes, and nothing written past the terminator. */
static void test_sort_key(void)
{
	char sk[MESSAGE_SK_MAX + 2], want[MESSAGE_SK_MAX + 2];
	struct message *m = message_new(ID1, ROLE_USER, 1);

	memset(sk, 'x', sizeof(sk));
	message_sort_key(m, sk);
	CHECK_STR(sk, ID1);
	CHECK(sk[MESSAGE_SK_MAX + 1] == 'x');
	message_free(m);

	m = message_new(ID3, ROLE_SUMMARY, 6);
	message_sort_key(m, sk); /* a summary with no ids yet: its own id */
	CHECK_STR(sk, ID3);
	m->nsummary_ids = 2;
	m->summary_ids = malloc(2 * sizeof(*m->summary_ids));
	CHECK(m->summary_ids != NULL);
	if (m->summary_ids) {
		memcpy(m->summary_ids[0], ID1, ULID_LEN + 1);
		memcpy(m->summary_ids[1], ID2, ULID_LEN + 1);
		memset(sk, 'x', sizeof(sk));
		message_sort_key(m, sk);
		snprintf(want, sizeof(want), "%s~%s", ID2, ID3);
		CHECK_STR(sk, want);
		CHECK(strlen(sk) == MESSAGE_SK_MAX);
		CHECK(sk[MESSAGE_SK_MAX + 1] == 'x');
	} else {
		m->nsummary_ids = 0;
	}
	message_free(m);
}

/* The timing keys other than creation live in an array made by the first one set. */
static void test_timing(void)
{
	struct message *m = message_new(ID1, ROLE_USER, 42);
	int64_t saved[TIMING_COUNT], all[TIMING_COUNT];

	CHECK(sizeof(struct message) <= 112 || sizeof(void *) != 8);
	if (!m)
		return;
	CHECK(message_timing(m, TIMING_CREATION) == 42 && !m->timing_more);
	CHECK(message_set_timing(m, TIMING_LLM_END, -1) == 0 && !m->timing_more); /* no array */
	message_get_timing(m, saved);
	CHECK(saved[TIMING_CREATION] == 42);
	for (int k = 1; k < TIMING_COUNT; k++)
		CHECK(saved[k] == -1);

	CHECK(message_set_timing(m, TIMING_LISTEN_START, 5) == 0 && m->timing_more);
	CHECK(message_set_timing(m, TIMING_LLM_END, 0) == 0);
	CHECK(message_set_timing(m, TIMING_CREATION, 43) == 0);
	for (int k = 0; k < TIMING_COUNT; k++) {
		int64_t want = k == TIMING_CREATION       ? 43
		               : k == TIMING_LISTEN_START ? 5
		               : k == TIMING_LLM_END      ? 0
		                                          : -1;
		CHECK(message_timing(m, (enum timing_key)k) == want);
	}
	message_get_timing(m, all);
	CHECK(all[TIMING_LISTEN_START] == 5 && all[TIMING_LLM_END] == 0);

	/* An undo: back to before the array was made; it stays, all unset. */
	message_restore_timing(m, saved);
	CHECK(m->timing_more != NULL);
	for (int k = 0; k < TIMING_COUNT; k++)
		CHECK(message_timing(m, (enum timing_key)k) == saved[k]);
	message_restore_timing(m, all);
	CHECK(message_timing(m, TIMING_LISTEN_START) == 5 &&
	      message_timing(m, TIMING_CREATION) == 43);
	CHECK(message_set_timing(m, TIMING_LISTEN_START, -1) == 0);
	CHECK(message_timing(m, TIMING_LISTEN_START) == -1);
	message_free(m); /* frees the array: valgrind and ASan watch */
}

/* message_json_whole against numbers as jansson reads them from text. */
static void test_json_whole(void)
{
	static const struct {
		const char *text;
		int64_t lo, hi;
		int ok;
		int64_t want;
	} cases[] = {
	    {"1000", 0, INT64_MAX, 1, 1000},
	    {"1000.0", 0, INT64_MAX, 1, 1000},
	    {"1e3", 0, INT64_MAX, 1, 1000},
	    {"0.0", 0, INT64_MAX, 1, 0},
	    {"-0.0", 0, INT64_MAX, 1, 0},
	    {"9007199254740991.0", 0, INT64_MAX, 1, 9007199254740991},
	    /* 2^53 + 1 as a real reads as 2^53: either may have been written */
	    {"9007199254740992.0", 0, INT64_MAX, 0, 0},
	    {"9007199254740993.0", 0, INT64_MAX, 0, 0},
	    {"9007199254740993", 0, INT64_MAX, 1, 9007199254740993}, /* an integer: exact */
	    {"9007199254740994.0", 0, INT64_MAX, 0, 0},
	    {"-9007199254740991.0", INT64_MIN, 0, 1, -9007199254740991},
	    {"-9007199254740992.0", INT64_MIN, 0, 0, 0},
	    {"1.5", 0, INT64_MAX, 0, 0},
	    {"1e-300", 0, INT64_MAX, 0, 0},
	    {"1e300", 0, INT64_MAX, 0, 0},
	    {"-1", 0, INT64_MAX, 0, 0},
	    {"-1.0", 0, INT64_MAX, 0, 0},
	    {"5.0", 1, 4, 0, 0},
	    {"4.0", 1, 4, 1, 4},
	    {"\"5\"", 0, 10, 0, 0},
	    {"true", 0, 10, 0, 0},
	    {"null", 0, 10, 0, 0},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		json_t *v = json_loads(cases[i].text, JSON_DECODE_ANY, NULL);
		int64_t got = -12345;
		bool ok = v && message_json_whole(v, cases[i].lo, cases[i].hi, &got);
		CHECK(v != NULL);
		if (ok != (bool)cases[i].ok || (ok && got != cases[i].want) ||
		    (!ok && got != -12345))
			fprintf(stderr, "json_whole %s: ok %d got %lld\n", cases[i].text, ok,
			        (long long)got);
		CHECK(ok == (bool)cases[i].ok);
		CHECK(!ok ? got == -12345 : got == cases[i].want);
		json_decref(v);
	}
}

int main(void)
{
	test_names();
	test_storage();
	test_inline_text();
	test_map();
	test_patch_parse();
	test_patch_apply();
	test_from_map();
	test_pack();
	test_sort_key();
	test_timing();
	test_json_whole();
	return test_done("message");
}
