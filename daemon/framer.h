/* Newline framing of a byte stream with a line-length limit: bytes are read straight into
 * the framer's buffer, complete lines come out borrowed. Memory stays under the limit
 * plus one read: an over-long line is reported once and its bytes are discarded up to the
 * next newline. */
#ifndef CONVOD_FRAMER_H
#define CONVOD_FRAMER_H

#include <stdbool.h>
#include <stddef.h>

struct framer {
	char *data;       /* owned buffer */
	size_t cap;
	size_t start;     /* first byte not yet consumed */
	size_t len;       /* bytes in data */
	size_t scanned;   /* bytes from start already known to hold no '\n' */
	size_t max_line;  /* limit on a line's bytes, terminator ("\n" or "\r\n") excluded */
	bool discarding;  /* inside an over-long line: drop bytes up to the next '\n' */
};

enum framer_event {
	FRAMER_NONE = 0,  /* no complete line buffered */
	FRAMER_LINE,      /* *line / *len hold one line without its terminator */
	FRAMER_TOO_LARGE, /* a line went over max_line; its bytes are being discarded */
};

void framer_init(struct framer *f, size_t max_line);
void framer_free(struct framer *f); /* frees the buffer; f can be initialised again */

/* Space to read into: at least `want` bytes at *buf. 0 or -ENOMEM. The pointer stays valid
 * until the next framer call. */
int framer_reserve(struct framer *f, size_t want, char **buf, size_t *size);
/* Records that n bytes were written at the reserved space. */
void framer_commit(struct framer *f, size_t n);

/* The next event. A FRAMER_LINE's bytes are borrowed until the next framer call. */
enum framer_event framer_next(struct framer *f, const char **line, size_t *len);

/* Bytes buffered and not yet returned (an unfinished line, or lines not yet taken). */
size_t framer_pending(const struct framer *f);

#endif
