/* Unit tests for daemon/walvfs: a commit's WAL frames go to the file in one write, and are
 * there when the commit returns (a copy of the files taken then, as a crash would leave
 * them, holds it); transactions bigger than one write, rolled back after spilling frames,
 * without memory to gather, or failing on the way (the file size limit) leave the same
 * database as the default VFS; a commit whose sync failed is not in a crash's copy through
 * WALVFS_SYNCED_NAME, and when its spoiling fails too, that is logged. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sqlite3.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "test.h"
#include "walvfs.h"

static char top[160];

/* alloc_fail.h routes the allocations of walvfs.c (and of this file) here: walvfs's buffer
 * can be refused. */
static bool refuse_realloc;

void *test_malloc(size_t n)
{
	return (malloc)(n);
}

void *test_calloc(size_t n, size_t size)
{
	return (calloc)(n, size);
}

void *test_realloc(void *p, size_t n)
{
	return refuse_realloc ? NULL : (realloc)(p, n);
}

char *test_strdup(const char *s)
{
	return (strdup)(s);
}

char *test_strndup(const char *s, size_t n)
{
	return (strndup)(s, n);
}

void test_free(void *p)
{
	(free)(p);
}

/* The syncs of SQLite's unix VFS, failed with EIO while fail_syncs is set, as a failing
 * disk would (the executable's definitions come before libc's). */
static bool fail_syncs;

int fsync(int fd)
{
	if (fail_syncs) {
		errno = EIO;
		return -1;
	}
	return (int)syscall(SYS_fsync, fd);
}

int fdatasync(int fd)
{
	if (fail_syncs) {
		errno = EIO;
		return -1;
	}
	return (int)syscall(SYS_fdatasync, fd);
}

/* The writes of one WAL frame header alone (24 bytes), which only walvfs's spoiling makes
 * once the commit's frames are gathered, failed with EIO while fail_header_writes is set;
 * refused_writes counts them. SQLite's unix VFS writes with pwrite64 on Linux (osPwrite64:
 * the library imports it, not pwrite). */
static bool fail_header_writes;
static int refused_writes;

ssize_t pwrite64(int fd, const void *p, size_t n, off64_t off)
{
	if (fail_header_writes && n == 24) {
		refused_writes++;
		errno = EIO;
		return -1;
	}
	return (ssize_t)syscall(SYS_pwrite64, fd, p, n, off);
}

static void path_of(char *out, size_t n, const char *dir, const char *file)
{
	snprintf(out, n, "%s/%s/%s", top, dir, file);
}

static sqlite3 *open_db(const char *dir, const char *vfs_name)
{
	char path[320], d[256];
	sqlite3 *db = NULL;

	snprintf(d, sizeof(d), "%s/%s", top, dir);
	mkdir(d, 0700);
	path_of(path, sizeof(path), dir, "t.db");
	if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, vfs_name) !=
	    SQLITE_OK) {
		fprintf(stderr, "open %s: %s\n", path, db ? sqlite3_errmsg(db) : "?");
		sqlite3_close(db);
		return NULL;
	}
	/* As the store: WAL, no sync at commit, no automatic checkpoint (the WAL keeps
	 * everything, so that a copy of it is what is checked). */
	if (sqlite3_exec(db,
	                 "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"
	                 " PRAGMA wal_autocheckpoint=0;"
	                 " CREATE TABLE IF NOT EXISTS t(k INTEGER PRIMARY KEY, v BLOB NOT NULL);",
	                 NULL, NULL, NULL) != SQLITE_OK) {
		fprintf(stderr, "setup: %s\n", sqlite3_errmsg(db));
		sqlite3_close(db);
		return NULL;
	}
	return db;
}

static int64_t query_int(sqlite3 *db, const char *sql)
{
	sqlite3_stmt *st = NULL;
	int64_t v = -1;

	if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) == SQLITE_OK &&
	    sqlite3_step(st) == SQLITE_ROW)
		v = sqlite3_column_int64(st, 0);
	sqlite3_finalize(st);
	return v;
}

