/* walvfs: an SQLite VFS that forwards everything to the default VFS, except that it gathers
 * the frames a transaction appends to a WAL file and writes them in one call when the
 * commit frame is complete.
 *
 * SQLite writes each WAL frame as two writes (its 24-byte header, then the page), so a
 * commit of n pages is 2n system calls; at durability process, where nothing is synced,
 * they were about a quarter of the loop's time in its commits (4.5 pages a commit at 50
 * connections). The gathering keeps what SQLite relies on:
 *
 * - the bytes reach the file in the order SQLite wrote them: only a write that continues
 *   the gathered bytes joins them, and anything else on the file (another write, a read,
 *   a sync, a truncation, its size, a file control, the close) writes them out first;
 * - a commit is on the file before its write returns, so before SQLite publishes it in
 *   the WAL index and before the daemon answers: a failed write (a full disk) fails the
 *   commit, as before;
 * - the only bytes that can wait past a transaction's end are frames of one that was rolled
 *   back before its commit frame; they are written at the next access, where SQLite would
 *   have written them at once, and are past the last valid frame either way. */
#include "walvfs.h"

#include <errno.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

/* sqlite3's WAL format (https://www.sqlite.org/fileformat2.html#walformat) */
#define WAL_FRAME_HEADER 24
/* What one file gathers at most before it writes (a commit of many pages goes in parts):
 * the unix VFS writes at most 128 KiB - 1 bytes in one call (seekAndWriteFd masks the
 * length) and reports the rest as a full disk. */
#define GATHER_MAX (128 * 1024 - 1)

struct wfile {
	sqlite3_file base;  /* pMethods: one of ours */
	sqlite3_file *real; /* the default VFS's file, in the same allocation */
	/* WAL files only: bytes [off, off + len) to write, in buf of cap bytes. */
	unsigned char *buf;
	size_t len, cap;
	sqlite3_int64 off;
	bool want_page; /* a frame header was the last thing gathered */
	bool commit;    /* and it was a commit frame's */
	/* Opened through WALVFS_SYNCED_NAME: a failed sync of a commit spoils the commit. */
	bool spoil;
	/* The offset of the frame whose page is awaited, and of the last commit frame while
	 * nothing but its sync followed it; -1 when none. */
	sqlite3_int64 frame_off, commit_start;
	const char *name; /* SQLite's, valid until the close: for messages */
};

static sqlite3_vfs vfs;
static sqlite3_vfs *base_vfs;
static int register_rc;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static sqlite3_vfs vfs_synced;
static _Atomic unsigned long long n_writes, n_gathered, n_wal_syncs, n_other_syncs, n_spoiled,
    n_spoil_failed;

static const sqlite3_io_methods wal_methods;

#define REAL(f) (((struct wfile *)(f))->real)
#define RM(f) (REAL(f)->pMethods)

/* ---- forwarding, for every file ---- */

static int gather_flush(struct wfile *w)
{
	int rc;

	if (!w->len)
		return SQLITE_OK;
	rc = RM(w)->xWrite(w->real, w->buf, (int)w->len, w->off);
	atomic_fetch_add_explicit(&n_writes, 1, memory_order_relaxed);
	w->len = 0;
	w->want_page = w->commit = false;
	return rc;
}

static int f_close(sqlite3_file *f)
{
	struct wfile *w = (struct wfile *)f;
	int rc = gather_flush(w);
	int rc2 = RM(f)->xClose(w->real);

	free(w->buf);
	w->buf = NULL;
	w->cap = 0;
	return rc != SQLITE_OK ? rc : rc2;
}

static int f_read(sqlite3_file *f, void *p, int n, sqlite3_int64 off)
{
	int rc = gather_flush((struct wfile *)f);
	return rc != SQLITE_OK ? rc : RM(f)->xRead(REAL(f), p, n, off);
}

static int f_truncate(sqlite3_file *f, sqlite3_int64 size)
{
	struct wfile *w = (struct wfile *)f;
	int rc = gather_flush(w);

	w->commit_start = -1;
	return rc != SQLITE_OK ? rc : RM(f)->xTruncate(REAL(f), size);
}

