/* pagecache: SQLite's default page cache behind a thin layer that keeps the page numbers it
 * holds near the database's end, so that ending a write transaction stays cheap. */
#ifndef CONVOD_PAGECACHE_H
#define CONVOD_PAGECACHE_H

/* Installs the layer for the whole process, once; later calls only return the first one's
 * result. It must run before anything initializes SQLite (opening a connection, finding or
 * registering a VFS). Thread-safe. 0, or -EBUSY when SQLite was initialized first (SQLite's
 * own cache then stays, which is only slower). */
int pagecache_install(void);

/* Pages the layer parked near the database's end instead of at SQLite's temporary page
 * number, since the process started. */
unsigned long long pagecache_parked(void);

#endif
