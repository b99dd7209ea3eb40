/* pagecache: SQLite's default page cache (pcache1) behind a layer that moves one temporary
 * page number out of its way.
 *
 * When a B-tree balance leaves its new pages out of order, SQLite (3.40, balance_nonroot)
 * swaps two page numbers through a temporary one: the page just past the lock byte at 1 GiB
 * (262,145 with 4 kB pages). pcache1 then records 262,145 as the highest page number it
 * holds, and the end of that write transaction, which drops the pages past the database's
 * end, walks every hash bucket between the database's end and it: the whole table, 8,192
 * buckets with a 32 MiB cache. Under load that was 0.5-1.5 ms of the loop's commit, about 25
 * times a second at 50 connections: three quarters of the loop's perf samples inside its
 * commits of 0.5 ms or more. With the layer, 10 s runs at durability process (p1, release
 * build) had 77-86 such commits instead of 255-281, and the commit statement took 38-42 us
 * on average instead of 45-50.
 *
 * This layer gives that page, while it is parked, a number just past the highest one the
 * cache holds instead (it keeps that bound), and hands it back under the temporary number
 * to whoever asks for it. Everything else goes to pcache1 unchanged. Each cache belongs to
 * one connection, which SQLite uses from one thread at a time. */
#include "pagecache.h"

#include <errno.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

/* SQLite's lock byte (PENDING_BYTE), unless a test build moves it. */
#define LOCK_BYTE 0x40000000u

struct cache {
	sqlite3_pcache *real;
	unsigned top;                /* no page of real has a higher number */
	unsigned temp;               /* the B-tree's temporary page number */
	unsigned alias;              /* the number real knows the parked page by, or 0 */
	sqlite3_pcache_page *parked; /* the page SQLite has at temp, when alias */
};

static sqlite3_pcache_methods2 base;
static int install_rc;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static _Atomic unsigned long long n_parked;

#define C(p) ((struct cache *)(p))

static void raise_top(struct cache *c, unsigned key)
{
	if (key > c->top)
		c->top = key;
}

/* Gives the parked page its temporary number back in real (what SQLite alone would have). */
static void unpark(struct cache *c)
{
	base.xRekey(c->real, c->parked, c->alias, c->temp);
	raise_top(c, c->temp);
	c->alias = 0;
	c->parked = NULL;
}

static int p_init(void *arg)
{
	(void)arg;
	return base.xInit ? base.xInit(base.pArg) : SQLITE_OK;
}

static void p_shutdown(void *arg)
{
	(void)arg;
	if (base.xShutdown)
		base.xShutdown(base.pArg);
}

static sqlite3_pcache *p_create(int page_size, int extra, int purgeable)
{
	struct cache *c = sqlite3_malloc(sizeof(*c));

	if (!c)
		return NULL;
	if (!(c->real = base.xCreate(page_size, extra, purgeable))) {
		sqlite3_free(c);
		return NULL;
	}
	c->top = 0;
	c->temp = page_size > 0 ? LOCK_BYTE / (unsigned)page_size + 1 : 0;
	c->alias = 0;
	c->parked = NULL;
	return (sqlite3_pcache *)c;
}

static void p_cachesize(sqlite3_pcache *p, int n)
{
	base.xCachesize(C(p)->real, n);
}

static int p_pagecount(sqlite3_pcache *p)
{
	return base.xPagecount(C(p)->real);
}

static sqlite3_pcache_page *p_fetch(sqlite3_pcache *p, unsigned key, int create)
{
	struct cache *c = C(p);
	sqlite3_pcache_page *pg;

	if (c->alias) {
		if (key == c->temp)
			key = c->alias;
		/* Its stand-in number is wanted for a page of its own (SQLite's swap never asks
		 * for it): the parked page goes back where SQLite put it. */
		else if (key == c->alias)
			unpark(c);
	}
	pg = base.xFetch(c->real, key, create);
	if (pg)
		raise_top(c, key);
	return pg;
}

static void p_unpin(sqlite3_pcache *p, sqlite3_pcache_page *pg, int discard)
{
	struct cache *c = C(p);

	/* A parked page kept unpinned must not answer for its stand-in number later. */
	if (c->alias && pg == c->parked) {
		if (discard) {
			c->alias = 0;
			c->parked = NULL;
		} else
			unpark(c);
	}
	base.xUnpin(c->real, pg, discard);
}

static void p_rekey(sqlite3_pcache *p, sqlite3_pcache_page *pg, unsigned from, unsigned to)
{
	struct cache *c = C(p);

	if (from == c->temp && c->alias && pg == c->parked) {
		from = c->alias;
		c->alias = 0;
		c->parked = NULL;
	} else if (to == c->temp && !c->alias && c->top + 1 < c->temp) {
		c->alias = c->top + 1;
		c->parked = pg;
		base.xRekey(c->real, pg, from, c->alias);
		c->top = c->alias;
		atomic_fetch_add_explicit(&n_parked, 1, memory_order_relaxed);
		return;
	}
	base.xRekey(c->real, pg, from, to);
	raise_top(c, to);
}

static void p_truncate(sqlite3_pcache *p, unsigned limit)
{
	struct cache *c = C(p);

	/* Every page numbered limit or higher is gone, the parked one too. */
	if (c->alias && c->temp >= limit) {
		if (c->alias < limit)
			unpark(c);
		else {
			c->alias = 0;
			c->parked = NULL;
		}
	}
	base.xTruncate(c->real, limit);
	if (c->top >= limit)
		c->top = limit ? limit - 1 : 0;
}

static void p_destroy(sqlite3_pcache *p)
{
	base.xDestroy(C(p)->real);
	sqlite3_free(p);
}

static void p_shrink(sqlite3_pcache *p)
{
	if (base.xShrink)
		base.xShrink(C(p)->real);
}

static void do_install(void)
{
	static sqlite3_pcache_methods2 layer;

	if (sqlite3_config(SQLITE_CONFIG_GETPCACHE2, &base) != SQLITE_OK || !base.xCreate) {
		install_rc = -EBUSY;
		return;
	}
	layer = (sqlite3_pcache_methods2){
	    .iVersion = 1,
	    .pArg = NULL,
	    .xInit = p_init,
	    .xShutdown = p_shutdown,
	    .xCreate = p_create,
	    .xCachesize = p_cachesize,
	    .xPagecount = p_pagecount,
	    .xFetch = p_fetch,
	    .xUnpin = p_unpin,
	    .xRekey = p_rekey,
	    .xTruncate = p_truncate,
	    .xDestroy = p_destroy,
	    .xShrink = p_shrink,
	};
	install_rc = sqlite3_config(SQLITE_CONFIG_PCACHE2, &layer) == SQLITE_OK ? 0 : -EBUSY;
}

int pagecache_install(void)
{
	pthread_once(&once, do_install);
	return install_rc;
}

unsigned long long pagecache_parked(void)
{
	return atomic_load_explicit(&n_parked, memory_order_relaxed);
}
