/* A growable byte buffer, and a compact JSON writer into it (jansson values, or strings and
 * integers one at a time). */
#ifndef CONVOD_BUF_H
#define CONVOD_BUF_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

struct buf {
	char *data; /* owned */
	size_t len, cap;
};

/* The slow paths of buf_reserve and buf_append (growing the buffer). */
int buf_grow(struct buf *b, size_t n);
int buf_append_slow(struct buf *b, const void *p, size_t n);

/* Makes room for n more bytes. 0 or -ENOMEM. */
static inline int buf_reserve(struct buf *b, size_t n)
{
	return b->cap - b->len >= n ? 0 : buf_grow(b, n);
}

/* Appends n bytes. 0 or -ENOMEM (b unchanged). Inline: the JSON writers append a few
 * bytes at a time. */
static inline int buf_append(struct buf *b, const void *p, size_t n)
{
	if (n && b->cap - b->len >= n) {
		memcpy(b->data + b->len, p, n);
		b->len += n;
		return 0;
	}
	return buf_append_slow(b, p, n);
}
/* Appends the compact JSON text of j (any value). 0, -ENOMEM or -EINVAL. */
int buf_append_json(struct buf *b, const json_t *j);
/* Appends s[0..n) as a JSON string (as jansson escapes it). 0, -ENOMEM, or -EINVAL for
 * invalid UTF-8 (b unchanged only on -ENOMEM before writing; callers reset len). */
int buf_append_jstring(struct buf *b, const char *s, size_t n);
/* The length of the multi-byte UTF-8 sequence at s[0..n), 0 when it is invalid or cut
 * (overlong forms, surrogates and code points above U+10FFFF included; an ASCII byte is
 * not a multi-byte sequence and gives 0 too). */
size_t buf_utf8_len(const char *s, size_t n);
/* Whether s[0..n) is valid UTF-8 (NUL bytes allowed). Allocates nothing. */
bool buf_utf8_valid(const char *s, size_t n);
/* Appends v in decimal. 0 or -ENOMEM. */
int buf_append_jint(struct buf *b, int64_t v);
/* Writes v in decimal to out (at most 20 bytes: INT64_MIN is "-9223372036854775808");
 * returns its length. */
size_t buf_jint(char out[20], int64_t v);
/* Appends v as a varint: 7 bits per byte, low bits first, the high bit set on every byte
 * but the last (1 to 10 bytes). 0 or -ENOMEM. */
int buf_append_varint(struct buf *b, uint64_t v);
/* Writes that varint to out; returns its length. */
size_t buf_varint(char out[10], uint64_t v);
/* Reads a varint of buf_append_varint at *p (before end) and moves *p past it. 0, or
 * -EINVAL when it is cut by end or longer than 10 bytes or 64 bits (*p unchanged). */
int buf_get_varint(const char **p, const char *end, uint64_t *v);
/* Drops the first n bytes (n <= len), moving the rest to the front. The allocation is
 * kept for reuse, unless it is over 1 MiB and nothing is left. */
void buf_consume(struct buf *b, size_t n);
/* Hands the bytes to the caller (who frees them) and empties b. */
char *buf_steal(struct buf *b, size_t *len);
void buf_free(struct buf *b);

#endif
