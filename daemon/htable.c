/* Chained hash table with incremental resizing (see htable.h). */
#include "htable.h"

#include <errno.h>
#include <stdlib.h>

int ht_init(struct htable *t)
{
	t->b = calloc(HT_MIN_BUCKETS, sizeof(*t->b));
	if (!t->b)
		return -ENOMEM;
	t->mask = HT_MIN_BUCKETS - 1;
	t->n = 0;
	t->old = NULL;
	t->old_mask = t->moved = 0;
	return 0;
}

/* The chain a node of hash is in, or goes to. */
static struct hnode **ht_chain(const struct htable *t, uint64_t hash)
{
	if (t->old && (hash & t->old_mask) >= t->moved)
		return &t->old[hash & t->old_mask];
	return &t->b[hash & t->mask];
}

struct hnode *ht_first(const struct htable *t, uint64_t hash)
{
	return *ht_chain(t, hash);
}

/* Moves up to k old buckets' nodes over; the old buckets go once all are. */
static void ht_move(struct htable *t, size_t k)
{
	for (; t->old && k > 0; k--) {
		struct hnode *h = t->old[t->moved], *next;
		t->old[t->moved] = NULL;
		for (; h; h = next) {
			next = h->next;
			h->next = t->b[h->hash & t->mask];
			t->b[h->hash & t->mask] = h;
		}
		if (t->moved++ == t->old_mask) {
			free(t->old);
			t->old = NULL;
			t->old_mask = t->moved = 0;
		}
	}
}

/* Starts moving the nodes to nb buckets (the one under way is finished first); on ENOMEM
 * the table stays as it is (chains get longer). */
static void ht_resize(struct htable *t, size_t nb)
{
	struct hnode **b;

	ht_move(t, SIZE_MAX);
	if (!(b = calloc(nb, sizeof(*b))))
		return;
	t->old = t->b;
	t->old_mask = t->mask;
	t->moved = 0;
	t->b = b;
	t->mask = nb - 1;
}

void ht_insert(struct htable *t, struct hnode *h)
{
	struct hnode **slot;

	ht_move(t, HT_MOVE_STEP);
	slot = ht_chain(t, h->hash);
	h->next = *slot;
	*slot = h;
	if (++t->n > t->mask + 1)
		ht_resize(t, 2 * (t->mask + 1));
}

void ht_remove(struct htable *t, struct hnode *h)
{
	struct hnode **p;

	ht_move(t, HT_MOVE_STEP);
	for (p = ht_chain(t, h->hash); *p && *p != h;)
		p = &(*p)->next;
	if (*p)
		*p = h->next;
	t->n--;
	if (!t->old && t->mask + 1 > HT_MIN_BUCKETS && t->n < (t->mask + 1) / 8)
		ht_resize(t, (t->mask + 1) / 2);
}

void ht_each(const struct htable *t, void (*fn)(struct hnode *h, void *arg), void *arg)
{
	for (size_t i = 0; i <= t->mask; i++)
		for (struct hnode *h = t->b[i]; h; h = h->next)
			fn(h, arg);
	/* Old buckets below moved are empty: their nodes are in b. */
	for (size_t i = t->moved; t->old && i <= t->old_mask; i++)
		for (struct hnode *h = t->old[i]; h; h = h->next)
			fn(h, arg);
}

void ht_free(struct htable *t, void (*fn)(struct hnode *h))
{
	struct hnode **tables[2] = {t->b, t->old};
	size_t masks[2] = {t->mask, t->old_mask};

	for (int k = 0; k < 2; k++) {
		if (!tables[k])
			continue;
		for (size_t i = 0; i <= masks[k]; i++) {
			struct hnode *h = tables[k][i], *next;
			for (; h; h = next) {
				next = h->next;
				fn(h);
			}
		}
		free(tables[k]);
	}
	t->b = t->old = NULL;
	t->n = 0;
}
