/* Unit tests for lib/crc32: the catalogue's check value, other published values (zlib's
 * crc32 gives the same), dynalite's answers, a checksum built in pieces, and every length
 * and alignment against the plain bit-at-a-time definition (the code goes 8 bytes a step). */
#include "crc32.h"
#include "test.h"

#include <stdint.h>
#include <string.h>

static uint32_t of(const char *s)
{
	return crc32_update(0, s, strlen(s));
}

/* The definition, one bit at a time: reflected polynomial 0xEDB88320, all ones in and out. */
static uint32_t bitwise(const unsigned char *p, size_t n)
{
	uint32_t c = 0xFFFFFFFFu;

	while (n--) {
		c ^= *p++;
		for (int k = 0; k < 8; k++)
			c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
	}
	return ~c;
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
	/* Every length up to 100 at every alignment of 8, and a long one. */
	for (size_t off = 0; off < 8; off++)
		for (size_t n = 0; n <= 100; n++)
			if (crc32_update(0, big + off, n) != bitwise((unsigned char *)big + off, n))
				CHECK(!"every length and alignment matches the definition");
	CHECK(whole == bitwise((unsigned char *)big, sizeof(big)));
	/* One flipped bit changes it. */
	big[500] ^= 4;
	CHECK(crc32_update(0, big, sizeof(big)) != whole);
	return test_done("crc32");
}
