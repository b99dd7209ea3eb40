/* The monotonic clock in nanoseconds, for durations (request time, commit time). */
#ifndef CONVOD_MONOCLOCK_H
#define CONVOD_MONOCLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#endif
