/* The conversations the daemon holds in memory, keyed by conversation id: an open-addressing
 * hash table with a keyed hash (SipHash-1-3, random key), so that chosen ids cannot make
 * lookups slow. */
#ifndef CONVOD_REGISTRY_H
#define CONVOD_REGISTRY_H

#include <stddef.h>
#include <stdint.h>

#include "convo.h"

/* A slot keeps its conversation's hash: a probe compares it before touching the
 * conversation, which is mostly not in the cache (measured: 7.6% of the loop's time went
 * to lookups in the voice mix, about two cache misses per probe). */
struct registry_slot {
	struct convo *c; /* owned; NULL = empty, REGISTRY_TOMBSTONE = deleted */
	uint64_t hash;
};

struct registry {
	struct registry_slot *slots;
	size_t cap;           /* power of two */
	size_t count;         /* live entries */
	size_t used;          /* live entries + tombstones */
	uint64_t key[2];
};

/* Initialises an empty registry with a hash key from 16 random bytes. */
void registry_init(struct registry *r, const uint8_t key[16]);
/* Frees every conversation and the table. */
void registry_free(struct registry *r);

/* The conversation with that id, or NULL. Borrowed: valid until it is removed. */
struct convo *registry_get(const struct registry *r, const char *id, size_t len);
/* Adds c (ownership taken on success; the id must not be present). 0 or -ENOMEM. */
int registry_put(struct registry *r, struct convo *c);
/* Removes c from the table and returns it (caller frees), or NULL if absent. */
struct convo *registry_take(struct registry *r, const char *id, size_t len);

/* Calls fn for every conversation, in table order. fn must not change the registry. */
void registry_each(const struct registry *r, void (*fn)(void *arg, struct convo *c), void *arg);

#endif
