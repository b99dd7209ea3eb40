/* Growable byte buffer with JSON appends straight into it: a compact JSON writer for
 * jansson values, several times faster than json_dumpb (no callbacks, no printf for
 * integers), writing the same text. */
#include "buf.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BUF_KEEP_MAX (1024 * 1024) /* buf_consume frees emptied buffers above this */

int buf_grow(struct buf *b, size_t n)
{
	size_t ncap;
	char *p;

	if (b->cap - b->len >= n)
		return 0;
	ncap = b->cap ? b->cap : 4096;
	while (ncap - b->len < n) {
		if (ncap > SIZE_MAX / 2)
			return -ENOMEM;
		ncap *= 2;
	}
	p = realloc(b->data, ncap);
	if (!p)
		return -ENOMEM;
	b->data = p;
	b->cap = ncap;
	return 0;
}

int buf_append_slow(struct buf *b, const void *p, size_t n)
{
	if (n == 0)
		return 0; /* memcpy must not see an empty buffer's NULL */
	if (buf_reserve(b, n) < 0)
		return -ENOMEM;
	memcpy(b->data + b->len, p, n);
	b->len += n;
	return 0;
}

size_t buf_utf8_len(const char *str, size_t n)
{
	const unsigned char *p = (const unsigned char *)str;
	size_t k = *p < 0xc2 ? 0 : *p < 0xe0 ? 2 : *p < 0xf0 ? 3 : *p < 0xf5 ? 4 : 0;

	if (k == 0 || k > n)
		return 0;
	for (size_t i = 1; i < k; i++)
		if ((p[i] & 0xc0) != 0x80)
			return 0;
	if (k == 3 && ((*p == 0xe0 && p[1] < 0xa0) || (*p == 0xed && p[1] >= 0xa0)))
		return 0;
	if (k == 4 && ((*p == 0xf0 && p[1] < 0x90) || (*p == 0xf4 && p[1] >= 0x90)))
		return 0;
	return k;
}

bool buf_utf8_valid(const char *s, size_t n)
{
	for (size_t i = 0; i < n;) {
		size_t k = (unsigned char)s[i] < 0x80 ? 1 : buf_utf8_len(s + i, n - i);
		if (!k)
			return false;
		i += k;
	}
	return true;
}

/* Appends s as a JSON string: quotes, backslashes and control characters escaped, the
 * rest (valid UTF-8) as is. -EINVAL for invalid UTF-8, -ENOMEM. */
int buf_append_jstring(struct buf *b, const char *str, size_t n)
{
	static const char hex[] = "0123456789ABCDEF";
	const unsigned char *s = (const unsigned char *)str;
	size_t i = 0, run = 0;
	char *o;

	/* Worst case: every byte becomes \u00XX. */
	if (n > (SIZE_MAX - 2) / 6 || buf_reserve(b, 6 * n + 2) < 0)
		return -ENOMEM;
	o = b->data + b->len;
	*o++ = '"';
	while (i < n) {
		/* Eight plain bytes at a time: none below 0x20, no '"', no '\\', none >= 0x80. */
		while (i + 8 <= n) {
			uint64_t w;
			memcpy(&w, s + i, 8);
			const uint64_t ones = 0x0101010101010101ull, highs = 0x8080808080808080ull;
			uint64_t special = ((w - ones * 0x20) | ((w ^ (ones * '"')) - ones) |
			                    ((w ^ (ones * '\\')) - ones) | w) &
			                   highs;
			/* (w ^ c) - ones has the high bit set in a byte that was c (or, by a borrow,
			 * near one); w - 0x20.. in a byte below 0x20; w itself in a byte >= 0x80.
			 * False alarms only send those 8 bytes down the byte loop. */
			if (special)
				break;
			i += 8;
			run += 8;
		}
		if (i >= n)
			break;
		unsigned char ch = s[i];
		if (ch >= 0x20 && ch != '"' && ch != '\\' && ch < 0x80) {
			i++;
			run++;
			continue;
		}
		memcpy(o, s + i - run, run);
		o += run;
		run = 0;
		if (ch >= 0x80) {
			size_t k = buf_utf8_len((const char *)s + i, n - i);
			if (k == 0)
				return -EINVAL;
			memcpy(o, s + i, k);
			o += k;
			i += k;
			continue;
		}
		*o++ = '\\';
		switch (ch) {
		case '"': *o++ = '"'; break;
		case '\\': *o++ = '\\'; break;
		case '\b': *o++ = 'b'; break;
		case '\f': *o++ = 'f'; break;
		case '\n': *o++ = 'n'; break;
		case '\r': *o++ = 'r'; break;
		case '\t': *o++ = 't'; break;
		default:
			*o++ = 'u';
			*o++ = '0';
			*o++ = '0';
			*o++ = hex[ch >> 4];
			*o++ = hex[ch & 15];
		}
		i++;
	}
	memcpy(o, s + i - run, run);
	o += run;
	*o++ = '"';
	b->len = (size_t)(o - b->data);
	return 0;
}

