/* Unit tests for lib/ddbitem: AttributeValue round trips, the exact item of a worked message,
 * DynamoDB's size and depth rules on hand-computed examples, refusals over the limits, and
 * request bodies and the parsing of well-formed and malformed answers. */
#include "ddbitem.h"
#include "test.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define ID_A "01JRZJ166HZFPP405DV1QQB2X1"
#define ID_B "01JRZJ166HZFPP405DV1QQB2X2"
#define ID_C "01JRZJ166HZFPP405DV1QQB2X3"
#define ID_S "01JRZJ166HZFPP405DV1QQB2XS"
#define ID_7 "01JRZJ166HZFPP405DV1QQB2X9"

/* Message 7 of semantics.md's worked example, as message_to_map writes it. */
#define MAP_7                                                                                      \
	"{\"id\":\"" ID_7 "\",\"message\":{\"role\":\"user\",\"contents\":[\"Yes, but I do not "   \
	"need help!\"]},\"metadata\":{\"timing\":{\"creation\":1744815823057,\"playStart\":"       \
	"1744815823080},\"aux\":{\"stopped\":true}}}"

#define ITEM_7                                                                                     \
	"{\"conversation\":{\"S\":\"conv-1\"},\"sk\":{\"S\":\"" ID_7 "\"},\"id\":{\"S\":\"" ID_7   \
	"\"},\"message\":{\"M\":{\"role\":{\"S\":\"user\"},\"contents\":{\"L\":[{\"S\":\"Yes, "    \
	"but I do not need help!\"}]}}},\"metadata\":{\"M\":{\"timing\":{\"M\":{\"creation\":{"    \
	"\"N\":\"1744815823057\"},\"playStart\":{\"N\":\"1744815823080\"}}},\"aux\":{\"M\":{"      \
	"\"stopped\":{\"BOOL\":true}}}}},\"version\":{\"N\":\"2\"},\"updated\":{\"N\":"            \
	"\"1744815823100\"}}"

#define MAP_SUMMARY                                                                                \
	"{\"id\":\"" ID_S "\",\"message\":{\"role\":\"summary\",\"contents\":[\"...\"]},"          \
	"\"metadata\":{\"summaryIds\":[\"" ID_A "\",\"" ID_B "\",\"" ID_C "\"],\"timing\":{"       \
	"\"creation\":1744815824000}}}"

/* Parses test JSON (any value); a parse error is a bug of the test and fails it. */
static json_t *J(const char *text)
{
	json_error_t e;
	json_t *v = json_loads(text, JSON_DECODE_ANY | JSON_ALLOW_NUL, &e);
	if (!v) {
		fprintf(stderr, "test JSON does not parse: %s\n  %s\n", e.text, text);
		test_failures++;
	}
	return v;
}

static void check_text(const json_t *v, const char *expected, int line)
{
	char *s = v ? json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
	test_checks++;
	if (!s || strcmp(s, expected) != 0) {
		test_failures++;
		fprintf(stderr, "%s:%d: JSON differs\n  got:      %s\n  expected: %s\n", __FILE__,
		        line, s ? s : "(null)", expected);
	}
	free(s);
}
#define CHECK_TEXT(v, expected) check_text(v, expected, __LINE__)

/* ---- AttributeValues ---- */

static void roundtrip(const char *text)
{
	json_t *v = J(text), *av = NULL, *back = NULL;
	struct error e;
	CHECK(ddbitem_attr_from_json(v, &av, &e) == ERR_OK);
	CHECK(ddbitem_attr_to_json(av, &back, &e) == ERR_OK);
	/* json_equal tells an integer from a real, so types are checked as well */
	CHECK(back && json_equal(v, back));
	if (!back || !json_equal(v, back))
		fprintf(stderr, "  round trip of %s\n", text);
	json_decref(v);
	json_decref(av);
	json_decref(back);
}

static void number_text_is(const char *json, const char *n)
{
	json_t *v = J(json), *av = NULL;
	char expected[128];
	snprintf(expected, sizeof(expected), "{\"N\":\"%s\"}", n);
	CHECK(ddbitem_attr_from_json(v, &av, NULL) == ERR_OK);
	CHECK_TEXT(av, expected);
	json_decref(v);
	json_decref(av);
}

/* N text read back: kind 'i' integer, 'r' real, with value. */
static void n_reads_as(const char *n, char kind, double value)
{
	json_t *av = json_pack("{s:s}", "N", n), *v = NULL;
	CHECK(ddbitem_attr_to_json(av, &v, NULL) == ERR_OK);
	if (kind == 'i')
		CHECK(json_is_integer(v) && (double)json_integer_value(v) == value);
	else
		CHECK(json_is_real(v) && json_real_value(v) == value);
	if (!v || (kind == 'i' ? !json_is_integer(v) : !json_is_real(v)))
		fprintf(stderr, "  N \"%s\" read wrongly\n", n);
	json_decref(av);
	json_decref(v);
}

static void av_refused(const char *text)
{
	json_t *av = J(text), *v = NULL;
	struct error e = {0};
	CHECK(ddbitem_attr_to_json(av, &v, &e) == ERR_BAD_REQUEST);
	CHECK(v == NULL && e.message[0] != '\0');
	json_decref(av);
}

