/* Newline framing with a line-length limit. */
#include "framer.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"

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

/* The bytes of a UTF-8 character led by c that may be white space (ops_text_blank): 2 or 3,
 * else 1 (ASCII, or a byte no white space starts with). */
static size_t blank_seq_len(unsigned char c)
{
	return c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : 1;
}

/* Takes n more bytes of an over-long line into f->blank: whether the whole line, judged at
 * once, would be blank. A character split between two reads is judged once whole. */
static void discard_judge(struct framer *f, const unsigned char *p, size_t n)
{
	if (f->carry_len && f->blank) {
		size_t need = blank_seq_len(f->carry[0]) - f->carry_len, take = n < need ? n : need;
		unsigned char ch[3];
		memcpy(ch, f->carry, f->carry_len);
		memcpy(ch + f->carry_len, p, take);
		p += take;
		n -= take;
		if (take < need) {
			memcpy(f->carry, ch, f->carry_len + take);
			f->carry_len = (unsigned char)(f->carry_len + take);
			return;
		}
		f->blank = ops_text_blank((const char *)ch, need + f->carry_len);
		f->carry_len = 0;
	}
	if (!f->blank || n == 0)
		return;
	/* A character the read ends inside of waits for the next read. */
	size_t keep = 0;
	if (blank_seq_len(p[n - 1]) > 1)
		keep = 1;
	else if (n >= 2 && blank_seq_len(p[n - 2]) == 3 && (p[n - 1] & 0xC0) == 0x80)
		keep = 2;
	f->blank = ops_text_blank((const char *)p, n - keep);
	memcpy(f->carry, p + n - keep, keep);
	f->carry_len = (unsigned char)keep;
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
			bool blank;
			discard_judge(f, (const unsigned char *)base,
			              nl ? (size_t)(nl - base) : avail);
			if (!nl) {
				/* Drop everything: nothing of an over-long line is kept. */
				f->start = f->len = f->scanned = 0;
				return FRAMER_NONE;
			}
			blank = f->blank && !f->carry_len; /* a character cut short is not blank */
			f->start += (size_t)(nl - base) + 1;
			f->scanned = 0;
			f->discarding = false;
			if (!blank)
				return FRAMER_TOO_LARGE;
			continue;
		}
		if (!nl) {
			f->scanned = avail;
			/* An unfinished line may still end in "\r\n": allow one byte for the '\r'. */
			if (avail > f->max_line + 1 ||
			    (avail == f->max_line + 1 && base[avail - 1] != '\r')) {
				f->discarding = true;
				f->blank = true;
				f->carry_len = 0;
				discard_judge(f, (const unsigned char *)base, avail);
				f->start = f->len = f->scanned = 0;
			}
			return FRAMER_NONE;
		}
		n = (size_t)(nl - base);
		f->start += n + 1;
		f->scanned = 0;
		if (n > 0 && base[n - 1] == '\r')
			n--;
		if (n > f->max_line) {
			if (ops_text_blank(base, n))
				continue;
			return FRAMER_TOO_LARGE;
		}
		*line = base;
		*len = n;
		return FRAMER_LINE;
	}
}
