/* walcheck: the WAL format of SQLite's file format document (section 4): a 32-byte header,
 * then frames of a 24-byte header and a page. Numbers are big-endian; the checksums add
 * 32-bit words in the order the header's magic number names (its lowest bit: big-endian). */
#include "walcheck.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define WAL_MAGIC 0x377f0682u
#define WAL_VERSION 3007000u
#define WAL_HEADER 32
#define FRAME_HEADER 24

static uint32_t be32(const unsigned char *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static uint32_t le32(const unsigned char *p)
{
	return (uint32_t)p[3] << 24 | (uint32_t)p[2] << 16 | (uint32_t)p[1] << 8 | p[0];
}

/* Adds n bytes (a multiple of 8) to the checksum s[2]. */
static void checksum(bool big, const unsigned char *p, size_t n, uint32_t s[2])
{
	uint32_t s1 = s[0], s2 = s[1];

	for (size_t i = 0; i + 8 <= n; i += 8) {
		s1 += (big ? be32(p + i) : le32(p + i)) + s2;
		s2 += (big ? be32(p + i + 4) : le32(p + i + 4)) + s1;
	}
	s[0] = s1;
	s[1] = s2;
}

/* Reads n bytes at off: 1 read, 0 the file ends first, -errno. */
static int read_at(int fd, unsigned char *p, size_t n, off_t off)
{
	size_t got = 0;

	while (got < n) {
		ssize_t r = pread(fd, p + got, n - got, off + (off_t)got);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return -errno;
		if (r == 0)
			return 0;
		got += (size_t)r;
	}
	return 1;
}

int walcheck_scan(int fd, struct walcheck *out)
{
	unsigned char h[WAL_HEADER], *f;
	uint32_t magic, salt1, salt2, prev[2], sum[2];
	bool big, in_run;
	int64_t rejected = 0;
	struct stat st;
	size_t frame_size;
	int rc;

	memset(out, 0, sizeof(*out));
	if ((rc = read_at(fd, h, sizeof(h), 0)) <= 0)
		return rc;
	if (fstat(fd, &st) < 0)
		return -errno;
	magic = be32(h);
	big = magic & 1;
	/* As SQLite's recovery reads it: 65536 is written as such here (the database
	 * header's 1 for 65536 is not taken). */
	out->page_size = be32(h + 8);
	if (out->page_size < 512 || out->page_size > 65536 ||
	    (out->page_size & (out->page_size - 1))) {
		out->page_size = 0;
		return 0;
	}
	sum[0] = sum[1] = 0;
	checksum(big, h, 24, sum);
	out->header_ok = (magic & ~1u) == WAL_MAGIC && be32(h + 4) == WAL_VERSION &&
	                 sum[0] == be32(h + 24) && sum[1] == be32(h + 28);
	salt1 = be32(h + 16);
	salt2 = be32(h + 20);
	prev[0] = be32(h + 24);
	prev[1] = be32(h + 28);
	frame_size = FRAME_HEADER + (size_t)out->page_size;
	out->frames = st.st_size > WAL_HEADER ? (st.st_size - WAL_HEADER) / (off_t)frame_size : 0;
	if (!(f = malloc(frame_size)))
		return -ENOMEM;
	in_run = out->header_ok;
	if (!in_run)
		rejected = 1;
	for (int64_t j = 1; j <= out->frames; j++) {
		bool whole, commit;

		rc = read_at(fd, f, frame_size, WAL_HEADER + (off_t)(j - 1) * (off_t)frame_size);
		if (rc <= 0) {
			out->frames = j - 1; /* shrunk while read */
			break;
		}
		sum[0] = prev[0];
		sum[1] = prev[1];
		checksum(big, f, 8, sum);
		checksum(big, f + FRAME_HEADER, out->page_size, sum);
		prev[0] = be32(f + 16);
		prev[1] = be32(f + 20);
		commit = be32(f + 4) != 0;
		whole = be32(f) != 0 && be32(f + 8) == salt1 && be32(f + 12) == salt2 &&
		        sum[0] == prev[0] && sum[1] == prev[1];
		if (be32(f + 8) == salt1 && be32(f + 12) == salt2)
			out->last_own = j;
		if (in_run && whole) {
			if (commit) {
				out->kept_frames = j;
				out->kept_commits++;
			}
			continue;
		}
		if (in_run) {
			in_run = false;
			rejected = j;
		}
		if (whole && commit) {
			out->lost_commits++;
			out->last_lost = j;
		}
	}
	free(f);
	if (rc < 0)
		return rc;
	if (out->lost_commits)
		out->first_bad = rejected;
	return 0;
}
