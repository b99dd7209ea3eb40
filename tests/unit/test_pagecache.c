/* Unit tests for daemon/pagecache: the layer's methods keep what SQLite sees of the cache
 * (a page parked at the temporary number is found there, and nowhere else; truncations and
 * unpins drop or keep it as they would any page), and databases whose B-trees SQLite
 * rebalances through the temporary page number, with a cache of any size, read back what
 * was written, before and after they are opened again. */
#include <errno.h>
#include <sqlite3.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "pagecache.h"
#include "test.h"

#define PAGE 4096u
#define TEMP (0x40000000u / PAGE + 1)

static sqlite3_pcache_methods2 m;
static char top[160];

static sqlite3_pcache_page *fetch(sqlite3_pcache *c, unsigned key, int create)
{
	return m.xFetch(c, key, create);
}

/* The swap balance_nonroot makes: a to b's number and b to a's, through TEMP. */
static void swap(sqlite3_pcache *c, sqlite3_pcache_page *a, unsigned na, sqlite3_pcache_page *b,
                 unsigned nb)
{
	CHECK(fetch(c, TEMP, 0) == NULL);
	m.xRekey(c, a, na, TEMP);
	CHECK(fetch(c, na, 0) == NULL);
	m.xRekey(c, b, nb, na);
	CHECK(fetch(c, nb, 0) == NULL);
	m.xRekey(c, a, TEMP, nb);
}