static void test_attribute_values(void)
{
	json_t *v, *av = NULL;
	struct error e;

	roundtrip("{\"a\":null,\"b\":true,\"c\":false,\"d\":1,\"e\":-9223372036854775808,"
	          "\"f\":1.5,\"g\":1.0,\"h\":0.1,\"i\":\"str\\u0000nul\",\"j\":[1,[2,{}],[]],"
	          "\"k\":{\"\":{\"x\":\"y\"}},\"l\":1e125,\"m\":-2.5e-100,\"n\":0.0,"
	          "\"o\":9223372036854775807,\"p\":\"\\u00e9\\ud83d\\ude00\",\"q\":123456789.125}");
	roundtrip("[]");
	roundtrip("\"plain\"");
	roundtrip("-0.1");

	v = J("{\"a\":[1,\"x\",null,true,{\"b\":1.5}]}");
	CHECK(ddbitem_attr_from_json(v, &av, NULL) == ERR_OK);
	CHECK_TEXT(av, "{\"M\":{\"a\":{\"L\":[{\"N\":\"1\"},{\"S\":\"x\"},{\"NULL\":true},"
	               "{\"BOOL\":true},{\"M\":{\"b\":{\"N\":\"1.5\"}}}]}}}");
	json_decref(v);
	json_decref(av);

	/* reals: the shortest text that reads back the same, and always real-looking */
	number_text_is("0.1", "0.1");
	number_text_is("1.0", "1.0");
	number_text_is("100.0", "100.0");
	number_text_is("1e20", "1e+20");
	number_text_is("-0.5", "-0.5");
	number_text_is("1e125", "1e+125");
	number_text_is("1e-130", "1e-130");
	number_text_is("0.30000000000000004", "0.30000000000000004");
	number_text_is("-42", "-42");

	/* outside DynamoDB's range */
	v = J("[1e126]");
	CHECK(ddbitem_attr_from_json(v, &av, &e) == ERR_BAD_REQUEST);
	CHECK(strstr(e.message, "range") != NULL);
	json_decref(v);
	v = J("{\"x\":-1e-131}");
	CHECK(ddbitem_attr_from_json(v, &av, &e) == ERR_BAD_REQUEST);
	json_decref(v);

	n_reads_as("123", 'i', 123);
	n_reads_as("-0", 'i', 0);
	n_reads_as("1.50", 'r', 1.5);
	n_reads_as("1E+2", 'r', 100);
	n_reads_as("1e-2", 'r', 0.01);
	n_reads_as(".5", 'r', 0.5);
	n_reads_as("5.", 'r', 5);
	n_reads_as("99999999999999999999", 'r', 1e20); /* too big for an integer */

	av_refused("{\"N\":\"\"}");
	av_refused("{\"N\":\"-\"}");
	av_refused("{\"N\":\"1e\"}");
	av_refused("{\"N\":\"abc\"}");
	av_refused("{\"N\":\" 1\"}");
	av_refused("{\"N\":\"1 \"}");
	av_refused("{\"N\":\"+1\"}");
	av_refused("{\"N\":\"0x10\"}");
	av_refused("{\"N\":\"nan\"}");
	av_refused("{\"N\":\"inf\"}");
	av_refused("{\"N\":\"1e999\"}");
	av_refused("{\"N\":1}");
	av_refused("{}");
	av_refused("{\"S\":1}");
	av_refused("{\"S\":\"a\",\"N\":\"1\"}");
	av_refused("{\"NULL\":false}");
	av_refused("{\"BOOL\":\"true\"}");
	av_refused("{\"L\":{}}");
	av_refused("{\"M\":[]}");
	av_refused("{\"M\":{\"a\":{\"S\":\"ok\"},\"b\":{\"X\":1}}}");
	av_refused("{\"L\":[{\"S\":\"ok\"},5]}");
	av_refused("{\"SS\":[\"a\"]}");
	av_refused("{\"B\":\"AAAA\"}");
	av_refused("[]");
	av_refused("\"S\"");
	av_refused("null");
	CHECK(ddbitem_attr_to_json(NULL, &v, NULL) == ERR_BAD_REQUEST);
	CHECK(ddbitem_attr_from_json(NULL, &v, NULL) == ERR_BAD_REQUEST);
}

/* Values nested far beyond anything DynamoDB stores are refused, not recursed into. */
static void test_absurd_nesting(void)
{
	json_t *deep = json_integer(1), *deep_av = json_pack("{s:s}", "N", "1"), *out = NULL;
	json_t *item;
	size_t size;
	int depth;
	for (int i = 0; i < 300; i++) {
		deep = json_pack("[o]", deep);
		deep_av = json_pack("{s:[o]}", "L", deep_av);
	}
	CHECK(deep && deep_av);
	CHECK(ddbitem_attr_from_json(deep, &out, NULL) == ERR_BAD_REQUEST && out == NULL);
	CHECK(ddbitem_attr_to_json(deep_av, &out, NULL) == ERR_BAD_REQUEST && out == NULL);
	item = json_pack("{s:O}", "a", deep_av);
	CHECK(ddbitem_size(item, &size) == -EINVAL);
	CHECK(ddbitem_depth(item, &depth) == -EINVAL);
	json_decref(item);
	json_decref(deep);
	json_decref(deep_av);
}

/* ---- items ---- */

static void test_sort_key(void)
{
	char sk[DDBITEM_SK_MAX + 1];
	struct error e;
	json_t *m7 = J(MAP_7), *ms = J(MAP_SUMMARY), *bad;

	CHECK(ddbitem_sort_key(m7, sk, &e) == ERR_OK);
	CHECK_STR(sk, ID_7);
	CHECK(ddbitem_sort_key(ms, sk, &e) == ERR_OK);
	CHECK_STR(sk, ID_C "~" ID_S);
	CHECK(strlen(sk) == DDBITEM_SK_MAX);
	/* the summary sorts after what it summarizes and before any later message */
	CHECK(strcmp(ID_C, sk) < 0 && strcmp(sk, "01JRZJ166HZFPP405DV1QQB2X4") < 0);

	bad = J("{\"id\":\"" ID_S "\",\"message\":{\"role\":\"summary\",\"contents\":[\"x\"]}}");
	CHECK(ddbitem_sort_key(bad, sk, &e) == ERR_BAD_REQUEST);
	CHECK(strstr(e.message, "summaryIds") != NULL);
	json_decref(bad);
	bad = J("{\"id\":\"01jrzj166hzfpp405dv1qqb2x9\",\"message\":{\"role\":\"user\","
	        "\"contents\":[\"x\"]}}");
	CHECK(ddbitem_sort_key(bad, sk, &e) == ERR_BAD_REQUEST);
	json_decref(bad);
	json_decref(m7);
	json_decref(ms);
}

