/* Growable byte buffer with JSON appends straight into it. */
#include "buf.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int buf_reserve(struct buf *b, size_t n)
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

int buf_append(struct buf *b, const void *p, size_t n)
{
	if (n == 0)
		return 0; /* memcpy must not see an empty buffer's NULL */
	if (buf_reserve(b, n) < 0)
		return -ENOMEM;
	memcpy(b->data + b->len, p, n);
	b->len += n;
	return 0;
}

int buf_append_json(struct buf *b, const json_t *j)
{
	const size_t flags = JSON_COMPACT | JSON_ENCODE_ANY;
	size_t need;

	if (buf_reserve(b, 256) < 0)
		return -ENOMEM;
	need = json_dumpb(j, b->data + b->len, b->cap - b->len, flags);
	if (need == 0)
		return -EINVAL;
	if (need > b->cap - b->len) {
		if (buf_reserve(b, need) < 0)
			return -ENOMEM;
		need = json_dumpb(j, b->data + b->len, b->cap - b->len, flags);
		if (need == 0)
			return -EINVAL;
	}
	b->len += need;
	return 0;
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
