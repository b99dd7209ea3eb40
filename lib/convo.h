/* One conversation: the log, the LLM view and its two positions, and every operation of
 * semantics.md on them (add/merge/fake, summaries, message maps, renderings, describe).
 * Pure logic: the caller passes the time and the id generator. */
#ifndef CONVO_CONVO_H
#define CONVO_CONVO_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "message.h"
#include "ulid.h"

struct convo_limits {
	size_t max_messages; /* log entries (fake and summary messages included); 0 = none */
	size_t max_bytes;    /* sum of content bytes over the log; 0 = none */
};

/* What an operation needs from outside: the clock, the id generator and the limits. */
struct convo_env {
	struct ulid_gen *ulid; /* borrowed */
	int64_t now_ms;
	struct convo_limits limits;
};

struct convo {
	char *id; /* NUL-terminated, id_len bytes; after the struct */
	size_t id_len;
	struct message **log;   /* nlog owned messages, in log order */
	size_t nlog, cap;
	size_t first_llm;       /* index of the first LLM message; == nlog when the view is empty at the end */
	long last_summary;      /* index of the last summary, -1 if none */
	size_t text_bytes;      /* sum of message_text_bytes over the log */
	int64_t updated_ms;     /* last change of anything in the conversation */
	size_t scan_from[CONSUMER_COUNT]; /* no message before this index is unseen by that consumer */
	uint64_t client_takes; /* incremental to_messages_map calls that marked something */
	/* The daemon's bookkeeping (dirty lists of the group commit and the flusher, closing);
	 * zeroed by convo_new, never read or written by the library. */
	unsigned int daemon_flags;
	struct convo *daemon_next_store, *daemon_next_sink, *daemon_prev_sink;
	struct convo *daemon_next_marks, *daemon_prev_marks;
	size_t daemon_marks_from;  /* the client's marks may have moved from this index on */
	uint64_t daemon_store_seq; /* the last store transaction that wrote it */
	uint64_t daemon_data_seq;  /* the last that wrote a change of what a read shows (the
	                            * other may only have written its row open again) */
	int64_t daemon_changed_mono_ms; /* mono_ns / 1e6 at the daemon's last change of it, 0
	                                 * before one (the sink's idle rule, over clock steps) */
};

/* New empty conversation named id[0..id_len); caller frees with convo_free. NULL on ENOMEM. */
struct convo *convo_new(const char *id, size_t id_len);
void convo_free(struct convo *c); /* accepts NULL; frees every message */

/* Index of the message with that id, or -1. A binary search (ids increase in log order);
 * a summary is found by a short walk back from where its id would sort. */
long convo_find(const struct convo *c, const char *id, size_t id_len);

/* Adds contents (texts[i] of lens[i] bytes; blank ones already dropped by the caller, at
 * least one left) as role (user/assistant) with the rules of semantics.md: fake user "..."
 * first when role is assistant and the view is empty; merge into the last view message
 * when it has the same role; else a new message. patch (may be NULL) applies to the
 * resulting message; a new message gets version 1 with the patch, a merge increments the
 * version once. Limits: ERR_TOO_LARGE when the log would exceed max_messages or
 * max_bytes. On success *out is the resulting message (borrowed, valid until the next
 * mutation of c) and *merged says whether it was a merge. On failure c is unchanged.
 * New ids are kept above every id of c: a conversation restored with ids ahead of
 * env->ulid (another host's clock) moves the generator forward past them. */
enum error_code convo_add(struct convo *c, const struct convo_env *env, enum role role,
			  const char *const *texts, const size_t *lens, size_t ntexts,
			  const struct metadata_patch *patch, struct message **out, bool *merged,
			  struct error *err);

/* Formatting parts of get_summary_info; convo_summary_format_default() fills the defaults
 * of semantics.md. Strings are borrowed. */
struct summary_format {
	const char *preamble;
	bool include_previous_summary;
	const char *prefix, *postfix, *user_tag, *assistant_tag, *summary_tag, *separator,
		*closure, *summary_closure;
};
void convo_summary_format_default(struct summary_format *f);

/* get_summary_info: {"messages":[{"id","role","contents","index","version"}],
 * "previous_summary": MAP or null, "ids": [...], "versions": [...], "text": "..."}.
 * New reference, NULL on ENOMEM. */
json_t *convo_summary_info(const struct convo *c, const struct summary_format *f);

/* add_summary: validates ids (and versions when nversions != 0, same count as ids) as
 * semantics.md says, returning ERR_BAD_REQUEST (could never be valid) or ERR_CONFLICT (no
 * longer valid) with c unchanged, or inserts the summary after the last named message,
 * moves the positions and sets *out (borrowed). texts as for convo_add. ERR_TOO_LARGE
 * (limits) is checked first, then ERR_BAD_REQUEST wins over ERR_CONFLICT. Cost: one
 * convo_find per id, plus moving the messages after the insertion point. */