static void test_worked_item(void)
{
	json_t *map = J(MAP_7), *item = NULL, *back = NULL, *sum = J(MAP_SUMMARY);
	const char *conv = NULL;
	uint32_t version = 0;
	int64_t updated = 0;
	size_t size = 0;
	int depth = 0;
	struct error e;

	CHECK(ddbitem_from_map("conv-1", map, 2, 1744815823100, 0, &item, &e) == ERR_OK);
	CHECK_TEXT(item, ITEM_7);

	/* By hand, per attribute: name bytes + value size (rules in ddbitem.c):
	 *   conversation  12 + S "conv-1" 6                                     =  18
	 *   sk             2 + 26                                               =  28
	 *   id             2 + 26                                               =  28
	 *   message        7 + M(3 + [1 + 4 "role" + 4 "user"]
	 *                      + [1 + 8 "contents" + L(3 + [1 + 28])])         =  60
	 *                  (the content "Yes, but I do not need help!" is 28 bytes)
	 *   metadata       8 + M(3 + [1 + 6 "timing" + M(3
	 *                          + [1 + 8 "creation" + N 1744815823057: 10^12..10^0,
	 *                             7 base-100 digits -> 7+1]
	 *                          + [1 + 9 "playStart" + N 1744815823080: 10^12..10^1,
	 *                             7 base-100 digits -> 7+1])]
	 *                      + [1 + 3 "aux" + M(3 + [1 + 7 "stopped" + BOOL 1])])
	 *                = 8 + 3 + (1 + 6 + 38) + (1 + 3 + 12)                 =  72
	 *   version        7 + N "2": 1 digit -> 1+1                            =   9
	 *   updated        7 + N 1744815823100: 10^12..10^2 -> 6+1              =  14
	 *                                                                 total 229 */
	CHECK(ddbitem_size(item, &size) == 0);
	CHECK(size == 229);
	if (size != 229)
		fprintf(stderr, "  worked item size %zu\n", size);
	/* metadata (1) > timing (2) > N (3) */
	CHECK(ddbitem_depth(item, &depth) == 0 && depth == 3);

	CHECK(ddbitem_to_map(item, &conv, &back, &version, &updated, &e) == ERR_OK);
	CHECK_STR(conv, "conv-1");
	CHECK(version == 2 && updated == 1744815823100);
	CHECK(back && json_equal(back, map));
	CHECK_TEXT(back, MAP_7); /* the order of message maps, too */
	json_decref(back);
	back = NULL;
	json_decref(item);
	item = NULL;

	/* a summary: its sk, and back */
	CHECK(ddbitem_from_map("conv-1", sum, 1, 1744815824000, 1760000000, &item, &e) == ERR_OK);
	CHECK_TEXT(json_object_get(item, "sk"), "{\"S\":\"" ID_C "~" ID_S "\"}");
	CHECK_TEXT(json_object_get(item, "expires"), "{\"N\":\"1760000000\"}");
	CHECK_TEXT(json_object_get(item, "metadata"),
	           "{\"M\":{\"summaryIds\":{\"L\":[{\"S\":\"" ID_A "\"},{\"S\":\"" ID_B
	           "\"},{\"S\":\"" ID_C "\"}]},\"timing\":{\"M\":{\"creation\":{\"N\":"
	           "\"1744815824000\"}}}}}");
	CHECK(ddbitem_to_map(item, NULL, &back, NULL, NULL, &e) == ERR_OK);
	CHECK(back && json_equal(back, sum));
	json_decref(back);
	json_decref(item);

	/* a map without metadata makes an item without it, and back */
	json_object_del(map, "metadata");
	CHECK(ddbitem_from_map("c", map, 1, 0, 0, &item, &e) == ERR_OK);
	CHECK(item && !json_object_get(item, "metadata"));
	CHECK(ddbitem_to_map(item, NULL, &back, NULL, NULL, &e) == ERR_OK);
	CHECK(back && json_equal(back, map));
	json_decref(back);
	json_decref(item);

	json_decref(map);
	json_decref(sum);
}

static void map_refused(const char *conv, const char *text, enum error_code code)
{
	json_t *map = J(text), *item = NULL;
	struct error e = {0};
	CHECK(ddbitem_from_map(conv, map, 1, 0, 0, &item, &e) == code);
	CHECK(item == NULL && e.message[0]);
	json_decref(map);
}

static void test_from_map_refusals(void)
{
	json_t *map = J(MAP_7), *item = NULL;
	struct error e;
	const char *msg =
	    "{\"id\":\"" ID_7 "\",\"message\":{\"role\":\"user\",\"contents\":[\"x\"]}";

	CHECK(ddbitem_from_map("c", map, 0, 0, 0, &item, &e) == ERR_BAD_REQUEST && !item);
	CHECK(ddbitem_from_map("c", map, 1, -1, 0, &item, &e) == ERR_BAD_REQUEST && !item);
	CHECK(ddbitem_from_map("c", map, 1, 0, 0, NULL, &e) == ERR_BAD_REQUEST);
	CHECK(ddbitem_from_map("", map, 1, 0, 0, &item, &e) == ERR_BAD_REQUEST && !item);
	CHECK(ddbitem_from_map(NULL, map, 1, 0, 0, &item, &e) == ERR_BAD_REQUEST && !item);
	CHECK(ddbitem_from_map("\xff\xfe", map, 1, 0, 0, &item, &e) == ERR_BAD_REQUEST && !item);
	json_decref(map);

	map_refused("c", "[]", ERR_BAD_REQUEST);
	map_refused("c", "{\"message\":{\"role\":\"user\",\"contents\":[\"x\"]}}", ERR_BAD_REQUEST);
	map_refused("c", "{\"id\":\"" ID_7 "\",\"message\":{\"role\":\"robot\",\"contents\":[]}}",
	            ERR_BAD_REQUEST);
	map_refused("c", "{\"id\":\"" ID_7 "\",\"message\":{\"role\":\"user\",\"contents\":[1]}}",
	            ERR_BAD_REQUEST);
	map_refused("c", "{\"id\":\"" ID_7 "\",\"message\":{\"role\":\"user\"}}", ERR_BAD_REQUEST);
	map_refused("c",
	            "{\"id\":\"" ID_7 "\",\"message\":{\"role\":\"user\",\"contents\":[],\"x\":1}}",
	            ERR_BAD_REQUEST);
	map_refused("c",
	            "{\"id\":\"" ID_7 "\",\"version\":1,\"message\":{\"role\":\"user\","
	            "\"contents\":[]}}",
	            ERR_BAD_REQUEST);

	char buf[512];
	snprintf(buf, sizeof(buf), "%s,\"metadata\":[]}", msg);
	map_refused("c", buf, ERR_BAD_REQUEST);
	snprintf(buf, sizeof(buf), "%s,\"metadata\":{\"other\":1}}", msg);
	map_refused("c", buf, ERR_BAD_REQUEST);
	snprintf(buf, sizeof(buf), "%s,\"metadata\":{\"attribute\":\"fake\"}}", msg);
	map_refused("c", buf, ERR_BAD_REQUEST);
	snprintf(buf, sizeof(buf), "%s,\"metadata\":{\"timing\":{\"creation\":1.5}}}", msg);
	map_refused("c", buf, ERR_BAD_REQUEST);
	snprintf(buf, sizeof(buf), "%s,\"metadata\":{\"timing\":{\"creation\":-1}}}", msg);
	map_refused("c", buf, ERR_BAD_REQUEST);
	snprintf(buf, sizeof(buf), "%s,\"metadata\":{\"aux\":[1]}}", msg);
	map_refused("c", buf, ERR_BAD_REQUEST);
	snprintf(buf, sizeof(buf), "%s,\"metadata\":{\"aux\":{\"big\":[1, 2e200]}}}", msg);
	map_refused("c", buf, ERR_BAD_REQUEST);
	map = J(buf);
	CHECK(ddbitem_check(map, "c", &e) == ERR_BAD_REQUEST);
	CHECK(strncmp(e.message, "metadata.aux: number", 20) == 0);
	json_decref(map);
}

