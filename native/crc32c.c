/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), standard init/xorout 0xFFFFFFFF.
 *
 * Hardware path: the SSE4.2 crc32 instruction (8 bytes per instruction) on three independent
 * streams, which hides its 3-cycle latency; the three partial CRCs are merged by "shifting" the
 * earlier ones over the later blocks' length (multiplication by x^(8*len) mod P, done with
 * precomputed 4x256 tables for the two fixed block lengths). Software path: slicing-by-8 tables.
 * Both paths return identical values. Tables are built once by a library constructor.
 */
#include <string.h>

#include "tiermem_native.h"

#define POLY 0x82F63B78u
#define LONG_BLOCK 8192 /* bytes per stream in the long 3-stream loop */
#define SHORT_BLOCK 256 /* bytes per stream in the short 3-stream loop */

static uint32_t crc_table[8][256]; /* slicing-by-8 */
static uint32_t shift_long[4][256];  /* raw crc -> crc after LONG_BLOCK zero bytes */
static uint32_t shift_short[4][256]; /* raw crc -> crc after SHORT_BLOCK zero bytes */
static int have_hw;

/* Multiply a(x) b(x) mod P in the reflected representation (bit 31 = x^0). */
static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

/* x^(8 * nbytes) mod P */
static uint32_t x8nmodp(size_t nbytes) {
    uint32_t p = 1u << 31;        /* x^0 */
    uint32_t sq = 1u << 23;       /* x^8 (one byte of zeros) */
    while (nbytes) {
        if (nbytes & 1) p = multmodp(sq, p);
        sq = multmodp(sq, sq);
        nbytes >>= 1;
    }
    return p;
}

static void build_shift_table(uint32_t table[4][256], size_t nbytes) {
    const uint32_t op = x8nmodp(nbytes);
    for (int k = 0; k < 4; k++)
        for (uint32_t b = 0; b < 256; b++) table[k][b] = multmodp(op, b << (8 * k));
}

static inline uint32_t shift_crc(const uint32_t table[4][256], uint32_t crc) {
    return table[0][crc & 0xFF] ^ table[1][(crc >> 8) & 0xFF] ^ table[2][(crc >> 16) & 0xFF] ^
           table[3][crc >> 24];
}

__attribute__((constructor)) static void crc32c_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ POLY : c >> 1;
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = crc_table[0][n];
        for (int k = 1; k < 8; k++) {
            c = crc_table[0][c & 0xFF] ^ (c >> 8);
            crc_table[k][n] = c;
        }
    }
    build_shift_table(shift_long, LONG_BLOCK);
    build_shift_table(shift_short, SHORT_BLOCK);
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_hw = __builtin_cpu_supports("sse4.2");
#endif
}

static inline uint64_t load64(const unsigned char *p) {
    uint64_t x;
    memcpy(&x, p, 8); /* little-endian host (x86-64 / aarch64 LE) */
    return x;
}

/* raw (no pre/post inversion) slicing-by-8 update */
static uint32_t crc32c_sw(uint32_t crc, const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) {
        crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
        n--;
    }
    while (n >= 8) {
        uint64_t w = load64(p) ^ crc;
        crc = crc_table[7][w & 0xFF] ^ crc_table[6][(w >> 8) & 0xFF] ^
              crc_table[5][(w >> 16) & 0xFF] ^ crc_table[4][(w >> 24) & 0xFF] ^
              crc_table[3][(w >> 32) & 0xFF] ^ crc_table[2][(w >> 40) & 0xFF] ^
              crc_table[1][(w >> 48) & 0xFF] ^ crc_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return crc;
}

#if defined(__x86_64__)
#define TM_SSE42 __attribute__((target("sse4.2")))

/* three streams of `block` bytes each, merged; returns the raw crc after 3*block bytes */
#define CRC_3WAY(BLOCK, TABLE)                                                  \
    while (n >= 3 * (BLOCK)) {                                                  \
        uint64_t c0 = crc, c1 = 0, c2 = 0;                                      \
        const unsigned char *end = p + (BLOCK);                                 \
        do {                                                                    \
            c0 = __builtin_ia32_crc32di(c0, load64(p));                         \
            c1 = __builtin_ia32_crc32di(c1, load64(p + (BLOCK)));               \
            c2 = __builtin_ia32_crc32di(c2, load64(p + 2 * (BLOCK)));           \
            p += 8;                                                             \
        } while (p < end);                                                      \
        crc = shift_crc(TABLE, (uint32_t)c0) ^ (uint32_t)c1;                    \
        crc = shift_crc(TABLE, crc) ^ (uint32_t)c2;                             \
        p += 2 * (BLOCK);                                                       \
        n -= 3 * (BLOCK);                                                       \
    }

TM_SSE42 static uint32_t crc32c_hw(uint32_t crc, const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) {
        crc = __builtin_ia32_crc32qi(crc, *p++);
        n--;
    }
    CRC_3WAY(LONG_BLOCK, shift_long)
    CRC_3WAY(SHORT_BLOCK, shift_short)
    uint64_t c = crc;
    while (n >= 8) {
        c = __builtin_ia32_crc32di(c, load64(p));
        p += 8;
        n -= 8;
    }
    crc = (uint32_t)c;
    while (n--) crc = __builtin_ia32_crc32qi(crc, *p++);
    return crc;
}
#endif

TM_API uint32_t tm_crc32c(uint32_t crc, const void *buf, size_t nbytes) {
    const unsigned char *p = (const unsigned char *)buf;
    crc = ~crc;
#if defined(__x86_64__)
    if (have_hw) return ~crc32c_hw(crc, p, nbytes);
#endif
    return ~crc32c_sw(crc, p, nbytes);
}

TM_API int tm_crc32c_hw(void) { return have_hw; }

TM_API uint32_t tm_crc32c_sw(uint32_t crc, const void *buf, size_t nbytes) {
    return ~crc32c_sw(~crc, (const unsigned char *)buf, nbytes);
}
