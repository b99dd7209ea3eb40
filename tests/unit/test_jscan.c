/* Unit tests for lib/jscan: hand-written cases, then jansson as the oracle: for random JSON
 * texts and random mutations of them, whatever jscan accepts jansson reads (JSON_ALLOW_NUL,
 * as the daemon reads requests) to the same members, types and values; and jscan accepts
 * the texts jansson itself writes, but for the numbers it leaves to jansson on purpose. */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "buf.h"
#include "jscan.h"
#include "test.h"

static uint64_t rng = 0x2545f4914f6cdd1dull;

static uint64_t next(void)
{
	return test_rand(&rng);
}

static int scan(const char *text, struct jscan_member *m, size_t max, size_t *n)
{
	return jscan_object(text, strlen(text), m, max, n);
}

static bool accepted(const char *text)
{
	struct jscan_member m[16];
	size_t n;
	return scan(text, m, 16, &n) == 0;
}

/* The decoded bytes of a string member. */
static bool string_is(const struct jscan_value *v, const char *want, size_t want_len)
{
	struct buf b = {NULL, 0, 0};
	bool same;

	if (v->type != JSCAN_STRING || jscan_string(v, &b) < 0)
		return false;
	same = b.len == want_len && (want_len == 0 || memcmp(b.data, want, want_len) == 0);
	buf_free(&b);
	return same;
}

static void test_members(void)
{
	struct jscan_member m[8];
	const struct jscan_member *f;
	size_t n = 99;
	bool dup = false;

	CHECK(scan(" \t\r\n{ \"id\" : 7 , \"op\":\"add_user\",\"contents\":[\"a\", \"b\\n\"],"
	           "\"x\":{\"y\":[null,true,false,-1.5e3]}} \r\n",
	           m, 8, &n) == 0);
	CHECK(n == 4);
	CHECK(m[0].key_len == 2 && memcmp(m[0].key, "id", 2) == 0);
	CHECK(m[0].value.type == JSCAN_INTEGER && m[0].value.len == 1 && m[0].value.p[0] == '7');
	CHECK(string_is(&m[1].value, "add_user", 8) && !m[1].value.escaped);
	CHECK(m[2].value.type == JSCAN_ARRAY);
	CHECK(m[3].value.type == JSCAN_OBJECT && m[3].value.p[0] == '{' &&
	      m[3].value.p[m[3].value.len - 1] == '}');
	{
		struct jscan_value el;
		size_t pos = 0, k = 0;
		while (jscan_array_next(&m[2].value, &pos, &el)) {
			CHECK(el.type == JSCAN_STRING);
			CHECK(k != 0 || string_is(&el, "a", 1));
			CHECK(k != 1 || (el.escaped && string_is(&el, "b\n", 2)));
			k++;
		}
		CHECK(k == 2);
	}
	f = jscan_find(m, n, "op", 2, &dup);
	CHECK(f == &m[1] && !dup);
	CHECK(jscan_find(m, n, "o", 1, &dup) == NULL);

	/* Empty containers, and more members than room: counted, not stored past max. */
	CHECK(scan("{}", m, 8, &n) == 0 && n == 0);
	CHECK(scan("{\"a\":[],\"b\":{},\"c\":1,\"d\":2}", m, 2, &n) == 0 && n == 4);
	CHECK(m[1].key_len == 1 && m[1].key[0] == 'b');

	/* Duplicate keys: found, and flagged (jansson keeps the last). */
	CHECK(scan("{\"k\":1,\"k\":2}", m, 8, &n) == 0 && n == 2);
	dup = false;
	f = jscan_find(m, n, "k", 1, &dup);
	CHECK(dup && f == &m[1]);

	/* Reals and the integers that certainly fit. */
	CHECK(scan("{\"a\":-0,\"b\":123456789012345678,\"c\":0.5,\"d\":1E+2,\"e\":-1e-400}", m, 8,
	           &n) == 0);
	CHECK(m[0].value.type == JSCAN_INTEGER && m[1].value.type == JSCAN_INTEGER);
	CHECK(m[2].value.type == JSCAN_REAL && m[3].value.type == JSCAN_REAL &&
	      m[4].value.type == JSCAN_REAL);
}

