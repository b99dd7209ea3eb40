/* Shared by the fuzz targets: the libFuzzer entry point, a fatal check that names the broken
 * invariant, and a reader that turns the input bytes into choices. */
#ifndef CONVOD_FUZZ_H
#define CONVOD_FUZZ_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Reports a broken invariant and aborts, so that libFuzzer keeps the input as a crash. */
__attribute__((noreturn, format(printf, 3, 4))) static inline void
fuzz_fail(const char *file, int line, const char *fmt, ...)
{
	va_list ap;
	fprintf(stderr, "%s:%d: invariant broken: ", file, line);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	abort();
}

#define FUZZ_REQUIRE(cond, ...)                                                                    \
	do {                                                                                       \
		if (!(cond))                                                                       \
			fuzz_fail(__FILE__, __LINE__, __VA_ARGS__);                                \
	} while (0)

/* The input read front to back; past its end every read gives zeros. */
struct fuzz_in {
	const uint8_t *p;
	size_t n;
};

static inline uint8_t fuzz_u8(struct fuzz_in *in)
{
	if (!in->n)
		return 0;
	in->n--;
	return *in->p++;
}

static inline uint16_t fuzz_u16(struct fuzz_in *in)
{
	uint16_t hi = fuzz_u8(in);
	return (uint16_t)(hi << 8 | fuzz_u8(in));
}

/* Up to want bytes (fewer at the end of the input), borrowed from the input. */
static inline const uint8_t *fuzz_bytes(struct fuzz_in *in, size_t want, size_t *got)
{
	const uint8_t *p = in->p;
	*got = want < in->n ? want : in->n;
	in->p += *got;
	in->n -= *got;
	return p;
}

#endif