/* A map of one assistant message whose single content is n bytes of 'x'. */
static json_t *map_with_content(size_t n)
{
	char *s = malloc(n + 1);
	json_t *map;
	memset(s, 'x', n);
	s[n] = '\0';
	map = json_pack("{s:s, s:{s:s, s:[s]}, s:{s:{s:I}}}", "id", ID_7, "message", "role",
	                "assistant", "contents", s, "metadata", "timing", "creation",
	                (json_int_t)1744815823057);
	free(s);
	return map;
}

/* aux = {"x": k maps deep around 1} */
static json_t *map_with_nesting(int k, bool arrays)
{
	json_t *leaf = json_integer(1);
	for (int i = 0; i < k; i++)
		leaf = arrays ? json_pack("[o]", leaf) : json_pack("{s:o}", "a", leaf);
	return json_pack("{s:s, s:{s:s, s:[s]}, s:{s:{s:I}, s:{s:o}}}", "id", ID_7, "message",
	                 "role", "user", "contents", "hi", "metadata", "timing", "creation",
	                 (json_int_t)1, "aux", "x", leaf);
}

static void test_limits(void)
{
	struct error e;
	json_t *map, *item = NULL;
	char *longid;
	int depth = 0;

	/* ddbitem_check sizes the item with version 4294967295 and updated and expires at
	 * 9223372036854775807. For conversation "c" and one content of L bytes:
	 *   conversation 12 + 1                                          =  13
	 *   sk 2 + 26, id 2 + 26                                         =  56
	 *   message 7 + M(3 + [1 + 4 + 9 "assistant"] + [1 + 8 + L(3 + 1 + L)])
	 *                                                                =  37 + L
	 *   metadata 8 + M(3 + [1 + 6 + M(3 + [1 + 8 + N 13 digits 8])]) =  38
	 *   version 7 + N 10 digits (5 + 1)                              =  13
	 *   updated 7 + N 19 digits (10 + 1), expires 7 + 11             =  36
	 *                                                          total 193 + L
	 * so 409600 - 193 = 409407 bytes of content fit, one more does not. */
	map = map_with_content(409407);
	CHECK(ddbitem_check(map, "c", &e) == ERR_OK);
	json_decref(map);
	map = map_with_content(409408);
	CHECK(ddbitem_check(map, "c", &e) == ERR_TOO_LARGE);
	CHECK(strstr(e.message, "409601 bytes") != NULL);
	/* the item itself can still be built; DynamoDB would refuse it */
	CHECK(ddbitem_from_map("c", map, 1, 0, 0, &item, &e) == ERR_OK);
	json_decref(item);
	json_decref(map);
	map = map_with_content(5000000);
	CHECK(ddbitem_check(map, "c", &e) == ERR_TOO_LARGE);
	CHECK(strstr(e.message, "5000000 bytes of contents") != NULL);
	json_decref(map);

	/* metadata (1) > aux (2) > k maps (3 .. k+2) > N (k+3): k = 29 is the deepest */
	map = map_with_nesting(29, false);
	CHECK(ddbitem_check(map, "c", &e) == ERR_OK);
	CHECK(ddbitem_from_map("c", map, 1, 0, 0, &item, &e) == ERR_OK);
	CHECK(ddbitem_depth(item, &depth) == 0 && depth == 32);
	json_decref(item);
	json_decref(map);
	map = map_with_nesting(30, false);
	CHECK(ddbitem_check(map, "c", &e) == ERR_TOO_LARGE);
	CHECK(strstr(e.message, "33 levels") != NULL);
	json_decref(map);
	map = map_with_nesting(29, true);
	CHECK(ddbitem_check(map, "c", &e) == ERR_OK);
	json_decref(map);
	map = map_with_nesting(30, true);
	CHECK(ddbitem_check(map, "c", &e) == ERR_TOO_LARGE);
	json_decref(map);

	/* the conversation id is the partition key: 2048 bytes at most */
	longid = malloc(DDBITEM_PARTITION_KEY_MAX + 2);
	memset(longid, 'c', DDBITEM_PARTITION_KEY_MAX + 1);
	longid[DDBITEM_PARTITION_KEY_MAX + 1] = '\0';
	map = J(MAP_7);
	CHECK(ddbitem_check(map, longid, &e) == ERR_TOO_LARGE);
	longid[DDBITEM_PARTITION_KEY_MAX] = '\0';
	CHECK(ddbitem_check(map, longid, &e) == ERR_OK);
	CHECK(ddbitem_check(map, "", &e) == ERR_BAD_REQUEST);
	CHECK(ddbitem_check(NULL, "c", &e) == ERR_BAD_REQUEST);
	free(longid);
	json_decref(map);
}

