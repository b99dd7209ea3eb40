/* The DynamoDB item codec of persistence.md ("DynamoDB item layout"): one item per message
 * in AttributeValue JSON and back, DynamoDB's item size and nesting rules, and the JSON
 * bodies of the requests the flusher and restore send (BatchWriteItem, Query, CreateTable)
 * with the parsing of their answers. Builds and reads JSON only; sending is the daemon's. */
#ifndef CONVO_DDBITEM_H
#define CONVO_DDBITEM_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "ulid.h"

#define DDBITEM_MAX_BYTES 409600       /* 400 KB per item */
#define DDBITEM_MAX_DEPTH 32           /* nesting levels, the top-level attribute being level 1 */
#define DDBITEM_BATCH_MAX 25           /* put requests per BatchWriteItem */
#define DDBITEM_PARTITION_KEY_MAX 2048 /* bytes of a partition key value */
#define DDBITEM_SK_MAX (2 * ULID_LEN + 1) /* "<last summarized id>~<summary id>" */

/* JSON value -> AttributeValue: null -> NULL, bool -> BOOL, number -> N, string -> S,
 * array -> L, object -> M. A real keeps a '.' or an exponent in its N text so that it reads
 * back as a real. New reference in *out. ERR_OK, ERR_BAD_REQUEST (a number outside
 * DynamoDB's range, absurd nesting) or ERR_INTERNAL (out of memory). */
enum error_code ddbitem_attr_from_json(const json_t *v, json_t **out, struct error *err);

/* AttributeValue -> JSON, the inverse of ddbitem_attr_from_json: N text of integer syntax
 * becomes an integer (a real when it overflows), any other N a real. Types the codec never
 * writes (B, SS, NS, BS) are refused. New reference in *out. ERR_OK, ERR_BAD_REQUEST
 * (malformed) or ERR_INTERNAL. */
enum error_code ddbitem_attr_to_json(const json_t *av, json_t **out, struct error *err);

/* Sort key of a message map: its id, or for a summary the last of its summaryIds, '~' and
 * its id, so that a Query returns the log in order. Writes a NUL-terminated key to out.
 * ERR_OK or ERR_BAD_REQUEST. */
enum error_code ddbitem_sort_key(const json_t *map, char out[DDBITEM_SK_MAX + 1],
                                 struct error *err);

/* The item of one message: conversation, sk, id, message, metadata (when the map has it),
 * version, updated and, when expires_s > 0, expires (Unix seconds, for a TTL). map is a
 * message map (borrowed; unknown fields refused). Limits are not checked here, see
 * ddbitem_check. New reference in *item. ERR_OK, ERR_BAD_REQUEST or ERR_INTERNAL. */
enum error_code ddbitem_from_map(const char *conversation, const json_t *map, uint32_t version,
                                 int64_t updated_ms, int64_t expires_s, json_t **item,
                                 struct error *err);

/* Reads an item back for a restore: *conversation is borrowed from item (valid while item
 * lives), *map is a new reference the caller owns. Each out pointer may be NULL. The sk must
 * match the message. ERR_OK, ERR_BAD_REQUEST (malformed item) or ERR_INTERNAL; on failure
 * nothing is returned. */
enum error_code ddbitem_to_map(const json_t *item, const char **conversation, json_t **map,
                               uint32_t *version, int64_t *updated_ms, struct error *err);

/* Borrowed key strings of an item (valid while item lives). 0 or -EINVAL. */
int ddbitem_key(const json_t *item, const char **conversation, const char **sk);

/* Size of an item in bytes as DynamoDB counts it (see ddbitem.c). 0 or -EINVAL. */
int ddbitem_size(const json_t *item, size_t *size);

/* Nesting depth of an item: a scalar top-level attribute is 1, each List or Map adds one
 * (an empty one counts as if it held a scalar). 0 or -EINVAL. */
int ddbitem_depth(const json_t *item, int *depth);

/* Can this message ever be stored? Builds its item with the largest version, updated and
 * expires values and checks DynamoDB's limits. ERR_OK, ERR_TOO_LARGE (over
 * DDBITEM_MAX_BYTES or DDBITEM_MAX_DEPTH, or an over-long conversation id), ERR_BAD_REQUEST
 * (not a valid map, or a number DynamoDB cannot hold) or ERR_INTERNAL. */
enum error_code ddbitem_check(const json_t *map, const char *conversation, struct error *err);

/* True for a valid table name: 3 to 255 of [A-Za-z0-9_.-]. */
bool ddbitem_table_name_valid(const char *table);

/* BatchWriteItem body putting items[0..n) (borrowed; 1 to DDBITEM_BATCH_MAX, no two with
 * the same key, since DynamoDB refuses the whole batch then). New reference in *out.
 * ERR_OK, ERR_BAD_REQUEST or ERR_INTERNAL. */
enum error_code ddbitem_batch_write_request(const char *table, json_t *const *items, size_t n,
                                            json_t **out, struct error *err);

/* Parses a successful BatchWriteItem answer: *unprocessed is a new array of the items
 * DynamoDB did not write (empty when all were), to be sent again. ERR_OK, ERR_BAD_REQUEST
 * (malformed answer: the caller should treat the whole batch as unwritten) or ERR_INTERNAL. */
enum error_code ddbitem_batch_write_parse(const char *body, size_t len, const char *table,
                                          json_t **unprocessed, struct error *err);

/* Query body for every item of a conversation in sk order (strongly consistent), starting
 * after start_key (borrowed LastEvaluatedKey of the previous page, or NULL). New reference in
 * *out. ERR_OK, ERR_BAD_REQUEST or ERR_INTERNAL. */
enum error_code ddbitem_query_request(const char *table, const char *conversation,
                                      const json_t *start_key, json_t **out, struct error *err);

/* Parses a Query answer: *items is a new array of items, *last_key a new reference to the
 * LastEvaluatedKey, or NULL on the last page. ERR_OK, ERR_BAD_REQUEST or ERR_INTERNAL. */
enum error_code ddbitem_query_parse(const char *body, size_t len, json_t **items, json_t **last_key,
                                    struct error *err);

/* CreateTable body: key schema conversation (HASH, S) and sk (RANGE, S), on-demand. */
enum error_code ddbitem_create_table_request(const char *table, json_t **out, struct error *err);

/* An error answer of DynamoDB: the exception name (the part of "__type" after '#') and its
 * message, each cut to fit. 0, or -EINVAL when body is not such an answer. */
int ddbitem_error_parse(const char *body, size_t len, char *type, size_t type_size, char *message,
                        size_t message_size);

/* True for the exceptions that reject the request itself, so that sending it again cannot
 * succeed (ValidationException, ...); throttling, server and credential errors are not. */
bool ddbitem_error_permanent(const char *type);

#endif