/* Rows k in [from, from + n), each of `bytes` bytes of a pattern of k, in one transaction
 * (committed, or rolled back when `rollback`): the SQLite result. */
static int put_rows(sqlite3 *db, int64_t from, int n, int bytes, bool rollback)
{
	sqlite3_stmt *st = NULL;
	unsigned char *v = malloc((size_t)bytes);
	int rc = v ? sqlite3_exec(db, "BEGIN", NULL, NULL, NULL) : SQLITE_NOMEM;

	if (rc == SQLITE_OK)
		rc = sqlite3_prepare_v2(db, "INSERT OR REPLACE INTO t(k, v) VALUES(?1, ?2)", -1,
		                        &st, NULL);
	for (int i = 0; rc == SQLITE_OK && i < n; i++) {
		for (int b = 0; b < bytes; b++)
			v[b] = (unsigned char)((from + i) * 31 + b);
		sqlite3_bind_int64(st, 1, from + i);
		sqlite3_bind_blob(st, 2, v, bytes, SQLITE_STATIC);
		rc = sqlite3_step(st);
		rc = rc == SQLITE_DONE ? SQLITE_OK : rc;
		sqlite3_reset(st);
	}
	sqlite3_finalize(st);
	free(v);
	if (rc == SQLITE_OK)
		rc = sqlite3_exec(db, rollback ? "ROLLBACK" : "COMMIT", NULL, NULL, NULL);
	if (rc != SQLITE_OK && !sqlite3_get_autocommit(db))
		sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
	return rc;
}

/* Do rows [from, from + n) hold what put_rows wrote? */
static bool rows_hold(sqlite3 *db, int64_t from, int n, int bytes)
{
	sqlite3_stmt *st = NULL;
	bool ok =
	    sqlite3_prepare_v2(db, "SELECT v FROM t WHERE k = ?1", -1, &st, NULL) == SQLITE_OK;

	for (int i = 0; ok && i < n; i++) {
		const unsigned char *v;
		sqlite3_bind_int64(st, 1, from + i);
		ok = sqlite3_step(st) == SQLITE_ROW && sqlite3_column_bytes(st, 0) == bytes;
		v = ok ? sqlite3_column_blob(st, 0) : NULL;
		for (int b = 0; ok && b < bytes; b++)
			ok = v[b] == (unsigned char)((from + i) * 31 + b);
		sqlite3_reset(st);
	}
	sqlite3_finalize(st);
	return ok;
}

static int copy_file(const char *from_dir, const char *to_dir, const char *name)
{
	char a[320], b[320], buf[65536];
	FILE *in, *out;
	size_t n;
	int rc = 0;

	path_of(a, sizeof(a), from_dir, name);
	path_of(b, sizeof(b), to_dir, name);
	snprintf(buf, sizeof(buf), "%s/%s", top, to_dir);
	mkdir(buf, 0700);
	if (!(in = fopen(a, "rb")))
		return -errno;
	if (!(out = fopen(b, "wb"))) {
		fclose(in);
		return -errno;
	}
	while ((n = fread(buf, 1, sizeof(buf), in)) > 0)
		if (fwrite(buf, 1, n, out) != n)
			rc = -EIO;
	fclose(in);
	if (fclose(out) != 0)
		rc = -EIO;
	return rc;
}

/* The copy of dir's files, as a kill -9 would leave them, opened by the default VFS. */
static sqlite3 *crash_copy(const char *dir, const char *to)
{
	char d[256];

	snprintf(d, sizeof(d), "%s/%s", top, to);
	mkdir(d, 0700);
	if (copy_file(dir, to, "t.db") < 0 || copy_file(dir, to, "t.db-wal") < 0)
		return NULL;
	return open_db(to, NULL);
}

/* Commits of a few pages each: one write a commit, and every commit in the file when it
 * returned. */
