/* Unit tests for lib/crc32: the catalogue's check value, other published values (zlib's
 * crc32 gives the same), dynalite's answers, and a checksum built in pieces. */
#include "crc32.h"
#include "test.h"

#include <stdint.h>
#include <string.h>

static uint32_t of(const char *s)
{
	return crc32_update(0, s, strlen(s));
}

int main(void)
{
	char big[1000];

	CHECK(of("") == 0);
	/* The CRC catalogue's check value of CRC-32/ISO-HDLC. */
	CHECK(of("123456789") == 0xCBF43926u);
	CHECK(of("a") == 0xE8B7BE43u);
	CHECK(of("The quick brown fox jumps over the lazy dog") == 0x414FA339u);
	/* What dynalite sends as x-amz-crc32 with an empty object answer. */
	CHECK(of("{}") == 2745614147u);
	/* In pieces, at every split. */
	for (size_t i = 0; i < sizeof(big); i++)
		big[i] = (char)(i * 7 + 3);
	uint32_t whole = crc32_update(0, big, sizeof(big));
	for (size_t cut = 0; cut <= sizeof(big); cut += 37)
		CHECK(crc32_update(crc32_update(0, big, cut), big + cut, sizeof(big) - cut) ==
		      whole);
	/* One flipped bit changes it. */
	big[500] ^= 4;
	CHECK(crc32_update(0, big, sizeof(big)) != whole);
	return test_done("crc32");
}
