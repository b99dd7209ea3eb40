/* Unit tests for lib/ulid: encoding (vectors computed independently), strict increase within
 * a millisecond, across a clock step back and over a carry, validation and time decoding. */
#include "ulid.h"
#include "test.h"

#include <stdint.h>
#include <string.h>

static void seed_gen(struct ulid_gen *g, uint8_t base)
{
	uint8_t seed[32];
	for (int i = 0; i < 32; i++)
		seed[i] = (uint8_t)(base + i * 7);
	ulid_gen_init(g, seed);
}

/* Forces the generator's last id so that the next one in the same millisecond is known. */
static void set_last(struct ulid_gen *g, uint64_t ms, const uint8_t r[10])
{
	g->started = true;
	g->last_ms = ms;
	memcpy(g->last, r, 10);
}

static void test_vectors(void)
{
	struct ulid_gen g;
	char id[ULID_LEN + 1];
	const uint8_t before[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 9};
	const uint8_t all_ff[10] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
	const uint8_t ffe[10] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe};
	const uint8_t zero[10] = {0};

	seed_gen(&g, 1);
	/* random part 01 02 .. 0A after the increment */
	set_last(&g, 1744815823057, before);
	ulid_gen_next(&g, 1744815823057, id);
	CHECK_STR(id, "01JRZJ166H041061050R3GG28A");
	CHECK(strlen(id) == ULID_LEN);

	set_last(&g, 1744815823057, ffe);
	ulid_gen_next(&g, 1744815823057, id);
	CHECK_STR(id, "01JRZJ166HZZZZZZZZZZZZZZZZ");
	/* carry out of the random part moves to the next millisecond */
	set_last(&g, 1744815823057, all_ff);
	ulid_gen_next(&g, 1744815823057, id);
	CHECK_STR(id, "01JRZJ166J0000000000000000");
	CHECK(g.last_ms == 1744815823058);
	CHECK(ulid_time_ms(id) == 1744815823058);

	set_last(&g, 0, zero);
	ulid_gen_next(&g, 0, id);
	CHECK_STR(id, "00000000000000000000000001");

	/* a clock step back still increments the last id */
	set_last(&g, 1744815823057, before);
	ulid_gen_next(&g, 1000, id);
	CHECK_STR(id, "01JRZJ166H041061050R3GG28A");

	/* the largest time of the format, and a clock beyond it is clamped */
	set_last(&g, (UINT64_C(1) << 48) - 1, ffe);
	ulid_gen_next(&g, UINT64_MAX, id);
	CHECK_STR(id, "7ZZZZZZZZZZZZZZZZZZZZZZZZZ");
	CHECK(ulid_valid(id, ULID_LEN));
}

static void test_fresh_millisecond(void)
{
	struct ulid_gen g;
	char id[ULID_LEN + 1];

	seed_gen(&g, 3);
	ulid_gen_next(&g, 1469918176385, id);
	/* time part of 1469918176385 is "01ARYZ6S41" */
	CHECK(memcmp(id, "01ARYZ6S41", 10) == 0);
	CHECK(ulid_valid(id, ULID_LEN));
	CHECK(ulid_time_ms(id) == 1469918176385);
	CHECK(g.started && g.last_ms == 1469918176385);
}

static void test_monotonic(void)
{
	struct ulid_gen g;
	char prev[ULID_LEN + 1], id[ULID_LEN + 1];
	int bad_order = 0, bad_valid = 0, bad_time = 0;
	uint64_t now = 1744815823000;

	seed_gen(&g, 5);
	ulid_gen_next(&g, now, prev);
	for (int i = 0; i < 20000; i++) {
		/* the clock mostly stands still, sometimes moves, sometimes steps back */
		if (i % 1000 == 999)
			now += 3;
		else if (i % 777 == 0)
			now -= 5;
		ulid_gen_next(&g, now, id);
		if (strcmp(id, prev) <= 0)
			bad_order++;
		if (!ulid_valid(id, ULID_LEN))
			bad_valid++;
		if (ulid_time_ms(id) < ulid_time_ms(prev))
			bad_time++;
		memcpy(prev, id, sizeof(id));
	}
	CHECK(bad_order == 0);
	CHECK(bad_valid == 0);
	CHECK(bad_time == 0);
}

static void test_seeds(void)
{
	struct ulid_gen a, b, c;
	char ia[ULID_LEN + 1], ib[ULID_LEN + 1], ic[ULID_LEN + 1];
	uint8_t zero[32] = {0};

	seed_gen(&a, 9);
	seed_gen(&b, 9);
	seed_gen(&c, 10);
	ulid_gen_next(&a, 5000, ia);
	ulid_gen_next(&b, 5000, ib);
	ulid_gen_next(&c, 5000, ic);
	CHECK_STR(ia, ib);
	CHECK(strcmp(ia, ic) != 0);
	CHECK(memcmp(ia, ic, 10) == 0); /* same millisecond */
	/* an all-zero seed still gives a working generator */
	ulid_gen_init(&a, zero);
	ulid_gen_next(&a, 5000, ia);
	ulid_gen_next(&a, 5001, ib);
	CHECK(ulid_valid(ia, ULID_LEN) && ulid_valid(ib, ULID_LEN));
	CHECK(strcmp(ia + 10, ib + 10) != 0);
}

static void test_valid(void)
{
	CHECK(ulid_valid("01ARZ3NDEKTSV4RRFFQ69G5FAV", 26));
	CHECK(ulid_valid("7ZZZZZZZZZZZZZZZZZZZZZZZZZ", 26));
	CHECK(ulid_valid("00000000000000000000000000", 26));
	CHECK(!ulid_valid("8ZZZZZZZZZZZZZZZZZZZZZZZZZ", 26)); /* over 48 bits */
	CHECK(!ulid_valid("01arz3ndektsv4rrffq69g5fav", 26)); /* lower case */
	CHECK(!ulid_valid("01ARZ3NDEKTSV4RRFFQ69G5FA", 25));
	CHECK(!ulid_valid("01ARZ3NDEKTSV4RRFFQ69G5FAVX", 27));
	CHECK(!ulid_valid("01ARZ3NDEKTSV4RRFFQ69G5FAI", 26)); /* I, L, O, U excluded */
	CHECK(!ulid_valid("01ARZ3NDEKTSV4RRFFQ69G5FAL", 26));
	CHECK(!ulid_valid("01ARZ3NDEKTSV4RRFFQ69G5FAO", 26));
	CHECK(!ulid_valid("01ARZ3NDEKTSV4RRFFQ69G5FAU", 26));
	CHECK(!ulid_valid("01ARZ3NDEKTSV4RRFFQ69G5FA-", 26));
	CHECK(!ulid_valid("01ARZ3NDEKTSV4RRFFQ69G5FA\0", 26));
	CHECK(!ulid_valid(NULL, 26));
	CHECK(!ulid_valid("", 0));
}

static void test_time(void)
{
	CHECK(ulid_time_ms("01ARZ3NDEKTSV4RRFFQ69G5FAV") == UINT64_C(1469922850259));
	CHECK(ulid_time_ms("01JRZJ166HZFPP405DV1QQB2X9") == UINT64_C(1744815823057));
	CHECK(ulid_time_ms("00000000000000000000000000") == 0);
	CHECK(ulid_time_ms("7ZZZZZZZZZZZZZZZZZZZZZZZZZ") == (UINT64_C(1) << 48) - 1);
}

int main(void)
{
	test_vectors();
	test_fresh_millisecond();
	test_monotonic();
	test_seeds();
	test_valid();
	test_time();
	return test_done("ulid");
}
