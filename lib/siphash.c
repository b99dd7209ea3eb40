/* SipHash with 1 compression and 3 finalisation rounds, written from the paper's
 * description (Aumasson, Bernstein 2012). */
#include "siphash.h"

static inline uint64_t rotl(uint64_t x, int b)
{
	return (x << b) | (x >> (64 - b));
}

#define SIPROUND                                                                           \
	do {                                                                               \
		v0 += v1;                                                                  \
		v1 = rotl(v1, 13);                                                         \
		v1 ^= v0;                                                                  \
		v0 = rotl(v0, 32);                                                         \
		v2 += v3;                                                                  \
		v3 = rotl(v3, 16);                                                         \
		v3 ^= v2;                                                                  \
		v0 += v3;                                                                  \
		v3 = rotl(v3, 21);                                                         \
		v3 ^= v0;                                                                  \
		v2 += v1;                                                                  \
		v1 = rotl(v1, 17);                                                         \
		v1 ^= v2;                                                                  \
		v2 = rotl(v2, 32);                                                         \
	} while (0)

uint64_t siphash13(const uint64_t key[2], const unsigned char *p, size_t len)
{
	uint64_t v0 = 0x736f6d6570736575ULL ^ key[0];
	uint64_t v1 = 0x646f72616e646f6dULL ^ key[1];
	uint64_t v2 = 0x6c7967656e657261ULL ^ key[0];
	uint64_t v3 = 0x7465646279746573ULL ^ key[1];
	uint64_t b = (uint64_t)len << 56;
	size_t i, full = len & ~(size_t)7;

	for (i = 0; i < full; i += 8) {
		uint64_t m = 0;
		for (int k = 7; k >= 0; k--)
			m = (m << 8) | p[i + (size_t)k];
		v3 ^= m;
		SIPROUND;
		v0 ^= m;
	}
	for (size_t k = 0; i + k < len; k++)
		b |= (uint64_t)p[i + k] << (8 * k);
	v3 ^= b;
	SIPROUND;
	v0 ^= b;
	v2 ^= 0xff;
	SIPROUND;
	SIPROUND;
	SIPROUND;
	return v0 ^ v1 ^ v2 ^ v3;
}