static void test_refused(void)
{
	static const char *const bad[] = {
	    "", " ", "[]", "\"x\"", "1", "null", "{", "}", "{\"a\"}", "{\"a\":}", "{\"a\" 1}",
	    "{\"a\":1,}", "{,\"a\":1}", "{\"a\":1 \"b\":2}", "{\"a\":[1,]}", "{\"a\":[,1]}",
	    "{\"a\":01}", "{\"a\":-}", "{\"a\":1.}", "{\"a\":.5}", "{\"a\":1e}", "{\"a\":1e+}",
	    "{\"a\":+1}", "{\"a\":tru}", "{\"a\":truex}", "{\"a\":nul}", "{\"a\":True}",
	    "{\"a\":NaN}", "{\"a\":\"x}", "{\"a\":\"\\x\"}", "{\"a\":\"\\u12\"}",
	    "{\"a\":\"\\u12G4\"}", "{\"a\":\"tab\there\"}", "{\"a\":\"\x01\"}", "{a:1}",
	    "{'a':1}", "{\"a\":1} x", "{\"a\":1}}", "{\"a\":1}{}", "\xef\xbb\xbf{}",
	    /* Left to jansson on purpose. */
	    "{\"a\":1234567890123456789}", "{\"a\":-9223372036854775808}", "{\"a\":1e400}",
	    "{\"a\":1" "00000000000000000000000000000000000000000000000000000000000000000000000000000"
	    "00000000000000000000000000000000000000000000000000000000000000000000000000000000000"
	    "00000000000000000000000000000000000000000000000000000000000000000000000000000000000"
	    "00000000000000000000000000000000000000000000000000000000000000000000000.0}",
	    "{\"\\u006fp\":\"add_user\"}", "{\"a\\n\":1}", "{\"a\":{\"\\u0000\":1}}",
	    /* Surrogates and bad UTF-8. */
	    "{\"a\":\"\\ud800\"}", "{\"a\":\"\\udc00\"}", "{\"a\":\"\\ud800\\u0041\"}",
	    "{\"a\":\"\\ud800x\"}", "{\"a\":\"\xc3\"}", "{\"a\":\"\xc0\xaf\"}",
	    "{\"a\":\"\xed\xa0\x80\"}", "{\"a\":\"\xf4\x90\x80\x80\"}", "{\"a\":\"\xff\"}",
	    "{\"a\":\"\x80\"}", "{\xc3\xa9:1}",
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		bool ok = !accepted(bad[i]);
		if (!ok)
			fprintf(stderr, "accepted: %s\n", bad[i]);
		CHECK(ok);
	}
	/* A NUL byte in the text, outside and inside a string. */
	{
		struct jscan_member m[2];
		size_t n;
		CHECK(jscan_object("{\"a\":1}\0", 8, m, 2, &n) < 0);
		CHECK(jscan_object("{\"a\":\"\0\"}", 9, m, 2, &n) < 0);
	}
	/* Depth, as jansson counts it (every value a level, a scalar too): the object and 2047
	 * empty arrays pass, 2048 do not; the object and 2046 arrays around a number pass,
	 * 2047 do not. */
	{
		static char deep[5000];
		for (int scalar = 0; scalar < 2; scalar++) {
			for (int levels = 2046 - scalar + 1; levels <= 2048 - scalar; levels++) {
				size_t k = 0;
				memcpy(deep, "{\"a\":", 5);
				k = 5;
				for (int i = 0; i < levels; i++)
					deep[k++] = '[';
				if (scalar)
					deep[k++] = '1';
				for (int i = 0; i < levels; i++)
					deep[k++] = ']';
				deep[k++] = '}';
				deep[k] = 0;
				CHECK(accepted(deep) == (levels == 2047 - scalar));
			}
		}
	}
}

static void test_strings(void)
{
	struct jscan_member m[4];
	size_t n;

	CHECK(scan("{\"a\":\"\\\"\\\\\\/\\b\\f\\n\\r\\t\"}", m, 4, &n) == 0);
	CHECK(m[0].value.escaped && string_is(&m[0].value, "\"\\/\b\f\n\r\t", 8));
	CHECK(scan("{\"a\":\"\\u0041\\u00e9\\u20ac\\ud83d\\ude00\\u0000z\"}", m, 4, &n) == 0);
	CHECK(string_is(&m[0].value, "A\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\0z", 12));
	CHECK(scan("{\"a\":\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\x7f\"}", m, 4, &n) == 0);
	CHECK(!m[0].value.escaped && m[0].value.len == 15);
	CHECK(scan("{\"a\":\"\"}", m, 4, &n) == 0 && m[0].value.len == 0 &&
	      string_is(&m[0].value, "", 0));
	{
		/* A decoded string is appended to what the buffer holds. */
		struct buf b = {NULL, 0, 0};
		CHECK(scan("{\"a\":\"x\\ty\"}", m, 4, &n) == 0);
		buf_append(&b, "<", 1);
		CHECK(jscan_string(&m[0].value, &b) == 0);
		CHECK(b.len == 4 && memcmp(b.data, "<x\ty", 4) == 0);
		buf_free(&b);
	}
	{
		struct jscan_value v;
		size_t end;
		CHECK(jscan_value("\"ab\",1", 6, &v, &end) == 0 && end == 4 &&
		      v.type == JSCAN_STRING);
		CHECK(jscan_value("-12}", 4, &v, &end) == 0 && end == 3 && v.type == JSCAN_INTEGER);
		CHECK(jscan_value("[1,[2]] ", 8, &v, &end) == 0 && end == 7);
		CHECK(jscan_value(" 1", 2, &v, &end) < 0);
	}
}

