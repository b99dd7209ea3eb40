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

/* The op named by s, or OP_UNKNOWN. */
enum op ops_lookup(const char *s);
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

#endif
