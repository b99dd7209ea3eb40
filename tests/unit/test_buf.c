/* Unit tests for daemon/buf: the JSON writer must write exactly what jansson's json_dumpb
 * writes (JSON_COMPACT | JSON_ENCODE_ANY), and refuse what it refuses (invalid UTF-8), for
 * random trees of every type, random byte strings and edge values. Varints round-trip. */
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "buf.h"
#include "test.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint64_t next(void)
{
	return test_rand(&rng);
}

/* Random bytes, biased towards the interesting ones: controls, quotes, UTF-8 leads. */
static size_t random_bytes(char *out, size_t max, bool valid_utf8)
{
	static const char *const pieces[] = {"a", "\"", "\\", "\n", "\x01", "\x1f", "\x7f",
	                                     "/", "é", "€", "😀", "\xe2\x80\xa8", " "};
	static const char *const bad[] = {"\x80", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80",
	                                  "\xe2\x82", "\xff", "\xc3"};
	size_t n = 0, want = next() % 24;

	for (size_t i = 0; i < want; i++) {
		const char *p = pieces[next() % (sizeof(pieces) / sizeof(pieces[0]))];
		if (!valid_utf8 && next() % 8 == 0)
			p = bad[next() % (sizeof(bad) / sizeof(bad[0]))];
		size_t k = strlen(p);
		if (n + k > max)
			break;
		memcpy(out + n, p, k);
		n += k;
	}
	if (next() % 10 == 0 && n < max)
		out[n++] = '\0'; /* embedded NUL */
	return n;
}

static json_t *random_value(int depth)
{
	char tmp[128];
	size_t n;

	switch (next() % (depth > 3 ? 6 : 8)) {
	case 0: return json_true();
	case 1: return json_false();
	case 2: return json_null();
	case 3: {
		static const json_int_t edge[] = {0, -1, 1, 9, 10, INT64_MAX, INT64_MIN, 1234567890123};
		return json_integer(next() % 2 ? edge[next() % 8] : (json_int_t)next());
	}
	case 4: {
		static const double edge[] = {0.0, -0.0, 1.0, 0.1, 1e300, -2.5e-300, 123456789.0, 1e17};
		double v = edge[next() % 8];
		if (next() % 2)
			v = (double)(int64_t)next() / (double)(1 + next() % 100000);
		return json_real(v);
	}
	case 5:
		n = random_bytes(tmp, sizeof(tmp), true);
		return json_stringn(tmp, n);
	case 6: {
		json_t *o = json_object();
		size_t k = next() % 5;
		for (size_t i = 0; i < k; i++) {
			n = random_bytes(tmp, sizeof(tmp), true);
			json_object_setn_new(o, tmp, n, random_value(depth + 1));
		}
		return o;
	}
	default: {
		json_t *a = json_array();
		size_t k = next() % 5;
		for (size_t i = 0; i < k; i++)
			json_array_append_new(a, random_value(depth + 1));
		return a;
	}
	}
}

/* buf_append_json and json_dumpb agree on v: the same text, or both refuse. */
static bool same_as_jansson(const json_t *v)
{
	struct buf b = {NULL, 0, 0};
	size_t need = json_dumpb(v, NULL, 0, JSON_COMPACT | JSON_ENCODE_ANY);
	char *want = need ? malloc(need) : NULL;
	bool ok;
	int rc;

	if (need)
		json_dumpb(v, want, need, JSON_COMPACT | JSON_ENCODE_ANY);
	buf_append(&b, "x", 1); /* appends after what is there */
	rc = buf_append_json(&b, v);
	if (need == 0)
		ok = rc == -EINVAL && b.len == 1;
	else
		ok = rc == 0 && b.len == need + 1 && memcmp(b.data + 1, want, need) == 0;
	if (!ok)
		fprintf(stderr, "mismatch: jansson %.*s, buf rc %d %.*s\n", (int)need,
		        want ? want : "", rc, (int)b.len, b.data);
	free(want);
	buf_free(&b);
	return ok;
}

/* Varints: round trips at every bit length, their sizes, and refusals of cut and overlong
 * ones. */
static void test_varint(void)
{
	struct buf b = {NULL, 0, 0};
	const char *p, *end;
	uint64_t v;

	for (int bits = 0; bits <= 64; bits++) {
		uint64_t want = bits == 64 ? UINT64_MAX : (1ull << bits) - 1;
		for (int k = 0; k < 3; k++, want = bits ? want ^ (next() & (want >> 1)) : 0) {
			b.len = 0;
			CHECK(buf_append_varint(&b, want) == 0);
			CHECK(b.len == (size_t)(bits ? (bits + 6) / 7 : 1)); /* the top bit stays */
			p = b.data;
			end = b.data + b.len;
			CHECK(buf_get_varint(&p, end, &v) == 0 && v == want && p == end);
			/* Cut anywhere: refused, p unchanged. */
			for (size_t cut = 0; cut < b.len; cut++) {
				p = b.data;
				CHECK(buf_get_varint(&p, b.data + cut, &v) == -EINVAL && p == b.data);
			}
		}
	}
	/* Eleven bytes, or a tenth byte over the 64th bit. */
	p = "\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01";
	end = p + 11;
	CHECK(buf_get_varint(&p, end, &v) == -EINVAL);
	p = "\xff\xff\xff\xff\xff\xff\xff\xff\xff\x02";
	end = p + 10;
	CHECK(buf_get_varint(&p, end, &v) == -EINVAL);
	p = "\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01";
	end = p + 10;
	CHECK(buf_get_varint(&p, end, &v) == 0 && v == UINT64_MAX && p == end);
	buf_free(&b);
}