/* A commit whose sync failed is answered as failed, and SQLite forgets it; but its frames
 * are in the WAL file, with valid checksums, and a crash before the next commit overwrites
 * them would bring the commit back at the next open's recovery. Spoiling its commit frame's
 * salts ends the recovery before it: the transaction's other frames, without their commit
 * frame, are ignored. The write goes to the page cache, which a crash of the
 * process keeps; a power cut may keep either, as it may any write whose sync failed. When
 * that write fails too, nothing else can be done here: the error is logged (on the thread
 * that committed; log_msg may be called from the store's writer). */
static void spoil_commit(struct wfile *w)
{
	unsigned char hdr[WAL_FRAME_HEADER];
	int rc, err = 0;

	if (RM(w)->xRead(w->real, hdr, (int)sizeof(hdr), w->commit_start) != SQLITE_OK)
		memset(hdr, 0, sizeof(hdr));
	/* Bytes 8-15: the salts, which must match the WAL header's. */
	for (size_t i = 8; i < 16; i++)
		hdr[i] ^= 0xff;
	rc = RM(w)->xWrite(w->real, hdr, (int)sizeof(hdr), w->commit_start);
	if (rc == SQLITE_OK) {
		atomic_fetch_add_explicit(&n_spoiled, 1, memory_order_relaxed);
		return;
	}
	atomic_fetch_add_explicit(&n_spoil_failed, 1, memory_order_relaxed);
	if (RM(w)->xFileControl(w->real, SQLITE_FCNTL_LAST_ERRNO, &err) != SQLITE_OK)
		err = 0;
	log_msg(LOG_ERROR, "store",
	        "%s: a commit whose sync failed could not be spoiled in the WAL (%s, errno %d): a "
	        "crash before the next commit would bring it back",
	        w->name ? w->name : "?", sqlite3_errstr(rc), err);
}

/* Counted once the real sync succeeded: what walvfs_counts reports as durable. */
static int f_sync(sqlite3_file *f, int flags)
{
	struct wfile *w = (struct wfile *)f;
	int rc = gather_flush(w);
	if (rc == SQLITE_OK && (rc = RM(f)->xSync(REAL(f), flags)) == SQLITE_OK)
		atomic_fetch_add_explicit(f->pMethods == &wal_methods ? &n_wal_syncs
		                                                      : &n_other_syncs,
		                          1, memory_order_relaxed);
	if (f->pMethods == &wal_methods) {
		/* A commit's own sync comes right after its commit frame (and the rewrite of
		 * its frames' checksums), with SQLITE_SYNC_NORMAL: with checkpoint_fullfsync,
		 * the syncs of checkpoints and of the WAL's header come with SQLITE_SYNC_FULL,
		 * and may follow a commit that stands (one at synchronous=NORMAL). */
		if (rc != SQLITE_OK && w->spoil && w->commit_start >= 0 &&
		    (flags & 0x0f) == SQLITE_SYNC_NORMAL)
			spoil_commit(w);
		w->commit_start = -1;
	}
	return rc;
}

static int f_size(sqlite3_file *f, sqlite3_int64 *size)
{
	int rc = gather_flush((struct wfile *)f);
	return rc != SQLITE_OK ? rc : RM(f)->xFileSize(REAL(f), size);
}

static int f_lock(sqlite3_file *f, int lock)
{
	return RM(f)->xLock(REAL(f), lock);
}

static int f_unlock(sqlite3_file *f, int lock)
{
	return RM(f)->xUnlock(REAL(f), lock);
}

static int f_reserved(sqlite3_file *f, int *out)
{
	return RM(f)->xCheckReservedLock(REAL(f), out);
}

static int f_control(sqlite3_file *f, int op, void *arg)
{
	int rc = gather_flush((struct wfile *)f);

	if (rc != SQLITE_OK)
		return rc;
	rc = RM(f)->xFileControl(REAL(f), op, arg);
	if (op == SQLITE_FCNTL_VFSNAME && rc == SQLITE_OK) {
		/* As SQLite asks of a shim: its name, then "/" and what is below. */
		char **name = arg, *below = *name;
		*name = sqlite3_mprintf(
		    "%s/%s", ((struct wfile *)f)->spoil ? WALVFS_SYNCED_NAME : WALVFS_NAME,
		    below ? below : "");
		sqlite3_free(below);
	}
	return rc;
}