static void test_one_write_a_commit(void)
{
	struct walvfs_counts c0, c1;
	sqlite3 *db = open_db("small", WALVFS_NAME), *copy;

	CHECK(db != NULL);
	if (!db)
		return;
	CHECK(put_rows(db, 0, 1, 10, false) == SQLITE_OK); /* the WAL's header is written */
	walvfs_counts(&c0);
	for (int t = 0; t < 100; t++)
		CHECK(put_rows(db, 1000 + t * 1000 + (t * 7919) % 500, 10, 300, false) ==
		      SQLITE_OK);
	walvfs_counts(&c1);
	printf("small commits: %llu writes, %llu pieces gathered\n", c1.writes - c0.writes,
	       c1.gathered - c0.gathered);
	/* Each commit: at least two pages (leaf, and a parent or the first page), four writes
	 * of SQLite's, gathered into one of ours. */
	CHECK(c1.writes - c0.writes == 100);
	CHECK(c1.gathered - c0.gathered >= 4 * 100);
	/* synchronous=NORMAL: commits sync nothing. */
	CHECK(c1.wal_syncs == c0.wal_syncs && c1.other_syncs == c0.other_syncs);
	CHECK((copy = crash_copy("small", "small-crash")) != NULL);
	if (copy) {
		CHECK(query_int(copy, "SELECT count(*) FROM t") == 1 + 100 * 10);
		for (int t = 0; t < 100; t++)
			CHECK(rows_hold(copy, 1000 + t * 1000 + (t * 7919) % 500, 10, 300));
		CHECK(query_int(copy, "SELECT count(*) FROM pragma_integrity_check"
		                      " WHERE integrity_check = 'ok'") == 1);
		sqlite3_close(copy);
	}
	CHECK(sqlite3_close(db) == SQLITE_OK);
}

/* The syncs are counted by file: at synchronous=FULL one of the WAL per commit, nothing of
 * the database's; a checkpoint syncs the WAL before it copies it and the database after. */
static void test_syncs_counted(void)
{
	struct walvfs_counts c0, c1, c2;
	sqlite3 *db = open_db("syncs", WALVFS_NAME);

	CHECK(db != NULL);
	if (!db)
		return;
	CHECK(sqlite3_exec(db, "PRAGMA synchronous=FULL", NULL, NULL, NULL) == SQLITE_OK);
	CHECK(put_rows(db, 0, 1, 10, false) == SQLITE_OK);
	walvfs_counts(&c0);
	for (int t = 0; t < 10; t++)
		CHECK(put_rows(db, 100 + t * 10, 5, 100, false) == SQLITE_OK);
	walvfs_counts(&c1);
	printf("10 commits at FULL: %llu WAL syncs, %llu others\n", c1.wal_syncs - c0.wal_syncs,
	       c1.other_syncs - c0.other_syncs);
	CHECK(c1.wal_syncs - c0.wal_syncs == 10);
	CHECK(c1.other_syncs == c0.other_syncs);
	CHECK(sqlite3_wal_checkpoint_v2(db, NULL, SQLITE_CHECKPOINT_TRUNCATE, NULL, NULL) ==
	      SQLITE_OK);
	walvfs_counts(&c2);
	printf("a checkpoint: %llu WAL syncs, %llu others\n", c2.wal_syncs - c1.wal_syncs,
	       c2.other_syncs - c1.other_syncs);
	CHECK(c2.wal_syncs - c1.wal_syncs >= 1);
	CHECK(c2.other_syncs - c1.other_syncs >= 1);
	CHECK(sqlite3_close(db) == SQLITE_OK);
}

/* A transaction of far more than one write holds (GATHER_MAX), and so does one rolled back
 * after spilling frames to the WAL (a cache of a few pages). */
