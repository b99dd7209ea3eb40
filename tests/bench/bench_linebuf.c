/* Line splitter over a growable buffer: the partial line it holds never exceeds the limit,
 * so the buffer stays below max_line plus one read. */
#include "bench_linebuf.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

void linebuf_init(struct linebuf *lb, size_t max_line)
{
	memset(lb, 0, sizeof(*lb));
	lb->max_line = max_line;
}

void linebuf_free(struct linebuf *lb)
{
	free(lb->data);
	lb->data = NULL;
	lb->cap = lb->start = lb->end = lb->scan = 0;
}

int linebuf_reserve(struct linebuf *lb, size_t want, char **area, size_t *len)
{
	if (lb->cap - lb->end < want && lb->start > 0) {
		memmove(lb->data, lb->data + lb->start, lb->end - lb->start);
		lb->end -= lb->start;
		lb->start = 0;
	}
	if (lb->cap - lb->end < want) {
		size_t need = lb->end + want;
		size_t cap = lb->cap ? lb->cap : 4096;
		char *data;

		while (cap < need)
			cap *= 2;
		data = realloc(lb->data, cap);
		if (!data)
			return -ENOMEM;
		lb->data = data;
		lb->cap = cap;
	}
	*area = lb->data + lb->end;
	*len = lb->cap - lb->end;
	return 0;
}

void linebuf_commit(struct linebuf *lb, size_t n)
{
	lb->end += n;
}

/* A partial line may be max_line bytes plus a '\r' still waiting for its '\n'. */
static int partial_too_long(const struct linebuf *lb)
{
	size_t n = lb->end - lb->start;

	if (n <= lb->max_line)
		return 0;
	return !(n == lb->max_line + 1 && lb->data[lb->end - 1] == '\r');
}

enum linebuf_next linebuf_next(struct linebuf *lb, const char **line, size_t *len)
{
	for (;;) {
		const char *nl;
		size_t n;

		if (lb->start == lb->end) {
			lb->start = lb->end = lb->scan = 0;
			return LINEBUF_NEED_MORE;
		}
		nl = memchr(lb->data + lb->start + lb->scan, '\n', lb->end - lb->start - lb->scan);
		if (!nl) {
			lb->scan = lb->end - lb->start;
			if (lb->discarding) {
				lb->start = lb->end = lb->scan = 0;
				return LINEBUF_NEED_MORE;
			}
			if (partial_too_long(lb)) {
				lb->discarding = true;
				lb->start = lb->end = lb->scan = 0;
				return LINEBUF_TOO_LONG;
			}
			return LINEBUF_NEED_MORE;
		}
		*line = lb->data + lb->start;
		n = (size_t)(nl - *line);
		lb->start += n + 1;
		lb->scan = 0;
		if (lb->discarding) {
			lb->discarding = false;
			continue;
		}
		if (n > 0 && (*line)[n - 1] == '\r')
			n--;
		if (n > lb->max_line)
			return LINEBUF_TOO_LONG;
		*len = n;
		return LINEBUF_LINE;
	}
}
