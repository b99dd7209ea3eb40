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
		if (r->slots[i].c && r->slots[i].c != REGISTRY_TOMBSTONE)
			convo_free(r->slots[i].c);
	free(r->slots);
	r->slots = NULL;
	r->cap = r->count = r->used = 0;
}

static uint64_t registry_hash(const struct registry *r, const char *id, size_t len)
{
	return siphash13(r->key, (const unsigned char *)id, len);
}

static long registry_slot(const struct registry *r, const char *id, size_t len)
{
	size_t mask, i;
	uint64_t hash;

	if (r->cap == 0)
		return -1;
	mask = r->cap - 1;
	hash = registry_hash(r, id, len);
	for (i = (size_t)hash & mask;; i = (i + 1) & mask) {
		const struct registry_slot *s = &r->slots[i];
		if (!s->c)
			return -1;
		if (s->hash == hash && s->c != REGISTRY_TOMBSTONE && s->c->id_len == len &&
		    memcmp(s->c->id, id, len) == 0)
			return (long)i;
	}
}

struct convo *registry_get(const struct registry *r, const char *id, size_t len)
{
	long i = registry_slot(r, id, len);
	return i < 0 ? NULL : r->slots[i].c;
}

/* The slot for a new entry of that hash: the first empty or deleted one of its run. */
static struct registry_slot *registry_free_slot(struct registry_slot *slots, size_t cap,
                                                uint64_t hash)
{
	size_t mask = cap - 1, i;
	for (i = (size_t)hash & mask; slots[i].c && slots[i].c != REGISTRY_TOMBSTONE;
	     i = (i + 1) & mask)
		;
	return &slots[i];
}

static int registry_grow(struct registry *r)
{
	/* Rehash into a table sized for the live entries, dropping tombstones. */
	size_t ncap = r->cap ? r->cap : 64;
	struct registry_slot *ns;

	while ((r->count + 1) * 4 >= ncap * 3)
		ncap *= 2;
	ns = calloc(ncap, sizeof(*ns));
	if (!ns)
		return -ENOMEM;
	for (size_t i = 0; i < r->cap; i++) {
		const struct registry_slot *s = &r->slots[i];
		if (s->c && s->c != REGISTRY_TOMBSTONE)
			*registry_free_slot(ns, ncap, s->hash) = *s;
	}
	free(r->slots);
	r->slots = ns;
	r->cap = ncap;
	r->used = r->count;
	return 0;
}

int registry_put(struct registry *r, struct convo *c)
{
	uint64_t hash = registry_hash(r, c->id, c->id_len);
	struct registry_slot *s;

	if ((r->used + 1) * 4 >= r->cap * 3) {
		int rc = registry_grow(r);
		if (rc < 0)
			return rc;
	}
	s = registry_free_slot(r->slots, r->cap, hash);
	if (!s->c)
		r->used++;
	s->c = c;
	s->hash = hash;
	r->count++;
	return 0;
}

struct convo *registry_take(struct registry *r, const char *id, size_t len)
{
	long i = registry_slot(r, id, len);
	struct convo *c;

	if (i < 0)
		return NULL;
	c = r->slots[i].c;
	r->slots[i].c = REGISTRY_TOMBSTONE;
	r->count--;
	return c;
}

void registry_each(const struct registry *r, void (*fn)(void *arg, struct convo *c), void *arg)
{
	for (size_t i = 0; i < r->cap; i++)
		if (r->slots[i].c && r->slots[i].c != REGISTRY_TOMBSTONE)
			fn(arg, r->slots[i].c);
}
