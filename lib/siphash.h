/* A keyed hash for tables whose keys come from clients (conversation ids): without the
 * random key nobody can choose keys that collide. */
#ifndef CONVOD_SIPHASH_H
#define CONVOD_SIPHASH_H

#include <stddef.h>
#include <stdint.h>

/* SipHash-1-3 of p[0..len) under key. */
uint64_t siphash13(const uint64_t key[2], const unsigned char *p, size_t len);

#endif