/* Hand-made items whose sizes are worked out in the comments. */
static void test_sizes(void)
{
	struct {
		const char *item;
		size_t size;
		int depth;
	} cases[] = {
	    /* 1 + 6 ("h", 0xc3 0xa9, "llo") */
	    {"{\"a\":{\"S\":\"h\\u00e9llo\"}}", 7, 1},
	    /* 1 + [1|23|.45] (3 base-100 digits) + 1 */
	    {"{\"n\":{\"N\":\"123.4500\"}}", 5, 1},
	    /* 1 + [.001] (1) + 1 + 1 for the sign */
	    {"{\"z\":{\"N\":\"-0.00100\"}}", 4, 1},
	    /* 1 + zero (1) */
	    {"{\"z\":{\"N\":\"0\"}}", 2, 1},
	    {"{\"z\":{\"N\":\"-0.0\"}}", 2, 1},
	    /* 1 + [1|2 * 10^98] (2) + 1: the exponent's parity splits the pair */
	    {"{\"e\":{\"N\":\"1.2E+100\"}}", 4, 1},
	    /* 1.2E+101 = 12 * 10^100: one pair */
	    {"{\"e\":{\"N\":\"1.2e101\"}}", 3, 1},
	    {"{\"e\":{\"N\":\"1.2E-99\"}}", 3, 1},
	    /* 12: 1 + 1; 120: [1|20] 2 + 1; 1.5: [1|.5] 2 + 1; 0.15: [.15] 1 + 1; -1: 1 + 1 + 1;
	     * 12340: [1|23|40] 3 + 1; 1234: [12|34] 2 + 1 */
	    {"{\"a\":{\"N\":\"12\"}}", 3, 1},
	    {"{\"a\":{\"N\":\"120\"}}", 4, 1},
	    {"{\"a\":{\"N\":\"1.5\"}}", 4, 1},
	    {"{\"a\":{\"N\":\"0.15\"}}", 3, 1},
	    {"{\"a\":{\"N\":\"-1\"}}", 4, 1},
	    {"{\"a\":{\"N\":\"12340\"}}", 5, 1},
	    {"{\"a\":{\"N\":\"1234\"}}", 4, 1},
	    {"{\"a\":{\"N\":\"-0.05\"}}", 4, 1},
	    {"{\"b\":{\"BOOL\":false}}", 2, 1},
	    {"{\"x\":{\"NULL\":true}}", 2, 1},
	    /* 1 + 3 + [1 + 2] + [1 + (1 + 1)] */
	    {"{\"l\":{\"L\":[{\"S\":\"ab\"},{\"N\":\"7\"}]}}", 10, 2},
	    /* 1 + 3 + [1 + 1 "k" + 1] + [1 + 1 "e" + 3] */
	    {"{\"m\":{\"M\":{\"k\":{\"S\":\"v\"},\"e\":{\"M\":{}}}}}", 12, 3},
	    /* 4 "blob" + 3 raw bytes of base64 "YWJj" */
	    {"{\"blob\":{\"B\":\"YWJj\"}}", 7, 1},
	    /* 2 + 3 */
	    {"{\"el\":{\"L\":[]}}", 5, 2},
	    /* the first ones together: 7+5+4+2+2+10+12 */
	    {"{\"a\":{\"S\":\"h\\u00e9llo\"},\"n\":{\"N\":\"123.4500\"},\"z\":{\"N\":\"-0.00100\"},"
	     "\"b\":{\"BOOL\":true},\"x\":{\"NULL\":true},\"l\":{\"L\":[{\"S\":\"ab\"},{\"N\":"
	     "\"7\"}]},\"m\":{\"M\":{\"k\":{\"S\":\"v\"},\"e\":{\"M\":{}}}}}",
	     42, 3},
	    {"{}", 0, 0},
	};
	const char *bad[] = {"[]",
	                     "{\"a\":{\"SS\":[\"a\"]}}",
	                     "{\"a\":{\"N\":\"x\"}}",
	                     "{\"a\":{\"B\":\"abc\"}}",
	                     "{\"a\":{\"L\":[{}]}}",
	                     "{\"a\":1}"};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		json_t *item = J(cases[i].item);
		size_t size = 0;
		int depth = -1;
		CHECK(ddbitem_size(item, &size) == 0 && size == cases[i].size);
		CHECK(ddbitem_depth(item, &depth) == 0 && depth == cases[i].depth);
		if (size != cases[i].size || depth != cases[i].depth)
			fprintf(stderr, "  %s: size %zu depth %d\n", cases[i].item, size, depth);
		json_decref(item);
	}
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		json_t *item = J(bad[i]);
		size_t size = 0;
		CHECK(ddbitem_size(item, &size) == -EINVAL);
		json_decref(item);
	}
	CHECK(ddbitem_size(NULL, NULL) == -EINVAL);
}

static void item_refused(const char *text)
{
	json_t *item = J(text), *map = NULL;
	const char *conv = NULL;
	struct error e = {0};
	CHECK(ddbitem_to_map(item, &conv, &map, NULL, NULL, &e) == ERR_BAD_REQUEST);
	CHECK(map == NULL && conv == NULL && e.message[0]);
	if (map)
		fprintf(stderr, "  accepted: %s\n", text);
	json_decref(map);
	json_decref(item);
}

#define K7 "\"conversation\":{\"S\":\"c\"},\"sk\":{\"S\":\"" ID_7 "\"},\"id\":{\"S\":\"" ID_7 "\"}"
#define MSG7 "\"message\":{\"M\":{\"role\":{\"S\":\"user\"},\"contents\":{\"L\":[{\"S\":\"x\"}]}}}"
#define NUMS7 "\"version\":{\"N\":\"1\"},\"updated\":{\"N\":\"5\"}"

