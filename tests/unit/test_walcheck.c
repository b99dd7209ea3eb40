/* Unit tests for daemon/walcheck, on WAL files SQLite wrote (a copy taken while the database
 * is open, as a crash leaves it), then altered: what walcheck says SQLite's recovery keeps
 * is what SQLite then reads from the same files (its row count), and the whole commits it
 * says are dropped are those after the altered frame. */
#include <fcntl.h>
#include <sqlite3.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test.h"
#include "walcheck.h"

#define ROWS 20
#define VALUE_BYTES 700 /* a frame or two a row */

static char top[160];

struct bytes {
	unsigned char *p;
	size_t n;
};

static int read_file(const char *path, struct bytes *b)
{
	struct stat st;
	int fd = open(path, O_RDONLY);

	b->p = NULL;
	b->n = 0;
	if (fd < 0 || fstat(fd, &st) < 0 || !(b->p = malloc((size_t)st.st_size + 1)) ||
	    read(fd, b->p, (size_t)st.st_size) != st.st_size) {
		if (fd >= 0)
			close(fd);
		return -1;
	}
	b->n = (size_t)st.st_size;
	close(fd);
	return 0;
}

static int write_file(const char *path, const unsigned char *p, size_t n)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
	bool ok = fd >= 0 && write(fd, p, n) == (ssize_t)n;

	if (fd >= 0)
		close(fd);
	return ok ? 0 : -1;
}

