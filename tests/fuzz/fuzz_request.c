/* Fuzz target for the request path: each line of the input goes through daemon/dispatch.c as
 * a connection's lines would (memory only, no sockets), with small limits so that they are
 * hit. Every non-blank line must get exactly one answer line of valid JSON with an "ok"
 * boolean, the request's id echoed, a result or an error of a known code (never internal:
 * nothing fails to allocate here), and every conversation must keep the invariants of
 * semantics.md. The same lines go through a second dispatcher that reads every request with
 * jansson (no fast path): both must answer the same, ids and times aside. */
#include <string.h>

#include "buf.h"
#include "config.h"
#include "dispatch.h"
#include "fuzz.h"
#include "jscan.h"
#include "log.h"
#include "ops.h"

static bool known_code(const char *s)
{
	for (int c = ERR_PARSE_ERROR; c <= ERR_INTERNAL; c++)
		if (strcmp(s, error_code_str((enum error_code)c)) == 0)
			return true;
	return false;
}

/* protocol.md: empty, or only Unicode White_Space (the set of blank contents). */
static bool blank(const char *p, size_t n)
{
	return ops_text_blank(p, n);
}

/* jansson's reading of text, numbers it cannot hold tamed (as the daemon reads requests;
 * its answers echo such an id as written). */
static json_t *load_tamed(const char *text, size_t len)
{
	struct buf b = {NULL, 0, 0};
	size_t n = 0;
	json_error_t jerr;
	json_t *j = json_loadb(text, len, JSON_ALLOW_NUL, &jerr);

	if (!j && jscan_tame_numbers(text, len, &b, &n) == 0 && n > 0)
		j = json_loadb(b.data, b.len, JSON_ALLOW_NUL, &jerr);
	buf_free(&b);
	return j;
}

static void check_convo(void *arg, struct convo *c)
{
	struct error err = {ERR_OK, ""};
	(void)arg;
	FUZZ_REQUIRE(convo_check(c, &err) == ERR_OK, "conversation %.*s: %s", (int)c->id_len, c->id,
	             err.message);
}

/* The answer to line[0..len) is out[0..out_len). */
static void check_answer(const char *line, size_t len, const char *out, size_t out_len)
{
	json_t *req, *ans, *ok, *id;

	FUZZ_REQUIRE(out_len > 0 && out[out_len - 1] == '\n', "no answer line");
	FUZZ_REQUIRE(memchr(out, '\n', out_len - 1) == NULL, "more than one answer line");
	ans = load_tamed(out, out_len - 1);
	FUZZ_REQUIRE(ans, "the answer is not JSON: %.*s", (int)out_len, out);
	FUZZ_REQUIRE(json_is_object(ans), "the answer is not an object");
	ok = json_object_get(ans, "ok");
	FUZZ_REQUIRE(json_is_boolean(ok), "the answer has no ok boolean");
	if (json_is_true(ok)) {
		FUZZ_REQUIRE(json_is_object(json_object_get(ans, "result")),
		             "an ok answer without a result object");
		FUZZ_REQUIRE(!json_object_get(ans, "error"), "an ok answer with an error");
	} else {
		const json_t *e = json_object_get(ans, "error");
		const char *code = json_string_value(json_object_get(e, "code"));
		FUZZ_REQUIRE(json_is_object(e) && code, "an error answer without a code");
		FUZZ_REQUIRE(known_code(code), "unknown error code %s", code);
		FUZZ_REQUIRE(strcmp(code, "internal") != 0, "internal error: %s",
		             json_string_value(json_object_get(e, "message")));
		FUZZ_REQUIRE(json_is_string(json_object_get(e, "message")),
		             "an error without a message");
		FUZZ_REQUIRE(!json_object_get(ans, "result"), "an error answer with a result");
	}
	/* The id is echoed when the line was a JSON object, and only then. (A raw NUL byte makes
	 * it none, though jansson drops one after a number or a literal.) */
	req = memchr(line, '\0', len) ? NULL : load_tamed(line, len);
	id = json_object_get(ans, "id");
	if (json_is_object(req) && json_object_get(req, "id"))
		FUZZ_REQUIRE(id && json_equal(id, json_object_get(req, "id")), "id not echoed");
	else
		FUZZ_REQUIRE(!id, "an id in the answer to a line without one");
	json_decref(req);
	json_decref(ans);
}

