/* The record format of msgrec.h, little-endian:
 *   'M'  u16 conv_len, conv  u8 sk_len, sk  u32 version  u32 client_seen  i64 updated_ms
 *   u32 map_len, map
 * Every length is checked against what is left when reading: rows come from a file that
 * may be damaged. */
#include "msgrec.h"

#include <errno.h>
#include <string.h>

#define MSGREC_KIND 'M'
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

int msgrec_append(struct buf *b, const struct msgrec *r)
{
	size_t n;
	char *p;

	if (r->conv_len > MSGREC_CONV_MAX || r->sk_len == 0 || r->sk_len > MSGREC_SK_MAX ||
	    r->map_len > UINT32_MAX)
		return -EINVAL;
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

int msgrec_next(const char *data, size_t len, size_t *pos, struct msgrec *r)
{
	const unsigned char *p = (const unsigned char *)data + *pos;
	size_t left = len - *pos, need;

	if (*pos >= len)
		return 0;
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
	*pos += need + r->map_len;
	return 1;
}
