/* Test helper shared by test_store and test_alloc_fail: a store turned back into the form
 * an older convod wrote. */
#ifndef CONVOD_TEST_STORE_LEGACY_H
#define CONVOD_TEST_STORE_LEGACY_H

/* Rewrites the rows of table (segments or batches) of the closed store in dir as convod
 * wrote them before schema 4: each packed record as a record of its JSON map, the batches
 * in one table (schema 5 added batches1), user_version 3. Returns the records rewritten,
 * -1 on failure. */
long unpack_rows(const char *dir, const char *table);

#endif