/* s[0..n) with every run of 13 digits (a time in ms) and of 26 ULID characters turned into
 * one marker, into out (NUL-terminated): answers of the two dispatchers compare equal then. */
static void normalize(const char *s, size_t n, struct buf *out)
{
	static const char ulid_chars[] = "0123456789ABCDEFGHJKMNPQRSTVWXYZ";
	out->len = 0;
	for (size_t i = 0; i < n;) {
		size_t k = 0;
		while (i + k < n && k < 26 && s[i + k] && strchr(ulid_chars, s[i + k]))
			k++;
		if (k == 26) {
			buf_append(out, "U", 1);
			i += 26;
			continue;
		}
		for (k = 0; i + k < n && s[i + k] >= '0' && s[i + k] <= '9';)
			k++;
		if (k == 13) {
			buf_append(out, "T", 1);
			i += 13;
			continue;
		}
		buf_append(out, s + i, k ? k : 1);
		i += k ? k : 1;
	}
	buf_append(out, "", 1);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static bool quiet;
	struct config cfg;
	struct dispatch d, slow;
	struct buf out = {NULL, 0, 0}, out2 = {NULL, 0, 0}, n1 = {NULL, 0, 0}, n2 = {NULL, 0, 0};
	const char *p = (const char *)data, *end = p + size;

	if (!quiet) {
		log_set_level(LOG_ERROR);
		quiet = true;
	}
	config_defaults(&cfg);
	cfg.memory_only = true;
	cfg.max_conversations = 8;
	cfg.max_messages = 24;
	cfg.max_conversation_bytes = 2048;
	cfg.max_conversation_id_bytes = 32;
	cfg.max_line_bytes = 4096;
	if (dispatch_init(&d, &cfg, NULL, NULL) < 0 || dispatch_init(&slow, &cfg, NULL, NULL) < 0)
		abort();
	slow.no_fast_path = true;
	while (p < end) {
		const char *nl = memchr(p, '\n', (size_t)(end - p));
		size_t len = nl ? (size_t)(nl - p) : (size_t)(end - p);
		enum dispatch_result r;

		if (len > 0 && p[len - 1] == '\r')
			len--; /* as the framer hands lines over */
		out.len = 0;
		out2.len = 0;
		if (len > cfg.max_line_bytes) {
			dispatch_too_large_line(&d, &out);
			check_answer("", 0, out.data, out.len);
		} else {
			r = dispatch_line(&d, p, len, &out, NULL, DISPATCH_REMOTE_CHECK);
			FUZZ_REQUIRE(r == DISPATCH_DONE, "a memory-only daemon waited");
			r = dispatch_line(&slow, p, len, &out2, NULL, DISPATCH_REMOTE_CHECK);
			FUZZ_REQUIRE(r == DISPATCH_DONE, "a memory-only daemon waited");
			if (blank(p, len))
				FUZZ_REQUIRE(out.len == 0, "an answer to a blank line");
			else
				check_answer(p, len, out.data, out.len);
			/* stats count the time spent, which differs */
			if (!memmem(p, len, "stats", 5)) {
				normalize(out.data, out.len, &n1);
				normalize(out2.data, out2.len, &n2);
				FUZZ_REQUIRE(n1.len == n2.len && memcmp(n1.data, n2.data, n1.len) == 0,
				             "the fast path answered\n%s\nthe jansson path\n%s", n1.data,
				             n2.data);
			}
		}
		dispatch_commit(&d, false);
		dispatch_commit(&slow, false);
		registry_each(&d.reg, check_convo, NULL);
		FUZZ_REQUIRE(d.reg.count <= cfg.max_conversations, "%zu conversations (limit %zu)",
		             d.reg.count, cfg.max_conversations);
		p = nl ? nl + 1 : end;
	}
	FUZZ_REQUIRE(d.reg.count == slow.reg.count, "%zu conversations, %zu without the fast path",
	             d.reg.count, slow.reg.count);
	buf_free(&out);
	buf_free(&out2);
	buf_free(&n1);
	buf_free(&n2);
	dispatch_free(&d);
	dispatch_free(&slow);
	config_free(&cfg);
	return 0;
}