size_t buf_jint(char out[20], int64_t v)
{
	static const char pairs[] = "00010203040506070809101112131415161718192021222324252627282930"
	                            "31323334353637383940414243444546474849505152535455565758596061"
	                            "62636465666768697071727374757677787980818283848586878889909192"
	                            "93949596979899";
	static const uint64_t pow10[20] = {1ull,
	                                   10ull,
	                                   100ull,
	                                   1000ull,
	                                   10000ull,
	                                   100000ull,
	                                   1000000ull,
	                                   10000000ull,
	                                   100000000ull,
	                                   1000000000ull,
	                                   10000000000ull,
	                                   100000000000ull,
	                                   1000000000000ull,
	                                   10000000000000ull,
	                                   100000000000000ull,
	                                   1000000000000000ull,
	                                   10000000000000000ull,
	                                   100000000000000000ull,
	                                   1000000000000000000ull,
	                                   10000000000000000000ull};
	/* Negate in unsigned arithmetic: -INT64_MIN does not fit. */
	uint64_t u = v < 0 ? 0ull - (uint64_t)v : (uint64_t)v;
	size_t neg = v < 0, n = (size_t)(((64 - __builtin_clzll(u | 1)) * 1233) >> 12);
	char *p;
	uint32_t w;

	/* The digit count from the bit length (1233 / 4096 ~ log10 2), then the digits from
	 * the right, two a step, in 32 bits once the rest fits (a time in ms needs two 64-bit
	 * steps of its seven). */
	n += n < 20 && u >= pow10[n];
	n += n == 0;
	p = out + neg + n;
	for (; u > UINT32_MAX; u /= 100) {
		unsigned d = (unsigned)(u % 100) * 2;
		*--p = pairs[d + 1];
		*--p = pairs[d];
	}
	for (w = (uint32_t)u; w >= 100; w /= 100) {
		unsigned d = (w % 100) * 2;
		*--p = pairs[d + 1];
		*--p = pairs[d];
	}
	if (w >= 10) {
		*--p = pairs[w * 2 + 1];
		*--p = pairs[w * 2];
	} else {
		*--p = (char)('0' + w);
	}
	if (neg)
		out[0] = '-';
	return neg + n;
}

int buf_append_jint(struct buf *b, int64_t v)
{
	if (buf_reserve(b, 20) < 0)
		return -ENOMEM;
	b->len += buf_jint(b->data + b->len, v);
	return 0;
}

size_t buf_varint(char out[10], uint64_t v)
{
	size_t n = 0;

	while (v >= 0x80) {
		out[n++] = (char)(v | 0x80);
		v >>= 7;
	}
	out[n++] = (char)v;
	return n;
}

int buf_append_varint(struct buf *b, uint64_t v)
{
	char tmp[10];
	return buf_append(b, tmp, buf_varint(tmp, v));
}

