/* Checks of the bench's own building blocks: the line splitter and the latency histogram. */
#include "bench_hist.h"
#include "bench_linebuf.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;

#define CHECK(cond)                                                                                \
	do {                                                                                       \
		if (!(cond)) {                                                                     \
			fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);   \
			failures++;                                                                \
		}                                                                                  \
	} while (0)

static void feed(struct linebuf *lb, const char *s)
{
	size_t n = strlen(s);
	char *area;
	size_t len;

	CHECK(linebuf_reserve(lb, n, &area, &len) == 0);
	CHECK(len >= n);
	memcpy(area, s, n);
	linebuf_commit(lb, n);
}

static int next_is(struct linebuf *lb, enum linebuf_next want, const char *text)
{
	const char *line = NULL;
	size_t len = 0;
	enum linebuf_next got = linebuf_next(lb, &line, &len);

	if (got != want)
		return 0;
	if (want == LINEBUF_LINE)
		return len == strlen(text) && memcmp(line, text, len) == 0;
	return 1;
}

static void test_linebuf_split(void)
{
	struct linebuf lb;

	linebuf_init(&lb, 16);
	CHECK(next_is(&lb, LINEBUF_NEED_MORE, NULL));
	feed(&lb, "ab");
	CHECK(next_is(&lb, LINEBUF_NEED_MORE, NULL));
	feed(&lb, "c\nde\r\n\nf");
	CHECK(next_is(&lb, LINEBUF_LINE, "abc"));
	CHECK(next_is(&lb, LINEBUF_LINE, "de"));
	CHECK(next_is(&lb, LINEBUF_LINE, ""));
	CHECK(next_is(&lb, LINEBUF_NEED_MORE, NULL));
	feed(&lb, "g\n");
	CHECK(next_is(&lb, LINEBUF_LINE, "fg"));
	CHECK(next_is(&lb, LINEBUF_NEED_MORE, NULL));
	linebuf_free(&lb);
}

static void test_linebuf_limit(void)
{
	struct linebuf lb;

	linebuf_init(&lb, 4);
	/* exactly at the limit, with a "\r" arriving before its "\n" */
	feed(&lb, "abcd\r");
	CHECK(next_is(&lb, LINEBUF_NEED_MORE, NULL));
	feed(&lb, "\n");
	CHECK(next_is(&lb, LINEBUF_LINE, "abcd"));
	/* one byte over, complete in one read: refused, the next line still comes through */
	feed(&lb, "abcde\nok\n");
	CHECK(next_is(&lb, LINEBUF_TOO_LONG, NULL));
	CHECK(next_is(&lb, LINEBUF_LINE, "ok"));
	/* over the limit across reads: refused once, its tail dropped */
	feed(&lb, "abcdef");
	CHECK(next_is(&lb, LINEBUF_TOO_LONG, NULL));
	CHECK(next_is(&lb, LINEBUF_NEED_MORE, NULL));
	feed(&lb, "ghijkl");
	CHECK(next_is(&lb, LINEBUF_NEED_MORE, NULL));
	feed(&lb, "mn\nxy\n");
	CHECK(next_is(&lb, LINEBUF_LINE, "xy"));
	CHECK(next_is(&lb, LINEBUF_NEED_MORE, NULL));
	/* the buffer never holds much more than the limit plus one read */
	CHECK(lb.cap <= 4096);
	linebuf_free(&lb);
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

static void test_hist_quantiles(void)
{
	static struct bench_hist h, half1, half2;
	enum { N = 100000 };
	uint64_t *v = malloc(N * sizeof(*v));
	uint64_t seed = 42;
	const double qs[] = {0.5, 0.9, 0.99, 0.999};

	CHECK(v != NULL);
	if (!v)
		return;
	bench_hist_reset(&h);
	bench_hist_reset(&half1);
	bench_hist_reset(&half2);
	CHECK(bench_hist_quantile(&h, 0.5) == 0);
	for (int i = 0; i < N; i++) {
		/* spread over six decades, like latencies from microseconds to seconds */
		seed = seed * 6364136223846793005u + 1442695040888963407u;
		v[i] = (seed >> 33) % 1000 * ((uint64_t)1 << ((seed >> 20) % 20)) + 1;
		bench_hist_add(&h, v[i]);
		bench_hist_add(i % 2 ? &half1 : &half2, v[i]);
	}
	qsort(v, N, sizeof(*v), cmp_u64);
	bench_hist_merge(&half1, &half2);
	CHECK(h.total == N);
	CHECK(h.min == v[0]);
	CHECK(h.max == v[N - 1]);
	CHECK(bench_hist_quantile(&h, 1.0) == v[N - 1]);
	CHECK(bench_hist_quantile(&h, 0.0) == v[0]);
	for (size_t i = 0; i < sizeof(qs) / sizeof(qs[0]); i++) {
		uint64_t exact = v[(size_t)(qs[i] * N + 0.5) - 1];
		uint64_t got = bench_hist_quantile(&h, qs[i]);

		/* never below the true value, and within the bucket width (1/128) above it */
		if (!(got >= exact && (double)got <= (double)exact * (1 + 1.0 / 128) + 1)) {
			fprintf(stderr, "q%.3f: exact %" PRIu64 " got %" PRIu64 "\n", qs[i], exact,
			        got);
			failures++;
		}
		CHECK(bench_hist_quantile(&half1, qs[i]) == got);
	}
	free(v);
}

static void test_hist_extremes(void)
{
	static struct bench_hist h;

	bench_hist_reset(&h);
	bench_hist_add(&h, 0);
	bench_hist_add(&h, UINT64_MAX);
	CHECK(bench_hist_quantile(&h, 0.5) == 0);
	CHECK(bench_hist_quantile(&h, 0.99) == UINT64_MAX);
	bench_hist_reset(&h);
	for (uint64_t x = 1; x < 256; x++)
		bench_hist_add(&h, x);
	/* small values are exact */
	CHECK(bench_hist_quantile(&h, 0.5) == 128);
}

int main(void)
{
	test_linebuf_split();
	test_linebuf_limit();
	test_hist_quantiles();
	test_hist_extremes();
	if (failures) {
		fprintf(stderr, "%d checks failed\n", failures);
		return 1;
	}
	printf("bench selftest: ok\n");
	return 0;
}