static void test_to_map_refusals(void)
{
	json_t *item = J("{" K7 "," MSG7 "," NUMS7 "}"), *map = NULL;
	uint32_t version = 0;
	int64_t updated = 0;
	CHECK(ddbitem_to_map(item, NULL, &map, &version, &updated, NULL) == ERR_OK);
	CHECK(version == 1 && updated == 5 && map);
	json_decref(map);
	json_decref(item);

	item_refused("[]");
	item_refused("{" MSG7 "," NUMS7 "}");
	item_refused("{" K7 "," MSG7 "}");
	item_refused("{" K7 "," MSG7 ",\"version\":{\"N\":\"0\"},\"updated\":{\"N\":\"5\"}}");
	item_refused("{" K7 "," MSG7
	             ",\"version\":{\"N\":\"4294967296\"},\"updated\":{\"N\":\"5\"}}");
	item_refused("{" K7 "," MSG7 ",\"version\":{\"N\":\"1.5\"},\"updated\":{\"N\":\"5\"}}");
	item_refused("{" K7 "," MSG7 ",\"version\":{\"S\":\"1\"},\"updated\":{\"N\":\"5\"}}");
	item_refused("{" K7 "," MSG7 ",\"version\":{\"N\":\"1\"},\"updated\":{\"N\":\"-1\"}}");
	item_refused("{" K7 "," MSG7 ",\"version\":{\"N\":\"1\"},\"updated\":{\"N\":\"x\"}}");
	/* sk of another message */
	item_refused("{\"conversation\":{\"S\":\"c\"},\"sk\":{\"S\":\"" ID_A
	             "\"},\"id\":{\"S\":\"" ID_7 "\"}," MSG7 "," NUMS7 "}");
	item_refused("{\"conversation\":{\"S\":\"\"},\"sk\":{\"S\":\"" ID_7
	             "\"},\"id\":{\"S\":\"" ID_7 "\"}," MSG7 "," NUMS7 "}");
	item_refused(
	    "{\"conversation\":{\"S\":\"c\"},\"sk\":{\"S\":\"x\"},\"id\":{\"S\":\"x\"}," MSG7
	    "," NUMS7 "}");
	item_refused("{" K7 ",\"message\":{\"S\":\"x\"}," NUMS7 "}");
	item_refused(
	    "{" K7
	    ",\"message\":{\"M\":{\"role\":{\"S\":\"robot\"},\"contents\":{\"L\":[]}}}," NUMS7 "}");
	item_refused("{" K7
	             ",\"message\":{\"M\":{\"role\":{\"S\":\"user\"},\"contents\":{\"L\":[{\"N\":"
	             "\"1\"}]}}}," NUMS7 "}");
	item_refused(
	    "{" K7
	    ",\"message\":{\"M\":{\"role\":{\"S\":\"user\"},\"contents\":{\"S\":\"x\"}}}," NUMS7
	    "}");
	item_refused("{" K7
	             ",\"message\":{\"M\":{\"role\":{\"S\":\"user\"},\"contents\":{\"L\":[]},"
	             "\"more\":{\"S\":\"x\"}}}," NUMS7 "}");
	item_refused("{" K7 "," MSG7 "," NUMS7 ",\"metadata\":{\"L\":[]}}");
	item_refused("{" K7 "," MSG7 "," NUMS7 ",\"metadata\":{\"M\":{\"other\":{\"S\":\"x\"}}}}");
	item_refused("{" K7 "," MSG7 "," NUMS7
	             ",\"metadata\":{\"M\":{\"timing\":{\"M\":{\"creation\":{\"N\":\"1.5\"}}}}}}");
	item_refused("{" K7 "," MSG7 "," NUMS7 ",\"metadata\":{\"M\":{\"aux\":{\"L\":[]}}}}");
	item_refused("{" K7 "," MSG7 "," NUMS7
	             ",\"metadata\":{\"M\":{\"aux\":{\"M\":{\"a\":{\"Q\":1}}}}}}");
	item_refused("{" K7 "," MSG7 "," NUMS7
	             ",\"metadata\":{\"M\":{\"attribute\":{\"L\":[{\"BOOL\":true}]}}}}");
	/* a summary item without the ids it summarizes */
	item_refused(
	    "{\"conversation\":{\"S\":\"c\"},\"sk\":{\"S\":\"" ID_S "\"},\"id\":{\"S\":\"" ID_S
	    "\"},\"message\":{\"M\":{\"role\":{\"S\":\"summary\"},\"contents\":{\"L\":[]}}}," NUMS7
	    "}");
	/* unknown top-level attributes (a TTL, another writer's) are ignored */
	item = J("{" K7 "," MSG7 "," NUMS7 ",\"expires\":{\"N\":\"1\"},\"other\":{\"B\":\"\"}}");
	CHECK(ddbitem_to_map(item, NULL, &map, NULL, NULL, NULL) == ERR_OK);
	json_decref(map);
	json_decref(item);
}

/* Replaces every node of the worked item in turn with junk (and drops every member): the
 * reader must answer ERR_OK with a map the writer accepts, or ERR_BAD_REQUEST; never
 * crash. */
static int mutations, mutations_refused;

static void try_item(const json_t *root)
{
	json_t *map = NULL, *again = NULL;
	const char *conv = NULL;
	enum error_code rc = ddbitem_to_map(root, &conv, &map, NULL, NULL, NULL);
	mutations++;
	CHECK(rc == ERR_OK || rc == ERR_BAD_REQUEST);
	if (rc == ERR_OK) {
		CHECK(map && conv);
		CHECK(ddbitem_from_map(conv, map, 1, 0, 0, &again, NULL) == ERR_OK);
	} else {
		CHECK(!map);
		mutations_refused++;
	}
	json_decref(map);
	json_decref(again);
}

static void mutate(json_t *root, json_t *node)
{
	static const char *const junk[] = {
	    "null",          "1",          "\"x\"",     "[]", "{}", "{\"S\":\"x\"}",
	    "{\"N\":\"1\"}", "{\"L\":[]}", "{\"M\":{}}"};
	const char *key;
	json_t *val;
	size_t i;
	if (json_is_object(node)) {
		/* keys copied first: the loop below changes the object */
		size_t n = json_object_size(node), k = 0;
		char **keys = calloc(n ? n : 1, sizeof(*keys));
		json_object_foreach(node, key, val) keys[k++] = strdup(key);
		for (k = 0; k < n; k++) {
			json_t *saved = json_incref(json_object_get(node, keys[k])), *copy;
			for (size_t j = 0; j < sizeof(junk) / sizeof(junk[0]); j++) {
				json_object_set_new(node, keys[k], J(junk[j]));
				try_item(root);
			}
			json_object_set(node, keys[k], saved);
			/* drop the member, then put every member back in its order */
			copy = json_copy(node);
			json_object_del(node, keys[k]);
			try_item(root);
			json_object_clear(node);
			json_object_update(node, copy);
			json_decref(copy);
			mutate(root, saved);
			json_decref(saved);
			free(keys[k]);
		}
		free(keys);
	} else if (json_is_array(node)) {
		json_array_foreach(node, i, val)
		{
			json_t *saved = json_incref(val);
			for (size_t j = 0; j < sizeof(junk) / sizeof(junk[0]); j++) {
				json_array_set_new(node, i, J(junk[j]));
				try_item(root);
			}
			json_array_set(node, i, saved);
			mutate(root, saved);
			json_decref(saved);
		}
	}
}

static void test_mutations(void)
{
	json_t *item = J(ITEM_7);
	mutate(item, item);
	CHECK_TEXT(item, ITEM_7); /* restored after all mutations */
	fprintf(stderr, "ddbitem: %d mutated items read, %d refused\n", mutations,
	        mutations_refused);
	CHECK(mutations > 250 && mutations_refused > 200);
	json_decref(item);
}

/* ---- requests and answers ---- */

static void batch_parse_refused(const char *body)
{
	json_t *un = NULL;
	struct error e = {0};
	CHECK(ddbitem_batch_write_parse(body, body ? strlen(body) : 0, "convod", &un, &e) ==
	      ERR_BAD_REQUEST);
	CHECK(un == NULL && e.message[0]);
}