int buf_get_varint(const char **p, const char *end, uint64_t *v)
{
	const unsigned char *q = (const unsigned char *)*p;
	uint64_t x = 0;

	for (int shift = 0; shift < 64 && q < (const unsigned char *)end; shift += 7) {
		uint64_t bits = *q & 0x7f;
		/* The tenth byte holds only the top bit. */
		if (shift == 63 && bits > 1)
			return -EINVAL;
		x |= bits << shift;
		if (!(*q++ & 0x80)) {
			*v = x;
			*p = (const char *)q;
			return 0;
		}
	}
	return -EINVAL;
}

/* As jansson writes reals: %.17g, with ".0" added when that reads as an integer and the
 * exponent without '+' or leading zeros. */
static int append_real(struct buf *b, double v)
{
	char tmp[40];
	int n = snprintf(tmp, sizeof(tmp), "%.17g", v);

	if (n <= 0 || (size_t)n >= sizeof(tmp) - 2)
		return -EINVAL;
	char *e = strchr(tmp, 'e');
	if (!e && !strchr(tmp, '.')) {
		tmp[n++] = '.';
		tmp[n++] = '0';
	} else if (e) {
		/* No '+' and no leading zeros in the exponent: 1e+17 is 1e17, 2e-05 is 2e-5. */
		char *w = e + 1, *r = e + 1;
		if (*r == '-')
			w++, r++;
		else if (*r == '+')
			r++;
		while (*r == '0' && r[1])
			r++;
		memmove(w, r, strlen(r) + 1);
		n = (int)strlen(tmp);
	}
	return buf_append(b, tmp, (size_t)n);
}

static int append_value(struct buf *b, const json_t *j)
{
	switch (json_typeof(j)) {
	case JSON_OBJECT: {
		const char *key;
		size_t klen;
		json_t *v;
		bool first = true;
		if (buf_append(b, "{", 1) < 0)
			return -ENOMEM;
		json_object_keylen_foreach((json_t *)j, key, klen, v)
		{
			int rc;
			if (!first && buf_append(b, ",", 1) < 0)
				return -ENOMEM;
			first = false;
			if ((rc = buf_append_jstring(b, key, klen)) < 0)
				return rc;
			if (buf_append(b, ":", 1) < 0)
				return -ENOMEM;
			if ((rc = append_value(b, v)) < 0)
				return rc;
		}
		return buf_append(b, "}", 1);
	}
	case JSON_ARRAY: {
		size_t n = json_array_size(j);
		if (buf_append(b, "[", 1) < 0)
			return -ENOMEM;
		for (size_t i = 0; i < n; i++) {
			int rc;
			if (i && buf_append(b, ",", 1) < 0)
				return -ENOMEM;
			if ((rc = append_value(b, json_array_get(j, i))) < 0)
				return rc;
		}
		return buf_append(b, "]", 1);
	}
	case JSON_STRING:
		return buf_append_jstring(b, json_string_value(j), json_string_length(j));
	case JSON_INTEGER:
		return buf_append_jint(b, json_integer_value(j));
	case JSON_REAL:
		return append_real(b, json_real_value(j));
	case JSON_TRUE:
		return buf_append(b, "true", 4);
	case JSON_FALSE:
		return buf_append(b, "false", 5);
	case JSON_NULL:
		return buf_append(b, "null", 4);
	}
	return -EINVAL;
}

int buf_append_json(struct buf *b, const json_t *j)
{
	size_t mark = b->len;
	int rc;

	if (!j)
		return -EINVAL;
	rc = append_value(b, j);
	if (rc < 0)
		b->len = mark;
	return rc;
}

void buf_consume(struct buf *b, size_t n)
{
	if (n >= b->len) {
		b->len = 0;
		if (b->cap > BUF_KEEP_MAX)
			buf_free(b);
		return;
	}
	memmove(b->data, b->data + n, b->len - n);
	b->len -= n;
}

char *buf_steal(struct buf *b, size_t *len)
{
	char *p = b->data;
	*len = b->len;
	b->data = NULL;
	b->len = b->cap = 0;
	return p;
}

void buf_free(struct buf *b)
{
	free(b->data);
	b->data = NULL;
	b->len = b->cap = 0;
}
