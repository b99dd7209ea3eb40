/* One message of a conversation log: id, role, contents, metadata and version, and
 * its conversion to the message map of semantics.md ("Mapping the log"). */
#ifndef CONVO_MESSAGE_H
#define CONVO_MESSAGE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "ulid.h"

enum role { ROLE_USER = 0, ROLE_ASSISTANT, ROLE_SUMMARY };

/* The most merges a message can have once accepted: its DynamoDB item must fit in 409,600
 * bytes (DDBITEM_MAX_BYTES; convo.c refuses a change that would not), and each merge takes
 * 7 of them ("merged", an element of a list). message_unpack refuses more, as damage. */
#define MESSAGE_MERGES_MAX (409600u / 7u)

enum timing_key {
	TIMING_CREATION = 0,
	TIMING_PLAY_START,
	TIMING_PLAY_END,
	TIMING_LISTEN_START,
	TIMING_LISTEN_END,
	TIMING_LLM_START,
	TIMING_LLM_END,
	TIMING_COUNT,
};

/* Who keeps track of which version of each message it has taken (see convo_take). */
enum consumer {
	CONSUMER_CLIENT = 0, /* incremental to_messages_map of clients */
	CONSUMER_SINK,       /* the flusher's snapshots towards DynamoDB / the spool */
	CONSUMER_STORE,      /* the local store's group commit */
	CONSUMER_COUNT,
};

/* One content string; may hold NUL bytes, bytes[len] is always NUL. */
struct text {
	uint32_t len;
	char bytes[];
};

/* 112 bytes on 64-bit machines. The timing keys other than creation are rarely set: they
 * live in an array of their own, made by the first one set (message_set_timing); with all
 * seven inline a message took 160. */
struct message {
	char id[ULID_LEN + 1];
	uint8_t role;           /* enum role */
	bool fake;              /* attribute starts with "fake" */
	uint8_t inline_parts;   /* MESSAGE_INLINE_*: what lives in the message's own block */
	uint16_t daemon_mark_hi; /* (see daemon_mark_lo) */
	uint32_t merges;        /* number of "merged" entries in attribute */
	uint32_t version;       /* 1 at creation, +1 per real change */
	uint32_t ncontents;
	uint32_t nsummary_ids;
	struct text **contents; /* ncontents owned strings */
	int64_t creation_ms;    /* timing creation: always set */
	/* The other timing keys, [k - 1] for key k (Unix ms; -1 = unset), owned; NULL while
	 * none was ever set. Read with message_timing; kept until message_free once made. */
	int64_t *timing_more;
	json_t *aux; /* owned object, or NULL when unset (never an empty object) */
	char (*summary_ids)[ULID_LEN + 1]; /* summaries only; owned */
	int64_t updated_ms;     /* Unix ms of the last change */
	uint32_t seen[CONSUMER_COUNT]; /* version each consumer last took; 0 = never */
	/* The daemon's, never read or written by the library: the low 32 bits of the store
	 * transaction that must be written for the client's mark (seen[CONSUMER_CLIENT]) to
	 * stand; daemon_mark_hi has the next 16 (the struct's padding: it stays 112 bytes). */
	uint32_t daemon_mark_lo;
};

/* Timing key k of m: Unix ms, or -1 when unset (creation is always set). */
static inline int64_t message_timing(const struct message *m, enum timing_key k)
{
	if (k == TIMING_CREATION)
		return m->creation_ms;
	return m->timing_more ? m->timing_more[k - 1] : -1;
}
/* Sets timing key k of m to v (-1 unsets it). 0, or -ENOMEM with m unchanged when the
 * array of the other keys had to be made and could not. */
int message_set_timing(struct message *m, enum timing_key k, int64_t v);

/* The whole number v holds, in *out, when it is one from lo to hi: an integer, or a real
 * without a fraction (1000.0, 1e3; JSON does not tell them apart) below 2^53 in magnitude,
 * from which on a double no longer holds every integer the text may have written. */
bool message_json_whole(const json_t *v, int64_t lo, int64_t hi, int64_t *out);

/* All of m's timing keys into out, and back: message_restore_timing never allocates, and
 * what message_get_timing took from m always fits back into m (its array, once made, stays
 * until message_free). An undo's save and restore. */
void message_get_timing(const struct message *m, int64_t out[TIMING_COUNT]);
void message_restore_timing(struct message *m, const int64_t in[TIMING_COUNT]);

/* message_new_text puts the contents array (room for one) and the first text in the
 * message's own allocation; these say which of them still are there. */
#define MESSAGE_INLINE_ARRAY 1u /* contents is the array in the block */
#define MESSAGE_INLINE_TEXT 2u  /* contents[0] is the text in the block */

/* Wire names. */
const char *message_role_str(enum role r);
const char *message_timing_str(enum timing_key k);
/* Returns the key for a wire name, or -1. */
int message_timing_key(const char *name);