enum error_code convo_add_summary(struct convo *c, const struct convo_env *env,
				  const char *const *texts, const size_t *lens, size_t ntexts,
				  const char *const *ids, size_t nids, const int64_t *versions,
				  size_t nversions, struct message **out, struct error *err);

/* The last summary, or NULL. Borrowed. */
struct message *convo_last_summary(const struct convo *c);

/* set_metadata on message index i: applies patch, version+1 and updated_ms only if it
 * changes something. ERR_OK or ERR_INTERNAL (ENOMEM, or i out of range; c unchanged). */
enum error_code convo_set_metadata(struct convo *c, const struct convo_env *env, size_t i,
				   const struct metadata_patch *patch, struct error *err);

/* Calls fn(arg, m, index) for every message that consumer `who` has not taken at its
 * current version, in log order, and marks them taken; with exclude_last the last message
 * of the log is left out (and stays pending). Returns the number of messages passed.
 * Amortised cost: messages passed plus messages between scan_from[who] and the end. */
size_t convo_take(struct convo *c, enum consumer who, bool exclude_last,
		  void (*fn)(void *arg, const struct message *m, size_t index), void *arg);

/* True if consumer `who` has not taken message m at its current version. */
bool convo_pending(const struct message *m, enum consumer who);

/* to_messages_map: incremental=false returns the whole log and moves nothing; otherwise
 * convo_take(CONSUMER_CLIENT, exclude_last) as maps. {"messages": [MAP...]}; new reference
 * or NULL on ENOMEM (then nothing is marked taken). */
json_t *convo_to_messages_map(struct convo *c, bool incremental, bool exclude_last);
/* The two halves of convo_to_messages_map, for a caller that must deliver the result
 * before the messages count as taken: the result alone (marks nothing), then the marks. */
json_t *convo_to_messages_map_build(const struct convo *c, bool incremental, bool exclude_last);
void convo_to_messages_map_taken(struct convo *c, bool exclude_last);

enum render_format { RENDER_META = 0, RENDER_BEDROCK, RENDER_ANTHROPIC, RENDER_OPENAI };
/* Returns the format for a wire name ("meta", ...) or -1. */
int convo_render_format(const char *name);

/* get_messages: {"messages": [the LLM view in that format], "summary": [strings] or null}.
 * New reference or NULL on ENOMEM. */
json_t *convo_get_messages(const struct convo *c, enum render_format fmt);
struct buf;
/* The text of convo_get_messages(c, RENDER_META) (the same bytes buf_append_json would
 * write) written straight into b: get_messages' fast path. 0, -ENOMEM or -EINVAL. */
int convo_write_messages(const struct convo *c, struct buf *b);
/* The text of convo_to_messages_map_build(c, incremental, exclude_last) written straight
 * into b; marks nothing (convo_to_messages_map_taken does). 0, -ENOMEM or -EINVAL. */
int convo_write_messages_map(const struct convo *c, bool incremental, bool exclude_last,
                             struct buf *b);

/* describe: the seed's dump, one row per message:
 *   "META MESSAGES ('*' -> first message to LLM, '-' -> next message to convert into a Map, '^' -> last summary message):\n"
 *   then per message "%-4zu%c%c%c [role] {'c1' 'c2'} -- 'ID' {metadata}": the first marker
 *   column holds '*' (first LLM message) or '^' (last summary), the second '-' (pending
 *   for CONSUMER_CLIENT), the third a space; metadata as in the seed, "attribute=[fake,
 *   merged], summaryIds=[..], aux={json}, timing=[{creation=..}, {playStart=..}]" (unset
 *   parts left out); rows end with ",\n", the last with ".\n"; then ".  - -> index N.\n"
 *   where N is the index of the first message pending for CONSUMER_CLIENT (nlog if none).
 *   NUL bytes of contents are written as the two characters \0.
 * Newly allocated string (free()), NULL on ENOMEM. */
char *convo_describe(const struct convo *c);

/* Restoring a persisted conversation: append m (ownership taken, even on failure) as is,
 * no rules applied. Then convo_restore_finish recomputes positions (last summary = last
 * summary in the log, first LLM = the message after it or 0), text_bytes and updated_ms,
 * and checks the invariants of semantics.md (ERR_INTERNAL naming the broken one). */
int convo_restore_append(struct convo *c, struct message *m);
enum error_code convo_restore_finish(struct convo *c, struct error *err);

/* Checks every invariant of semantics.md (view starts with user, alternates, holds no
 * summary; ids of non-summary messages strictly increasing in log order; positions in range). For tests and fuzzing. */
enum error_code convo_check(const struct convo *c, struct error *err);

#endif
