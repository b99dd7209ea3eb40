/* A chained hash table of nodes embedded first in their owners, resized a few buckets at a
 * time: a table of a million nodes that doubled (or halved) in one go held the loop for
 * about 50 ms while it relinked them all. */
#ifndef CONVOD_HTABLE_H
#define CONVOD_HTABLE_H

#include <stddef.h>
#include <stdint.h>

#define HT_MIN_BUCKETS 64
/* Old buckets moved by each insert or remove during a resize: a halving (at 1/8 full) must
 * be done before the next one is due. */
#define HT_MOVE_STEP 32

struct hnode {
	struct hnode *next;
	uint64_t hash;
};

struct htable {
	struct hnode **b;
	size_t mask; /* buckets - 1 */
	size_t n;
	/* During a resize: the buckets nodes are moved from (NULL when none), their mask, and
	 * how many of them are moved already. A node whose old bucket is below moved is in b. */
	struct hnode **old;
	size_t old_mask, moved;
};

/* 0 or -ENOMEM. */
int ht_init(struct htable *t);
/* The first node of the chain hash is in (then follow next; compare the hashes). */
struct hnode *ht_first(const struct htable *t, uint64_t hash);
void ht_insert(struct htable *t, struct hnode *h);
/* h must be in t. */
void ht_remove(struct htable *t, struct hnode *h);
/* Calls fn(h, arg) on every node, in no particular order; fn must not insert or remove. */
void ht_each(const struct htable *t, void (*fn)(struct hnode *h, void *arg), void *arg);
/* Calls fn on every node (which may free it), then frees the buckets. */
void ht_free(struct htable *t, void (*fn)(struct hnode *h));

#endif