static uint32_t be32(const unsigned char *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* A database in dir/t.db, WAL mode, no automatic checkpoint, table t. */
static sqlite3 *open_db(const char *name)
{
	char path[320];
	sqlite3 *db = NULL;

	snprintf(path, sizeof(path), "%s/%s", top, name);
	if (sqlite3_open(path, &db) != SQLITE_OK ||
	    sqlite3_exec(db,
	                 "PRAGMA journal_mode=WAL; PRAGMA wal_autocheckpoint=0;"
	                 " CREATE TABLE IF NOT EXISTS t(k INTEGER PRIMARY KEY, v BLOB NOT NULL);",
	                 NULL, NULL, NULL) != SQLITE_OK) {
		fprintf(stderr, "open %s: %s\n", path, db ? sqlite3_errmsg(db) : "?");
		sqlite3_close(db);
		return NULL;
	}
	return db;
}

/* Rows [from, to), each its own commit. */
static bool put_rows(sqlite3 *db, int from, int to)
{
	bool ok = true;

	for (int k = from; ok && k < to; k++) {
		char sql[128];
		snprintf(sql, sizeof(sql), "INSERT INTO t VALUES(%d, randomblob(%d))", k,
		         VALUE_BYTES);
		ok = sqlite3_exec(db, sql, NULL, NULL, NULL) == SQLITE_OK;
	}
	return ok;
}

/* The bytes of name and name-wal as they are now, the database open (as a crash leaves
 * them). Whether the WAL holds a header at least. */
static bool snapshot(const char *name, struct bytes *db, struct bytes *wal)
{
	char path[320];

	snprintf(path, sizeof(path), "%s/%s", top, name);
	CHECK(read_file(path, db) == 0);
	snprintf(path, sizeof(path), "%s/%s-wal", top, name);
	CHECK(read_file(path, wal) == 0);
	return wal->p && wal->n >= 32;
}

/* The rows SQLite reads from db + wal written under name/ (-1: no table t at all). */
static int64_t rows_read(const char *name, const struct bytes *db, const struct bytes *wal)
{
	char dir[256], path[320];
	sqlite3 *c = NULL;
	sqlite3_stmt *st = NULL;
	int64_t rows = -1;

	snprintf(dir, sizeof(dir), "%s/%s", top, name);
	mkdir(dir, 0700);
	snprintf(path, sizeof(path), "%s/t.db", dir);
	if (write_file(path, db->p, db->n) < 0)
		return -2;
	snprintf(path, sizeof(path), "%s/t.db-wal", dir);
	if (write_file(path, wal->p, wal->n) < 0)
		return -2;
	snprintf(path, sizeof(path), "%s/t.db", dir);
	if (sqlite3_open(path, &c) == SQLITE_OK &&
	    sqlite3_prepare_v2(c, "SELECT count(*) FROM t", -1, &st, NULL) == SQLITE_OK &&
	    sqlite3_step(st) == SQLITE_ROW)
		rows = sqlite3_column_int64(st, 0);
	sqlite3_finalize(st);
	sqlite3_close(c);
	return rows;
}

/* walcheck_scan on wal's bytes, told the database's page size is hint. */
static int scan_hint(const char *name, const struct bytes *wal, uint32_t hint, struct walcheck *w)
{
	char path[320];
	int fd, rc;

	snprintf(path, sizeof(path), "%s/%s.wal", top, name);
	if (write_file(path, wal->p, wal->n) < 0 || (fd = open(path, O_RDONLY)) < 0)
		return -1;
	rc = walcheck_scan(fd, hint, w);
	close(fd);
	return rc;
}

/* The same, told the page size the databases here have (SQLite's default). */
static int scan(const char *name, const struct bytes *wal, struct walcheck *w)
{
	return scan_hint(name, wal, 4096, w);
}

static size_t frame_size(const struct bytes *wal)
{
	return 24 + (size_t)be32(wal->p + 8);
}

static bool is_commit(const struct bytes *wal, int64_t j)
{
	return be32(wal->p + 32 + (size_t)(j - 1) * frame_size(wal) + 4) != 0;
}

/* Commit frames in (from, to]. */
static int64_t commits_in(const struct bytes *wal, int64_t from, int64_t to)
{
	int64_t n = 0;

	for (int64_t j = from + 1; j <= to; j++)
		n += is_commit(wal, j);
	return n;
}

/* The copy with byte `at` of frame j (or of the header when j is 0) changed. */
static struct bytes altered(const struct bytes *wal, int64_t j, size_t at)
{
	struct bytes b = {malloc(wal->n), wal->n};

	memcpy(b.p, wal->p, wal->n);
	b.p[(j ? 32 + (size_t)(j - 1) * frame_size(wal) : 0) + at] ^= 0x40;
	return b;
}

static void test_intact_and_damaged(void)
{
	struct bytes db, wal;
	struct walcheck w;
	int64_t frames, commits;
	sqlite3 *live = open_db("live.db");

	CHECK(live && put_rows(live, 0, ROWS));
	if (!snapshot("live.db", &db, &wal)) {
		sqlite3_close(live);
		return;
	}
	frames = (int64_t)((wal.n - 32) / frame_size(&wal));
	commits = commits_in(&wal, 0, frames);
	CHECK(commits == ROWS + 1); /* the CREATE TABLE, then one a row */

	/* As written: everything kept, nothing dropped. */
	CHECK(scan("intact", &wal, &w) == 0);
	CHECK(w.header_ok);
	CHECK(w.page_size == 4096);
	CHECK(w.frames == frames);
	CHECK(w.kept_frames == frames);
	CHECK(w.kept_commits == commits);
	CHECK(w.first_bad == 0 && w.lost_commits == 0 && w.last_lost == 0);
	CHECK(w.last_own == frames);
	CHECK(rows_read("intact", &db, &wal) == ROWS);

	/* A byte of a page in the middle: the commits after it are whole, and lost. */
	for (int64_t j = frames / 2; j <= frames / 2 + 1; j++) {
		struct bytes bad = altered(&wal, j, 24 + 1000);
		int64_t kept = commits_in(&wal, 0, j - 1), lost = commits_in(&wal, j, frames);
		CHECK(scan("page", &bad, &w) == 0);
		CHECK(w.header_ok);
		CHECK(w.kept_commits == kept);
		CHECK(w.first_bad == j);
		CHECK(w.lost_commits == lost && lost > 0);
		CHECK(w.last_lost == frames && w.last_own == frames);
		/* What SQLite reads: the rows of the commits kept (the first made the table). */
		CHECK(rows_read("page", &db, &bad) == kept - 1);
		free(bad.p);
	}

	/* A frame's salt: the same. */
	{
		struct bytes bad = altered(&wal, 5, 9);
		CHECK(scan("salt", &bad, &w) == 0);
		CHECK(w.first_bad == 5 && w.kept_commits == commits_in(&wal, 0, 4));
		CHECK(w.lost_commits == commits_in(&wal, 5, frames));
		CHECK(rows_read("salt", &db, &bad) == commits_in(&wal, 0, 4) - 1);
		free(bad.p);
	}

	/* The last commit frame: nothing whole after it, nothing reported. */
	{
		struct bytes bad = altered(&wal, frames, 24 + 17);
		CHECK(scan("last", &bad, &w) == 0);
		CHECK(w.kept_commits == commits - 1 && w.first_bad == 0 && w.lost_commits == 0);
		CHECK(rows_read("last", &db, &bad) == ROWS - 1);
		free(bad.p);
	}

	/* The header's checkpoint sequence: SQLite drops the whole log, every commit. */
	{
		struct bytes bad = altered(&wal, 0, 13);
		CHECK(scan("header", &bad, &w) == 0);
		CHECK(!w.header_ok && w.kept_commits == 0);
		CHECK(w.first_bad == 1 && w.lost_commits == commits);
		CHECK(rows_read("header", &db, &bad) == -1); /* the table is in the WAL */
		free(bad.p);
	}

	/* A page size of 1 in the header: no WAL page size (the database header's 1 for 65536
	 * is not the WAL's), so SQLite ignores the file. walcheck reads the frames at the
	 * database's page size, or with none known, reads none. */
	{
		struct bytes bad = altered(&wal, 0, 0);
		bad.p[0] = wal.p[0];
		memcpy(bad.p + 8, "\0\0\0\1", 4);
		CHECK(scan_hint("size1", &bad, 0, &w) == 0);
		CHECK(!w.header_ok && w.page_size == 0 && w.frames == 0 && w.lost_commits == 0);
		CHECK(scan("size1", &bad, &w) == 0);
		CHECK(!w.header_ok && w.page_size == 4096 && w.frames == frames);
		CHECK(w.first_bad == 1 && w.lost_commits == commits && w.last_lost == frames);
		CHECK(rows_read("size1", &db, &bad) == -1);
		free(bad.p);
	}

	/* The header's salts, and the low bit of its magic number (the checksums' byte order):
	 * SQLite ignores the file; the frames, read with frame 1's salts and either byte
	 * order, hold every commit. */
	for (size_t at = 3; at <= 22; at += at == 3 ? 14 : 5) {
		struct bytes bad = altered(&wal, 0, at);
		if (at == 3)
			bad.p[3] = wal.p[3] ^ 1;
		CHECK(scan("header-fields", &bad, &w) == 0);
		CHECK(!w.header_ok && w.first_bad == 1 && w.lost_commits == commits);
		CHECK(rows_read("header-fields", &db, &bad) == -1);
		free(bad.p);
	}

	/* The commit frame of the last commit but one: the last commit is dropped too, intact,
	 * with a broken commit before it, which tells it from a power loss during the last
	 * commit's write. */
	{
		int64_t c2 = frames - 1;
		while (c2 > 0 && !is_commit(&wal, c2))
			c2--;
		struct bytes bad = altered(&wal, c2, 24 + 2000);
		CHECK(scan("second-last", &bad, &w) == 0);
		CHECK(w.first_bad == c2 && w.kept_commits == commits - 2);
		CHECK(w.lost_commits == 1 && w.last_lost == frames && w.last_own == frames);
		CHECK(w.broken_commits == 1);
		CHECK(rows_read("second-last", &db, &bad) == ROWS - 2);
		free(bad.p);
	}

	/* A frame's stored checksum: the frame after it still counts as intact (its checksum
	 * follows from the one computed for the damaged frame). */
	{
		int64_t j = frames / 2;
		struct bytes bad = altered(&wal, j, 17);
		CHECK(scan("stored-sum", &bad, &w) == 0);
		CHECK(w.first_bad == j && w.lost_commits == commits_in(&wal, j, frames));
		CHECK(w.kept_commits == commits_in(&wal, 0, j - 1));
		CHECK(rows_read("stored-sum", &db, &bad) == w.kept_commits - 1);
		free(bad.p);
	}

	/* Cut in the middle of the last frame, as a crash during the write: a torn end. */
	{
		struct bytes cut = {wal.p, wal.n - 100};
		CHECK(scan("cut", &cut, &w) == 0);
		CHECK(w.frames == frames - 1);
		CHECK(w.kept_commits == commits_in(&wal, 0, frames - 1));
		CHECK(w.first_bad == 0 && w.lost_commits == 0);
		CHECK(rows_read("cut", &db, &cut) == w.kept_commits - 1);
	}

	/* Shorter than a header, and empty. */
	{
		struct bytes part = {wal.p, 20};
		CHECK(scan("short", &part, &w) == 0);
		CHECK(!w.header_ok && w.frames == 0 && w.lost_commits == 0 && w.first_bad == 0);
		part.n = 0;
		CHECK(scan("empty", &part, &w) == 0);
		CHECK(!w.header_ok && w.frames == 0 && w.lost_commits == 0);
	}

	/* Restarted: after a checkpoint, new commits are written from the start with new
	 * salts, over the old frames that remain after them. Those end the log normally. */
	{
		struct bytes db2, wal2;
		int64_t frames2, end2;
		CHECK(sqlite3_exec(live, "PRAGMA wal_checkpoint(RESTART)", NULL, NULL, NULL) ==
		      SQLITE_OK);
		CHECK(put_rows(live, ROWS, ROWS + 2));
		CHECK(snapshot("live.db", &db2, &wal2));
		CHECK(wal2.n == wal.n); /* not truncated: the old frames are there */
		CHECK(be32(wal2.p + 16) != be32(wal.p + 16));
		frames2 = (int64_t)((wal2.n - 32) / frame_size(&wal2));
		CHECK(scan("restarted", &wal2, &w) == 0);
		CHECK(w.header_ok && w.frames == frames2);
		CHECK(w.kept_commits == 2 && w.kept_frames < frames2);
		end2 = w.kept_frames;
		CHECK(w.first_bad == 0 && w.lost_commits == 0);
		CHECK(rows_read("restarted", &db2, &wal2) == ROWS + 2);
		/* The new first commit's first frame altered: the second is lost, the old
		 * frames after it are not counted. */
		{
			struct bytes bad = altered(&wal2, 1, 24 + 50);
			CHECK(scan("restarted-bad", &bad, &w) == 0);
			CHECK(w.kept_commits == 0 && w.first_bad == 1);
			CHECK(w.lost_commits == commits_in(&wal2, 1, end2) && w.lost_commits >= 1);
			CHECK(w.last_lost == end2);
			CHECK(rows_read("restarted-bad", &db2, &bad) == ROWS);
			free(bad.p);
		}
		free(db2.p);
		free(wal2.p);
	}
	free(db.p);
	free(wal.p);
	sqlite3_close(live);
}

/* The last commit of a file, of several frames, one of which is not as written (a power
 * loss while the commit was written): that commit alone is dropped, and it ends the frames
 * of this WAL (last_lost == last_own), which tells it from damage before it. */
static void test_last_commit_cut(void)
{
	struct bytes db, wal;
	struct walcheck w;
	int64_t frames, start = 0;
	sqlite3 *live = open_db("tail.db");

	CHECK(live && put_rows(live, 0, 3));
	CHECK(sqlite3_exec(live, "BEGIN", NULL, NULL, NULL) == SQLITE_OK);
	CHECK(put_rows(live, 3, 13));
	CHECK(sqlite3_exec(live, "COMMIT", NULL, NULL, NULL) == SQLITE_OK);
	if (!snapshot("tail.db", &db, &wal)) {
		sqlite3_close(live);
		return;
	}
	frames = (int64_t)((wal.n - 32) / frame_size(&wal));
	CHECK(is_commit(&wal, frames));
	for (int64_t j = 1; j < frames; j++)
		if (is_commit(&wal, j))
			start = j + 1; /* the last commit's first frame */
	CHECK(start > 1 && frames - start >= 2);
	{
		struct bytes bad = altered(&wal, start, 24 + 300);
		CHECK(scan("tail", &bad, &w) == 0);
		CHECK(w.header_ok && w.first_bad == start);
		CHECK(w.kept_commits == 4); /* the table, then three rows */
		CHECK(w.lost_commits == 1 && w.last_lost == frames && w.last_own == frames);
		CHECK(w.broken_commits == 0);
		CHECK(rows_read("tail", &db, &bad) == 3);
		free(bad.p);
	}
	free(db.p);
	free(wal.p);
	sqlite3_close(live);
}

/* Random damage: a byte of the header or of any frame changed, or the file cut anywhere,
 * 300 times over. Whatever it is, the commits walcheck says recovery keeps are those
 * SQLite's recovery keeps (the rows it reads: one a commit but the table's first; none and
 * no table when it keeps nothing), and what it says is dropped lies after first_bad. */
static void test_random_damage(void)
{
	struct bytes db, wal;
	struct walcheck w;
	uint64_t rng = 0x9e3779b97f4a7c15ull;
	int agree = 0, dropped = 0;
	sqlite3 *live = open_db("random.db");

	CHECK(live && put_rows(live, 0, ROWS));
	if (!snapshot("random.db", &db, &wal)) {
		sqlite3_close(live);
		return;
	}
	int64_t last_start = (int64_t)((wal.n - 32) / frame_size(&wal));
	while (last_start > 1 && !is_commit(&wal, last_start - 1))
		last_start--; /* the first frame of the last commit */
	for (int i = 0; i < 300; i++) {
		struct bytes bad = {malloc(wal.n), wal.n};
		int64_t rows, frame = -1; /* the frame changed (0: the header), -1: a cut */

		memcpy(bad.p, wal.p, wal.n);
		if (i % 10 == 9) {
			bad.n = (size_t)(test_rand(&rng) % wal.n);
		} else {
			/* Mostly in the frame headers and the header, where a byte means most. */
			size_t at = (size_t)(test_rand(&rng) % wal.n), fs = frame_size(&wal);
			if (i % 3 == 0 && at >= 32)
				at = 32 + (at - 32) / fs * fs + (size_t)(test_rand(&rng) % 24);
			else if (i % 3 == 1)
				at = (size_t)(test_rand(&rng) % 32);
			bad.p[at] ^= (unsigned char)(1 + test_rand(&rng) % 255);
			frame = at < 32 ? 0 : (int64_t)((at - 32) / fs) + 1;
		}
		CHECK(scan("random", &bad, &w) == 0);
		rows = rows_read("random", &db, &bad);
		agree += rows == w.kept_commits - 1;
		if (rows != w.kept_commits - 1)
			fprintf(stderr,
			        "damage %d: SQLite reads %lld rows, walcheck keeps %lld commits\n",
			        i, (long long)rows, (long long)w.kept_commits);
		CHECK(w.kept_frames <= w.frames && w.last_lost <= w.frames);
		CHECK(!w.lost_commits || (w.first_bad >= 1 && w.last_lost >= w.first_bad));
		CHECK(w.kept_commits + w.lost_commits <= ROWS + 1);
		/* SQLite lost rows to a change before the last commit: walcheck tells. */
		if (frame >= 0 && frame < last_start && rows < ROWS && !w.lost_commits) {
			fprintf(stderr,
			        "damage %d (frame %lld): SQLite reads %lld rows, nothing told\n", i,
			        (long long)frame, (long long)rows);
			CHECK(w.lost_commits > 0);
		}
		dropped += w.lost_commits > 0;
		free(bad.p);
	}
	CHECK(agree == 300);
	CHECK(dropped > 100); /* most damage is before the end */
	fprintf(stderr, "random damage: %d of 300 agree with SQLite, %d drop intact commits\n",
	        agree, dropped);
	free(db.p);
	free(wal.p);
	sqlite3_close(live);
}

static void remove_tree(void)
{
	char cmd[200];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", top);
	if (system(cmd) != 0)
		fprintf(stderr, "cannot remove %s\n", top);
}

int main(void)
{
	const char *tmp = getenv("TMPDIR");

	snprintf(top, sizeof(top), "%s/test_walcheck.XXXXXX", tmp && *tmp ? tmp : "/tmp");
	if (!mkdtemp(top)) {
		perror("mkdtemp");
		return 1;
	}
	test_intact_and_damaged();
	test_last_commit_cut();
	test_random_damage();
	remove_tree();
	return test_done("walcheck");
}
