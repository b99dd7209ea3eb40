/* The JSON face of a conversation: validates one request object of protocol.md for a
 * conversation op and runs it on a struct convo, producing the result object. The daemon
 * owns framing, the registry and the ops that are not about one conversation
 * (list, stats, ping, flush, close). */
#ifndef CONVO_OPS_H
#define CONVO_OPS_H

#include <jansson.h>
#include <stdbool.h>

#include "convo.h"
#include "error.h"

enum op {
	OP_UNKNOWN = 0,
	OP_ADD_USER,
	OP_ADD_ASSISTANT,
	OP_ADD_MESSAGE,
	OP_GET_MESSAGES,
	OP_GET_SUMMARY_INFO,
	OP_ADD_SUMMARY,
	OP_GET_LAST_SUMMARY,
	OP_TO_MESSAGES_MAP,
	OP_SET_METADATA,
	OP_DESCRIBE,
	OP_FLUSH,
	OP_CLOSE,
	OP_LIST,
	OP_STATS,
	OP_PING,
	OP_DEAD_LETTERS,
	OP_RETRY_DEAD_LETTERS,
	OP_CREATE_TABLE,
	OP_COUNT,
};

/* The op named by the len bytes at s (a NUL among them names none), or OP_UNKNOWN. */
enum op ops_lookup(const char *s, size_t len);
/* Wire name of op ("add_user", ...), "unknown" for OP_UNKNOWN. */
const char *ops_name(enum op op);
/* add_user, add_assistant, add_message: may create the conversation. */
bool ops_creates(enum op op);
/* Ops that change a conversation (and so need a durable commit before their answer):
 * add_*, add_summary, set_metadata. to_messages_map only moves the client's bookkeeping
 * (message seen[] and scan_from), so it is not one. */
bool ops_mutates(enum op op);
/* Ops that require the "conversation" field. */
bool ops_needs_conversation(enum op op);
/* Ops for which "conversation" is a field: those that need it, flush (optional), and
 * OP_UNKNOWN, whose fields are not known (a conversation id over the limit is too_large
 * there, first in protocol order). For the others (list, stats, ping, ...) it is an
 * unknown field, ignored like any other. */
bool ops_takes_conversation(enum op op);

/* Checks the fields of req for op without looking at any conversation (types, ranges,
 * unknown keys in metadata/timing/format, blank contents). ERR_OK or ERR_BAD_REQUEST /
 * ERR_TOO_LARGE; ERR_UNKNOWN_OP for OP_UNKNOWN. The daemon calls it before looking the
 * conversation up, so that a bad_request wins over not_found as protocol.md orders them.
 * Optional fields must have their type when present (null is not "absent"); unknown
 * top-level fields are ignored. The daemon's own ops (flush .. ping) pass unchecked. */
enum error_code ops_check(enum op op, const json_t *req, struct error *err);

/* Runs a conversation op (OP_ADD_USER .. OP_DESCRIBE) on c, which the daemon has looked up
 * (or, for ops_creates ops, created empty). req has passed ops_check. On success *result is
 * a new reference to the "result" object and, for mutating ops, *changed says whether c
 * changed (false for a set_metadata that changes nothing). On failure c is unchanged and
 * err is filled: an answer that cannot be built after c changed (ENOMEM) is rolled back.
 * The daemon's own ops (flush .. ping) answer ERR_INTERNAL here. */
enum error_code ops_run(enum op op, struct convo *c, const struct convo_env *env,
			const json_t *req, json_t **result, bool *changed, struct error *err);

struct buf;
/* Writes a result's JSON text into b (ctx is what the op passed along). 0, -ENOMEM, or
 * -EINVAL; the caller resets b on failure. */
typedef int (*ops_write_fn)(struct buf *b, const void *ctx);

/* Delivers a result while the op can still be undone: ops_run_emit calls it once the
 * result is built and before the change (or to_messages_map's marks) becomes final. The
 * result is a jansson value, or (result NULL) write(b, ctx) writes its text straight into
 * the caller's buffer (the adds, get_messages in the meta format and to_messages_map build
 * no tree). A negative return means the result could not be delivered (ENOMEM writing the
 * answer): the op is undone and ERR_INTERNAL returned. The callback borrows what it is
 * given. */
typedef int (*ops_emit_fn)(void *arg, const json_t *result, ops_write_fn write,
			   const void *ctx);

/* ops_run, handing the result to emit instead of returning it: on ERR_OK the result was
 * delivered and the change made; otherwise c is as before and nothing was delivered. */
enum error_code ops_run_emit(enum op op, struct convo *c, const struct convo_env *env,
			     const json_t *req, ops_emit_fn emit, void *emit_arg, bool *changed,
			     struct error *err);

/* add_user, add_assistant or add_message read without jansson (the daemon's reader that
 * builds no tree, jscan.h): the role and the contents strings as given (borrowed), no
 * metadata. */
struct ops_add_args {
	enum role role;
	const char *const *texts;
	const size_t *lens;
	size_t ntexts;
};

/* Runs that add as ops_run_emit would run the same request with jansson, writing the same
 * result ({"message": MAP, "merged": bool}) through emit(arg, NULL, write, ctx). Blank
 * strings are dropped here. The same errors, with c unchanged. */
enum error_code ops_add_direct(struct convo *c, const struct convo_env *env,
			       const struct ops_add_args *a, ops_emit_fn emit, void *emit_arg,
			       bool *changed, struct error *err);

/* get_messages or to_messages_map read without jansson: their options as given. */
struct ops_read_args {
	enum render_format format;      /* get_messages */
	bool incremental, exclude_last; /* to_messages_map */
};

/* Runs get_messages or to_messages_map as ops_run_emit would run the same request with
 * jansson, delivering the same result through emit(arg, ...). ERR_OK, or ERR_INTERNAL
 * (nothing delivered, c unchanged) when it cannot be built or delivered. */
enum error_code ops_read_direct(enum op op, struct convo *c, const struct ops_read_args *a,
                                ops_emit_fn emit, void *emit_arg, struct error *err);

/* True if s[0..len) is empty or only Unicode White_Space (such contents are dropped). */
bool ops_text_blank(const char *s, size_t len);

/* jansson's allocator reports no failure in some paths (its parser drops a byte of a string
 * or calls ENOMEM a syntax error; some setters fail silently). ops_json_alloc_init installs
 * wrappers around m and f that remember a failed allocation; ops_run and the daemon's
 * parser check ops_json_alloc_failed() after their jansson calls and answer internal. */
void ops_json_alloc_init(void *(*m)(size_t), void (*f)(void *));
/* A jansson allocation failed since the last ops_json_alloc_reset. */
bool ops_json_alloc_failed(void);
void ops_json_alloc_reset(void);
/* json_loadb, with *oom set when one of its allocations failed: the result (NULL, or a
 * document that may have lost a byte) is then freed and NULL returned. The failure still
 * counts for ops_json_alloc_failed, whatever it said before. */
json_t *ops_json_loadb(const char *s, size_t n, size_t flags, json_error_t *e, bool *oom);

#endif
