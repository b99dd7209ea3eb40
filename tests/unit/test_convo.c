/* Unit tests for lib/convo: the seed's worked example step by step, the deliberate
 * differences (fake after a summary, merge at index 0, per-message versions), summaries and
 * every error path of add_summary, limits, renderings, lookups, restore, invariants and
 * allocation failures. */
#include "convo.h"
#include "test.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#define T0 INT64_C(1744815823057)

static struct ulid_gen gen;

static void env_init(struct convo_env *env, int64_t now)
{
	uint8_t seed[32];
	for (int i = 0; i < 32; i++)
		seed[i] = (uint8_t)(i * 13 + 1);
	ulid_gen_init(&gen, seed);
	memset(env, 0, sizeof(*env));
	env->ulid = &gen;
	env->now_ms = now;
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

static void fail_jansson_after(long n)
{
	fail_after = n;
	json_set_alloc_funcs(failing_malloc, free);
}

static void jansson_ok(void)
{
	json_set_alloc_funcs(malloc, free);
	fail_after = -1;
}

static json_t *parse(const char *s)
{
	json_error_t e;
	json_t *j = json_loads(s, JSON_ALLOW_NUL | JSON_DECODE_ANY, &e);
	if (!j)
		fprintf(stderr, "bad test JSON: %s: %s\n", s, e.text);
	return j;
}

static void check_json(json_t *j, const char *expected, int line)
{
	char *s = j ? json_dumps(j, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
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

static void check_ok(const struct convo *c, int line)
{
	struct error e = {ERR_OK, ""};
	test_checks++;
	if (convo_check(c, &e) != ERR_OK) {
		test_failures++;
		fprintf(stderr, "%s:%d: convo_check: %s\n", __FILE__, line, e.message);
	}
}
#define CHECK_INVARIANTS(c) check_ok((c), __LINE__)

/* convo_add of the NULL-terminated list of strings. */
static enum error_code addv(struct convo *c, const struct convo_env *env, enum role role,
                            const struct metadata_patch *patch, struct message **out, bool *merged,
                            struct error *e, ...)
{
	const char *texts[16];
	size_t lens[16], n = 0;
	va_list ap;
	va_start(ap, e);
	for (const char *s; n < 16 && (s = va_arg(ap, const char *));) {
		texts[n] = s;
		lens[n++] = strlen(s);
	}
	va_end(ap);
	return convo_add(c, env, role, texts, lens, n, patch, out, merged, e);
}

/* Adds one string and returns the resulting message (NULL on failure). */
static struct message *add1(struct convo *c, const struct convo_env *env, enum role role,
                            const char *s)
{
	struct message *m = NULL;
	bool merged;
	struct error e;
	if (addv(c, env, role, NULL, &m, &merged, &e, s, (const char *)NULL) != ERR_OK)
		return NULL;
	return m;
}

static enum error_code summarize(struct convo *c, const struct convo_env *env, const char *text,
                                 const char *const *ids, size_t nids, const int64_t *versions,
                                 size_t nversions, struct message **out, struct error *e)
{
	size_t len = strlen(text);
	return convo_add_summary(c, env, &text, &len, 1, ids, nids, versions, nversions, out, e);
}

/* Everything observable about c, to check that a refused operation changed nothing. */
static char *snapshot(const struct convo *c)
{
	char *d = convo_describe(c), *out = NULL;
	size_t cap = (d ? strlen(d) : 0) + 128 + c->nlog * 64;
	out = malloc(cap);
	int n = snprintf(out, cap, "%s|%zu %zu %ld %zu %" PRId64 " %zu %zu %zu|", d ? d : "",
	                 c->nlog, c->first_llm, c->last_summary, c->text_bytes, c->updated_ms,
	                 c->scan_from[0], c->scan_from[1], c->scan_from[2]);
	for (size_t i = 0; i < c->nlog; i++) {
		const struct message *m = c->log[i];
		n += snprintf(out + n, cap - (size_t)n, "%u/%u/%u/%u/%" PRId64 ";", m->version,
		              m->seen[0], m->seen[1], m->seen[2], m->updated_ms);
	}
	free(d);
	return out;
}

static void check_unchanged(const struct convo *c, const char *before, int line)
{
	char *now = snapshot(c);
	test_checks++;
	if (strcmp(now, before) != 0) {
		test_failures++;
		fprintf(stderr, "%s:%d: conversation changed\n  before: %s\n  after:  %s\n",
		        __FILE__, line, before, now);
	}
	free(now);
}
#define CHECK_UNCHANGED(c, before) check_unchanged((c), (before), __LINE__)

/* Ids of the messages an incremental to_messages_map returns, as "i,j,k" log indexes. */
static void check_take(struct convo *c, bool exclude_last, const char *expected, int line)
{
	json_t *r = convo_to_messages_map(c, true, exclude_last);
	json_t *arr = json_object_get(r, "messages"), *m;
	char got[512] = "";
	size_t i, n = 0;
	json_array_foreach(arr, i, m)
	{
		const char *id = json_string_value(json_object_get(m, "id"));
		long at = convo_find(c, id, strlen(id));
		n += (size_t)snprintf(got + n, sizeof(got) - n, "%s%ld", i ? "," : "", at);
	}
	test_checks++;
	if (!r || strcmp(got, expected) != 0) {
		test_failures++;
		fprintf(stderr, "%s:%d: to_messages_map returned [%s], expected [%s]\n", __FILE__,
		        line, got, expected);
	}
	json_decref(r);
}
#define CHECK_TAKE(c, excl, expected) check_take((c), (excl), (expected), __LINE__)

static const char *text0(const struct message *m)
{
	return m && m->ncontents ? m->contents[0]->bytes : NULL;
}

static void test_worked_example(void)
{
	struct convo_env env;
	struct convo *c = convo_new("call-42", 7);
	struct message *m = NULL;
	struct error e;
	bool merged = true;
	char ids[8][ULID_LEN + 1];

	env_init(&env, T0);
	CHECK(c && c->id_len == 7 && strcmp(c->id, "call-42") == 0);
	CHECK(c->nlog == 0 && c->first_llm == 0 && c->last_summary == -1);
	CHECK_INVARIANTS(c);

	/* add_assistant "Hello!" -> fake user "..." (0), assistant (1) */
	CHECK(addv(c, &env, ROLE_ASSISTANT, NULL, &m, &merged, &e, "Hello!", (char *)0) == ERR_OK);
	CHECK(!merged && c->nlog == 2 && m == c->log[1]);
	CHECK(c->log[0]->role == ROLE_USER && c->log[0]->fake && c->log[0]->ncontents == 1);
	CHECK_STR(text0(c->log[0]), "...");
	CHECK(message_timing(c->log[0], TIMING_CREATION) == T0 && c->log[0]->version == 1);
	CHECK(m->role == ROLE_ASSISTANT && !m->fake && m->version == 1);
	CHECK_STR(text0(m), "Hello!");
	CHECK(strcmp(c->log[0]->id, c->log[1]->id) < 0);
	memcpy(ids[0], c->log[0]->id, sizeof(ids[0]));
	memcpy(ids[1], c->log[1]->id, sizeof(ids[1]));
	CHECK_INVARIANTS(c);

	/* add_user "Hi, there" -> user (2) */
	env.now_ms = T0 + 1;
	m = add1(c, &env, ROLE_USER, "Hi, there");
	CHECK(m && m == c->log[2] && c->nlog == 3);
	memcpy(ids[2], m->id, sizeof(ids[2]));

	/* add_user "how are you" -> merged into (2) */
	env.now_ms = T0 + 3;
	CHECK(addv(c, &env, ROLE_USER, NULL, &m, &merged, &e, "how are you", (char *)0) == ERR_OK);
	CHECK(merged && m == c->log[2] && c->nlog == 3);
	CHECK_STR(m->id, ids[2]);
	CHECK(m->ncontents == 2 && m->merges == 1 && m->version == 2);
	CHECK_STR(m->contents[1]->bytes, "how are you");
	CHECK(message_timing(m, TIMING_CREATION) == T0 + 1 && m->updated_ms == T0 + 3);

	/* add_assistant ["I am fine,", "and you?"] -> assistant (3) */
	env.now_ms = T0 + 6;
	CHECK(addv(c, &env, ROLE_ASSISTANT, NULL, &m, &merged, &e, "I am fine,", "and you?",
	           (char *)0) == ERR_OK);
	CHECK(!merged && m == c->log[3] && m->ncontents == 2);
	memcpy(ids[3], m->id, sizeof(ids[3]));

	/* add_message user ["Good, ", "thank you!"] -> user (4) */
	CHECK(addv(c, &env, ROLE_USER, NULL, &m, &merged, &e, "Good, ", "thank you!", (char *)0) ==
	      ERR_OK);
	CHECK(!merged && m == c->log[4] && c->nlog == 5);
	CHECK_STR(m->contents[0]->bytes, "Good, ");
	memcpy(ids[5], m->id, sizeof(ids[5]));
	CHECK_INVARIANTS(c);

	/* get_summary_info -> messages 1, 2, 3 */
	json_t *info = convo_summary_info(c, NULL);
	char expect[2048];
	snprintf(expect, sizeof(expect),
	         "{\"messages\":[{\"id\":\"%s\",\"role\":\"assistant\",\"contents\":[\"Hello!\"],"
	         "\"index\":1,\"version\":1},{\"id\":\"%s\",\"role\":\"user\",\"contents\":"
	         "[\"Hi, there\",\"how are you\"],\"index\":2,\"version\":2},{\"id\":\"%s\","
	         "\"role\":\"assistant\",\"contents\":[\"I am fine,\",\"and you?\"],\"index\":3,"
	         "\"version\":1}],\"previous_summary\":null,\"ids\":[\"%s\",\"%s\",\"%s\"],"
	         "\"versions\":[1,2,1],\"text\":\"[Assistant]: Hello!\\n[User]: Hi, there. how are "
	         "you.\\n[Assistant]: I am fine,. and you?\"}",
	         ids[1], ids[2], ids[3], ids[1], ids[2], ids[3]);
	CHECK_JSON(json_incref(info), expect);

	/* add_summary "..." with those ids -> summary inserted at 4, user moves to 5 */
	const char *sids[3];
	int64_t versions[3];
	for (int i = 0; i < 3; i++) {
		sids[i] =
		    json_string_value(json_array_get(json_object_get(info, "ids"), (size_t)i));
		versions[i] = json_integer_value(
		    json_array_get(json_object_get(info, "versions"), (size_t)i));
	}
	env.now_ms = T0 + 20;
	CHECK(summarize(c, &env, "...", sids, 3, versions, 3, &m, &e) == ERR_OK);
	json_decref(info);
	CHECK(c->nlog == 6 && m == c->log[4] && m->role == ROLE_SUMMARY);
	CHECK(c->last_summary == 4 && c->first_llm == 5 && convo_last_summary(c) == m);
	CHECK(m->nsummary_ids == 3);
	CHECK(m->nsummary_ids == 3 && strcmp(m->summary_ids[0], ids[1]) == 0 &&
	      strcmp(m->summary_ids[1], ids[2]) == 0 && strcmp(m->summary_ids[2], ids[3]) == 0);
	CHECK_STR(c->log[5]->id, ids[5]);
	memcpy(ids[4], m->id, sizeof(ids[4]));
	CHECK(strcmp(ids[4], ids[5]) > 0); /* newer than the message it was inserted before */
	CHECK_INVARIANTS(c);
	/* LLM view = [5] */
	json_t *view = convo_get_messages(c, RENDER_BEDROCK);
	CHECK_JSON(view, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"text\":\"Good, \"},"
	                 "{\"text\":\"thank you!\"}]}],\"summary\":[\"...\"]}");

	/* add_assistant "How can I help you?" -> assistant (6) */
	env.now_ms = T0 + 21;
	m = add1(c, &env, ROLE_ASSISTANT, "How can I help you?");
	CHECK(m && m == c->log[6] && c->nlog == 7 && !c->log[5]->fake);
	memcpy(ids[6], m->id, sizeof(ids[6]));

	/* to_messages_map incremental exclude_last -> messages 0..5 */
	CHECK_TAKE(c, true, "0,1,2,3,4,5");
	CHECK(c->scan_from[CONSUMER_CLIENT] == 6);

	/* add_assistant "Are you still there?" -> merged into (6) */
	env.now_ms = T0 + 22;
	CHECK(addv(c, &env, ROLE_ASSISTANT, NULL, &m, &merged, &e, "Are you still there?",
	           (char *)0) == ERR_OK);
	CHECK(merged && m == c->log[6] && m->merges == 1 && m->version == 2);

	/* add_user "Yes, but I do not need help!" -> user (7) */
	env.now_ms = T0 + 23;
	m = add1(c, &env, ROLE_USER, "Yes, but I do not need help!");
	CHECK(m && m == c->log[7] && c->nlog == 8);
	memcpy(ids[7], m->id, sizeof(ids[7]));

	/* set_metadata 7: aux stopped=true, timing playStart */
	struct metadata_patch p;
	json_t *aux = parse("{\"stopped\":true}"), *timing = parse("{\"playStart\":1744815823080}");
	CHECK(message_patch_parse(timing, aux, "", &p, &e) == ERR_OK);
	env.now_ms = T0 + 24;
	CHECK(convo_set_metadata(c, &env, 7, &p, &e) == ERR_OK);
	json_decref(aux);
	json_decref(timing);
	CHECK(c->log[7]->version == 2 && message_timing(c->log[7], TIMING_PLAY_START) == T0 + 23);
	CHECK(c->log[7]->updated_ms == T0 + 24 && c->updated_ms == T0 + 24);
	CHECK_INVARIANTS(c);

	/* to_messages_map incremental, exclude_last=false -> messages 6, 7 */
	CHECK_TAKE(c, false, "6,7");
	CHECK_TAKE(c, false, "");
	CHECK(c->scan_from[CONSUMER_CLIENT] == 8);

	/* get_last_summary -> the summary (4) */
	CHECK(convo_last_summary(c) == c->log[4]);

	/* final log */
	for (int i = 0; i < 8; i++)
		CHECK_STR(c->log[i]->id, ids[i]);
	static const enum role roles[8] = {ROLE_USER,      ROLE_ASSISTANT, ROLE_USER,
	                                   ROLE_ASSISTANT, ROLE_SUMMARY,   ROLE_USER,
	                                   ROLE_ASSISTANT, ROLE_USER};
	for (int i = 0; i < 8; i++)
		CHECK(c->log[i]->role == roles[i]);
	CHECK(c->first_llm == 5 && c->last_summary == 4);
	CHECK(c->text_bytes == 3 + 6 + 9 + 11 + 10 + 8 + 3 + 6 + 10 + 19 + 20 + 28);
	char *d = convo_describe(c);
	snprintf(
	    expect, sizeof(expect),
	    "META MESSAGES ('*' -> first message to LLM, '-' -> next message to convert into "
	    "a Map, '^' -> last summary message):\n"
	    "0       [user] {'...'} -- '%s' {attribute=[fake], timing=[{creation=%" PRId64 "}]},\n"
	    "1       [assistant] {'Hello!'} -- '%s' {timing=[{creation=%" PRId64 "}]},\n"
	    "2       [user] {'Hi, there' 'how are you'} -- '%s' {attribute=[merged], "
	    "timing=[{creation=%" PRId64 "}]},\n"
	    "3       [assistant] {'I am fine,' 'and you?'} -- '%s' {timing=[{creation=%" PRId64
	    "}]},\n"
	    "4   ^   [summary] {'...'} -- '%s' {summaryIds=[%s, %s, %s], timing=[{creation=%" PRId64
	    "}]},\n"
	    "5   *   [user] {'Good, ' 'thank you!'} -- '%s' {timing=[{creation=%" PRId64 "}]},\n"
	    "6       [assistant] {'How can I help you?' 'Are you still there?'} -- '%s' "
	    "{attribute=[merged], timing=[{creation=%" PRId64 "}]},\n"
	    "7       [user] {'Yes, but I do not need help!'} -- '%s' {aux={\"stopped\":true}, "
	    "timing=[{creation=%" PRId64 "}, {playStart=%" PRId64 "}]}.\n"
	    ".  - -> index 8.\n",
	    ids[0], T0, ids[1], T0, ids[2], T0 + 1, ids[3], T0 + 6, ids[4], ids[1], ids[2], ids[3],
	    T0 + 20, ids[5], T0 + 6, ids[6], T0 + 21, ids[7], T0 + 23, T0 + 23);
	CHECK_STR(d, expect);
	free(d);

	/* the whole log, non-incremental, moves nothing */
	json_t *all = convo_to_messages_map(c, false, true);
	CHECK(json_array_size(json_object_get(all, "messages")) == 8);
	snprintf(
	    expect, sizeof(expect),
	    "{\"id\":\"%s\",\"message\":{\"role\":\"summary\",\"contents\":[\"...\"]},"
	    "\"metadata\":{\"summaryIds\":[\"%s\",\"%s\",\"%s\"],\"timing\":{\"creation\":%" PRId64
	    "}}}",
	    ids[4], ids[1], ids[2], ids[3], T0 + 20);
	CHECK_JSON(json_incref(json_array_get(json_object_get(all, "messages"), 4)), expect);
	json_decref(all);
	CHECK(c->scan_from[CONSUMER_CLIENT] == 8);
	CHECK_INVARIANTS(c);
	convo_free(c);
}

static void test_fake_after_summary_and_merge_at_zero(void)
{
	struct convo_env env;
	struct convo *c = convo_new("c", 1);
	struct message *m = NULL;
	struct error e;
	bool merged = false;

	env_init(&env, 1000);
	/* merge at index 0 (deliberate: the reference skips it) */
	m = add1(c, &env, ROLE_USER, "a");
	CHECK(addv(c, &env, ROLE_USER, NULL, &m, &merged, &e, "b", (char *)0) == ERR_OK);
	CHECK(merged && m == c->log[0] && c->nlog == 1 && m->merges == 1);
	CHECK_INVARIANTS(c);
	add1(c, &env, ROLE_ASSISTANT, "x");
	const char *ids[] = {c->log[0]->id, c->log[1]->id};
	CHECK(summarize(c, &env, "s", ids, 2, NULL, 0, &m, &e) == ERR_OK);
	CHECK(c->nlog == 3 && c->first_llm == 3 && c->last_summary == 2);
	CHECK_INVARIANTS(c);
	/* the view is empty: an assistant message gets a fake user first (deliberate) */
	CHECK(addv(c, &env, ROLE_ASSISTANT, NULL, &m, &merged, &e, "y", (char *)0) == ERR_OK);
	CHECK(!merged && c->nlog == 5 && m == c->log[4]);
	CHECK(c->log[3]->fake && c->log[3]->role == ROLE_USER);
	CHECK_STR(text0(c->log[3]), "...");
	CHECK_INVARIANTS(c);
	/* the fake is never summarized and the next summary may follow it */
	json_t *info = convo_summary_info(c, NULL);
	json_t *idsj = json_object_get(info, "ids");
	CHECK(json_array_size(idsj) == 2);
	CHECK_STR(json_string_value(json_array_get(idsj, 0)), c->log[2]->id);
	CHECK_STR(json_string_value(json_array_get(idsj, 1)), c->log[4]->id);
	json_decref(info);
	/* a user message after an empty view gets no fake */
	const char *ids2[] = {c->log[2]->id, c->log[4]->id};
	CHECK(summarize(c, &env, "s2", ids2, 2, NULL, 0, &m, &e) == ERR_OK);
	CHECK(c->nlog == 6 && c->last_summary == 5);
	m = add1(c, &env, ROLE_USER, "u");
	CHECK(m == c->log[6] && !m->fake && c->nlog == 7);
	CHECK_INVARIANTS(c);
	convo_free(c);
}

static void test_incremental_versions(void)
{
	struct convo_env env;
	struct convo *c = convo_new("c", 1);
	struct message *m;
	struct error e;
	struct metadata_patch p;

	env_init(&env, 1000);
	CHECK_TAKE(c, true, "");
	CHECK_TAKE(c, false, "");
	add1(c, &env, ROLE_USER, "u0");
	CHECK_TAKE(c, true, ""); /* the last message stays pending */
	CHECK(c->scan_from[CONSUMER_CLIENT] == 0);
	add1(c, &env, ROLE_ASSISTANT, "a1");
	CHECK_TAKE(c, true, "0");
	CHECK(c->scan_from[CONSUMER_CLIENT] == 1);
	/* merged into after being taken: sent again */
	add1(c, &env, ROLE_USER, "u2");
	CHECK_TAKE(c, false, "1,2");
	add1(c, &env, ROLE_USER, "u2b");
	CHECK_TAKE(c, true, "");
	CHECK_TAKE(c, false, "2");
	CHECK_TAKE(c, false, "");
	/* metadata that changes nothing does not count */
	for (int k = 0; k < TIMING_COUNT; k++)
		p.timing[k] = -1;
	p.aux = NULL;
	p.timing[TIMING_LISTEN_END] = 5;
	CHECK(convo_set_metadata(c, &env, 0, &p, &e) == ERR_OK && c->log[0]->version == 2);
	CHECK(c->scan_from[CONSUMER_CLIENT] == 0);
	CHECK_TAKE(c, true, "0");
	uint32_t v = c->log[0]->version;
	CHECK(convo_set_metadata(c, &env, 0, &p, &e) == ERR_OK && c->log[0]->version == v);
	CHECK_TAKE(c, false, "");
	/* a summary inserted behind what was taken is sent, nothing else again */
	add1(c, &env, ROLE_ASSISTANT, "a3");
	add1(c, &env, ROLE_USER, "u4");
	CHECK_TAKE(c, true, "3");
	const char *ids[] = {c->log[0]->id, c->log[1]->id};
	CHECK(summarize(c, &env, "s", ids, 2, NULL, 0, &m, &e) == ERR_OK);
	CHECK(m == c->log[2]);
	CHECK_TAKE(c, true, "2");
	CHECK_TAKE(c, false, "5");
	/* consumers do not disturb each other */
	size_t n = convo_take(c, CONSUMER_SINK, true, NULL, NULL);
	CHECK(n == 5); /* all but the last */
	CHECK(c->scan_from[CONSUMER_SINK] == 5);
	CHECK(convo_pending(c->log[5], CONSUMER_SINK) &&
	      !convo_pending(c->log[5], CONSUMER_CLIENT));
	CHECK_TAKE(c, false, "");
	CHECK(convo_take(c, CONSUMER_SINK, false, NULL, NULL) == 1);
	CHECK(convo_take(c, CONSUMER_STORE, false, NULL, NULL) == 6);
	CHECK(convo_take(c, CONSUMER_STORE, false, NULL, NULL) == 0);
	CHECK_INVARIANTS(c);
	convo_free(c);
}

struct take_log {
	size_t n, last_index;
	int order_ok;
};

static void take_cb(void *arg, const struct message *m, size_t index)
{
	struct take_log *t = arg;
	if (t->n && index <= t->last_index)
		t->order_ok = 0;
	(void)m;
	t->last_index = index;
	t->n++;
}

/* Appends never rescan: every take starts at most one message before the end. */
/* A wall clock set back (NTP, a resumed VM) does not take updated back: a merge, new
 * metadata, a new message and a summary after the step keep the time of the change before
 * it, and the clock counts again once it is past that. Creation times and ids follow their
 * own rules. */
static void test_clock_set_back(void)
{
	struct convo_env env;
	struct convo *c = convo_new("c", 1);
	struct message *m, *u;
	struct error e;
	struct metadata_patch p;
	bool merged;

	env_init(&env, T0);
	u = add1(c, &env, ROLE_USER, "u0");
	env.now_ms = T0 + 1000;
	CHECK(addv(c, &env, ROLE_USER, NULL, &m, &merged, &e, "u0 more", (char *)0) == ERR_OK);
	CHECK(merged && m == u && u->version == 2 && u->updated_ms == T0 + 1000);
	CHECK(c->updated_ms == T0 + 1000);

	env.now_ms = T0 - 86400000; /* a day back */
	CHECK(addv(c, &env, ROLE_USER, NULL, &m, &merged, &e, "and more", (char *)0) == ERR_OK);
	CHECK(merged && u->version == 3 && u->updated_ms == T0 + 1000);
	CHECK(c->updated_ms == T0 + 1000);
	/* a new message: created by the clock, its updated (and the conversation's) the last
	 * change's, so that no item in DynamoDB is older than the last change */
	m = add1(c, &env, ROLE_ASSISTANT, "a1");
	CHECK(m && m->updated_ms == T0 + 1000 && c->updated_ms == T0 + 1000);
	CHECK(message_timing(m, TIMING_CREATION) == T0 - 86400000);
	json_t *aux = parse("{\"stopped\":true}");
	CHECK(message_patch_parse(NULL, aux, "", &p, &e) == ERR_OK);
	CHECK(convo_set_metadata(c, &env, 0, &p, &e) == ERR_OK);
	json_decref(aux);
	CHECK(u->version == 4 && u->updated_ms == T0 + 1000 && c->updated_ms == T0 + 1000);
	const char *ids[] = {u->id, c->log[1]->id};
	int64_t versions[] = {4, 1};
	CHECK(summarize(c, &env, "s", ids, 2, versions, 2, &m, &e) == ERR_OK);
	CHECK(c->updated_ms == T0 + 1000 && m->updated_ms == T0 + 1000);
	CHECK_INVARIANTS(c);

	/* past the last change again: the clock's own time */
	env.now_ms = T0 + 2000;
	m = add1(c, &env, ROLE_USER, "u3");
	CHECK(m && c->updated_ms == T0 + 2000);
	convo_free(c);
}

static void test_take_cost(void)
{
	struct convo_env env;
	struct convo *c = convo_new("c", 1);
	struct take_log t = {0, 0, 1};
	int scan_ok = 1, count_ok = 1;

	env_init(&env, 1000);
	for (int i = 0; i < 20000; i++) {
		env.now_ms++;
		add1(c, &env, i % 2 ? ROLE_ASSISTANT : ROLE_USER, "x");
		if (c->scan_from[CONSUMER_SINK] + 2 < c->nlog)
			scan_ok = 0;
		size_t before = t.n;
		convo_take(c, CONSUMER_SINK, true, take_cb, &t);
		if (t.n - before != (i ? 1u : 0u))
			count_ok = 0;
		if (c->scan_from[CONSUMER_SINK] != c->nlog - 1)
			scan_ok = 0;
	}
	CHECK(scan_ok && count_ok && t.order_ok);
	CHECK(t.n == 19999);
	CHECK(c->nlog == 20000 && c->cap >= 20000 && c->cap < 40000);
	/* lookups of every message by id */
	int found = 1;
	for (size_t i = 0; i < c->nlog; i += 7) {
		if (convo_find(c, c->log[i]->id, ULID_LEN) != (long)i)
			found = 0;
	}
	CHECK(found);
	CHECK_INVARIANTS(c);
	convo_free(c);
}

/* A conversation user/assistant pairs 0..n-1, plus a last user message when odd. */
static struct convo *make_convo(struct convo_env *env, int n)
{
	struct convo *c = convo_new("c", 1);
	char buf[32];
	for (int i = 0; i < n; i++) {
		snprintf(buf, sizeof(buf), "m%d", i);
		env->now_ms++;
		add1(c, env, i % 2 ? ROLE_ASSISTANT : ROLE_USER, buf);
	}
	return c;
}

static void check_summary_error(struct convo *c, const struct convo_env *env,
                                const char *const *ids, size_t nids, const int64_t *versions,
                                size_t nversions, enum error_code want, const char *message,
                                int line)
{
	struct error e = {ERR_OK, ""};
	struct message *m = (struct message *)&m;
	char *before = snapshot(c);
	struct convo_env env2 = *env;
	enum error_code rc = summarize(c, &env2, "sum", ids, nids, versions, nversions, &m, &e);
	test_checks++;
	if (rc != want || e.code != want || (message && strcmp(e.message, message) != 0)) {
		test_failures++;
		fprintf(stderr, "%s:%d: add_summary: %s \"%s\", expected %s \"%s\"\n", __FILE__,
		        line, error_code_str(rc), e.message, error_code_str(want),
		        message ? message : "");
	}
	check_unchanged(c, before, line);
	free(before);
}
#define CHECK_SUMMARY_ERROR(c, env, ids, n, v, nv, want, msg)                                      \
	check_summary_error((c), (env), (ids), (n), (v), (nv), (want), (msg), __LINE__)

static void test_add_summary_errors(void)
{
	struct convo_env env;
	struct error e;
	struct message *m;
	env_init(&env, 5000);
	/* log: u0 a1 u2 a3 u4 a5 u6 */
	struct convo *c = make_convo(&env, 7);
	char id[7][ULID_LEN + 1];
	for (int i = 0; i < 7; i++)
		memcpy(id[i], c->log[i]->id, ULID_LEN + 1);
	const char *none[1] = {NULL};
	const char *ok[] = {id[0], id[1]};
	int64_t v1[] = {1, 1};

	CHECK_SUMMARY_ERROR(c, &env, none, 0, NULL, 0, ERR_BAD_REQUEST,
	                    "ids: expected a non-empty array of ids");
	CHECK_SUMMARY_ERROR(c, &env, ok, 2, v1, 1, ERR_BAD_REQUEST,
	                    "versions: expected one version per id (2 ids, 1 versions)");
	const char *bad[] = {id[0], "01JRZJ166HZFPP405DV1QQB2XU"};
	CHECK_SUMMARY_ERROR(c, &env, bad, 2, NULL, 0, ERR_BAD_REQUEST,
	                    "ids[1]: expected a message id (a 26-character ULID)");
	const char *shortid[] = {"01JRZJ166HZ"};
	CHECK_SUMMARY_ERROR(c, &env, shortid, 1, NULL, 0, ERR_BAD_REQUEST,
	                    "ids[0]: expected a message id (a 26-character ULID)");
	const char *unknown[] = {id[0], "01ARZ3NDEKTSV4RRFFQ69G5FAV"};
	CHECK_SUMMARY_ERROR(c, &env, unknown, 2, NULL, 0, ERR_BAD_REQUEST,
	                    "ids[1]: no message 01ARZ3NDEKTSV4RRFFQ69G5FAV in this conversation");
	const char *order[] = {id[0], id[3], id[2], id[3]};
	CHECK_SUMMARY_ERROR(c, &env, order, 4, NULL, 0, ERR_BAD_REQUEST, NULL);
	const char *dup[] = {id[0], id[1], id[1]};
	CHECK_SUMMARY_ERROR(c, &env, dup, 3, NULL, 0, ERR_BAD_REQUEST, NULL);
	const char *gap[] = {id[0], id[1], id[3]};
	CHECK_SUMMARY_ERROR(c, &env, gap, 3, NULL, 0, ERR_BAD_REQUEST,
	                    NULL); /* u2 missing: never a valid list */
	const char *notstart[] = {id[2], id[3]};
	CHECK_SUMMARY_ERROR(c, &env, notstart, 2, NULL, 0, ERR_BAD_REQUEST, NULL);
	const char *lastuser[] = {id[0], id[1], id[2]};
	CHECK_SUMMARY_ERROR(c, &env, lastuser, 3, NULL, 0, ERR_BAD_REQUEST,
	                    "ids[2]: the last id must name an assistant message");
	const char *onlyuser[] = {id[0]};
	CHECK_SUMMARY_ERROR(c, &env, onlyuser, 1, NULL, 0, ERR_BAD_REQUEST, NULL);
	int64_t v0[] = {1, 0}, vhigh[] = {1, 2};
	CHECK_SUMMARY_ERROR(c, &env, ok, 2, v0, 2, ERR_BAD_REQUEST, NULL);
	CHECK_SUMMARY_ERROR(c, &env, ok, 2, vhigh, 2, ERR_BAD_REQUEST, NULL);
	/* nothing left after dropping blanks (the caller passes none) */
	CHECK(convo_add_summary(c, &env, NULL, NULL, 0, ok, 2, NULL, 0, &m, &e) == ERR_BAD_REQUEST);
	CHECK_STR(e.message, "contents: expected at least one non-blank string");

	/* messages added after get_summary_info stay after the summary; a merge into a named
	 * message is a conflict when versions are given */
	json_t *info = convo_summary_info(c, NULL); /* u0..a5 */
	CHECK(json_array_size(json_object_get(info, "ids")) == 6);
	json_decref(info);
	const char *six[] = {id[0], id[1], id[2], id[3], id[4], id[5]};
	int64_t vs[] = {1, 1, 1, 1, 1, 1};
	add1(c, &env, ROLE_USER, "u6 more"); /* merged into u6: not named, fine */
	add1(c, &env, ROLE_ASSISTANT, "a7");
	c->log[5]->version++; /* as if set_metadata had changed a5 */
	char msg[128];
	snprintf(msg, sizeof(msg), "versions[5]: message %s changed since (version 1, now 2)",
	         id[5]);
	CHECK_SUMMARY_ERROR(c, &env, six, 6, vs, 6, ERR_CONFLICT, msg);
	/* conflict + bad request: bad request wins */
	int64_t vs_bad[] = {1, 1, 1, 1, 1, 9};
	CHECK_SUMMARY_ERROR(c, &env, six, 6, vs_bad, 6, ERR_BAD_REQUEST, NULL);
	/* without versions it goes through, after a5; u6 and a7 stay after it */
	CHECK(summarize(c, &env, "first", six, 6, NULL, 0, &m, &e) == ERR_OK);
	CHECK(m == c->log[6] && c->first_llm == 7 && c->nlog == 9);
	CHECK_STR(c->log[7]->id, id[6]);
	CHECK_INVARIANTS(c);
	char sid1[ULID_LEN + 1];
	memcpy(sid1, m->id, sizeof(sid1));

	/* the same ids again: summarized since -> conflict */
	CHECK_SUMMARY_ERROR(c, &env, six, 6, NULL, 0, ERR_CONFLICT, NULL);
	const char *two[] = {id[0], id[1]};
	CHECK_SUMMARY_ERROR(c, &env, two, 2, NULL, 0, ERR_CONFLICT, NULL);
	/* a summary id anywhere but first */
	const char *sum_second[] = {id[6], sid1};
	CHECK_SUMMARY_ERROR(c, &env, sum_second, 2, NULL, 0, ERR_BAD_REQUEST,
	                    "ids[1]: a summary id can only come first");
	/* only the summary id */
	const char *sum_only[] = {sid1};
	CHECK_SUMMARY_ERROR(c, &env, sum_only, 1, NULL, 0, ERR_BAD_REQUEST,
	                    "ids: expected at least one message id after the summary id");
	/* [summary, u6, a7] with versions: the summary's version counts too */
	const char *next[] = {sid1, id[6], c->log[8]->id};
	int64_t vn[] = {1, 2, 1}, vn_stale[] = {1, 1, 1};
	CHECK_SUMMARY_ERROR(c, &env, next, 3, vn_stale, 3, ERR_CONFLICT, NULL);
	/* the summary id is optional */
	const char *next_nosum[] = {id[6], c->log[8]->id};
	CHECK(summarize(c, &env, "second", next, 3, vn, 3, &m, &e) == ERR_OK);
	CHECK(m == c->log[9] && c->first_llm == 10 && c->last_summary == 9 && c->nlog == 10);
	CHECK_INVARIANTS(c);
	/* the older summary is no longer the last one */
	CHECK_SUMMARY_ERROR(c, &env, next, 3, NULL, 0, ERR_CONFLICT, NULL);
	CHECK_SUMMARY_ERROR(c, &env, next_nosum, 2, NULL, 0, ERR_CONFLICT, NULL);
	/* a fake message is never named */
	add1(c, &env, ROLE_ASSISTANT, "a10"); /* fake at 10, a at 11 */
	CHECK(c->log[10]->fake);
	const char *fake[] = {c->log[10]->id, c->log[11]->id};
	CHECK_SUMMARY_ERROR(c, &env, fake, 2, NULL, 0, ERR_BAD_REQUEST, NULL);
	const char *after_fake[] = {c->log[11]->id};
	CHECK(summarize(c, &env, "third", after_fake, 1, NULL, 0, &m, &e) == ERR_OK);
	CHECK(m == c->log[12] && c->first_llm == 13);
	CHECK_INVARIANTS(c);
	convo_free(c);

	/* a list that spans a summary added since (another client summarized a prefix) */
	env_init(&env, 9000);
	c = make_convo(&env, 4); /* u0 a1 u2 a3 */
	const char *all4[] = {c->log[0]->id, c->log[1]->id, c->log[2]->id, c->log[3]->id};
	char keep[4][ULID_LEN + 1];
	for (int i = 0; i < 4; i++)
		memcpy(keep[i], all4[i], ULID_LEN + 1);
	const char *k4[] = {keep[0], keep[1], keep[2], keep[3]};
	CHECK(summarize(c, &env, "prefix", k4, 2, NULL, 0, &m, &e) == ERR_OK);
	CHECK(c->log[2] == m);
	CHECK_SUMMARY_ERROR(c, &env, k4, 4, NULL, 0, ERR_CONFLICT, NULL);
	convo_free(c);
}

static void test_limits(void)
{
	struct convo_env env;
	struct error e;
	struct message *m;
	bool merged;
	env_init(&env, 100);
	struct convo *c = convo_new("c", 1);
	env.limits.max_messages = 3;
	env.limits.max_bytes = 20;

	/* a fake plus an assistant message count two */
	add1(c, &env, ROLE_USER, "u");
	add1(c, &env, ROLE_ASSISTANT, "a");
	const char *ids[] = {c->log[0]->id, c->log[1]->id};
	env.limits.max_messages = 0;
	CHECK(summarize(c, &env, "s", ids, 2, NULL, 0, &m, &e) == ERR_OK);
	env.limits.max_messages = 4;
	char *before = snapshot(c);
	CHECK(addv(c, &env, ROLE_ASSISTANT, NULL, &m, &merged, &e, "b", (char *)0) ==
	      ERR_TOO_LARGE);
	CHECK(e.code == ERR_TOO_LARGE);
	CHECK_STR(e.message, "conversation: would exceed the limit of 4 messages");
	CHECK_UNCHANGED(c, before);
	free(before);
	/* a user message fits */
	CHECK(addv(c, &env, ROLE_USER, NULL, &m, &merged, &e, "v", (char *)0) == ERR_OK);
	CHECK(c->nlog == 4);
	/* a merge adds no message: allowed when full */
	CHECK(addv(c, &env, ROLE_USER, NULL, &m, &merged, &e, "w", (char *)0) == ERR_OK && merged);
	before = snapshot(c);
	CHECK(addv(c, &env, ROLE_ASSISTANT, NULL, &m, &merged, &e, "x", (char *)0) ==
	      ERR_TOO_LARGE);
	CHECK_UNCHANGED(c, before);
	free(before);
	/* bytes: 1+1+1+1+1 = 5 so far; 15 more fit exactly, 16 do not */
	env.limits.max_messages = 0;
	CHECK(c->text_bytes == 5);
	before = snapshot(c);
	CHECK(addv(c, &env, ROLE_USER, NULL, &m, &merged, &e, "0123456789abcdef", (char *)0) ==
	      ERR_TOO_LARGE);
	CHECK_STR(e.message, "conversation: would exceed the limit of 20 content bytes");
	CHECK_UNCHANGED(c, before);
	free(before);
	CHECK(addv(c, &env, ROLE_USER, NULL, &m, &merged, &e, "0123456789", "abcde", (char *)0) ==
	      ERR_OK);
	CHECK(c->text_bytes == 20);
	env.limits.max_bytes = 25;
	CHECK(addv(c, &env, ROLE_ASSISTANT, NULL, &m, &merged, &e, "12345", (char *)0) == ERR_OK);
	const char *ids3[] = {c->log[3]->id, c->log[4]->id};
	before = snapshot(c);
	CHECK(summarize(c, &env, "s", ids3, 2, NULL, 0, &m, &e) == ERR_TOO_LARGE);
	CHECK_UNCHANGED(c, before);
	free(before);
	env.limits.max_bytes = 26;
	CHECK(summarize(c, &env, "s", ids3, 2, NULL, 0, &m, &e) == ERR_OK);
	before = snapshot(c);
	/* the view is empty: the fake's "..." counts too, 26 + 3 + 1 */
	CHECK(addv(c, &env, ROLE_ASSISTANT, NULL, &m, &merged, &e, "z", (char *)0) ==
	      ERR_TOO_LARGE);
	CHECK_UNCHANGED(c, before);
	free(before);
	env.limits.max_bytes = 30;
	CHECK(addv(c, &env, ROLE_ASSISTANT, NULL, &m, &merged, &e, "z", (char *)0) == ERR_OK);
	CHECK(c->text_bytes == 30 && c->log[c->nlog - 2]->fake);
	CHECK_INVARIANTS(c);
	convo_free(c);
}

static void test_summary_info_format(void)
{
	struct convo_env env;
	struct error e;
	struct message *m;
	struct summary_format f;
	env_init(&env, 100);
	struct convo *c = convo_new("c", 1);

	/* empty: nothing to summarize, text = preamble */
	convo_summary_format_default(&f);
	f.preamble = "PRE";
	CHECK_JSON(convo_summary_info(c, &f),
	           "{\"messages\":[],\"previous_summary\":null,\"ids\":[],"
	           "\"versions\":[],\"text\":\"PRE\"}");
	/* a lone user message is never summarized */
	add1(c, &env, ROLE_USER, "hello");
	CHECK_JSON(convo_summary_info(c, NULL), "{\"messages\":[],\"previous_summary\":null,"
	                                        "\"ids\":[],\"versions\":[],\"text\":\"\"}");
	add1(c, &env, ROLE_ASSISTANT, "Hi?");
	add1(c, &env, ROLE_USER, "q");
	CHECK(addv(c, &env, ROLE_ASSISTANT, NULL, &m, NULL, &e, "yes!", "no", "", (char *)0) ==
	      ERR_OK); /* an empty string (convo_add trusts its caller) is left out of fmt */
	add1(c, &env, ROLE_USER, "unanswered");
	const char *ids[] = {c->log[0]->id, c->log[1]->id};
	CHECK(summarize(c, &env, "They greeted", ids, 2, NULL, 0, &m, &e) == ERR_OK);
	char sid[ULID_LEN + 1];
	memcpy(sid, m->id, sizeof(sid));

	f.prefix = "<";
	f.postfix = "> ";
	f.user_tag = "U";
	f.assistant_tag = "A";
	f.summary_tag = "S";
	f.separator = " | ";
	f.closure = ";\n";
	f.summary_closure = "//";
	f.include_previous_summary = true;
	json_t *info = convo_summary_info(c, &f);
	CHECK_STR(json_string_value(json_object_get(info, "text")),
	          "PRE<S> They greeted.//<U> q.;\n<A> yes! | no.");
	json_t *ids_j = json_object_get(info, "ids");
	CHECK(json_array_size(ids_j) == 3);
	CHECK_STR(json_string_value(json_array_get(ids_j, 0)), sid);
	CHECK_STR(json_string_value(json_array_get(ids_j, 2)), c->log[4]->id);
	CHECK(json_integer_value(json_array_get(json_object_get(info, "versions"), 0)) == 1);
	CHECK(json_integer_value(json_object_get(
	          json_array_get(json_object_get(info, "messages"), 0), "index")) == 3);
	CHECK_STR(
	    json_string_value(json_object_get(
	        json_object_get(json_object_get(info, "previous_summary"), "message"), "role")),
	    "summary");
	json_decref(info);
	f.include_previous_summary = false;
	info = convo_summary_info(c, &f);
	CHECK_STR(json_string_value(json_object_get(info, "text")), "PRE<U> q.;\n<A> yes! | no.");
	json_decref(info);
	/* the ids of get_summary_info are accepted by add_summary, summary id first */
	const char *again[] = {sid, c->log[3]->id, c->log[4]->id};
	CHECK(summarize(c, &env, "more", again, 3, NULL, 0, &m, &e) == ERR_OK);
	CHECK(c->log[5] == m && c->first_llm == 6);
	/* the view holds only "unanswered": nothing, not even the previous summary */
	convo_summary_format_default(&f);
	f.include_previous_summary = true;
	CHECK_JSON(convo_summary_info(c, &f),
	           "{\"messages\":[],\"previous_summary\":null,\"ids\":[],"
	           "\"versions\":[],\"text\":\"\"}");
	CHECK_INVARIANTS(c);
	convo_free(c);
}

static void test_renderings(void)
{
	struct convo_env env;
	struct message *m;
	struct error e;
	bool merged;
	env_init(&env, 100);
	struct convo *c = convo_new("c", 1);

	CHECK(convo_render_format("meta") == RENDER_META);
	CHECK(convo_render_format("bedrock") == RENDER_BEDROCK);
	CHECK(convo_render_format("anthropic") == RENDER_ANTHROPIC);
	CHECK(convo_render_format("openai") == RENDER_OPENAI);
	CHECK(convo_render_format("OpenAI") == -1 && convo_render_format(NULL) == -1);

	CHECK_JSON(convo_get_messages(c, RENDER_OPENAI), "{\"messages\":[],\"summary\":null}");
	addv(c, &env, ROLE_ASSISTANT, NULL, &m, &merged, &e, "Hi", "there", (char *)0);
	CHECK_JSON(convo_get_messages(c, RENDER_ANTHROPIC),
	           "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":"
	           "\"...\"}]},{\"role\":\"assistant\",\"content\":[{\"type\":\"text\",\"text\":"
	           "\"Hi\"},{\"type\":\"text\",\"text\":\"there\"}]}],\"summary\":null}");
	CHECK_JSON(convo_get_messages(c, RENDER_OPENAI),
	           "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":"
	           "\"...\"}]},{\"role\":\"assistant\",\"content\":[{\"type\":\"text\",\"text\":"
	           "\"Hi\"},{\"type\":\"text\",\"text\":\"there\"}]}],\"summary\":null}");
	CHECK_JSON(convo_get_messages(c, RENDER_BEDROCK),
	           "{\"messages\":[{\"role\":\"user\",\"content\":[{\"text\":\"...\"}]},"
	           "{\"role\":\"assistant\",\"content\":[{\"text\":\"Hi\"},{\"text\":\"there\"}]}],"
	           "\"summary\":null}");
	json_t *meta = convo_get_messages(c, RENDER_META);
	json_t *first = json_array_get(json_object_get(meta, "messages"), 0);
	CHECK_STR(json_string_value(json_object_get(first, "id")), c->log[0]->id);
	CHECK(json_array_size(json_object_get(json_object_get(first, "metadata"), "attribute")) ==
	      1);
	json_decref(meta);
	const char *ids[] = {c->log[1]->id};
	const char *texts[] = {"a", "b\0c"};
	size_t lens[] = {1, 3};
	CHECK(convo_add_summary(c, &env, texts, lens, 2, ids, 1, NULL, 0, &m, &e) == ERR_OK);
	CHECK_JSON(convo_get_messages(c, RENDER_BEDROCK),
	           "{\"messages\":[],\"summary\":[\"a\",\"b\\u0000c\"]}");
	/* describe escapes NUL bytes and marks pending messages */
	add1(c, &env, ROLE_USER, "next");
	char *d = convo_describe(c);
	CHECK(d && strstr(d, "[summary] {'a' 'b\\0c'}") != NULL);
	CHECK(d && strstr(d, "\n0    -  [user] {'...'}") != NULL);
	CHECK(d && strstr(d, "\n2   ^-  [summary]") != NULL);
	CHECK(d && strstr(d, "\n3   *-  [user] {'next'}") != NULL);
	CHECK(d && strstr(d, "\n.  - -> index 0.\n") != NULL);
	free(d);
	CHECK_TAKE(c, true, "0,1,2");
	d = convo_describe(c);
	CHECK(d && strstr(d, "\n3   *-  [user] {'next'}") != NULL);
	CHECK(d && strstr(d, "\n.  - -> index 3.\n") != NULL);
	free(d);
	convo_free(c);

	c = convo_new("", 0);
	d = convo_describe(c);
	CHECK_STR(d, "META MESSAGES ('*' -> first message to LLM, '-' -> next message to convert "
	             "into a Map, '^' -> last summary message):\n.  - -> index 0.\n");
	free(d);
	convo_free(c);
}

static void test_find(void)
{
	struct convo_env env;
	struct error e;
	struct message *m;
	env_init(&env, 100);
	struct convo *c = convo_new("c", 1);

	CHECK(convo_find(c, "01ARZ3NDEKTSV4RRFFQ69G5FAV", 26) == -1);
	/* many summaries, some with long unsummarized tails */
	for (int round = 0; round < 30; round++) {
		for (int i = 0; i < 2 + round % 5; i++) {
			env.now_ms++;
			add1(c, &env, ROLE_USER, "u");
			add1(c, &env, ROLE_ASSISTANT, "a");
		}
		json_t *info = convo_summary_info(c, NULL);
		json_t *ids = json_object_get(info, "ids");
		size_t n = json_array_size(ids);
		/* summarize only a prefix, leaving round % 3 pairs behind */
		size_t keep = (size_t)(round % 3) * 2;
		const char *list[64];
		size_t k = 0;
		for (size_t i = 0; i < n && k < 64; i++)
			list[k++] = json_string_value(json_array_get(ids, i));
		if (k > keep + 1 || (k > 1 && keep == 0))
			k -= keep;
		env.now_ms++;
		CHECK(summarize(c, &env, "s", list, k, NULL, 0, &m, &e) == ERR_OK);
		json_decref(info);
	}
	CHECK_INVARIANTS(c);
	int all = 1, summaries = 0;
	for (size_t i = 0; i < c->nlog; i++) {
		if (convo_find(c, c->log[i]->id, ULID_LEN) != (long)i)
			all = 0;
		summaries += c->log[i]->role == ROLE_SUMMARY;
	}
	CHECK(all && summaries == 30);
	CHECK(convo_find(c, "01ARZ3NDEKTSV4RRFFQ69G5FAV", 26) == -1);
	CHECK(convo_find(c, "7ZZZZZZZZZZZZZZZZZZZZZZZZZ", 26) == -1);
	CHECK(convo_find(c, "00000000000000000000000000", 26) == -1);
	CHECK(convo_find(c, c->log[3]->id, 25) == -1);
	/* ids between existing ones */
	/* ids next to existing ones: convo_find agrees with a linear search */
	static const char alphabet[] = "0123456789ABCDEFGHJKMNPQRSTVWXYZ";
	int agree = 1;
	for (size_t i = 0; i < c->nlog; i++) {
		for (int d = -1; d <= 1; d += 2) {
			char probe[ULID_LEN + 1];
			memcpy(probe, c->log[i]->id, sizeof(probe));
			int v = (int)(strchr(alphabet, probe[25]) - alphabet) + d;
			if (v < 0 || v > 31)
				continue;
			probe[25] = alphabet[v];
			long want = -1;
			for (size_t j = 0; j < c->nlog; j++) {
				if (strcmp(c->log[j]->id, probe) == 0)
					want = (long)j;
			}
			if (convo_find(c, probe, ULID_LEN) != want)
				agree = 0;
		}
	}
	CHECK(agree);
	convo_free(c);
}

/* Rebuilds c from its maps, as the store does. */
static struct convo *restore(const struct convo *c, enum error_code *rc, struct error *e)
{
	struct convo *r = convo_new(c->id, c->id_len);
	for (size_t i = 0; i < c->nlog; i++) {
		json_t *map = message_to_map(c->log[i]);
		struct message *m = NULL;
		if (message_from_map(map, c->log[i]->version, &m, e) == ERR_OK) {
			memcpy(m->seen, c->log[i]->seen, sizeof(m->seen));
			m->updated_ms = c->log[i]->updated_ms;
			convo_restore_append(r, m);
		}
		json_decref(map);
	}
	*rc = convo_restore_finish(r, e);
	return r;
}

static void test_restore(void)
{
	struct convo_env env;
	struct error e;
	struct message *m;
	enum error_code rc;
	env_init(&env, 100);
	struct convo *c = make_convo(&env, 5);
	const char *ids[] = {c->log[0]->id, c->log[1]->id};
	CHECK(summarize(c, &env, "s", ids, 2, NULL, 0, &m, &e) == ERR_OK);
	add1(c, &env, ROLE_ASSISTANT, "a5");
	CHECK_TAKE(c, true, "0,1,2,3,4,5");
	convo_take(c, CONSUMER_STORE, false, NULL, NULL);

	struct convo *r = restore(c, &rc, &e);
	CHECK(rc == ERR_OK);
	char *a = snapshot(c), *b = snapshot(r);
	CHECK_STR(a, b);
	free(a);
	free(b);
	CHECK(r->first_llm == 3 && r->last_summary == 2 && r->text_bytes == c->text_bytes);
	CHECK(r->scan_from[CONSUMER_CLIENT] == 6 && r->scan_from[CONSUMER_SINK] == 0 &&
	      r->scan_from[CONSUMER_STORE] == 7);
	/* it carries on as the original would */
	CHECK_TAKE(r, false, "6");
	add1(r, &env, ROLE_USER, "u");
	CHECK(r->nlog == 8 && r->log[7]->role == ROLE_USER);
	CHECK_INVARIANTS(r);
	convo_free(r);

	/* ids ahead of this daemon's generator (another host's clock): new ids still go above */
	struct convo_env late;
	struct convo *l = make_convo(&env, 2);
	env.now_ms = 4000000000000;
	add1(l, &env, ROLE_USER, "future");
	struct convo *r2 = restore(l, &rc, &e);
	CHECK(rc == ERR_OK);
	env_init(&late, 60); /* a fresh generator with an earlier clock */
	m = add1(r2, &late, ROLE_ASSISTANT, "now");
	CHECK(m && strcmp(m->id, r2->log[2]->id) > 0 && ulid_time_ms(m->id) == 4000000000000);
	m = add1(r2, &late, ROLE_USER, "again");
	CHECK(m && strcmp(m->id, r2->log[3]->id) > 0);
	CHECK_INVARIANTS(r2);
	convo_free(r2);
	convo_free(l);

	/* broken logs are refused with the invariant named */
	r = convo_new("x", 1);
	m = message_new(c->log[1]->id, ROLE_ASSISTANT, 1);
	message_append_text(m, "a", 1);
	CHECK(convo_restore_append(r, m) == 0);
	CHECK(convo_restore_finish(r, &e) == ERR_INTERNAL);
	CHECK_STR(e.message, "invariant: roles do not alternate at 0");
	convo_free(r);
	r = convo_new("x", 1);
	for (int i = 1; i >= 0; i--) {
		m = message_new(c->log[i]->id, i ? ROLE_USER : ROLE_ASSISTANT, 1);
		message_append_text(m, "a", 1);
		convo_restore_append(r, m);
	}
	CHECK(convo_restore_finish(r, &e) == ERR_INTERNAL);
	CHECK_STR(e.message, "invariant: message ids not increasing at 1");
	convo_free(r);

	/* Logs only a hand could write: roles that do not alternate before a summary (the
	 * view after it is sound), a blank string, a fake that starts no view. */
	struct convo *idsrc = make_convo(&env, 6);
	static const struct {
		enum role roles[5];
		const char *texts[5];
		bool fake[5];
		size_t n;
		const char *error;
	} broken[] = {
	    {{ROLE_USER, ROLE_USER, ROLE_ASSISTANT, ROLE_SUMMARY, ROLE_USER},
	     {"u", "u again", "a", "s", "u"},
	     {false},
	     5,
	     "invariant: roles do not alternate at 1"},
	    {{ROLE_USER, ROLE_ASSISTANT},
	     {"u", " \t"},
	     {false},
	     2,
	     "invariant: message 1 holds a blank string"},
	    {{ROLE_USER},
	     {"..."},
	     {true},
	     1,
	     "invariant: fake message 0 not a \"...\" starting a view"},
	    {{ROLE_USER, ROLE_ASSISTANT, ROLE_USER, ROLE_ASSISTANT},
	     {"u", "a", "...", "a"},
	     {false, false, true, false},
	     4,
	     "invariant: fake message 2 not a \"...\" starting a view"},
	    {{ROLE_USER, ROLE_ASSISTANT},
	     {"hm", "a"},
	     {true, false},
	     2,
	     "invariant: fake message 0 not a \"...\" starting a view"},
	};
	for (size_t k = 0; k < sizeof(broken) / sizeof(broken[0]); k++) {
		r = convo_new("x", 1);
		for (size_t i = 0; i < broken[k].n; i++) {
			m = message_new(idsrc->log[i]->id, broken[k].roles[i], 1);
			message_append_text(m, broken[k].texts[i], strlen(broken[k].texts[i]));
			m->fake = broken[k].fake[i];
			CHECK(convo_restore_append(r, m) == 0);
		}
		CHECK(convo_restore_finish(r, &e) == ERR_INTERNAL);
		CHECK_STR(e.message, broken[k].error);
		convo_free(r);
	}
	convo_free(idsrc);
	convo_free(c);
}

static void test_check_detects(void)
{
	struct convo_env env;
	struct error e;
	env_init(&env, 100);
	struct convo *c = make_convo(&env, 4);
	CHECK_INVARIANTS(c);
	c->text_bytes++;
	CHECK(convo_check(c, &e) == ERR_INTERNAL);
	c->text_bytes--;
	c->log[2]->role = ROLE_ASSISTANT;
	CHECK(convo_check(c, &e) == ERR_INTERNAL);
	CHECK_STR(e.message, "invariant: roles do not alternate at 2");
	c->log[2]->role = ROLE_USER;
	c->first_llm = 1;
	CHECK(convo_check(c, &e) == ERR_INTERNAL);
	c->first_llm = 0;
	c->scan_from[CONSUMER_SINK] = 3;
	CHECK(convo_check(c, &e) == ERR_INTERNAL);
	c->scan_from[CONSUMER_SINK] = 0;
	CHECK_INVARIANTS(c);
	convo_free(c);
}

/* Every jansson allocation failure in turn: the operation fails cleanly or succeeds. */
static void test_allocation_failures(void)
{
	struct convo_env env;
	struct error e;
	struct message *m;
	bool merged;
	int clean = 1, failed = 0, succeeded = 0;

	env_init(&env, 100);
	struct convo *c = make_convo(&env, 3);
	json_t *aux = parse("{\"k\":{\"deep\":[1,2]},\"j\":\"v\"}");
	struct metadata_patch p;
	CHECK(message_patch_parse(NULL, aux, "", &p, &e) == ERR_OK);
	for (long n = 0; n < 60 && !succeeded; n++) {
		char *before = snapshot(c);
		fail_jansson_after(n);
		/* a merge into u2 with aux metadata */
		enum error_code rc =
		    addv(c, &env, ROLE_USER, &p, &m, &merged, &e, "more", (char *)0);
		jansson_ok();
		if (rc == ERR_OK) {
			succeeded = 1;
		} else {
			failed++;
			char *after = snapshot(c);
			if (rc != ERR_INTERNAL || strcmp(before, after))
				clean = 0;
			free(after);
		}
		free(before);
	}
	CHECK(clean && failed > 0 && succeeded);
	CHECK(c->log[2]->ncontents == 2 && c->log[2]->aux != NULL);
	/* a new assistant message */
	succeeded = failed = 0;
	for (long n = 0; n < 60 && !succeeded; n++) {
		char *before = snapshot(c);
		fail_jansson_after(n);
		enum error_code rc =
		    addv(c, &env, ROLE_ASSISTANT, &p, &m, &merged, &e, "new", (char *)0);
		jansson_ok();
		if (rc == ERR_OK) {
			succeeded = 1;
		} else {
			failed++;
			char *after = snapshot(c);
			if (rc != ERR_INTERNAL || strcmp(before, after))
				clean = 0;
			free(after);
		}
		free(before);
	}
	CHECK(clean && failed > 0 && succeeded);
	/* incremental maps: nothing is marked taken unless the answer was built */
	succeeded = failed = 0;
	for (long n = 0; n < 200 && !succeeded; n++) {
		char *before = snapshot(c);
		fail_jansson_after(n);
		json_t *r = convo_to_messages_map(c, true, false);
		jansson_ok();
		if (r) {
			succeeded = 1;
			CHECK(json_array_size(json_object_get(r, "messages")) == 4);
			json_decref(r);
		} else {
			failed++;
			char *after = snapshot(c);
			if (strcmp(before, after))
				clean = 0;
			free(after);
		}
		free(before);
	}
	CHECK(clean && failed > 0 && succeeded);
	/* summary info and describe-free readers fail without side effects */
	succeeded = failed = 0;
	for (long n = 0; n < 200 && !succeeded; n++) {
		fail_jansson_after(n);
		json_t *r = convo_summary_info(c, NULL);
		jansson_ok();
		if (r)
			succeeded = 1;
		else
			failed++;
		json_decref(r);
	}
	CHECK(failed > 0 && succeeded);
	succeeded = failed = 0;
	for (long n = 0; n < 200 && !succeeded; n++) {
		fail_jansson_after(n);
		json_t *r = convo_get_messages(c, n % 2 ? RENDER_OPENAI : RENDER_META);
		jansson_ok();
		if (r)
			succeeded = 1;
		else
			failed++;
		json_decref(r);
	}
	CHECK(failed > 0 && succeeded);
	/* set_metadata */
	json_t *aux2 = parse("{\"x\":[1,2,3]}");
	CHECK(message_patch_parse(NULL, aux2, "", &p, &e) == ERR_OK);
	succeeded = failed = 0;
	for (long n = 0; n < 60 && !succeeded; n++) {
		char *before = snapshot(c);
		env.now_ms++;
		fail_jansson_after(n);
		enum error_code rc = convo_set_metadata(c, &env, 1, &p, &e);
		jansson_ok();
		if (rc == ERR_OK) {
			succeeded = 1;
		} else {
			failed++;
			char *after = snapshot(c);
			if (rc != ERR_INTERNAL || strcmp(before, after))
				clean = 0;
			free(after);
		}
		free(before);
	}
	CHECK(clean && failed > 0 && succeeded);
	CHECK(c->log[1]->version == 2);
	json_decref(aux2);
	json_decref(aux);
	CHECK_INVARIANTS(c);
	convo_free(c);
}

int main(void)
{
	test_worked_example();
	test_fake_after_summary_and_merge_at_zero();
	test_incremental_versions();
	test_clock_set_back();
	test_take_cost();
	test_add_summary_errors();
	test_limits();
	test_summary_info_format();
	test_renderings();
	test_find();
	test_restore();
	test_check_detects();
	test_allocation_failures();
	convo_free(NULL);
	return test_done("convo");
}