static void test_batch_write(void)
{
	json_t *map = J(MAP_7), *sum = J(MAP_SUMMARY), *items[DDBITEM_BATCH_MAX + 1];
	json_t *body = NULL, *un = NULL;
	struct error e;
	char *text;
	const char *conv, *sk;

	CHECK(ddbitem_from_map("conv-1", map, 2, 1744815823100, 0, &items[0], &e) == ERR_OK);
	CHECK(ddbitem_from_map("conv-1", sum, 1, 1744815824000, 0, &items[1], &e) == ERR_OK);
	CHECK(ddbitem_batch_write_request("convod", items, 2, &body, &e) == ERR_OK);
	text = json_dumps(items[1], JSON_COMPACT);
	{
		char expected[4096];
		snprintf(expected, sizeof(expected),
		         "{\"RequestItems\":{\"convod\":[{\"PutRequest\":{\"Item\":%s}},"
		         "{\"PutRequest\":{\"Item\":%s}}]}}",
		         ITEM_7, text ? text : "");
		CHECK_TEXT(body, expected);
	}
	free(text);
	json_decref(body);
	body = NULL;

	CHECK(ddbitem_key(items[1], &conv, &sk) == 0);
	CHECK_STR(conv, "conv-1");
	CHECK_STR(sk, ID_C "~" ID_S);

	/* refusals: counts, duplicates, bad table, keyless items */
	CHECK(ddbitem_batch_write_request("convod", items, 0, &body, &e) == ERR_BAD_REQUEST);
	for (int i = 2; i < DDBITEM_BATCH_MAX + 1; i++)
		items[i] = items[i % 2];
	CHECK(ddbitem_batch_write_request("convod", items, DDBITEM_BATCH_MAX + 1, &body, &e) ==
	      ERR_BAD_REQUEST);
	CHECK(ddbitem_batch_write_request("convod", items, 3, &body, &e) == ERR_BAD_REQUEST);
	CHECK(strstr(e.message, "same key") != NULL);
	CHECK(ddbitem_batch_write_request("no", items, 1, &body, &e) == ERR_BAD_REQUEST);
	CHECK(ddbitem_batch_write_request("bad table", items, 1, &body, &e) == ERR_BAD_REQUEST);
	CHECK(ddbitem_batch_write_request(NULL, items, 1, &body, &e) == ERR_BAD_REQUEST);
	{
		json_t *keyless = J("{\"id\":{\"S\":\"x\"}}");
		CHECK(ddbitem_batch_write_request("convod", &keyless, 1, &body, &e) ==
		      ERR_BAD_REQUEST);
		json_decref(keyless);
	}
	CHECK(body == NULL);

	/* answers */
	CHECK(ddbitem_batch_write_parse("{\"UnprocessedItems\":{}}", 23, "convod", &un, &e) ==
	      ERR_OK);
	CHECK(json_is_array(un) && json_array_size(un) == 0);
	json_decref(un);
	CHECK(ddbitem_batch_write_parse("{}", 2, "convod", &un, &e) == ERR_OK);
	CHECK(json_is_array(un) && json_array_size(un) == 0);
	json_decref(un);
	{
		char answer[4096];
		snprintf(answer, sizeof(answer),
		         "{\"UnprocessedItems\":{\"convod\":[{\"PutRequest\":{\"Item\":%s}}]},"
		         "\"ConsumedCapacity\":[{\"TableName\":\"convod\",\"CapacityUnits\":1.5}]}",
		         ITEM_7);
		CHECK(ddbitem_batch_write_parse(answer, strlen(answer), "convod", &un, &e) ==
		      ERR_OK);
		CHECK(json_array_size(un) == 1 && json_equal(json_array_get(un, 0), items[0]));
		json_decref(un);
		/* only the first len bytes count */
		CHECK(ddbitem_batch_write_parse(answer, strlen(answer) - 1, "convod", &un, &e) ==
		      ERR_BAD_REQUEST);
	}
	batch_parse_refused(NULL);
	batch_parse_refused("");
	batch_parse_refused("nope");
	batch_parse_refused("[]");
	batch_parse_refused("{\"UnprocessedItems\":[]}");
	batch_parse_refused("{\"UnprocessedItems\":{\"other\":[]}}");
	batch_parse_refused("{\"UnprocessedItems\":{\"convod\":{}}}");
	batch_parse_refused("{\"UnprocessedItems\":{\"convod\":[{\"DeleteRequest\":{}}]}}");
	batch_parse_refused("{\"UnprocessedItems\":{\"convod\":[{\"PutRequest\":{\"Item\":"
	                    "{\"x\":{\"S\":\"y\"}}}}]}}");
	batch_parse_refused("{\"UnprocessedItems\":{\"convod\":[{\"PutRequest\":{}}]}}");
	batch_parse_refused("{\"UnprocessedItems\":{\"convod\":[7]}}");
	batch_parse_refused("{\"UnprocessedItems\":{\"convod\":[]}");

	json_decref(items[0]);
	json_decref(items[1]);
	json_decref(map);
	json_decref(sum);
}

static void query_parse_refused(const char *body)
{
	json_t *items = NULL, *key = NULL;
	struct error e = {0};
	CHECK(ddbitem_query_parse(body, body ? strlen(body) : 0, &items, &key, &e) ==
	      ERR_BAD_REQUEST);
	CHECK(items == NULL && key == NULL && e.message[0]);
}

