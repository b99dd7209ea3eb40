/* Newline framing of a byte stream with a line-length limit: bytes are read straight into
 * the framer's buffer, complete lines come out borrowed. Memory stays under the limit
 * plus one read: an over-long line's bytes are discarded as they come, and the line is
 * reported once its newline arrives, unless it was blank (white space only, as
 * ops_text_blank judges, which a blank line of any length is: ignored). An over-long line
 * the stream ends in before its newline is an unfinished request: never reported. */
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
	bool blank;       /* while discarding: the line's bytes so far are white space */
	unsigned char carry[2]; /* and the start of a character the last read split */
	unsigned char carry_len;
};

enum framer_event {
	FRAMER_NONE = 0,  /* no complete line buffered */
	FRAMER_LINE,      /* *line / *len hold one line without its terminator */
	FRAMER_TOO_LARGE, /* a line over max_line ended (not blank); its bytes were discarded */
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
