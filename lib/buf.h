/* A growable byte buffer for response lines. */
#ifndef CONVOD_BUF_H
#define CONVOD_BUF_H

#include <jansson.h>
#include <stddef.h>

struct buf {
	char *data; /* owned */
	size_t len, cap;
};

/* Makes room for n more bytes. 0 or -ENOMEM. */
int buf_reserve(struct buf *b, size_t n);
/* Appends n bytes. 0 or -ENOMEM (b unchanged). */
int buf_append(struct buf *b, const void *p, size_t n);
/* Appends the compact JSON text of j (any value). 0, -ENOMEM or -EINVAL. */
int buf_append_json(struct buf *b, const json_t *j);
/* Hands the bytes to the caller (who frees them) and empties b. */
char *buf_steal(struct buf *b, size_t *len);
void buf_free(struct buf *b);

#endif