/* Decimal integers: the same text as printf's, at the edges and at random. */
static void test_jint(void)
{
	const int64_t edges[] = {0,
	                         1,
	                         -1,
	                         9,
	                         10,
	                         -10,
	                         99,
	                         100,
	                         -100,
	                         101,
	                         999,
	                         1000,
	                         1763776000000,
	                         INT64_MAX,
	                         INT64_MIN,
	                         INT64_MIN + 1};
	struct buf b = {NULL, 0, 0};
	char want[32], got[20];
	int bad = 0;

	for (size_t i = 0; i < sizeof(edges) / sizeof(edges[0]); i++) {
		size_t n = buf_jint(got, edges[i]);
		snprintf(want, sizeof(want), "%" PRId64, edges[i]);
		CHECK(n == strlen(want) && memcmp(got, want, n) == 0);
	}
	for (int i = 0; i < 100000; i++) {
		int64_t v = (int64_t)(((uint64_t)rand() << 33) ^ ((uint64_t)rand() << 11) ^
		                      (uint64_t)rand()) >>
		            (rand() % 63);
		size_t n = buf_jint(got, v);
		snprintf(want, sizeof(want), "%" PRId64, v);
		bad += n != strlen(want) || memcmp(got, want, n) != 0;
	}
	CHECK(bad == 0);
	CHECK(buf_append(&b, "x", 1) == 0 && buf_append_jint(&b, INT64_MIN) == 0);
	CHECK(b.len == 21 && memcmp(b.data, "x-9223372036854775808", 21) == 0);
	buf_free(&b);
}

int main(void)
{
	char tmp[128];
	int bad = 0;

	test_varint();
	test_jint();

	/* Random trees. */
	for (int i = 0; i < 20000; i++) {
		json_t *v = random_value(0);
		CHECK(same_as_jansson(v));
		json_decref(v);
	}
	/* Strings that may be invalid UTF-8, made without jansson's check. */
	for (int i = 0; i < 20000; i++) {
		size_t n = random_bytes(tmp, sizeof(tmp), false);
		json_t *s = json_stringn_nocheck(tmp, n);
		json_t *o = json_object();
		json_object_set_new(o, "k", json_incref(s));
		if (!same_as_jansson(s) || !same_as_jansson(o))
			bad++;
		json_decref(s);
		json_decref(o);
	}
	CHECK(bad == 0);
	/* Every single byte, and every two-byte prefix of a UTF-8 lead. */
	for (int c = 0; c < 256; c++) {
		char s[3] = {(char)c, (char)0x80, 0};
		json_t *a = json_stringn_nocheck(s, 1), *b2 = json_stringn_nocheck(s, 2);
		CHECK(same_as_jansson(a));
		CHECK(same_as_jansson(b2));
		json_decref(a);
		json_decref(b2);
	}
	/* Plain text and an error answer as the daemon writes them. */
	{
		json_t *e = json_pack("{s:{s:s, s:s}}", "error", "code", "bad_request", "message",
		                      "contents: \"x\"\tnot allowed");
		struct buf b = {NULL, 0, 0};
		CHECK(buf_append_json(&b, e) == 0);
		CHECK(b.len == strlen("{\"error\":{\"code\":\"bad_request\",\"message\":"
		                      "\"contents: \\\"x\\\"\\tnot allowed\"}}"));
		CHECK(memcmp(b.data, "{\"error\":{\"code\":\"bad_request\"", 29) == 0);
		buf_free(&b);
		json_decref(e);
	}
	/* buf_utf8_len: whole sequences, and 0 for cut, overlong, surrogate, too high, ASCII. */
	CHECK(buf_utf8_len("\xc3\xa9", 2) == 2);
	CHECK(buf_utf8_len("\xe2\x82\xac!", 4) == 3);
	CHECK(buf_utf8_len("\xf0\x9f\x98\x80", 4) == 4);
	CHECK(buf_utf8_len("\xe2\x82\xac", 2) == 0);
	CHECK(buf_utf8_len("\xc0\xaf", 2) == 0);
	CHECK(buf_utf8_len("\xe0\x80\xaf", 3) == 0);
	CHECK(buf_utf8_len("\xed\xa0\x80", 3) == 0);
	CHECK(buf_utf8_len("\xf4\x90\x80\x80", 4) == 0);
	CHECK(buf_utf8_len("\xc3" "a", 2) == 0);
	CHECK(buf_utf8_len("a", 1) == 0);
	/* buf_utf8_valid: a whole string, NUL bytes allowed, any bad or cut sequence refused. */
	CHECK(buf_utf8_valid("", 0) && buf_utf8_valid("a\0b", 3));
	CHECK(buf_utf8_valid("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", 14));
	CHECK(!buf_utf8_valid("caf\xc3", 4) && !buf_utf8_valid("\xff", 1));
	CHECK(!buf_utf8_valid("ok\xed\xa0\x80", 5) && !buf_utf8_valid("\xc0\xaf", 2));
	/* A refused value leaves the buffer as it was. */
	{
		struct buf b = {NULL, 0, 0};
		json_t *a = json_pack("[s, o]", "ok", json_stringn_nocheck("\xff", 1));
		buf_append(&b, "abc", 3);
		CHECK(buf_append_json(&b, a) == -EINVAL);
		CHECK(b.len == 3);
		CHECK(buf_append_json(&b, NULL) == -EINVAL);
		buf_free(&b);
		json_decref(a);
	}
	return test_done("buf");
}