/* ---- jansson as the oracle ---- */

static size_t random_bytes(char *out, size_t max)
{
	static const char *const pieces[] = {"a", "\"", "\\", "\n", "\x01", "\x7f", "/", "é",
	                                     "€", "😀", "\xe2\x80\xa8", " ", "op", "id"};
	size_t n = 0, want = next() % 12;

	for (size_t i = 0; i < want; i++) {
		const char *p = pieces[next() % (sizeof(pieces) / sizeof(pieces[0]))];
		size_t k = strlen(p);
		if (n + k > max)
			break;
		memcpy(out + n, p, k);
		n += k;
	}
	if (next() % 10 == 0 && n < max)
		out[n++] = '\0';
	return n;
}

static json_t *random_value(int depth)
{
	char tmp[64];
	size_t n;

	switch (next() % (depth > 3 ? 6 : 8)) {
	case 0:
		return json_true();
	case 1:
		return json_false();
	case 2:
		return json_null();
	case 3: {
		static const json_int_t edge[] = {0, -1, 1, 999999999999999999, INT64_MAX, INT64_MIN};
		return json_integer(next() % 2 ? edge[next() % 6] : (json_int_t)(next() % 100000));
	}
	case 4: {
		static const double edge[] = {0.5, -0.0, 1e300, -2.5e-300, 1e17, 3.25};
		return json_real(edge[next() % 6]);
	}
	case 5:
		n = random_bytes(tmp, sizeof(tmp));
		return json_stringn(tmp, n);
	case 6: {
		json_t *o = json_object();
		size_t k = next() % 4;
		for (size_t i = 0; i < k; i++) {
			n = random_bytes(tmp, sizeof(tmp));
			json_object_setn_new(o, tmp, n, random_value(depth + 1));
		}
		return o;
	}
	default: {
		json_t *a = json_array();
		size_t k = next() % 4;
		for (size_t i = 0; i < k; i++)
			json_array_append_new(a, random_value(depth + 1));
		return a;
	}
	}
}

/* The scanned value v equals jansson's j. */
static bool same_value(const struct jscan_value *v, const json_t *j)
{
	switch (v->type) {
	case JSCAN_NULL:
		return json_is_null(j);
	case JSCAN_TRUE:
		return json_is_true(j);
	case JSCAN_FALSE:
		return json_is_false(j);
	case JSCAN_INTEGER:
		return json_is_integer(j) && json_integer_value(j) == strtoll(v->p, NULL, 10);
	case JSCAN_REAL:
		return json_is_real(j);
	case JSCAN_STRING:
		return json_is_string(j) && string_is(v, json_string_value(j), json_string_length(j));
	case JSCAN_ARRAY: {
		struct jscan_value el;
		size_t pos = 0, k = 0;
		if (!json_is_array(j))
			return false;
		while (jscan_array_next(v, &pos, &el))
			if (k >= json_array_size(j) || !same_value(&el, json_array_get(j, k++)))
				return false;
		return k == json_array_size(j);
	}
	case JSCAN_OBJECT: {
		struct jscan_member m[8];
		size_t n;
		if (!json_is_object(j))
			return false;
		if (jscan_object(v->p, v->len, m, 8, &n) < 0)
			return true; /* escaped keys: jscan lists no members of such an object */
		for (size_t i = 0; i < n && i < 8; i++) {
			bool dup = false;
			jscan_find(m, n < 8 ? n : 8, m[i].key, m[i].key_len, &dup);
			if (!dup && !same_value(&m[i].value,
			                        json_object_getn(j, m[i].key, m[i].key_len)))
				return false;
		}
		return true;
	}
	}
	return false;
}

