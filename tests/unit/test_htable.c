/* Unit tests for daemon/htable: every node is found while the table grows and shrinks in
 * steps, no insert or remove moves more than HT_MOVE_STEP old buckets (but the one that
 * finishes a resize to start the next), and ht_each and ht_free visit each node once,
 * mid-resize too. */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "htable.h"
#include "test.h"

#define N 200000

struct item {
	struct hnode h;
	bool in;
	unsigned seen; /* times ht_each visited it */
};

static struct item items[N];
static uint64_t rng = 0x2545f4914f6cdd1dull;

static bool found(const struct htable *t, const struct item *it)
{
	for (const struct hnode *h = ht_first(t, it->h.hash); h; h = h->next)
		if (h == &it->h)
			return true;
	return false;
}

/* Nodes reachable in the table: b whole, and the old buckets not moved yet. */
static size_t reachable(const struct htable *t)
{
	size_t n = 0;
	for (size_t i = 0; i <= t->mask; i++)
		for (const struct hnode *h = t->b[i]; h; h = h->next)
			n++;
	if (t->old)
		for (size_t i = t->moved; i <= t->old_mask; i++)
			for (const struct hnode *h = t->old[i]; h; h = h->next)
				n++;
	return n;
}

static size_t visited;

static void each(struct hnode *h, void *arg)
{
	(void)arg;
	((struct item *)h)->seen++;
	visited++;
}

static void visit(struct hnode *h)
{
	(void)h;
	visited++;
}

/* One insert or remove, checked for the buckets it moved: resizes started, and those that
 * had to finish the one under way first (in one go). */
static size_t steps_over, started, forced;

static void op(struct htable *t, struct item *it, bool insert)
{
	struct hnode *const *old = t->old;
	size_t moved = t->moved;

	if (insert)
		ht_insert(t, &it->h);
	else
		ht_remove(t, &it->h);
	it->in = insert;
	if (old && t->old == old && t->moved - moved > HT_MOVE_STEP)
		steps_over++;
	if (t->old && t->old != old) {
		started++;
		if (old)
			forced++;
	}
}

static void check_sample(const struct htable *t)
{
	for (int k = 0; k < 64; k++) {
		const struct item *it = &items[test_rand(&rng) % N];
		CHECK(found(t, it) == it->in);
	}
}

int main(void)
{
	struct htable t;
	size_t order[N];

	CHECK(ht_init(&t) == 0);
	for (size_t i = 0; i < N; i++) {
		/* One in 16 shares its hash with another: equal hashes share a chain. */
		items[i].h.hash = i % 16 == 1 ? items[i - 1].h.hash : test_rand(&rng);
		order[i] = i;
	}
	for (size_t i = N - 1; i > 0; i--) {
		size_t j = test_rand(&rng) % (i + 1), x = order[i];
		order[i] = order[j];
		order[j] = x;
	}

	for (size_t i = 0; i < N; i++) {
		op(&t, &items[order[i]], true);
		CHECK(found(&t, &items[order[i]]));
		if (i % 997 == 0) {
			check_sample(&t);
			CHECK(reachable(&t) == t.n);
		}
	}
	CHECK(t.n == N && reachable(&t) == N);
	for (size_t i = 0; i < N; i++)
		if (!found(&t, &items[i]))
			CHECK(!"every node is found after the inserts");
	CHECK(t.mask + 1 >= N / 2); /* it grew: chains of about one */

	for (size_t i = 0; i < N; i++) {
		size_t k = order[(i * 7919) % N]; /* another order */
		op(&t, &items[k], false);
		CHECK(!found(&t, &items[k]));
		if (i % 997 == 0) {
			check_sample(&t);
			CHECK(reachable(&t) == t.n);
		}
	}
	CHECK(t.n == 0 && reachable(&t) == 0);
	/* It shrinks back to the smallest size as operations go on. */
	for (int k = 0; k < 1000 && (t.old || t.mask + 1 > HT_MIN_BUCKETS); k++) {
		op(&t, &items[0], true);
		op(&t, &items[0], false);
	}
	CHECK(t.mask + 1 == HT_MIN_BUCKETS && !t.old && t.n == 0);
	/* Every resize was spread over the operations after it (64 -> 262144 buckets is 12
	 * doublings, and as many halvings back), and none moved more than its step. */
	CHECK(steps_over == 0);
	CHECK(started >= 24 && forced == 0);
	fprintf(stderr, "htable: %zu resizes, each spread over later operations\n", started);

	/* ht_free in the middle of a resize visits every node once. */
	for (size_t i = 0; i < N && !(t.old && i > 1000); i++)
		op(&t, &items[order[i]], true);
	CHECK(t.old != NULL);
	/* So does ht_each: each node in the table once, none out of it. */
	visited = 0;
	ht_each(&t, each, NULL);
	CHECK(visited == t.n);
	for (size_t i = 0; i < N; i++)
		if (items[i].seen != (items[i].in ? 1u : 0u))
			CHECK(!"ht_each visits each node in the table once");
	{
		size_t n = t.n;
		visited = 0;
		ht_free(&t, visit);
		CHECK(visited == n && n > 1000);
	}
	return test_done("htable");
}