static void test_big_and_rolled_back(void)
{
	struct walvfs_counts c0, c1;
	sqlite3 *db = open_db("big", WALVFS_NAME), *copy;

	CHECK(db != NULL);
	if (!db)
		return;
	walvfs_counts(&c0);
	CHECK(put_rows(db, 0, 400, 3000, false) == SQLITE_OK); /* about 1.2 MB */
	walvfs_counts(&c1);
	printf("big commit: %llu writes, %llu pieces gathered\n", c1.writes - c0.writes,
	       c1.gathered - c0.gathered);
	CHECK(c1.writes - c0.writes >= 10 && c1.writes - c0.writes < 100);
	CHECK(sqlite3_exec(db, "PRAGMA cache_size=5", NULL, NULL, NULL) == SQLITE_OK);
	CHECK(put_rows(db, 100000, 300, 3000, true) == SQLITE_OK);
	CHECK(put_rows(db, 200000, 5, 100, false) == SQLITE_OK);
	CHECK(query_int(db, "SELECT count(*) FROM t") == 405);
	CHECK((copy = crash_copy("big", "big-crash")) != NULL);
	if (copy) {
		CHECK(query_int(copy, "SELECT count(*) FROM t") == 405);
		CHECK(rows_hold(copy, 0, 400, 3000));
		CHECK(rows_hold(copy, 200000, 5, 100));
		CHECK(query_int(copy, "SELECT count(*) FROM t WHERE k >= 100000 AND k < 200000") ==
		      0);
		CHECK(query_int(copy, "SELECT count(*) FROM pragma_integrity_check"
		                      " WHERE integrity_check = 'ok'") == 1);
		sqlite3_close(copy);
	}
	CHECK(sqlite3_close(db) == SQLITE_OK);
}

/* Without memory for gathering, SQLite's writes go through one by one, and hold. */
static void test_no_memory(void)
{
	struct walvfs_counts c0, c1;
	sqlite3 *db, *copy;

	refuse_realloc = true; /* from the first write on: the buffer is never made */
	walvfs_counts(&c0);
	if (!(db = open_db("nomem", WALVFS_NAME))) {
		refuse_realloc = false;
		CHECK(db != NULL);
		return;
	}
	for (int t = 0; t < 20; t++)
		CHECK(put_rows(db, t * 1000, 10, 300, false) == SQLITE_OK);
	walvfs_counts(&c1);
	refuse_realloc = false;
	CHECK(c1.gathered == c0.gathered);
	CHECK(c1.writes - c0.writes >= 21 * 4);
	CHECK(put_rows(db, 100000, 10, 300, false) == SQLITE_OK);
	walvfs_counts(&c0);
	CHECK(c0.gathered > c1.gathered);
	CHECK((copy = crash_copy("nomem", "nomem-crash")) != NULL);
	if (copy) {
		CHECK(query_int(copy, "SELECT count(*) FROM t") == 21 * 10);
		for (int t = 0; t < 20; t++)
			CHECK(rows_hold(copy, t * 1000, 10, 300));
		CHECK(rows_hold(copy, 100000, 10, 300));
		sqlite3_close(copy);
	}
	CHECK(sqlite3_close(db) == SQLITE_OK);
}

/* A commit whose write fails (the WAL would pass the process's file size limit) fails, and
 * leaves the database as it was; with room again, commits go on. */
static void test_write_fails(void)
{
	struct rlimit saved, lim;
	sqlite3 *db = open_db("limit", WALVFS_NAME), *copy;
	char wal[320];
	struct stat sb;
	int rc;

	CHECK(db != NULL);
	if (!db)
		return;
	CHECK(put_rows(db, 0, 20, 200, false) == SQLITE_OK);
	path_of(wal, sizeof(wal), "limit", "t.db-wal");
	CHECK(stat(wal, &sb) == 0);
	CHECK(getrlimit(RLIMIT_FSIZE, &saved) == 0);
	signal(SIGXFSZ, SIG_IGN);
	lim = saved;
	lim.rlim_cur = (rlim_t)sb.st_size + 20000;
	CHECK(setrlimit(RLIMIT_FSIZE, &lim) == 0);
	rc = put_rows(db, 1000, 40, 1000, false); /* about 40 kB: past the limit */
	CHECK(setrlimit(RLIMIT_FSIZE, &saved) == 0);
	signal(SIGXFSZ, SIG_DFL);
	CHECK(rc != SQLITE_OK);
	CHECK(query_int(db, "SELECT count(*) FROM t") == 20);
	CHECK(put_rows(db, 2000, 40, 1000, false) == SQLITE_OK);
	CHECK(query_int(db, "SELECT count(*) FROM t") == 60);
	CHECK((copy = crash_copy("limit", "limit-crash")) != NULL);
	if (copy) {
		CHECK(query_int(copy, "SELECT count(*) FROM t") == 60);
		CHECK(rows_hold(copy, 0, 20, 200) && rows_hold(copy, 2000, 40, 1000));
		sqlite3_close(copy);
	}
	CHECK(sqlite3_close(db) == SQLITE_OK);
}