static int f_sector(sqlite3_file *f)
{
	return RM(f)->xSectorSize(REAL(f));
}

static int f_caps(sqlite3_file *f)
{
	return RM(f)->xDeviceCharacteristics(REAL(f));
}

static int f_shm_map(sqlite3_file *f, int region, int size, int extend, void volatile **out)
{
	if (RM(f)->iVersion < 2 || !RM(f)->xShmMap)
		return SQLITE_IOERR_SHMMAP;
	return RM(f)->xShmMap(REAL(f), region, size, extend, out);
}

static int f_shm_lock(sqlite3_file *f, int offset, int n, int flags)
{
	if (RM(f)->iVersion < 2 || !RM(f)->xShmLock)
		return SQLITE_IOERR_SHMLOCK;
	return RM(f)->xShmLock(REAL(f), offset, n, flags);
}

static void f_shm_barrier(sqlite3_file *f)
{
	if (RM(f)->iVersion >= 2 && RM(f)->xShmBarrier)
		RM(f)->xShmBarrier(REAL(f));
}

static int f_shm_unmap(sqlite3_file *f, int delete_flag)
{
	if (RM(f)->iVersion < 2 || !RM(f)->xShmUnmap)
		return SQLITE_OK;
	return RM(f)->xShmUnmap(REAL(f), delete_flag);
}

static int f_fetch(sqlite3_file *f, sqlite3_int64 off, int n, void **out)
{
	*out = NULL;
	if (RM(f)->iVersion < 3 || !RM(f)->xFetch)
		return SQLITE_OK;
	return RM(f)->xFetch(REAL(f), off, n, out);
}

static int f_unfetch(sqlite3_file *f, sqlite3_int64 off, void *p)
{
	if (RM(f)->iVersion < 3 || !RM(f)->xUnfetch)
		return SQLITE_OK;
	return RM(f)->xUnfetch(REAL(f), off, p);
}

/* ---- gathering, for WAL files ---- */

