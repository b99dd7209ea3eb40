/* Message records: one version of one message as the local store keeps it (its sort key,
 * version, update time, the version the client's to_messages_map has seen, and its map,
 * packed by message_pack or as JSON text), back to back in a byte string. A turn's records
 * make one row of the store's batches, a conversation's records one row of its segments. */
#ifndef CONVOD_MSGREC_H
#define CONVOD_MSGREC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "buf.h"

#define MSGREC_CONV_MAX 65535u /* conversation ids are far shorter (max 256 bytes) */
#define MSGREC_SK_MAX 255u

/* A record's fields; the pointers borrow from the bytes it was read from. */
struct msgrec {
	const char *conv; /* may be empty: segments name the conversation in their row */
	size_t conv_len;
	const char *sk;
	size_t sk_len;
	uint32_t version;
	uint32_t client_seen;
	int64_t updated_ms;
	const char *map; /* the message map: packed (message_pack), else JSON text */
	size_t map_len;
	bool packed; /* convod before schema 4 wrote JSON text */
};

/* Appends r to b. 0, -EINVAL (a field over its limit: conv over MSGREC_CONV_MAX, sk over
 * MSGREC_SK_MAX or empty, map over 4 GiB) or -ENOMEM (b unchanged). */
int msgrec_append(struct buf *b, const struct msgrec *r);

/* Reads the record at data[*pos..len) into r and moves *pos past it: 1, or 0 at the end,
 * or -EINVAL for bytes that are not a whole record (a damaged row; *pos unchanged). A caller
 * that knows a whole record is there may pass len = SIZE_MAX - (uintptr_t)data. */
int msgrec_next(const char *data, size_t len, size_t *pos, struct msgrec *r);

#endif