/* The files name the VFS stack: "convod-wal/unix" (SQLITE_FCNTL_VFSNAME, which the CLI's
 * .vfsname shows); the default VFS's files name only theirs. */
static void test_vfs_name(void)
{
	char *name = NULL, *plain = NULL;
	sqlite3 *db = open_db("name", WALVFS_NAME), *db2 = open_db("name2", NULL);

	CHECK(db && db2);
	if (db && db2) {
		const char *below = sqlite3_vfs_find(NULL)->zName;
		char want[64];
		snprintf(want, sizeof(want), "%s/%s", WALVFS_NAME, below);
		CHECK(sqlite3_file_control(db, "main", SQLITE_FCNTL_VFSNAME, &name) == SQLITE_OK);
		CHECK(name && strcmp(name, want) == 0);
		CHECK(sqlite3_file_control(db2, "main", SQLITE_FCNTL_VFSNAME, &plain) == SQLITE_OK);
		CHECK(plain && strcmp(plain, below) == 0);
	}
	sqlite3_free(name);
	sqlite3_free(plain);
	sqlite3_close(db);
	sqlite3_close(db2);
}

/* A commit at synchronous=FULL whose sync fails: SQLite answers it as failed, and a copy of
 * the files as a crash would leave them does not hold it either through
 * WALVFS_SYNCED_NAME (the commit frame is spoiled); through WALVFS_NAME, as through SQLite's
 * own VFS, it does. The next commit goes on from where the failed one began. */
static void failed_sync(const char *vfs_name, bool spoiled)
{
	char dir[32], crash[40];
	struct walvfs_counts c0, c1;
	sqlite3 *db, *copy;

	snprintf(dir, sizeof(dir), "fsync-%s", vfs_name);
	snprintf(crash, sizeof(crash), "%s-crash", dir);
	if (!(db = open_db(dir, vfs_name))) {
		CHECK(false);
		return;
	}
	CHECK(sqlite3_exec(db, "PRAGMA synchronous=FULL; PRAGMA checkpoint_fullfsync=ON", NULL,
	                   NULL, NULL) == SQLITE_OK);
	CHECK(put_rows(db, 0, 3, 100, false) == SQLITE_OK);
	walvfs_counts(&c0);
	fail_syncs = true;
	CHECK((put_rows(db, 100, 5, 300, false) & 0xff) == SQLITE_IOERR);
	fail_syncs = false;
	walvfs_counts(&c1);
	CHECK(c1.spoiled - c0.spoiled == (spoiled ? 1 : 0));
	CHECK(query_int(db, "SELECT count(*) FROM t") == 3);
	CHECK((copy = crash_copy(dir, crash)) != NULL);
	if (copy) {
		printf("%s: after a failed sync, a crash leaves %lld rows of 3 + 5\n", vfs_name,
		       (long long)query_int(copy, "SELECT count(*) FROM t"));
		CHECK(query_int(copy, "SELECT count(*) FROM t") == (spoiled ? 3 : 8));
		sqlite3_close(copy);
	}
	if (spoiled) {
		/* The next commit overwrites the spoiled frame; both it and what came before
		 * it are in a crash's copy. */
		CHECK(put_rows(db, 200, 2, 100, false) == SQLITE_OK);
		CHECK((copy = crash_copy(dir, crash)) != NULL);
		if (copy) {
			CHECK(query_int(copy, "SELECT count(*) FROM t") == 5);
			CHECK(rows_hold(copy, 0, 3, 100) && rows_hold(copy, 200, 2, 100));
			CHECK(query_int(copy, "SELECT count(*) FROM pragma_integrity_check"
			                      " WHERE integrity_check = 'ok'") == 1);
			sqlite3_close(copy);
		}
	}
	CHECK(sqlite3_close(db) == SQLITE_OK);
}

