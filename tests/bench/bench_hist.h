/* Log-linear latency histogram (HDR-style, < 1% relative error) of bounded size. */
#ifndef BENCH_HIST_H
#define BENCH_HIST_H

#include <stdint.h>

#define BENCH_HIST_SUB_BITS 7
#define BENCH_HIST_BUCKETS ((64 - BENCH_HIST_SUB_BITS + 1) << BENCH_HIST_SUB_BITS)

struct bench_hist {
	uint64_t counts[BENCH_HIST_BUCKETS];
	uint64_t total;
	uint64_t min;
	uint64_t max;
	double sum;
};

/* Empties a caller-owned histogram. */
void bench_hist_reset(struct bench_hist *h);

/* Records one value (any unit; the bench uses nanoseconds). */
void bench_hist_add(struct bench_hist *h, uint64_t v);

/* Adds every sample of src into dst. */
void bench_hist_merge(struct bench_hist *dst, const struct bench_hist *src);

/* Value at quantile q in [0, 1]: the highest value of the bucket holding that rank, never above
 * the exact maximum; 0 when empty. */
uint64_t bench_hist_quantile(const struct bench_hist *h, double q);

/* Mean of the recorded values, 0 when empty. */
double bench_hist_mean(const struct bench_hist *h);

#endif
