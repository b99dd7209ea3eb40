/* ULIDs: 48-bit Unix milliseconds + 80 random bits, 26 characters of Crockford base32.
 * A generator hands out strictly increasing ids, even within one millisecond and even
 * when the clock steps back. No I/O: the caller seeds it and passes the time. */
#ifndef CONVO_ULID_H
#define CONVO_ULID_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define ULID_LEN 26

struct ulid_gen {
	uint64_t last_ms;    /* timestamp part of the last id handed out */
	uint8_t last[10];    /* random part of the last id, big-endian */
	uint64_t rng[4];     /* xoshiro256** state for the random part of a new millisecond */
	bool started;
};

/* Seeds g from 32 bytes (the daemon uses getrandom()). */
void ulid_gen_init(struct ulid_gen *g, const uint8_t seed[32]);

/* Writes the next id (26 characters and a NUL) to out. If now_ms is not after the last
 * id's millisecond, the last id's random part is incremented (carrying into the
 * millisecond on overflow), so every id is greater than the one before it. */
void ulid_gen_next(struct ulid_gen *g, uint64_t now_ms, char out[ULID_LEN + 1]);

/* True if s[0..len) is a well-formed ULID (26 Crockford base32 chars, upper case, first
 * char <= '7'). */
bool ulid_valid(const char *s, size_t len);

/* Milliseconds encoded in a valid ULID. */
uint64_t ulid_time_ms(const char *s);

#endif