static void test_failed_sync_spoils_the_commit(void)
{
	failed_sync(WALVFS_SYNCED_NAME, true);
	failed_sync(WALVFS_NAME, false);
}

/* A commit made at synchronous=NORMAL (the store's fold, at durability machine) stands once
 * written: a checkpoint's sync that fails right after it spoils nothing (with
 * checkpoint_fullfsync, as the store runs, it is told from a commit's). */
static void test_failed_checkpoint_sync_spoils_nothing(void)
{
	struct walvfs_counts c0, c1;
	sqlite3 *db = open_db("ckpt", WALVFS_SYNCED_NAME), *copy;

	if (!db) {
		CHECK(false);
		return;
	}
	CHECK(sqlite3_exec(db, "PRAGMA checkpoint_fullfsync=ON", NULL, NULL, NULL) == SQLITE_OK);
	CHECK(put_rows(db, 0, 3, 100, false) == SQLITE_OK);
	walvfs_counts(&c0);
	CHECK(put_rows(db, 100, 5, 300, false) == SQLITE_OK);
	fail_syncs = true;
	CHECK(sqlite3_wal_checkpoint_v2(db, NULL, SQLITE_CHECKPOINT_PASSIVE, NULL, NULL) !=
	      SQLITE_OK);
	fail_syncs = false;
	walvfs_counts(&c1);
	CHECK(c1.spoiled == c0.spoiled);
	CHECK((copy = crash_copy("ckpt", "ckpt-crash")) != NULL);
	if (copy) {
		CHECK(query_int(copy, "SELECT count(*) FROM t") == 8);
		CHECK(rows_hold(copy, 100, 5, 300));
		sqlite3_close(copy);
	}
	CHECK(sqlite3_close(db) == SQLITE_OK);
}

/* A transaction that spills pages to the WAL and then changes one of them again: SQLite
 * rewrites that frame in place and, after the commit frame, the checksums of the frames
 * from there on (walRewriteChecksums). Its sync failing still spoils the commit. */
static void test_failed_sync_after_checksum_rewrite(void)
{
	struct walvfs_counts c0, c1;
	sqlite3 *db = open_db("recksum", WALVFS_SYNCED_NAME), *copy;

	if (!db) {
		CHECK(false);
		return;
	}
	CHECK(sqlite3_exec(db,
	                   "PRAGMA synchronous=FULL; PRAGMA checkpoint_fullfsync=ON;"
	                   " PRAGMA cache_size=4",
	                   NULL, NULL, NULL) == SQLITE_OK);
	CHECK(put_rows(db, 0, 3, 100, false) == SQLITE_OK);
	walvfs_counts(&c0);
	fail_syncs = true;
	CHECK(sqlite3_exec(db, "BEGIN", NULL, NULL, NULL) == SQLITE_OK);
	CHECK(sqlite3_exec(db,
	                   "WITH RECURSIVE n(k) AS (SELECT 100 UNION ALL SELECT k + 1 FROM n"
	                   " WHERE k < 399) INSERT INTO t(k, v) SELECT k, randomblob(300) FROM n;"
	                   " UPDATE t SET v = randomblob(100) WHERE k IN (0, 100, 101);",
	                   NULL, NULL, NULL) == SQLITE_OK);
	CHECK((sqlite3_exec(db, "COMMIT", NULL, NULL, NULL) & 0xff) == SQLITE_IOERR);
	if (!sqlite3_get_autocommit(db))
		sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
	fail_syncs = false;
	walvfs_counts(&c1);
	CHECK(c1.spoiled - c0.spoiled == 1);
	CHECK((copy = crash_copy("recksum", "recksum-crash")) != NULL);
	if (copy) {
		CHECK(query_int(copy, "SELECT count(*) FROM t") == 3);
		CHECK(rows_hold(copy, 0, 3, 100));
		sqlite3_close(copy);
	}
	CHECK(sqlite3_close(db) == SQLITE_OK);
}

/* A commit whose sync fails, and whose spoiling fails too (its write refused): the commit is
 * answered as failed as before, the failed spoiling is logged and counted (a crash before the
 * next commit brings the commit back, as without the spoiling). The next commit overwrites
 * its frames: the database, and a crash's copy after it, hold what came before and that
 * commit, and pass the integrity check. */