static void test_query(void)
{
	json_t *body = NULL, *items = NULL, *key = NULL, *start, *map = NULL;
	struct error e;
	char answer[4096];

	CHECK(ddbitem_query_request("convod", "conv-1", NULL, &body, &e) == ERR_OK);
	CHECK_TEXT(body, "{\"TableName\":\"convod\",\"KeyConditionExpression\":\"#c = :c\","
	                 "\"ExpressionAttributeNames\":{\"#c\":\"conversation\"},"
	                 "\"ExpressionAttributeValues\":{\":c\":{\"S\":\"conv-1\"}},"
	                 "\"ConsistentRead\":true}");
	json_decref(body);

	/* a first page with a LastEvaluatedKey, then the last page */
	snprintf(answer, sizeof(answer),
	         "{\"Count\":1,\"ScannedCount\":1,\"Items\":[%s],\"LastEvaluatedKey\":{"
	         "\"conversation\":{\"S\":\"conv-1\"},\"sk\":{\"S\":\"" ID_7 "\"}}}",
	         ITEM_7);
	CHECK(ddbitem_query_parse(answer, strlen(answer), &items, &key, &e) == ERR_OK);
	CHECK(json_array_size(items) == 1 && key);
	CHECK(ddbitem_to_map(json_array_get(items, 0), NULL, &map, NULL, NULL, &e) == ERR_OK);
	start = J(MAP_7);
	CHECK(map && json_equal(map, start));
	json_decref(start);
	json_decref(map);
	CHECK(ddbitem_query_request("convod", "conv-1", key, &body, &e) == ERR_OK);
	CHECK_TEXT(json_object_get(body, "ExclusiveStartKey"),
	           "{\"conversation\":{\"S\":\"conv-1\"},\"sk\":{\"S\":\"" ID_7 "\"}}");
	json_decref(body);
	/* a start key of another conversation, or not a key, is refused */
	CHECK(ddbitem_query_request("convod", "conv-2", key, &body, &e) == ERR_BAD_REQUEST);
	start = J("{\"conversation\":{\"S\":\"conv-1\"}}");
	CHECK(ddbitem_query_request("convod", "conv-1", start, &body, &e) == ERR_BAD_REQUEST);
	json_decref(start);
	CHECK(ddbitem_query_request("convod", "", NULL, &body, &e) == ERR_BAD_REQUEST);
	CHECK(ddbitem_query_request("x", "c", NULL, &body, &e) == ERR_BAD_REQUEST);
	json_decref(items);
	json_decref(key);

	CHECK(ddbitem_query_parse("{\"Items\":[],\"Count\":0}", 22, &items, &key, &e) == ERR_OK);
	CHECK(json_array_size(items) == 0 && key == NULL);
	json_decref(items);
	CHECK(ddbitem_query_parse("{\"Items\":[],\"LastEvaluatedKey\":null}", 36, &items, &key,
	                          &e) == ERR_OK);
	CHECK(items && key == NULL);
	json_decref(items);
	CHECK(ddbitem_query_parse(
	          "{\"Items\":[{\"conversation\":{\"S\":\"c\"},\"sk\":{\"S\":\"s\"}}]}", 53, &items,
	          &key, &e) == ERR_OK);
	/* its items are only checked for a key here; ddbitem_to_map reads the rest */
	CHECK(json_array_size(items) == 1);
	CHECK(ddbitem_to_map(json_array_get(items, 0), NULL, &map, NULL, NULL, &e) ==
	      ERR_BAD_REQUEST);
	json_decref(items);

	query_parse_refused(NULL);
	query_parse_refused("");
	query_parse_refused("{");
	query_parse_refused("[]");
	query_parse_refused("{}");
	query_parse_refused("{\"Items\":{}}");
	query_parse_refused("{\"Items\":[1]}");
	query_parse_refused("{\"Items\":[{}]}");
	query_parse_refused("{\"Items\":[{\"conversation\":{\"S\":\"c\"}}]}");
	query_parse_refused("{\"Items\":[],\"LastEvaluatedKey\":[]}");
	query_parse_refused("{\"Items\":[],\"LastEvaluatedKey\":{\"conversation\":{\"S\":\"c\"}}}");
	query_parse_refused("{\"Items\":[],\"LastEvaluatedKey\":{\"conversation\":{\"S\":\"c\"},"
	                    "\"sk\":{\"N\":\"1\"}}}");
	query_parse_refused("{\"Items\":[],\"LastEvaluatedKey\":{\"conversation\":{\"S\":\"c\"},"
	                    "\"sk\":{\"S\":\"s\"},\"x\":{\"S\":\"y\"}}}");
}

static void test_create_table(void)
{
	json_t *body = NULL;
	struct error e;
	CHECK(ddbitem_create_table_request("convod", &body, &e) == ERR_OK);
	CHECK_TEXT(body, "{\"TableName\":\"convod\",\"AttributeDefinitions\":[{\"AttributeName\":"
	                 "\"conversation\",\"AttributeType\":\"S\"},{\"AttributeName\":\"sk\","
	                 "\"AttributeType\":\"S\"}],\"KeySchema\":[{\"AttributeName\":"
	                 "\"conversation\",\"KeyType\":\"HASH\"},{\"AttributeName\":\"sk\","
	                 "\"KeyType\":\"RANGE\"}],\"BillingMode\":\"PAY_PER_REQUEST\"}");
	json_decref(body);
	body = NULL;
	CHECK(ddbitem_create_table_request("a/b", &body, &e) == ERR_BAD_REQUEST && body == NULL);
	CHECK(ddbitem_table_name_valid("my.table_1-x"));
	CHECK(!ddbitem_table_name_valid("ab"));
	CHECK(!ddbitem_table_name_valid("tablé"));
}

static void test_errors(void)
{
	char type[64], msg[256], tiny[8];
	const char *throttled = "{\"__type\":\"com.amazonaws.dynamodb.v20120810#"
	                        "ProvisionedThroughputExceededException\",\"message\":\"Rate "
	                        "exceeded\"}";
	const char *invalid = "{\"__type\":\"com.amazon.coral.validate#ValidationException\","
	                      "\"Message\":\"Item size has exceeded the maximum allowed size\"}";

	CHECK(ddbitem_error_parse(throttled, strlen(throttled), type, sizeof(type), msg,
	                          sizeof(msg)) == 0);
	CHECK_STR(type, "ProvisionedThroughputExceededException");
	CHECK_STR(msg, "Rate exceeded");
	CHECK(!ddbitem_error_permanent(type));
	CHECK(ddbitem_error_parse(invalid, strlen(invalid), type, sizeof(type), msg, sizeof(msg)) ==
	      0);
	CHECK_STR(type, "ValidationException");
	CHECK_STR(msg, "Item size has exceeded the maximum allowed size");
	CHECK(ddbitem_error_permanent(type));
	CHECK(ddbitem_error_parse(invalid, strlen(invalid), tiny, sizeof(tiny), NULL, 0) == 0);
	CHECK_STR(tiny, "Validat");
	CHECK(ddbitem_error_parse("{\"__type\":\"Plain\"}", 18, type, sizeof(type), msg,
	                          sizeof(msg)) == 0);
	CHECK_STR(type, "Plain");
	CHECK_STR(msg, "");
	CHECK(ddbitem_error_parse("<html>", 6, type, sizeof(type), msg, sizeof(msg)) == -EINVAL);
	CHECK(ddbitem_error_parse("{\"message\":\"x\"}", 15, type, sizeof(type), msg,
	                          sizeof(msg)) == -EINVAL);
	CHECK(ddbitem_error_parse(NULL, 0, type, sizeof(type), msg, sizeof(msg)) == -EINVAL);
	CHECK(!ddbitem_error_permanent("ThrottlingException"));
	CHECK(!ddbitem_error_permanent("ResourceNotFoundException"));
	CHECK(!ddbitem_error_permanent("InternalServerError"));
	CHECK(!ddbitem_error_permanent(NULL));
	CHECK(ddbitem_error_permanent("ItemCollectionSizeLimitExceededException"));
}

int main(void)
{
	test_attribute_values();
	test_absurd_nesting();
	test_sort_key();
	test_worked_item();
	test_from_map_refusals();
	test_limits();
	test_sizes();
	test_to_map_refusals();
	test_mutations();
	test_batch_write();
	test_query();
	test_create_table();
	test_errors();
	return test_done("ddbitem");
}