static void test_methods(void)
{
	sqlite3_pcache *c = m.xCreate((int)PAGE, 64, 1);
	sqlite3_pcache_page *p[11] = {NULL}, *q;
	unsigned long long parked = pagecache_parked();

	CHECK(c != NULL);
	if (!c)
		return;
	m.xCachesize(c, 100);
	for (unsigned k = 1; k <= 10; k++) {
		p[k] = fetch(c, k, 2);
		CHECK(p[k] != NULL);
	}
	CHECK(m.xPagecount(c) == 10);

	/* The swap itself: found at the temporary number while parked, then where it went. */
	swap(c, p[3], 3, p[7], 7);
	CHECK(pagecache_parked() == parked + 1);
	CHECK(fetch(c, 3, 0) == p[7]);
	CHECK(fetch(c, 7, 0) == p[3]);
	CHECK(fetch(c, TEMP, 0) == NULL);
	CHECK(fetch(c, 11, 0) == NULL); /* the stand-in number, free again */
	CHECK(m.xPagecount(c) == 10);

	/* The stand-in is the number past the highest the cache held: 11 once the cache was
	 * cut back to 10 pages (a truncation lowers that bound). While parked, the page
	 * answers for TEMP only, not for its stand-in number. */
	m.xTruncate(c, 11);
	m.xRekey(c, p[2], 2, TEMP);
	CHECK(fetch(c, TEMP, 0) == p[2]);
	CHECK(fetch(c, 2, 0) == NULL);
	CHECK(fetch(c, 11, 0) == NULL); /* asking moves it back to TEMP first */
	CHECK(fetch(c, TEMP, 0) == p[2]);
	q = fetch(c, 11, 2); /* a page of its own at that number */
	CHECK(q != NULL && q != p[2]);
	m.xRekey(c, p[2], TEMP, 2);
	CHECK(fetch(c, 2, 0) == p[2]);
	CHECK(fetch(c, TEMP, 0) == NULL);
	CHECK(fetch(c, 11, 0) == q);
	m.xUnpin(c, q, 1);
	CHECK(fetch(c, 11, 0) == NULL);

	/* Parked and unpinned without discarding: it stays at TEMP, as with SQLite's cache,
	 * and nothing answers for the stand-in number. */
	m.xTruncate(c, 11);
	m.xRekey(c, p[4], 4, TEMP);
	m.xUnpin(c, p[4], 0);
	CHECK(fetch(c, 11, 0) == NULL);
	CHECK(fetch(c, TEMP, 0) == p[4]);
	m.xRekey(c, p[4], TEMP, 4);
	CHECK(fetch(c, 4, 0) == p[4]);

	/* Parked and discarded: gone. */
	m.xTruncate(c, 11);
	m.xRekey(c, p[5], 5, TEMP);
	m.xUnpin(c, p[5], 1);
	CHECK(fetch(c, TEMP, 0) == NULL);
	CHECK(fetch(c, 11, 0) == NULL);
	p[5] = fetch(c, 5, 2);
	CHECK(p[5] != NULL);

	/* A truncation drops the parked page (TEMP is past the limit) with the others past
	 * it, and keeps those below. */
	m.xRekey(c, p[6], 6, TEMP);
	m.xTruncate(c, 6);
	CHECK(fetch(c, TEMP, 0) == NULL);
	CHECK(fetch(c, 11, 0) == NULL);
	for (unsigned k = 6; k <= 10; k++)
		CHECK(fetch(c, k, 0) == NULL);
	for (unsigned k = 1; k <= 5; k++)
		CHECK(fetch(c, k, 0) != NULL);
	CHECK(m.xPagecount(c) == 5);

	/* After the truncation the stand-in is just past the new end: 6. */
	p[6] = fetch(c, 6, 2);
	CHECK(p[6] != NULL);
	m.xRekey(c, p[1], 1, TEMP);
	CHECK(fetch(c, 7, 0) == NULL); /* asked for: the parked page goes back to TEMP */
	q = fetch(c, 7, 2);
	CHECK(q != NULL && q != p[1]);
	CHECK(fetch(c, TEMP, 0) == p[1]);
	m.xRekey(c, p[1], TEMP, 1);
	CHECK(fetch(c, 1, 0) == p[1]);
	CHECK(fetch(c, TEMP, 0) == NULL);

	/* Truncating everything. */
	m.xTruncate(c, 1);
	CHECK(m.xPagecount(c) == 0);
	m.xDestroy(c);
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint64_t next(void)
{
	return test_rand(&rng);
}

#define KEYS 20000

/* Row k's value: its length, then a pattern of k, len bytes in all. */
static void value_of(unsigned k, unsigned len, unsigned char *out)
{
	for (unsigned i = 0; i < len; i++)
		out[i] = (unsigned char)(k * 31u + i * 7u);
}

static bool check_rows(sqlite3 *db, const unsigned short *len)
{
	sqlite3_stmt *st = NULL;
	unsigned char want[1024];
	unsigned k = 0, rows = 0;
	bool ok = true;

	if (sqlite3_prepare_v2(db, "SELECT k, v FROM t ORDER BY k", -1, &st, NULL) != SQLITE_OK)
		return false;
	while (sqlite3_step(st) == SQLITE_ROW) {
		unsigned got = (unsigned)sqlite3_column_int(st, 0);
		const void *v = sqlite3_column_blob(st, 1);
		unsigned n = (unsigned)sqlite3_column_bytes(st, 1);
		for (; k < got && k < KEYS; k++)
			ok = ok && len[k] == 0;
		if (got >= KEYS || len[got] != n) {
			ok = false;
			break;
		}
		value_of(got, n, want);
		ok = ok && memcmp(v, want, n) == 0;
		rows++;
		k = got + 1;
	}
	for (; k < KEYS; k++)
		ok = ok && len[k] == 0;
	sqlite3_finalize(st);
	return ok && rows > 0;
}

static sqlite3 *open_db(const char *path, int cache_pages)
{
	sqlite3 *db = NULL;
	char sql[64];

	if (sqlite3_open(path, &db) != SQLITE_OK) {
		sqlite3_close(db);
		return NULL;
	}
	snprintf(sql, sizeof(sql), "PRAGMA cache_size=%d", cache_pages);
	sqlite3_exec(db, "PRAGMA journal_mode=WAL; PRAGMA synchronous=OFF", NULL, NULL, NULL);
	sqlite3_exec(db, sql, NULL, NULL, NULL);
	return db;
}

static char *integrity(sqlite3 *db)
{
	sqlite3_stmt *st = NULL;
	char *out = NULL;

	if (sqlite3_prepare_v2(db, "PRAGMA integrity_check", -1, &st, NULL) == SQLITE_OK &&
	    sqlite3_step(st) == SQLITE_ROW)
		out = strdup((const char *)sqlite3_column_text(st, 0));
	sqlite3_finalize(st);
	return out;
}

/* Random inserts, replacements and deletes (the freelist then hands out pages in any
 * order, so balances swap them), in transactions of a few hundred changes. */
static void test_database(int cache_pages)
{
	static unsigned short len[KEYS];
	char path[200];
	unsigned char v[1024];
	sqlite3 *db;
	sqlite3_stmt *put = NULL, *del = NULL;
	unsigned long long parked = pagecache_parked();
	char *ic;

	memset(len, 0, sizeof(len));
	snprintf(path, sizeof(path), "%s/db%d", top, cache_pages);
	db = open_db(path, cache_pages);
	CHECK(db != NULL);
	if (!db)
		return;
	CHECK(sqlite3_exec(db,
	                   "CREATE TABLE t(k INTEGER PRIMARY KEY, v BLOB NOT NULL);"
	                   "CREATE INDEX t_v ON t(v)",
	                   NULL, NULL, NULL) == SQLITE_OK);
	CHECK(sqlite3_prepare_v2(db, "INSERT OR REPLACE INTO t(k, v) VALUES (?, ?)", -1, &put,
	                         NULL) == SQLITE_OK);
	CHECK(sqlite3_prepare_v2(db, "DELETE FROM t WHERE k = ?", -1, &del, NULL) == SQLITE_OK);
	for (int txn = 0; txn < 60; txn++) {
		CHECK(sqlite3_exec(db, "BEGIN", NULL, NULL, NULL) == SQLITE_OK);
		for (int i = 0; i < 400; i++) {
			unsigned k = (unsigned)(next() % KEYS);
			/* Deletes outnumber inserts in every third transaction: the trees shrink.
			 */
			bool remove = next() % 3 == 0 || (txn % 3 == 2 && next() % 2 == 0);
			if (remove) {
				sqlite3_bind_int(del, 1, (int)k);
				CHECK(sqlite3_step(del) == SQLITE_DONE);
				sqlite3_reset(del);
				len[k] = 0;
				continue;
			}
			unsigned n = 1 + (unsigned)(next() % 900);
			value_of(k, n, v);
			sqlite3_bind_int(put, 1, (int)k);
			sqlite3_bind_blob(put, 2, v, (int)n, SQLITE_STATIC);
			CHECK(sqlite3_step(put) == SQLITE_DONE);
			sqlite3_reset(put);
			len[k] = (unsigned short)n;
		}
		CHECK(sqlite3_exec(db, "COMMIT", NULL, NULL, NULL) == SQLITE_OK);
	}
	sqlite3_finalize(put);
	sqlite3_finalize(del);
	/* The balances went through the layer. */
	CHECK(pagecache_parked() > parked);
	CHECK(check_rows(db, len));
	ic = integrity(db);
	CHECK_STR(ic, "ok");
	free(ic);
	CHECK(sqlite3_close(db) == SQLITE_OK);

	/* What the file holds, read through a cache that starts empty. */
	db = open_db(path, cache_pages);
	CHECK(db != NULL);
	CHECK(db && check_rows(db, len));
	ic = db ? integrity(db) : NULL;
	CHECK_STR(ic, "ok");
	free(ic);
	sqlite3_close(db);
}

static void remove_tree(void)
{
	char cmd[220];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", top);
	CHECK(system(cmd) == 0);
}

int main(void)
{
	const char *tmp = getenv("TMPDIR");

	snprintf(top, sizeof(top), "%s/test_pagecache.XXXXXX", tmp && *tmp ? tmp : "/tmp");
	if (!mkdtemp(top)) {
		perror("mkdtemp");
		return 1;
	}
	CHECK(pagecache_install() == 0);
	CHECK(pagecache_install() == 0); /* once is enough, twice harmless */
	/* The methods SQLite now uses are the layer's (asked before SQLite starts up). */
	CHECK(sqlite3_config(SQLITE_CONFIG_GETPCACHE2, &m) == SQLITE_OK);
	CHECK(m.xRekey != NULL && m.xTruncate != NULL);
	CHECK(sqlite3_initialize() == SQLITE_OK);
	if (m.xCreate)
		test_methods();
	test_database(2000); /* SQLite's default */
	test_database(16);   /* a cache smaller than one balance: pages spill and are evicted */
	test_database(-32768);
	remove_tree();
	return test_done("pagecache");
}