static void test_failed_spoil_is_logged(void)
{
	struct walvfs_counts c0, c1;
	sqlite3 *db = open_db("nospoil", WALVFS_SYNCED_NAME), *copy;
	char *out;
	int rc;

	if (!db) {
		CHECK(false);
		return;
	}
	CHECK(sqlite3_exec(db, "PRAGMA synchronous=FULL; PRAGMA checkpoint_fullfsync=ON", NULL,
	                   NULL, NULL) == SQLITE_OK);
	CHECK(put_rows(db, 0, 3, 100, false) == SQLITE_OK);
	walvfs_counts(&c0);
	refused_writes = 0;
	capture_begin();
	fail_syncs = fail_header_writes = true;
	rc = put_rows(db, 100, 5, 300, false);
	fail_syncs = fail_header_writes = false;
	out = capture_end();
	walvfs_counts(&c1);
	printf("a failed spoiling logs: %s", out ? out : "(nothing)\n");
	CHECK((rc & 0xff) == SQLITE_IOERR);
	CHECK(refused_writes == 1);
	CHECK(c1.spoiled == c0.spoiled);
	CHECK(c1.spoil_failed - c0.spoil_failed == 1);
	CHECK(out && strstr(out, "error store: ") &&
	      strstr(out, "/nospoil/t.db-wal: a commit whose sync failed could not be spoiled") &&
	      strstr(out, "errno 5)"));
	free(out);
	CHECK(query_int(db, "SELECT count(*) FROM t") == 3);
	CHECK((copy = crash_copy("nospoil", "nospoil-crash")) != NULL);
	if (copy) {
		CHECK(query_int(copy, "SELECT count(*) FROM t") == 8);
		sqlite3_close(copy);
	}
	CHECK(put_rows(db, 200, 2, 100, false) == SQLITE_OK);
	CHECK(query_int(db, "SELECT count(*) FROM t") == 5);
	CHECK(rows_hold(db, 0, 3, 100) && rows_hold(db, 200, 2, 100));
	CHECK(query_int(db, "SELECT count(*) FROM pragma_integrity_check"
	                    " WHERE integrity_check = 'ok'") == 1);
	CHECK((copy = crash_copy("nospoil", "nospoil-crash")) != NULL);
	if (copy) {
		CHECK(query_int(copy, "SELECT count(*) FROM t") == 5);
		CHECK(rows_hold(copy, 0, 3, 100) && rows_hold(copy, 200, 2, 100));
		CHECK(query_int(copy, "SELECT count(*) FROM pragma_integrity_check"
		                      " WHERE integrity_check = 'ok'") == 1);
		sqlite3_close(copy);
	}
	CHECK(sqlite3_close(db) == SQLITE_OK);
}

static void remove_tree(void)
{
	char cmd[256];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", top);
	if (system(cmd) != 0)
		fprintf(stderr, "could not remove %s\n", top);
}

int main(void)
{
	const char *tmp = getenv("TMPDIR");

	snprintf(top, sizeof(top), "%s/test_walvfs.XXXXXX", tmp && *tmp ? tmp : "/tmp");
	if (!mkdtemp(top)) {
		perror("mkdtemp");
		return 1;
	}
	CHECK(walvfs_register() == 0);
	CHECK(walvfs_register() == 0); /* once is enough, twice harmless */
	CHECK(sqlite3_vfs_find(WALVFS_NAME) != NULL);
	CHECK(sqlite3_vfs_find(WALVFS_SYNCED_NAME) != NULL);
	CHECK(sqlite3_vfs_find(NULL) != sqlite3_vfs_find(WALVFS_NAME));
	test_one_write_a_commit();
	test_syncs_counted();
	test_big_and_rolled_back();
	test_no_memory();
	test_write_fails();
	test_vfs_name();
	test_failed_sync_spoils_the_commit();
	test_failed_checkpoint_sync_spoils_nothing();
	test_failed_sync_after_checksum_rewrite();
	test_failed_spoil_is_logged();
	remove_tree();
	return test_done("walvfs");
}
