/* Conversation registry: open addressing, linear probing, SipHash-1-3 keyed hashing. */
#include "registry.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "siphash.h"

static struct convo registry_tombstone_obj;
#define REGISTRY_TOMBSTONE (&registry_tombstone_obj)

void registry_init(struct registry *r, const uint8_t key[16])
{
	memset(r, 0, sizeof(*r));
	memcpy(&r->key[0], key, 8);
	memcpy(&r->key[1], key + 8, 8);
}

void registry_free(struct registry *r)
{
	for (size_t i = 0; i < r->cap; i++)
		if (r->slots[i] && r->slots[i] != REGISTRY_TOMBSTONE)
			convo_free(r->slots[i]);
	free(r->slots);
	r->slots = NULL;
	r->cap = r->count = r->used = 0;
}

static size_t registry_hash(const struct registry *r, const char *id, size_t len)
{
	return (size_t)siphash13(r->key, (const unsigned char *)id, len);
}

static long registry_slot(const struct registry *r, const char *id, size_t len)
{
	size_t mask, i;

	if (r->cap == 0)
		return -1;
	mask = r->cap - 1;
	for (i = registry_hash(r, id, len) & mask;; i = (i + 1) & mask) {
		struct convo *c = r->slots[i];
		if (!c)
			return -1;
		if (c != REGISTRY_TOMBSTONE && c->id_len == len && memcmp(c->id, id, len) == 0)
			return (long)i;
	}
}

struct convo *registry_get(const struct registry *r, const char *id, size_t len)
{
	long i = registry_slot(r, id, len);
	return i < 0 ? NULL : r->slots[i];
}

static void registry_insert_slot(struct convo **slots, size_t cap, size_t hash, struct convo *c)
{
	size_t mask = cap - 1, i;
	for (i = hash & mask; slots[i] && slots[i] != REGISTRY_TOMBSTONE; i = (i + 1) & mask)
		;
	slots[i] = c;
}

static int registry_grow(struct registry *r)
{
	/* Rehash into a table sized for the live entries, dropping tombstones. */
	size_t ncap = r->cap ? r->cap : 64;
	struct convo **ns;

	while ((r->count + 1) * 4 >= ncap * 3)
		ncap *= 2;
	ns = calloc(ncap, sizeof(*ns));
	if (!ns)
		return -ENOMEM;
	for (size_t i = 0; i < r->cap; i++) {
		struct convo *c = r->slots[i];
		if (c && c != REGISTRY_TOMBSTONE)
			registry_insert_slot(ns, ncap, registry_hash(r, c->id, c->id_len), c);
	}
	free(r->slots);
	r->slots = ns;
	r->cap = ncap;
	r->used = r->count;
	return 0;
}

int registry_put(struct registry *r, struct convo *c)
{
	size_t mask, i;

	if ((r->used + 1) * 4 >= r->cap * 3) {
		int rc = registry_grow(r);
		if (rc < 0)
			return rc;
	}
	mask = r->cap - 1;
	for (i = registry_hash(r, c->id, c->id_len) & mask;
	     r->slots[i] && r->slots[i] != REGISTRY_TOMBSTONE; i = (i + 1) & mask)
		;
	if (!r->slots[i])
		r->used++;
	r->slots[i] = c;
	r->count++;
	return 0;
}

struct convo *registry_take(struct registry *r, const char *id, size_t len)
{
	long i = registry_slot(r, id, len);
	struct convo *c;

	if (i < 0)
		return NULL;
	c = r->slots[i];
	r->slots[i] = REGISTRY_TOMBSTONE;
	r->count--;
	return c;
}

void registry_each(const struct registry *r, void (*fn)(void *arg, struct convo *c), void *arg)
{
	for (size_t i = 0; i < r->cap; i++)
		if (r->slots[i] && r->slots[i] != REGISTRY_TOMBSTONE)
			fn(arg, r->slots[i]);
}
