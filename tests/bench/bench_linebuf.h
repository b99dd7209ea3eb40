/* Input buffer that splits a byte stream into newline-terminated lines,
 * with a size limit; shared by the load generator and the JSON baseline. */
#ifndef BENCH_LINEBUF_H
#define BENCH_LINEBUF_H

#include <stdbool.h>
#include <stddef.h>

enum linebuf_next {
	LINEBUF_NEED_MORE = 0, /* no complete line buffered */
	LINEBUF_LINE = 1,      /* line and len hold one line, without its "\n" or "\r\n" */
	LINEBUF_TOO_LONG = 2,  /* a line went over max_line; its bytes are being dropped */
};

struct linebuf {
	char *data;
	size_t cap;
	size_t start; /* first byte not yet returned */
	size_t end;   /* one past the last byte received */
	size_t scan;  /* bytes from start known to hold no '\n' */
	size_t max_line;
	bool discarding; /* dropping the rest of an over-long line */
};

/* Sets up an empty buffer; lines longer than max_line bytes are refused. Free with
 * linebuf_free. */
void linebuf_init(struct linebuf *lb, size_t max_line);

/* Frees the buffer's memory (the struct itself is the caller's); accepts a zeroed struct. */
void linebuf_free(struct linebuf *lb);

/* Makes room for at least want bytes and returns the free area in area and len, borrowed until
 * the next call on lb. Returns 0 or -ENOMEM. */
int linebuf_reserve(struct linebuf *lb, size_t want, char **area, size_t *len);

/* Records that n bytes were written into the area given by linebuf_reserve. */
void linebuf_commit(struct linebuf *lb, size_t n);

/* Takes the next line. On LINEBUF_LINE, *line is borrowed until the next linebuf_reserve. */
enum linebuf_next linebuf_next(struct linebuf *lb, const char **line, size_t *len);

#endif
