/* Newline framing with a line-length limit. */
#include "framer.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define FRAMER_MIN_CAP 16384

void framer_init(struct framer *f, size_t max_line)
{
	memset(f, 0, sizeof(*f));
	f->max_line = max_line;
}

void framer_free(struct framer *f)
{
	free(f->data);
	f->data = NULL;
	f->cap = f->len = f->start = f->scanned = 0;
}

int framer_reserve(struct framer *f, size_t want, char **buf, size_t *size)
{
	if (f->start > 0 && (f->start == f->len || f->cap - f->len < want)) {
		/* Move the unconsumed tail to the front before growing. */
		memmove(f->data, f->data + f->start, f->len - f->start);
		f->len -= f->start;
		f->start = 0;
	}
	if (f->cap - f->len < want) {
		size_t ncap = f->cap ? f->cap : FRAMER_MIN_CAP;
		char *p;
		while (ncap - f->len < want)
			ncap *= 2;
		p = realloc(f->data, ncap);
		if (!p)
			return -ENOMEM;
		f->data = p;
		f->cap = ncap;
	}
	*buf = f->data + f->len;
	*size = f->cap - f->len;
	return 0;
}

void framer_commit(struct framer *f, size_t n)
{
	f->len += n;
}

size_t framer_pending(const struct framer *f)
{
	return f->len - f->start;
}

enum framer_event framer_next(struct framer *f, const char **line, size_t *len)
{
	for (;;) {
		char *base = f->data + f->start;
		size_t avail = f->len - f->start;
		char *nl;
		size_t n;

		if (avail == 0) {
			f->start = f->len = f->scanned = 0;
			return FRAMER_NONE;
		}
		nl = memchr(base + f->scanned, '\n', avail - f->scanned);
		if (f->discarding) {
			if (!nl) {
				/* Drop everything: nothing of an over-long line is kept. */
				f->start = f->len = f->scanned = 0;
				return FRAMER_NONE;
			}
			f->start += (size_t)(nl - base) + 1;
			f->scanned = 0;
			f->discarding = false;
			continue;
		}
		if (!nl) {
			f->scanned = avail;
			/* An unfinished line may still end in "\r\n": allow one byte for the '\r'. */
			if (avail > f->max_line + 1 ||
			    (avail == f->max_line + 1 && base[avail - 1] != '\r')) {
				f->discarding = true;
				f->start = f->len = f->scanned = 0;
				return FRAMER_TOO_LARGE;
			}
			return FRAMER_NONE;
		}
		n = (size_t)(nl - base);
		f->start += n + 1;
		f->scanned = 0;
		if (n > 0 && base[n - 1] == '\r')
			n--;
		if (n > f->max_line)
			return FRAMER_TOO_LARGE;
		*line = base;
		*len = n;
		return FRAMER_LINE;
	}
}