/* Whatever jscan accepts, jansson reads the same way. */
static void check_against_jansson(const char *text, size_t len, int *accepted_n)
{
	struct jscan_member m[16];
	size_t n;
	json_error_t e;
	json_t *j;

	if (jscan_object(text, len, m, 16, &n) < 0)
		return;
	(*accepted_n)++;
	j = json_loadb(text, len, JSON_ALLOW_NUL, &e);
	CHECK(json_is_object(j));
	if (!json_is_object(j)) {
		fprintf(stderr, "jansson refused what jscan accepted: %.*s (%s)\n", (int)len, text,
		        e.text);
		json_decref(j);
		return;
	}
	CHECK(n > 16 || n >= json_object_size(j));
	for (size_t i = 0; i < n && i < 16; i++) {
		bool dup = false;
		const struct jscan_member *last = jscan_find(m, n < 16 ? n : 16, m[i].key,
		                                             m[i].key_len, &dup);
		if (last != &m[i])
			continue; /* jansson keeps the last of duplicates */
		bool same = same_value(&m[i].value, json_object_getn(j, m[i].key, m[i].key_len));
		CHECK(same);
		if (!same)
			fprintf(stderr, "member %.*s differs in %.*s\n", (int)m[i].key_len, m[i].key,
			        (int)len, text);
	}
	json_decref(j);
}

static void test_oracle(void)
{
	int written = 0, accepted_written = 0, mutants = 0, accepted_mutants = 0, easy = 0,
	    accepted_easy = 0;

	for (int round = 0; round < 20000; round++) {
		json_t *o = json_object();
		size_t k = next() % 6;
		char key[64];
		for (size_t i = 0; i < k; i++) {
			size_t n = random_bytes(key, sizeof(key));
			json_object_setn_new(o, key, n, random_value(1));
		}
		char *text = json_dumps(o, JSON_COMPACT);
		size_t len = strlen(text);
		int before = accepted_written;
		written++;
		check_against_jansson(text, len, &accepted_written);
		/* Without big numbers, reals or escaped keys, jscan must accept jansson's text. */
		if (!strstr(text, "e+") && !strstr(text, "e-") && !strstr(text, ".") &&
		    !strstr(text, "922337203685477") && !strstr(text, "\\\":") &&
		    !strstr(text, "\\\\\":") && !strstr(text, "\\u0000\":")) {
			bool escaped_key = false;
			const char *key_name;
			json_t *val;
			json_object_foreach(o, key_name, val)
			{
				(void)val;
				for (const char *p = key_name; *p; p++)
					if ((unsigned char)*p < 0x20 || *p == '"' || *p == '\\')
						escaped_key = true;
			}
			if (!escaped_key) {
				easy++;
				accepted_easy += accepted_written > before;
			}
		}
		/* Mutants: a byte changed, dropped or doubled. */
		for (int t = 0; t < 4 && len > 0; t++) {
			char *mut = malloc(len + 2);
			size_t at = next() % len, mlen = len;
			memcpy(mut, text, len);
			switch (next() % 3) {
			case 0:
				mut[at] = (char)(next() % 2 ? "{}[]\",:\\0-eE.tfnu "[next() % 18]
				                            : (char)next());
				break;
			case 1:
				memmove(mut + at, mut + at + 1, len - at - 1);
				mlen--;
				break;
			default:
				memmove(mut + at + 1, mut + at, len - at);
				mlen++;
				break;
			}
			mutants++;
			check_against_jansson(mut, mlen, &accepted_mutants);
			free(mut);
		}
		free(text);
		json_decref(o);
	}
	printf("oracle: %d texts, %d accepted; %d plain ones, %d accepted; %d mutants, %d "
	       "accepted\n",
	       written, accepted_written, easy, accepted_easy, mutants, accepted_mutants);
	CHECK(accepted_easy == easy);
	CHECK(accepted_mutants > 0 && accepted_mutants < mutants);
}

/* jscan_tame_numbers against jansson: a number is replaced exactly when jansson refuses the
 * text for it, and jansson reads the tamed text. */