/* New message with the given id, role, creation time and no contents; caller frees with
 * message_free. NULL on allocation failure. */
struct message *message_new(const char *id, enum role role, int64_t creation_ms);
void message_free(struct message *m); /* accepts NULL */
/* message_new with s[0..len) as its first content, in one allocation with the message
 * (one malloc instead of three, and about 50 bytes less for a short text). NULL on
 * allocation failure or a text over 4 GiB. */
struct message *message_new_text(const char *id, enum role role, int64_t creation_ms, const char *s,
                                 size_t len);

/* Appends a copy of s[0..len) to m's contents. 0 or -ENOMEM (m unchanged; also for a
 * string over 4 GiB). Amortised O(1): the array doubles. */
int message_append_text(struct message *m, const char *s, size_t len);
/* Drops the contents from index n on (a rolled-back merge); n <= ncontents. */
void message_truncate_contents(struct message *m, uint32_t n);

/* The sort key of persistence.md: the id; for a summary, the last summarized id, '~' and
 * its own id. */
#define MESSAGE_SK_MAX (2 * ULID_LEN + 1)
void message_sort_key(const struct message *m, char out[MESSAGE_SK_MAX + 1]);

/* Sum of the byte lengths of m's contents. */
size_t message_text_bytes(const struct message *m);

/* The message map of semantics.md: {"id","message":{"role","contents"},"metadata":{...}},
 * unset metadata fields absent. New reference, NULL on allocation failure. */
json_t *message_to_map(const struct message *m);

struct buf;
/* Appends the JSON text of message_to_map(m) (the same bytes buf_append_json would write)
 * without building it: the fast path of get_messages. 0, -ENOMEM or -EINVAL (invalid UTF-8;
 * the caller resets b->len either way). */
int message_write_map(struct buf *b, const struct message *m);
/* Appends m's contents as a JSON array of strings. As message_write_map. */
int message_write_contents(struct buf *b, const struct message *m);

/* Validated metadata of a request, ready to be applied without failing. */
struct metadata_patch {
	int64_t timing[TIMING_COUNT]; /* -1 = not given; [TIMING_CREATION] is never given */
	json_t *aux;                  /* borrowed object of aux keys to set (null value = remove), or NULL */
};

/* The error message_patch_parse gives an aux real DynamoDB cannot hold (a part of it). */
#define MESSAGE_AUX_RANGE "holds a number out of DynamoDB's range"

/* Checks `timing` and `aux` (each may be NULL = absent) against semantics.md's
 * set_metadata rules: timing is an object of known keys except creation with integer
 * values >= 0; aux is an object. `where` prefixes field names in error messages
 * ("metadata." or ""). Fills p (aux borrowed from the argument). ERR_OK or ERR_BAD_REQUEST. */
enum error_code message_patch_parse(const json_t *timing, const json_t *aux, const char *where,
				    struct metadata_patch *p, struct error *err);

/* Would applying p change m? */
bool message_patch_changes(const struct message *m, const struct metadata_patch *p);

/* Applies p to m (timing keys set, aux keys set to deep copies or removed; aux becomes NULL
 * when it ends up empty). m->aux is replaced, never modified in place, so maps may share
 * it. Does not touch version or updated_ms. 0, or -ENOMEM with m unchanged (the new aux is
 * built aside and swapped in). */
int message_patch_apply(struct message *m, const struct metadata_patch *p);

/* Rebuilds a message from its map (as stored by the local store or read back from
 * DynamoDB) with the given version; seen[] is 0 and updated_ms the creation time, for the
 * caller to adjust. Caller frees *out. ERR_OK, ERR_BAD_REQUEST, or ERR_INTERNAL (ENOMEM). */
enum error_code message_from_map(const json_t *map, uint32_t version, struct message **out,
				 struct error *err);

/* The packed map: what message_write_map writes, but in a compact binary form for the local
 * store (about a third of the JSON's size for a short text), without the id (the record's
 * sort key ends with it). Appends it to b: 0 or -ENOMEM (the caller resets b->len). */
int message_pack(struct buf *b, const struct message *m);
/* Rebuilds a message from data[0..len) of message_pack, with the given id (not checked
 * here: the caller has it from a sort key) and version, as message_from_map does. Every
 * length is checked against len: the bytes come from a file that may be damaged. ERR_OK,
 * ERR_BAD_REQUEST (not a whole packed map, or a field out of range: invalid UTF-8, an
 * unknown role or flag, no contents or no creation time, an aux that is not a non-empty
 * JSON object, summary ids on another role or not ULIDs) or ERR_INTERNAL (ENOMEM). */
enum error_code message_unpack(const char *data, size_t len, const char *id, uint32_t version,
                               struct message **out, struct error *err);

#endif
