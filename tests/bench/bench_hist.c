/* Log-linear latency histogram: values below 2^(SUB_BITS+1) are exact, above that each power
 * of two is cut into 2^SUB_BITS equal buckets. */
#include "bench_hist.h"

#include <math.h>
#include <string.h>

#define SUB (UINT64_C(1) << BENCH_HIST_SUB_BITS)

static unsigned msb64(uint64_t v)
{
	unsigned n = 0;

	while (v >>= 1)
		n++;
	return n;
}

static unsigned bucket_of(uint64_t v)
{
	unsigned shift;

	if (v < 2 * SUB)
		return (unsigned)v;
	shift = msb64(v) - BENCH_HIST_SUB_BITS;
	return (unsigned)(2 * SUB + (shift - 1) * SUB + ((v >> shift) - SUB));
}

static uint64_t bucket_high(unsigned idx)
{
	unsigned k, shift;
	uint64_t top;

	if (idx < 2 * SUB)
		return idx;
	k = idx - (unsigned)(2 * SUB);
	shift = k / (unsigned)SUB + 1;
	top = k % SUB + SUB;
	if (top + 1 >= (UINT64_C(1) << (64 - shift)))
		return UINT64_MAX;
	return ((top + 1) << shift) - 1;
}

void bench_hist_reset(struct bench_hist *h)
{
	memset(h, 0, sizeof(*h));
	h->min = UINT64_MAX;
}

void bench_hist_add(struct bench_hist *h, uint64_t v)
{
	h->counts[bucket_of(v)]++;
	h->total++;
	h->sum += (double)v;
	if (v < h->min)
		h->min = v;
	if (v > h->max)
		h->max = v;
}

void bench_hist_merge(struct bench_hist *dst, const struct bench_hist *src)
{
	for (unsigned i = 0; i < BENCH_HIST_BUCKETS; i++)
		dst->counts[i] += src->counts[i];
	dst->total += src->total;
	dst->sum += src->sum;
	if (src->min < dst->min)
		dst->min = src->min;
	if (src->max > dst->max)
		dst->max = src->max;
}

uint64_t bench_hist_quantile(const struct bench_hist *h, double q)
{
	uint64_t rank, seen = 0;

	if (h->total == 0)
		return 0;
	if (q <= 0)
		return h->min;
	if (q >= 1)
		return h->max;
	rank = (uint64_t)ceil(q * (double)h->total);
	if (rank == 0)
		rank = 1;
	for (unsigned i = 0; i < BENCH_HIST_BUCKETS; i++) {
		seen += h->counts[i];
		if (seen >= rank) {
			uint64_t v = bucket_high(i);

			if (v > h->max)
				v = h->max;
			if (v < h->min)
				v = h->min;
			return v;
		}
	}
	return h->max;
}

double bench_hist_mean(const struct bench_hist *h)
{
	return h->total ? h->sum / (double)h->total : 0;
}