static void test_tame(void)
{
	static const struct {
		const char *in, *out; /* out NULL: nothing to tame */
	} cases[] = {
	    {"{\"a\":9223372036854775807}", NULL},
	    {"{\"a\":9223372036854775808}", "{\"a\":1e300}"},
	    {"{\"a\":-9223372036854775808}", NULL},
	    {"{\"a\":-9223372036854775809}", "{\"a\":-1e300}"},
	    {"{\"a\":12345678901234567890123}", "{\"a\":1e300}"},
	    {"{\"a\":1e308}", NULL},
	    {"{\"a\":1e309}", "{\"a\":1e300}"},
	    {"{\"a\":-1.5E+400}", "{\"a\":-1e300}"},
	    {"{\"a\":1e-400}", NULL}, /* underflow: jansson reads 0 */
	    {"{\"a\":0.0000001e310}", NULL},
	    {"{\"a\":\"12345678901234567890\"}", NULL},
	    {"{\"a\":\"x\\\"99999999999999999999\",\"b\":[1e999, {\"c\":-1e999}]}",
	     "{\"a\":\"x\\\"99999999999999999999\",\"b\":[1e300, {\"c\":-1e300}]}"},
	    {"{\"id\":99999999999999999999,\"op\":\"ping\"}", "{\"id\":1e300,\"op\":\"ping\"}"},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		const char *in = cases[i].in;
		struct buf b = {NULL, 0, 0};
		size_t n = 99;
		json_error_t e;
		json_t *j = json_loadb(in, strlen(in), JSON_ALLOW_NUL, &e);

		CHECK(jscan_tame_numbers(in, strlen(in), &b, &n) == 0);
		CHECK((n > 0) == (cases[i].out != NULL));
		CHECK((j == NULL) == (n > 0)); /* jansson refuses it for those numbers only */
		json_decref(j);
		if (cases[i].out) {
			CHECK(b.len == strlen(cases[i].out) &&
			      memcmp(b.data, cases[i].out, b.len) == 0);
			j = json_loadb(b.data, b.len, JSON_ALLOW_NUL, &e);
			CHECK(j != NULL);
			json_decref(j);
		} else {
			CHECK(b.len == 0);
		}
		buf_free(&b);
		/* Counting only. */
		CHECK(jscan_tame_numbers(in, strlen(in), NULL, &n) == 0 &&
		      (n > 0) == (cases[i].out != NULL));
	}
	/* Invalid JSON stays invalid: a run that is no number is left alone. */
	{
		static const char *const bad[] = {"{\"a\":1e999", "{\"a\":1e5000-3}", "{\"a\":--1}",
		                                  "{\"a\":\"99999999999999999999}"};
		for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
			struct buf b = {NULL, 0, 0};
			size_t n = 0;
			json_error_t e;
			json_t *j;
			CHECK(jscan_tame_numbers(bad[i], strlen(bad[i]), &b, &n) == 0);
			j = n ? json_loadb(b.data, b.len, JSON_ALLOW_NUL, &e) : NULL;
			CHECK(j == NULL);
			buf_free(&b);
		}
	}
}

/* jscan_object_get: the top-level member's raw value, as jansson would pick it. */
static void test_object_get(void)
{
	struct jscan_value v;
	const char *t;

	t = " {\"x\":{\"id\":1},\"id\":12345678901234567890 ,\"y\":2} ";
	CHECK(jscan_object_get(t, strlen(t), "id", 2, &v) == 1);
	CHECK(v.type == JSCAN_INTEGER && v.len == 20 &&
	      memcmp(v.p, "12345678901234567890", 20) == 0);
	t = "{\"id\":1,\"\\u0069d\":[1e999, \"a\"]}"; /* an escaped key; the last one wins */
	CHECK(jscan_object_get(t, strlen(t), "id", 2, &v) == 1);
	CHECK(v.type == JSCAN_ARRAY && v.len == 12 && memcmp(v.p, "[1e999, \"a\"]", 12) == 0);
	t = "{\"id\":\"a\\\"b\"}";
	CHECK(jscan_object_get(t, strlen(t), "id", 2, &v) == 1);
	CHECK(v.type == JSCAN_STRING && v.escaped && v.len == 4);
	t = "{\"x\":{\"id\":1}}";
	CHECK(jscan_object_get(t, strlen(t), "id", 2, &v) == 0);
	CHECK(jscan_object_get("{}", 2, "id", 2, &v) == 0);
	CHECK(jscan_object_get("[]", 2, "id", 2, &v) == -EINVAL);
	CHECK(jscan_object_get("{\"id\":1", 7, "id", 2, &v) == -EINVAL);
	CHECK(jscan_object_get("{\"id\":01}", 9, "id", 2, &v) == -EINVAL);
	/* jscan_value_loose takes what jscan_value leaves to jansson. */
	{
		size_t end;
		t = "1e999,";
		CHECK(jscan_value(t, strlen(t), &v, &end) < 0);
		CHECK(jscan_value_loose(t, strlen(t), &v, &end) == 0 && end == 5 &&
		      v.type == JSCAN_REAL);
	}
}

int main(void)
{
	test_members();
	test_refused();
	test_strings();
	test_oracle();
	test_tame();
	test_object_get();
	return test_done("jscan");
}
