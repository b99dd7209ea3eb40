/* walcheck: reads an SQLite WAL file as SQLite's recovery will, and tells whether whole
 * commits lie beyond the point where that recovery stops: a WAL damaged after it was
 * written, whose later commits SQLite drops without a word. */
#ifndef CONVOD_WALCHECK_H
#define CONVOD_WALCHECK_H

#include <stdbool.h>
#include <stdint.h>

/* Frames are counted from 1, as SQLite does. A frame is "whole" when its salts are the
 * header's and its checksum follows from the checksum stored in the frame before it (the
 * header's, for frame 1): what it would be had nothing been changed since it was written.
 * SQLite's recovery keeps the frames up to the last commit of the run of whole frames that
 * starts at frame 1, if the header itself is whole; frames of an earlier WAL (other salts)
 * end that run as the normal end of the log. */
struct walcheck {
	bool header_ok;       /* magic, version, page size and checksum of the header */
	uint32_t page_size;   /* from the header (0 when it names none) */
	int64_t frames;       /* complete frames in the file */
	int64_t kept_frames;  /* the frames recovery keeps (up to its last commit) */
	int64_t kept_commits; /* the commits among them */
	int64_t first_bad;    /* the first frame recovery rejects while the file holds more
	                       * whole commits of this WAL after it (1 when the header is
	                       * not whole); 0 when nothing whole is dropped */
	int64_t lost_commits; /* whole commit frames of this WAL at or after first_bad */
	int64_t last_lost;    /* the last of them */
	int64_t last_own;     /* the last frame with this WAL's salts, whole or not */
};

/* Reads the WAL open on fd from its start (pread). 0, or -errno when a read failed. A file
 * shorter than a header gives header_ok false and nothing else. */
int walcheck_scan(int fd, struct walcheck *out);

#endif
