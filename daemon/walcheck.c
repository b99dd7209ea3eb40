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

static bool page_size_ok(uint32_t n)
{
	return n >= 512 && n <= 65536 && !(n & (n - 1));
}

/* What a scan of the frames goes by: the header's, or when it is not whole, what the frames
 * themselves suggest. */
struct params {
	bool big;         /* the checksums' byte order */
	bool header_ok;   /* recovery reads the frames at all */
	uint32_t salt[2]; /* this WAL's */
	uint32_t seed[2]; /* frame 1's checksum starts from these (the header's) */
	uint32_t page_size;
};

/* A frame is whole when its salts are this WAL's, its page number is not 0, and its
 * checksum follows from the stored checksum of the frame before it, or from the one
 * computed for that frame (in case that frame's stored checksum is what was damaged);
 * along the run recovery keeps, the two are the same. Adds what it finds to out. */
static int scan_frames(int fd, const struct params *p, int64_t frames, struct walcheck *out)
{
	size_t frame_size = FRAME_HEADER + (size_t)p->page_size;
	uint32_t stored[2] = {p->seed[0], p->seed[1]}, computed[2] = {p->seed[0], p->seed[1]};
	int64_t rejected = p->header_ok ? 0 : 1;
	bool in_run = p->header_ok;
	unsigned char *f = malloc(frame_size);
	int rc = 0;

	if (!f)
		return -ENOMEM;
	out->frames = frames;
	for (int64_t j = 1; j <= out->frames; j++) {
		uint32_t a[2] = {stored[0], stored[1]};
		bool own, whole, commit;

		rc = read_at(fd, f, frame_size, WAL_HEADER + (off_t)(j - 1) * (off_t)frame_size);
		if (rc <= 0) {
			out->frames = j - 1; /* shrunk while read */
			break;
		}
		checksum(p->big, f, 8, a);
		checksum(p->big, f + FRAME_HEADER, p->page_size, a);
		whole = a[0] == be32(f + 16) && a[1] == be32(f + 20);
		if (!whole && (computed[0] != stored[0] || computed[1] != stored[1])) {
			uint32_t b[2] = {computed[0], computed[1]};
			checksum(p->big, f, 8, b);
			checksum(p->big, f + FRAME_HEADER, p->page_size, b);
			if ((whole = b[0] == be32(f + 16) && b[1] == be32(f + 20))) {
				a[0] = b[0];
				a[1] = b[1];
			}
		}
		computed[0] = a[0];
		computed[1] = a[1];
		stored[0] = be32(f + 16);
		stored[1] = be32(f + 20);
		own = be32(f + 8) == p->salt[0] && be32(f + 12) == p->salt[1];
		commit = be32(f + 4) != 0;
		whole = whole && own && be32(f) != 0;
		if (own)
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
		} else if (own && commit) {
			out->broken_commits++;
		}
	}
	free(f);
	if (rc < 0)
		return rc;
	if (out->lost_commits)
		out->first_bad = rejected;
	return 0;
}

int walcheck_scan(int fd, uint32_t page_size_hint, struct walcheck *out)
{
	unsigned char h[WAL_HEADER], fh[FRAME_HEADER];
	uint32_t magic, ps, sum[2] = {0, 0};
	struct walcheck other;
	struct params p;
	struct stat st;
	int64_t frames;
	int rc;

	memset(out, 0, sizeof(*out));
	if ((rc = read_at(fd, h, sizeof(h), 0)) <= 0)
		return rc;
	if (fstat(fd, &st) < 0)
		return -errno;
	magic = be32(h);
	ps = be32(h + 8);
	p.big = magic & 1;
	checksum(p.big, h, 24, sum);
	/* As SQLite's recovery reads the header: the page size as written (the database
	 * header's 1 for 65536 is not taken here). */
	p.header_ok = out->header_ok = (magic & ~1u) == WAL_MAGIC && be32(h + 4) == WAL_VERSION &&
	                               page_size_ok(ps) && sum[0] == be32(h + 24) &&
	                               sum[1] == be32(h + 28);
	/* A header not whole: recovery reads no frame. What the frames hold is looked for all
	 * the same: at the page size the header names, or else the database's. */
	if (!page_size_ok(ps))
		ps = page_size_ok(page_size_hint) ? page_size_hint : 0;
	if (!ps)
		return 0;
	p.page_size = out->page_size = ps;
	p.seed[0] = be32(h + 24);
	p.seed[1] = be32(h + 28);
	p.salt[0] = be32(h + 16);
	p.salt[1] = be32(h + 20);
	frames =
	    st.st_size > WAL_HEADER ? (st.st_size - WAL_HEADER) / (off_t)(FRAME_HEADER + ps) : 0;
	if (p.header_ok || frames == 0)
		return scan_frames(fd, &p, frames, out);
	/* The salts of frame 1, and either byte order: the one under which more commits are
	 * whole. */
	if ((rc = read_at(fd, fh, sizeof(fh), WAL_HEADER)) <= 0)
		return rc;
	p.salt[0] = be32(fh + 8);
	p.salt[1] = be32(fh + 12);
	other = *out;
	if ((rc = scan_frames(fd, &p, frames, out)) < 0)
		return rc;
	p.big = !p.big;
	if ((rc = scan_frames(fd, &p, frames, &other)) < 0)
		return rc;
	if (other.lost_commits > out->lost_commits)
		*out = other;
	return 0;
}
