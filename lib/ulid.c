/* ULID generation and parsing: 48-bit milliseconds and 80 random bits in Crockford base32,
 * handed out strictly increasing by one generator (see ulid.h). */
#include "ulid.h"

#include <string.h>

#define ULID_MAX_MS ((UINT64_C(1) << 48) - 1)

static const char crockford[32] = "0123456789ABCDEFGHJKMNPQRSTVWXYZ";

static uint64_t rotl64(uint64_t x, int k)
{
	return (x << k) | (x >> (64 - k));
}

/* splitmix64: spreads the seed so that similar seeds give unrelated xoshiro states. */
static uint64_t splitmix64(uint64_t *x)
{
	uint64_t z = (*x += UINT64_C(0x9E3779B97F4A7C15));
	z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
	z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
	return z ^ (z >> 31);
}

/* xoshiro256** step. */
static uint64_t rng_next(uint64_t s[4])
{
	uint64_t result = rotl64(s[1] * 5, 7) * 9;
	uint64_t t = s[1] << 17;
	s[2] ^= s[0];
	s[3] ^= s[1];
	s[1] ^= s[2];
	s[0] ^= s[3];
	s[2] ^= t;
	s[3] = rotl64(s[3], 45);
	return result;
}

void ulid_gen_init(struct ulid_gen *g, const uint8_t seed[32])
{
	memset(g, 0, sizeof(*g));
	for (int i = 0; i < 4; i++) {
		uint64_t w = 0;
		for (int j = 0; j < 8; j++)
			w = (w << 8) | seed[i * 8 + j];
		uint64_t x = w ^ (UINT64_C(0x243F6A8885A308D3) * (uint64_t)(i + 1));
		g->rng[i] = splitmix64(&x);
	}
	/* xoshiro must not start from the all-zero state. */
	if (!(g->rng[0] | g->rng[1] | g->rng[2] | g->rng[3]))
		g->rng[0] = 1;
}

/* Adds one to the 80-bit random part; returns true on a carry out of it. */
static bool random_increment(uint8_t r[10])
{
	for (int i = 9; i >= 0; i--) {
		if (++r[i] != 0)
			return false;
	}
	return true;
}

static void encode(uint64_t ms, const uint8_t r[10], char out[ULID_LEN + 1])
{
	/* The 128-bit value ms << 80 | random, as hi:lo. */
	uint64_t hi = (ms << 16) | ((uint64_t)r[0] << 8) | r[1];
	uint64_t lo = 0;
	for (int i = 2; i < 10; i++)
		lo = (lo << 8) | r[i];
	/* Character i holds bits [125 - 5i, 130 - 5i); the first one only 3 bits. */
	for (int i = 0; i < ULID_LEN; i++) {
		int shift = 125 - 5 * i;
		uint64_t v;
		if (shift >= 64)
			v = hi >> (shift - 64);
		else if (shift + 5 <= 64)
			v = lo >> shift;
		else
			v = (lo >> shift) | (hi << (64 - shift));
		out[i] = crockford[v & 31];
	}
	out[ULID_LEN] = '\0';
}

void ulid_gen_next(struct ulid_gen *g, uint64_t now_ms, char out[ULID_LEN + 1])
{
	if (now_ms > ULID_MAX_MS)
		now_ms = ULID_MAX_MS;
	if (!g->started || now_ms > g->last_ms) {
		uint64_t a = rng_next(g->rng), b = rng_next(g->rng);
		for (int i = 0; i < 8; i++)
			g->last[i] = (uint8_t)(a >> (56 - 8 * i));
		g->last[8] = (uint8_t)(b >> 56);
		g->last[9] = (uint8_t)(b >> 48);
		g->last_ms = now_ms;
		g->started = true;
	} else if (random_increment(g->last)) {
		/* 2^80 ids in one millisecond: borrow the next millisecond. Past the 48-bit
		 * range (year 10889) ids would wrap; not worth a failure path. */
		g->last_ms = (g->last_ms + 1) & ULID_MAX_MS;
	}
	encode(g->last_ms, g->last, out);
}

/* Value of a Crockford character in canonical (upper case) form, or -1. */
static int char_value(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	const char *p = c ? memchr(crockford + 10, c, 22) : NULL;
	return p ? (int)(p - crockford) : -1;
}

bool ulid_valid(const char *s, size_t len)
{
	if (!s || len != ULID_LEN || s[0] < '0' || s[0] > '7')
		return false;
	for (size_t i = 1; i < ULID_LEN; i++) {
		if (char_value(s[i]) < 0)
			return false;
	}
	return true;
}

uint64_t ulid_time_ms(const char *s)
{
	uint64_t ms = 0;
	for (int i = 0; i < 10; i++)
		ms = (ms << 5) | (uint64_t)char_value(s[i]);
	return ms;
}
