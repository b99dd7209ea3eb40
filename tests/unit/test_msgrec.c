/* Unit tests for lib/msgrec, for packed and JSON records alike: records round-trip with every
 * field at its limits, back to back and mixed; limits are refused; and reading never runs
 * past the bytes it is given, whatever they are (every cut and every byte flip of a valid
 * string is read without a crash, and ends in -EINVAL or in records inside the string). */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "msgrec.h"
#include "test.h"

static bool same(const struct msgrec *a, const struct msgrec *b)
{
	return a->conv_len == b->conv_len && memcmp(a->conv, b->conv, a->conv_len) == 0 &&
	       a->sk_len == b->sk_len && memcmp(a->sk, b->sk, a->sk_len) == 0 &&
	       a->version == b->version && a->client_seen == b->client_seen &&
	       a->updated_ms == b->updated_ms && a->map_len == b->map_len &&
	       memcmp(a->map, b->map, a->map_len) == 0 && a->packed == b->packed;
}

static void test_round_trip(void)
{
	static char conv[MSGREC_CONV_MAX], sk[MSGREC_SK_MAX];
	struct msgrec in[8] = {
	    {"c1", 2, "01ARZ3NDEKTSV4RRFFQ69G5FAV", 26, 1, 0, 1744815823057, "{\"id\":1}", 8,
	     false},
	    {"", 0, "k", 1, UINT32_MAX, UINT32_MAX, INT64_MIN, "", 0, false},
	    {conv, sizeof(conv), sk, sizeof(sk), 7, 3, INT64_MAX, "\0x\0", 3, false},
	    {"n\0ul", 4, "a~b", 3, 2, 1, -1, "{}", 2, false},
	};
	struct buf b = {NULL, 0, 0};
	struct msgrec r;
	size_t pos = 0, n = 0;

	memset(conv, 'c', sizeof(conv));
	memset(sk, 's', sizeof(sk));
	/* The same four packed, interleaved with the JSON ones. */
	for (int i = 3; i >= 0; i--) {
		in[2 * i] = in[i];
		in[2 * i + 1] = in[i];
		in[2 * i + 1].packed = true;
	}
	for (int i = 0; i < 8; i++)
		CHECK(msgrec_append(&b, &in[i]) == 0);
	while (msgrec_next(b.data, b.len, &pos, &r) == 1) {
		CHECK(n < 8 && same(&r, &in[n]));
		n++;
	}
	CHECK(n == 8 && pos == b.len);
	CHECK(msgrec_next(b.data, b.len, &pos, &r) == 0);
	buf_free(&b);
}

static void test_limits(void)
{
	static char big[MSGREC_CONV_MAX + 1];
	struct buf b = {NULL, 0, 0};

	for (int packed = 0; packed <= 1; packed++) {
		struct msgrec r = {big, sizeof(big), "k", 1, 1, 0, 0, "", 0, packed};
		CHECK(msgrec_append(&b, &r) == -EINVAL);
		r.conv_len = 1;
		r.sk_len = 0;
		CHECK(msgrec_append(&b, &r) == -EINVAL);
		r.sk = big;
		r.sk_len = MSGREC_SK_MAX + 1;
		CHECK(msgrec_append(&b, &r) == -EINVAL);
		CHECK(b.len == 0);
	}
	/* A packed record's header with a varint of a 17-bit conversation length. */
	CHECK(buf_append(&b, "P\x80\x80\x04", 4) == 0);
	{
		size_t pos = 0;
		struct msgrec r;
		CHECK(msgrec_next(b.data, b.len, &pos, &r) == -EINVAL && pos == 0);
	}
	buf_free(&b);
}

/* Reads what it can; returns -EINVAL or the records read. Each must lie inside data. */
static long read_all(const char *data, size_t len)
{
	struct msgrec r;
	size_t pos = 0;
	long n = 0;
	int got;

	while ((got = msgrec_next(data, len, &pos, &r)) == 1) {
		CHECK(r.conv >= data && r.conv + r.conv_len <= data + len);
		CHECK(r.sk >= data && r.sk + r.sk_len <= data + len);
		CHECK(r.map >= data && r.map + r.map_len <= data + len);
		CHECK(pos <= len);
		n++;
	}
	return got < 0 ? -EINVAL : n;
}

static void test_damage(bool packed)
{
	struct msgrec in = {.conv = "conv", .conv_len = 4, .sk = "01ARZ3NDEKTSV4RRFFQ69G5FAV",
	                    .sk_len = 26, .version = 3, .client_seen = 2, .updated_ms = 99,
	                    .map = "{\"m\":1}", .map_len = 7, .packed = packed};
	struct buf b = {NULL, 0, 0};
	size_t whole;
	long cuts_refused = 0;

	CHECK(msgrec_append(&b, &in) == 0 && msgrec_append(&b, &in) == 0);
	whole = b.len;
	/* Every cut: whole records before it, then -EINVAL (or the end, at a boundary). */
	for (size_t cut = 0; cut <= whole; cut++) {
		char *copy = malloc(cut ? cut : 1);
		memcpy(copy, b.data, cut);
		long n = read_all(copy, cut);
		if (cut == 0 || cut == whole / 2 || cut == whole)
			CHECK(n == (long)(cut * 2 / whole));
		else
			cuts_refused += n == -EINVAL;
		free(copy);
	}
	CHECK(cuts_refused == (long)whole - 2);
	/* Every byte flipped to every value: read within bounds, no crash. */
	for (size_t at = 0; at < whole; at++) {
		for (int v = 0; v < 256; v++) {
			char *copy = malloc(whole);
			memcpy(copy, b.data, whole);
			copy[at] = (char)v;
			read_all(copy, whole);
			free(copy);
		}
	}
	buf_free(&b);
}

int main(void)
{
	test_round_trip();
	test_limits();
	test_damage(false);
	test_damage(true);
	return test_done("msgrec");
}
