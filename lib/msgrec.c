/* The record formats of msgrec.h. A packed map's record (schema 4), with varints of
 * buf_append_varint (updated_ms zigzagged: (v << 1) ^ (v >> 63)):
 *   'P'  varint conv_len, conv  u8 sk_len, sk  varint version  varint client_seen
 *   varint updated_ms  varint map_len, map
 * A JSON map's record (schema 3, still read), little-endian:
 *   'M'  u16 conv_len, conv  u8 sk_len, sk  u32 version  u32 client_seen  i64 updated_ms
 *   u32 map_len, map
 * Every length is checked against what is left when reading: rows come from a file that
 * may be damaged. */
#include "msgrec.h"

#include <errno.h>
#include <string.h>

#define MSGREC_KIND 'M'
#define MSGREC_PACKED 'P'
/* The longest record: kind, the varints at their longest, the three strings. */
#define MSGREC_BYTES_MAX                                                                           \
	((size_t)1 + 3 + MSGREC_CONV_MAX + 1 + MSGREC_SK_MAX + 5 + 5 + 10 + 5 + UINT32_MAX)
#define MSGREC_FIXED (1 + 2 + 1 + 4 + 4 + 8 + 4) /* everything but the three strings */

static char *put_le(char *p, uint64_t v, int bytes)
{
	for (int i = 0; i < bytes; i++)
		*p++ = (char)(v >> (8 * i));
	return p;
}

static uint64_t get_le(const unsigned char *p, int bytes)
{
	uint64_t v = 0;
	for (int i = bytes - 1; i >= 0; i--)
		v = (v << 8) | p[i];
	return v;
}

static uint64_t zigzag(int64_t v)
{
	return ((uint64_t)v << 1) ^ (uint64_t)(v < 0 ? -1 : 0);
}

static int64_t unzigzag(uint64_t u)
{
	return (int64_t)(u >> 1) ^ -(int64_t)(u & 1);
}

static int append_packed(struct buf *b, const struct msgrec *r)
{
	char head[1 + 10], tail[1 + 4 * 10];
	size_t nh = 1, nt = 0;

	head[0] = MSGREC_PACKED;
	nh += buf_varint(head + 1, r->conv_len);
	tail[nt++] = (char)r->sk_len;
	nt += buf_varint(tail + nt, r->version);
	nt += buf_varint(tail + nt, r->client_seen);
	nt += buf_varint(tail + nt, zigzag(r->updated_ms));
	nt += buf_varint(tail + nt, r->map_len);
	if (buf_reserve(b, nh + r->conv_len + nt + r->sk_len + r->map_len) < 0)
		return -ENOMEM;
	/* The sk goes between its length and the version. */
	buf_append(b, head, nh);
	buf_append(b, r->conv, r->conv_len);
	buf_append(b, tail, 1);
	buf_append(b, r->sk, r->sk_len);
	buf_append(b, tail + 1, nt - 1);
	buf_append(b, r->map, r->map_len);
	return 0;
}

int msgrec_append(struct buf *b, const struct msgrec *r)
{
	size_t n;
	char *p;

	if (r->conv_len > MSGREC_CONV_MAX || r->sk_len == 0 || r->sk_len > MSGREC_SK_MAX ||
	    r->map_len > UINT32_MAX)
		return -EINVAL;
	if (r->packed)
		return append_packed(b, r);
	n = MSGREC_FIXED + r->conv_len + r->sk_len + r->map_len;
	if (buf_reserve(b, n) < 0)
		return -ENOMEM;
	p = b->data + b->len;
	*p++ = MSGREC_KIND;
	p = put_le(p, r->conv_len, 2);
	if (r->conv_len)
		memcpy(p, r->conv, r->conv_len);
	p += r->conv_len;
	*p++ = (char)r->sk_len;
	memcpy(p, r->sk, r->sk_len);
	p += r->sk_len;
	p = put_le(p, r->version, 4);
	p = put_le(p, r->client_seen, 4);
	p = put_le(p, (uint64_t)r->updated_ms, 8);
	p = put_le(p, r->map_len, 4);
	if (r->map_len)
		memcpy(p, r->map, r->map_len);
	b->len += n;
	return 0;
}

/* A varint of at most max at *p, before end. */
static bool get(const char **p, const char *end, uint64_t max, uint64_t *v)
{
	return buf_get_varint(p, end, v) == 0 && *v <= max;
}

static int next_packed(const char *data, size_t len, size_t *pos, struct msgrec *r)
{
	/* No record is longer: a caller that knows its record is whole may pass a len that
	 * runs to the end of the address space, and data + len must not overflow. */
	size_t left = len - *pos < MSGREC_BYTES_MAX ? len - *pos : MSGREC_BYTES_MAX;
	const char *p = data + *pos + 1, *end = data + *pos + left;
	uint64_t v, version, seen, updated;

	if (!get(&p, end, MSGREC_CONV_MAX, &v) || (size_t)(end - p) < v + 1)
		return -EINVAL;
	r->conv = p;
	r->conv_len = (size_t)v;
	p += v;
	r->sk_len = (unsigned char)*p++;
	if (r->sk_len == 0 || (size_t)(end - p) < r->sk_len)
		return -EINVAL;
	r->sk = p;
	p += r->sk_len;
	if (!get(&p, end, UINT32_MAX, &version) || !get(&p, end, UINT32_MAX, &seen) ||
	    !get(&p, end, UINT64_MAX, &updated) || !get(&p, end, UINT32_MAX, &v) ||
	    (size_t)(end - p) < v)
		return -EINVAL;
	r->version = (uint32_t)version;
	r->client_seen = (uint32_t)seen;
	r->updated_ms = unzigzag(updated);
	r->map = p;
	r->map_len = (size_t)v;
	r->packed = true;
	*pos = (size_t)(p + v - data);
	return 1;
}

int msgrec_next(const char *data, size_t len, size_t *pos, struct msgrec *r)
{
	const unsigned char *p = (const unsigned char *)data + *pos;
	size_t left = len - *pos, need;

	if (*pos >= len)
		return 0;
	if (p[0] == MSGREC_PACKED)
		return next_packed(data, len, pos, r);
	/* Kind and conversation length, then each part once its length is known. */
	if (left < 3 || p[0] != MSGREC_KIND)
		return -EINVAL;
	r->conv_len = (size_t)get_le(p + 1, 2);
	need = 3 + r->conv_len + 1;
	if (left < need)
		return -EINVAL;
	r->conv = (const char *)p + 3;
	r->sk_len = p[3 + r->conv_len];
	r->sk = (const char *)p + need;
	need += r->sk_len + 4 + 4 + 8 + 4;
	if (r->sk_len == 0 || left < need)
		return -EINVAL;
	{
		const unsigned char *q = (const unsigned char *)r->sk + r->sk_len;
		r->version = (uint32_t)get_le(q, 4);
		r->client_seen = (uint32_t)get_le(q + 4, 4);
		r->updated_ms = (int64_t)get_le(q + 8, 8);
		r->map_len = (size_t)get_le(q + 16, 4);
		r->map = (const char *)q + 20;
	}
	if (left - need < r->map_len)
		return -EINVAL;
	r->packed = false;
	*pos += need + r->map_len;
	return 1;
}