static uint32_t get_be32(const unsigned char *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* Appends to the gathered bytes, making room: false when there is none to be had (then
 * nothing changed). */
static bool gather_add(struct wfile *w, const void *p, size_t n)
{
	if (w->len + n > GATHER_MAX)
		return false;
	if (w->len + n > w->cap) {
		size_t cap = w->cap ? w->cap : 32 * 1024;
		unsigned char *nb;
		while (cap < w->len + n)
			cap *= 2;
		if (cap > GATHER_MAX)
			cap = GATHER_MAX;
		if (!(nb = realloc(w->buf, cap)))
			return false;
		w->buf = nb;
		w->cap = cap;
	}
	memcpy(w->buf + w->len, p, n);
	w->len += n;
	return true;
}

/* A frame's header, then its page, each continuing what is gathered, join it; after a
 * commit frame's page everything is written. Any other write writes what is gathered, then
 * itself. */
static int f_write(sqlite3_file *f, const void *p, int n, sqlite3_int64 off)
{
	struct wfile *w = (struct wfile *)f;
	bool follows = !w->len || off == w->off + (sqlite3_int64)w->len;
	bool header = follows && !w->want_page && n == WAL_FRAME_HEADER;
	bool page = follows && w->want_page && w->len;
	int rc;

	if ((header || page) && w->len + (size_t)n > GATHER_MAX) {
		/* A long transaction: what is gathered goes, the frame goes on gathering. */
		bool want_page = w->want_page, commit = w->commit;
		if ((rc = gather_flush(w)) != SQLITE_OK)
			return rc;
		w->want_page = want_page;
		w->commit = commit;
	}
	/* A write past the commit frame, or of another size, begins something else: the
	 * commit is not the one a sync may come for. A frame header at or before it is
	 * SQLite rewriting the transaction's checksums (walRewriteChecksums, after a page
	 * written twice in it), which comes after the commit frame and before its sync. */
	if (n != WAL_FRAME_HEADER || off > w->commit_start)
		w->commit_start = -1;
	if (!(header || page)) {
		if ((rc = gather_flush(w)) != SQLITE_OK)
			return rc;
		atomic_fetch_add_explicit(&n_writes, 1, memory_order_relaxed);
		return RM(f)->xWrite(w->real, p, n, off);
	}
	if (!w->len)
		w->off = off;
	if (!gather_add(w, p, (size_t)n)) {
		/* No memory: SQLite's own write, after what was gathered. */
		if ((rc = gather_flush(w)) != SQLITE_OK)
			return rc;
		atomic_fetch_add_explicit(&n_writes, 1, memory_order_relaxed);
		return RM(f)->xWrite(w->real, p, n, off);
	}
	atomic_fetch_add_explicit(&n_gathered, 1, memory_order_relaxed);
	if (header) {
		w->frame_off = off;
		w->want_page = true;
		/* Bytes 4-7: the database's size in pages after a commit, 0 in other frames. */
		w->commit = get_be32((const unsigned char *)p + 4) != 0;
		return SQLITE_OK;
	}
	w->want_page = false;
	if (!w->commit)
		return SQLITE_OK;
	/* The commit frame, on the file: its sync may come next. (With sector padding, which
	 * the unix VFS does only with psow=0, padding frames follow, and nothing is spoiled.) */
	if ((rc = gather_flush(w)) == SQLITE_OK)
		w->commit_start = w->frame_off;
	return rc;
}

/* Every method forwards; WAL files' xWrite gathers. */
#define IO_METHODS(write)                                                                          \
	{                                                                                          \
		.iVersion = 3, .xClose = f_close, .xRead = f_read, .xWrite = (write),              \
		.xTruncate = f_truncate, .xSync = f_sync, .xFileSize = f_size, .xLock = f_lock,    \
		.xUnlock = f_unlock, .xCheckReservedLock = f_reserved, .xFileControl = f_control,  \
		.xSectorSize = f_sector, .xDeviceCharacteristics = f_caps, .xShmMap = f_shm_map,   \
		.xShmLock = f_shm_lock, .xShmBarrier = f_shm_barrier, .xShmUnmap = f_shm_unmap,    \
		.xFetch = f_fetch, .xUnfetch = f_unfetch,                                          \
	}

static const sqlite3_io_methods wal_methods = IO_METHODS(f_write);

/* Other files (the database, temporary files): the same forwarding, nothing gathered. */
static int p_write(sqlite3_file *f, const void *p, int n, sqlite3_int64 off)
{
	return RM(f)->xWrite(REAL(f), p, n, off);
}

static const sqlite3_io_methods plain_methods = IO_METHODS(p_write);

/* ---- the VFS ---- */

static size_t real_offset(void)
{
	size_t a = sizeof(struct wfile);
	return (a + 15) & ~(size_t)15;
}

static int v_open(sqlite3_vfs *v, const char *name, sqlite3_file *f, int flags, int *out_flags)
{
	struct wfile *w = (struct wfile *)f;
	int rc;

	memset(w, 0, sizeof(*w));
	w->spoil = v == &vfs_synced;
	w->frame_off = w->commit_start = -1;
	w->real = (sqlite3_file *)((char *)f + real_offset());
	w->name = name;
	rc = base_vfs->xOpen(base_vfs, name, w->real, flags, out_flags);
	if (rc != SQLITE_OK || !w->real->pMethods) {
		/* SQLite closes nothing whose pMethods is NULL. */
		if (w->real->pMethods)
			w->real->pMethods->xClose(w->real);
		w->base.pMethods = NULL;
		return rc != SQLITE_OK ? rc : SQLITE_CANTOPEN;
	}
	w->base.pMethods = (flags & SQLITE_OPEN_WAL) ? &wal_methods : &plain_methods;
	return SQLITE_OK;
}

static int v_delete(sqlite3_vfs *v, const char *name, int sync_dir)
{
	(void)v;
	return base_vfs->xDelete(base_vfs, name, sync_dir);
}

static int v_access(sqlite3_vfs *v, const char *name, int flags, int *out)
{
	(void)v;
	return base_vfs->xAccess(base_vfs, name, flags, out);
}

static int v_full(sqlite3_vfs *v, const char *name, int n, char *out)
{
	(void)v;
	return base_vfs->xFullPathname(base_vfs, name, n, out);
}

static void *v_dlopen(sqlite3_vfs *v, const char *name)
{
	(void)v;
	return base_vfs->xDlOpen(base_vfs, name);
}

static void v_dlerror(sqlite3_vfs *v, int n, char *out)
{
	(void)v;
	base_vfs->xDlError(base_vfs, n, out);
}

static void (*v_dlsym(sqlite3_vfs *v, void *h, const char *sym))(void)
{
	(void)v;
	return base_vfs->xDlSym(base_vfs, h, sym);
}

static void v_dlclose(sqlite3_vfs *v, void *h)
{
	(void)v;
	base_vfs->xDlClose(base_vfs, h);
}

static int v_random(sqlite3_vfs *v, int n, char *out)
{
	(void)v;
	return base_vfs->xRandomness(base_vfs, n, out);
}

static int v_sleep(sqlite3_vfs *v, int us)
{
	(void)v;
	return base_vfs->xSleep(base_vfs, us);
}

static int v_time(sqlite3_vfs *v, double *out)
{
	(void)v;
	return base_vfs->xCurrentTime(base_vfs, out);
}

static int v_error(sqlite3_vfs *v, int n, char *out)
{
	(void)v;
	return base_vfs->xGetLastError(base_vfs, n, out);
}

static int v_time64(sqlite3_vfs *v, sqlite3_int64 *out)
{
	(void)v;
	if (base_vfs->iVersion >= 2 && base_vfs->xCurrentTimeInt64)
		return base_vfs->xCurrentTimeInt64(base_vfs, out);
	double d = 0;
	int rc = base_vfs->xCurrentTime(base_vfs, &d);
	*out = (sqlite3_int64)(d * 86400000.0);
	return rc;
}

static void do_register(void)
{
	if (!(base_vfs = sqlite3_vfs_find(NULL))) {
		register_rc = -ENOSYS;
		return;
	}
	vfs = (sqlite3_vfs){
	    .iVersion = 2,
	    .szOsFile = (int)(real_offset() + (size_t)base_vfs->szOsFile),
	    .mxPathname = base_vfs->mxPathname,
	    .zName = WALVFS_NAME,
	    .xOpen = v_open,
	    .xDelete = v_delete,
	    .xAccess = v_access,
	    .xFullPathname = v_full,
	    .xDlOpen = v_dlopen,
	    .xDlError = v_dlerror,
	    .xDlSym = v_dlsym,
	    .xDlClose = v_dlclose,
	    .xRandomness = v_random,
	    .xSleep = v_sleep,
	    .xCurrentTime = v_time,
	    .xGetLastError = v_error,
	    .xCurrentTimeInt64 = v_time64,
	};
	vfs_synced = vfs;
	vfs_synced.zName = WALVFS_SYNCED_NAME;
	register_rc = sqlite3_vfs_register(&vfs, 0) == SQLITE_OK &&
	                      sqlite3_vfs_register(&vfs_synced, 0) == SQLITE_OK
	                  ? 0
	                  : -ENOMEM;
}

int walvfs_register(void)
{
	pthread_once(&once, do_register);
	return register_rc;
}

void walvfs_counts(struct walvfs_counts *out)
{
	out->writes = atomic_load_explicit(&n_writes, memory_order_relaxed);
	out->gathered = atomic_load_explicit(&n_gathered, memory_order_relaxed);
	out->wal_syncs = atomic_load_explicit(&n_wal_syncs, memory_order_relaxed);
	out->other_syncs = atomic_load_explicit(&n_other_syncs, memory_order_relaxed);
	out->spoiled = atomic_load_explicit(&n_spoiled, memory_order_relaxed);
	out->spoil_failed = atomic_load_explicit(&n_spoil_failed, memory_order_relaxed);
}
