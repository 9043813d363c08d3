/* kvindex/kx_xxh3.h: kvindex's own XXH3-64 (with a seed), so the native build needs a C compiler only.
 *
 * Written from the published specification (Yann Collet, "xxHash fast digest algorithm",
 * doc/xxhash_spec.md of the xxHash repository, section "XXH3 Algorithm Description"): its
 * constants, default secret and steps are facts; the code is kvindex's own.
 *
 * Invariants:
 * - kx_xxh3_64(data, len, seed) is XXH3-64 with that seed: it equals the reference library's
 *   XXH3_64bits_withSeed and the xxhash package's xxh3_64_intdigest(data, seed) for every input
 *   (tests/test_xxh3.py: every length 0..4096 with three seeds, random inputs up to 64 KiB, and
 *   the scalar loop and portable fallbacks below compiled and checked the same way).
 * - Portable C99: all reads are little-endian whatever the host (one memcpy on little-endian
 *   hosts, bytes assembled elsewhere); the 64x64 -> 128-bit multiply uses unsigned __int128 where
 *   the compiler has it, 32-bit halves otherwise. KX_XXH3_PORTABLE=1 forces both fallbacks.
 * - One SIMD path: SSE2 (every x86-64) for the accumulate/scramble loop of inputs past 240 bytes,
 *   where the scalar loop measured 1.24x (256 B) to 1.65x (8 KiB) libxxhash's time and SSE2 1.0x
 *   to 1.15x (benchmarks/xxh3.py); other hosts, and KX_XXH3_NO_SIMD=1, run the scalar loop.
 *   Inputs up to 240 bytes, kvindex's hot path (a block of 16 tokens is 64 bytes), are scalar.
 * - Header only, every function static: each extension that includes it gets its own inlined
 *   copy (no symbol to clash, no library to link). Secrets are read at any byte offset.
 */
#ifndef KVINDEX_XXH3_H
#define KVINDEX_XXH3_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifndef KX_XXH3_PORTABLE
#define KX_XXH3_PORTABLE 0
#endif

/* SSE2 for the loop over inputs past 240 bytes; KX_XXH3_NO_SIMD=1 or KX_XXH3_PORTABLE=1: scalar. */
#if !defined(KX_XXH3_NO_SIMD)
#define KX_XXH3_NO_SIMD 0
#endif
#if defined(__SSE2__) && !KX_XXH3_NO_SIMD && !KX_XXH3_PORTABLE
#define KX_SSE2 1
#include <emmintrin.h>
#else
#define KX_SSE2 0
#endif

/* The spec's constants ("XXH3 Algorithm Overview"). */
#define KX_PRIME32_1 0x9E3779B1U
#define KX_PRIME32_2 0x85EBCA77U
#define KX_PRIME32_3 0xC2B2AE3DU
#define KX_PRIME64_1 0x9E3779B185EBCA87ULL
#define KX_PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define KX_PRIME64_3 0x165667B19E3779F9ULL
#define KX_PRIME64_4 0x85EBCA77C2B2AE63ULL
#define KX_PRIME64_5 0x27D4EB2F165667C5ULL
#define KX_PRIME_MX1 0x165667919E3779F9ULL
#define KX_PRIME_MX2 0x9FB21C651E98DF25ULL

/* Large inputs: 64-byte stripes of 8 lanes; a block is as many stripes as the secret has 8-byte
   steps past its first 64 bytes (16 for the default secret: 1024 bytes). */
#define KX_SECRET_SIZE 192
#define KX_STRIPE 64
#define KX_LANES 8
#define KX_STRIPES_PER_BLOCK ((KX_SECRET_SIZE - KX_STRIPE) / 8)
#define KX_BLOCK (KX_STRIPE * KX_STRIPES_PER_BLOCK)
#define KX_MID_START 3        /* 129..240 bytes: secret offset of the chunks after the first 8 */
#define KX_MID_LAST 119       /* 129..240 bytes: secret offset of the last 16 bytes (136 - 17) */
#define KX_LAST_STRIPE (KX_SECRET_SIZE - KX_STRIPE - 7)
#define KX_MERGE 11           /* secret offset of the final merge */

static const unsigned char kx_default_secret[KX_SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* ---- building blocks: little-endian reads, byte swaps, rotation, the folded 128-bit product */

/* The hash is inlined where it is called, its paths past 128 bytes are calls: the short paths,
   kvindex's hot ones (a block of 16 tokens is 64 bytes, a chain step 16), then need no stack frame. */
#if defined(__GNUC__)
#define KX_NOINLINE __attribute__((noinline))
#define KX_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define KX_NOINLINE
#define KX_ALWAYS_INLINE inline
#endif

#if !KX_XXH3_PORTABLE && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define KX_NATIVE_LE 1
#else
#define KX_NATIVE_LE 0
#endif

static inline uint32_t kx_le32(const unsigned char *p) {
#if KX_NATIVE_LE
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
#else
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
#endif
}

static inline uint64_t kx_le64(const unsigned char *p) {
#if KX_NATIVE_LE
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
#else
    return (uint64_t)kx_le32(p) | ((uint64_t)kx_le32(p + 4) << 32);
#endif
}

static inline void kx_put_le64(unsigned char *out, uint64_t v) {
#if KX_NATIVE_LE
    memcpy(out, &v, sizeof v); /* one store: byte stores read back as a u64 stall the loads */
#else
    for (int i = 0; i < 8; i++) out[i] = (unsigned char)(v >> (8 * i));
#endif
}

static inline uint32_t kx_bswap32(uint32_t x) {
    return (x >> 24) | ((x >> 8) & 0x0000FF00U) | ((x << 8) & 0x00FF0000U) | (x << 24);
}

static inline uint64_t kx_bswap64(uint64_t x) {
    return ((uint64_t)kx_bswap32((uint32_t)x) << 32) | kx_bswap32((uint32_t)(x >> 32));
}

static inline uint64_t kx_rotl64(uint64_t x, unsigned r) { /* 0 < r < 64 */
    return (x << r) | (x >> (64 - r));
}

/* The 128-bit product of a and b, its low and high halves xor-ed together. */
static inline uint64_t kx_mul128_fold64(uint64_t a, uint64_t b) {
#if !KX_XXH3_PORTABLE && defined(__SIZEOF_INT128__)
    __extension__ typedef unsigned __int128 u128; /* __extension__: -pedantic knows it is not C99 */
    u128 product = (u128)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
#else
    uint64_t a_lo = a & 0xFFFFFFFFU, a_hi = a >> 32, b_lo = b & 0xFFFFFFFFU, b_hi = b >> 32;
    uint64_t lo_lo = a_lo * b_lo, hi_lo = a_hi * b_lo, lo_hi = a_lo * b_hi, hi_hi = a_hi * b_hi;
    uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFU) + lo_hi; /* cannot overflow */
    uint64_t high = hi_hi + (hi_lo >> 32) + (cross >> 32);
    uint64_t low = (cross << 32) | (lo_lo & 0xFFFFFFFFU);
    return low ^ high;
#endif
}

/* The spec's two final mixes: avalanche_XXH64 and XXH3's own avalanche. */
static inline uint64_t kx_avalanche_xxh64(uint64_t h) {
    h ^= h >> 33;
    h *= KX_PRIME64_2;
    h ^= h >> 29;
    h *= KX_PRIME64_3;
    return h ^ (h >> 32);
}

static inline uint64_t kx_avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= KX_PRIME_MX1;
    return h ^ (h >> 32);
}

/* ---- 0..16 bytes ---------------------------------------------------------------------------- */

static inline uint64_t kx_len_0(const unsigned char *secret, uint64_t seed) {
    return kx_avalanche_xxh64(seed ^ kx_le64(secret + 56) ^ kx_le64(secret + 64));
}

static inline uint64_t kx_len_1to3(const unsigned char *p, size_t len, const unsigned char *secret, uint64_t seed) {
    /* from the low byte up: last byte | length | first byte | middle (or last) byte */
    uint32_t combined = (uint32_t)p[len - 1] | ((uint32_t)len << 8) | ((uint32_t)p[0] << 16)
                        | ((uint32_t)p[len >> 1] << 24);
    uint64_t keyed = (uint64_t)(kx_le32(secret) ^ kx_le32(secret + 4)) + seed;
    return kx_avalanche_xxh64(keyed ^ combined);
}

static inline uint64_t kx_len_4to8(const unsigned char *p, size_t len, const unsigned char *secret, uint64_t seed) {
    uint64_t first = kx_le32(p), last = kx_le32(p + len - 4);
    uint64_t modified_seed = seed ^ ((uint64_t)kx_bswap32((uint32_t)seed) << 32);
    uint64_t v = ((kx_le64(secret + 8) ^ kx_le64(secret + 16)) - modified_seed) ^ (last | (first << 32));
    v ^= kx_rotl64(v, 49) ^ kx_rotl64(v, 24);
    v *= KX_PRIME_MX2;
    v ^= (v >> 35) + len;
    v *= KX_PRIME_MX2;
    return v ^ (v >> 28);
}

static inline uint64_t kx_len_9to16(const unsigned char *p, size_t len, const unsigned char *secret, uint64_t seed) {
    uint64_t low = ((kx_le64(secret + 24) ^ kx_le64(secret + 32)) + seed) ^ kx_le64(p);
    uint64_t high = ((kx_le64(secret + 40) ^ kx_le64(secret + 48)) - seed) ^ kx_le64(p + len - 8);
    return kx_avalanche(len + kx_bswap64(low) + high + kx_mul128_fold64(low, high));
}

/* ---- 17..240 bytes: 16-byte chunks, each mixed with 16 bytes of secret and the seed ---------- */

static inline uint64_t kx_mix16(const unsigned char *p, const unsigned char *secret, uint64_t seed) {
    return kx_mul128_fold64(kx_le64(p) ^ (kx_le64(secret) + seed), kx_le64(p + 8) ^ (kx_le64(secret + 8) - seed));
}

/* Round i of 17..128 bytes: chunk i from the front and chunk i from the back, 32 bytes of secret. */
static inline uint64_t kx_round_17to128(const unsigned char *p, size_t len, const unsigned char *secret,
                                        uint64_t seed, size_t i) {
    return kx_mix16(p + 16 * i, secret + 32 * i, seed) + kx_mix16(p + len - 16 * (i + 1), secret + 32 * i + 16, seed);
}

/* N rounds, N the fewest whose chunks cover the input (1..4), counted down as the spec does and
   unrolled (a loop of 1..4 trips costs more than the hash of 64 bytes itself). */
static inline uint64_t kx_len_17to128(const unsigned char *p, size_t len, const unsigned char *secret, uint64_t seed) {
    uint64_t acc = len * KX_PRIME64_1;
    switch (((len - 1) >> 5) + 1) {
    case 4: acc += kx_round_17to128(p, len, secret, seed, 3); /* fall through */
    case 3: acc += kx_round_17to128(p, len, secret, seed, 2); /* fall through */
    case 2: acc += kx_round_17to128(p, len, secret, seed, 1); /* fall through */
    default: acc += kx_round_17to128(p, len, secret, seed, 0);
    }
    return kx_avalanche(acc);
}

static KX_NOINLINE uint64_t kx_len_129to240(const unsigned char *p, size_t len, const unsigned char *secret, uint64_t seed) {
    uint64_t acc = len * KX_PRIME64_1;
    size_t chunks = len >> 4;
    for (size_t i = 0; i < 8; i++) acc += kx_mix16(p + 16 * i, secret + 16 * i, seed);
    acc = kx_avalanche(acc);
    for (size_t i = 8; i < chunks; i++) acc += kx_mix16(p + 16 * i, secret + 16 * (i - 8) + KX_MID_START, seed);
    acc += kx_mix16(p + len - 16, secret + KX_MID_LAST, seed);
    return kx_avalanche(acc);
}

/* ---- more than 240 bytes: 8 accumulators over 64-byte stripes, scrambled after each block ---- */

/* The 8 accumulators start as these constants. */
static const uint64_t kx_acc_start[KX_LANES] = {KX_PRIME32_3, KX_PRIME64_1, KX_PRIME64_2, KX_PRIME64_3,
                                                KX_PRIME64_4, KX_PRIME32_2, KX_PRIME64_5, KX_PRIME32_1};

#if KX_SSE2
/* Two accumulators per SSE2 register: lanes 2j and 2j+1 in pair[j]. */
typedef struct { __m128i pair[KX_LANES / 2]; } kx_acc;

static inline void kx_acc_init(kx_acc *acc) {
    for (size_t j = 0; j < KX_LANES / 2; j++) acc->pair[j] = _mm_loadu_si128((const __m128i *)(kx_acc_start + 2 * j));
}

static inline void kx_acc_lanes(const kx_acc *acc, uint64_t out[KX_LANES]) {
    for (size_t j = 0; j < KX_LANES / 2; j++) _mm_storeu_si128((__m128i *)(out + 2 * j), acc->pair[j]);
}

/* accumulate() as the scalar version below, two lanes at a time: the keyed lane's low half times
   its high half (one 32x32 -> 64 multiply per lane), plus the other lane of the pair. */
static inline void kx_accumulate(kx_acc *acc, const unsigned char *stripe, const unsigned char *secret) {
    for (size_t j = 0; j < KX_LANES / 2; j++) {
        __m128i data = _mm_loadu_si128((const __m128i *)(stripe + 16 * j));
        __m128i keyed = _mm_xor_si128(data, _mm_loadu_si128((const __m128i *)(secret + 16 * j)));
        __m128i product = _mm_mul_epu32(keyed, _mm_srli_epi64(keyed, 32));
        __m128i swapped = _mm_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
        acc->pair[j] = _mm_add_epi64(acc->pair[j], _mm_add_epi64(product, swapped));
    }
}

/* scramble() as below; a 64 x 32-bit multiply is the low half's product plus the high half's, shifted. */
static inline void kx_scramble(kx_acc *acc, const unsigned char *secret_end) {
    const __m128i prime = _mm_set1_epi32((int)KX_PRIME32_1);
    for (size_t j = 0; j < KX_LANES / 2; j++) {
        __m128i a = acc->pair[j];
        a = _mm_xor_si128(a, _mm_srli_epi64(a, 47));
        a = _mm_xor_si128(a, _mm_loadu_si128((const __m128i *)(secret_end + 16 * j)));
        __m128i low = _mm_mul_epu32(a, prime), high = _mm_mul_epu32(_mm_srli_epi64(a, 32), prime);
        acc->pair[j] = _mm_add_epi64(low, _mm_slli_epi64(high, 32));
    }
}
#else
typedef struct { uint64_t lane[KX_LANES]; } kx_acc;

static inline void kx_acc_init(kx_acc *acc) { memcpy(acc->lane, kx_acc_start, sizeof acc->lane); }

static inline void kx_acc_lanes(const kx_acc *acc, uint64_t out[KX_LANES]) { memcpy(out, acc->lane, sizeof acc->lane); }

/* The spec adds stripe lane i to acc[i ^ 1] and lane i's keyed 32x32 product to acc[i]; written
   per accumulator (what acc[i] receives) the loop has no cross-lane store. */
static inline void kx_accumulate(kx_acc *acc, const unsigned char *stripe, const unsigned char *secret) {
    for (size_t i = 0; i < KX_LANES; i++) {
        uint64_t keyed = kx_le64(stripe + 8 * i) ^ kx_le64(secret + 8 * i);
        acc->lane[i] += kx_le64(stripe + 8 * (i ^ 1)) + (uint64_t)(uint32_t)keyed * (uint32_t)(keyed >> 32);
    }
}

static inline void kx_scramble(kx_acc *acc, const unsigned char *secret_end) {
    for (size_t i = 0; i < KX_LANES; i++) {
        uint64_t a = acc->lane[i];
        a ^= a >> 47;
        a ^= kx_le64(secret_end + 8 * i);
        acc->lane[i] = a * KX_PRIME32_1;
    }
}
#endif

static inline uint64_t kx_len_long(const unsigned char *p, size_t len, const unsigned char *secret) {
    kx_acc acc;
    kx_acc_init(&acc);
    size_t blocks = (len - 1) / KX_BLOCK; /* the last block, even a full one, is left to the tail */
    for (size_t b = 0; b < blocks; b++) {
        const unsigned char *block = p + b * KX_BLOCK;
        for (size_t n = 0; n < KX_STRIPES_PER_BLOCK; n++) kx_accumulate(&acc, block + n * KX_STRIPE, secret + 8 * n);
        kx_scramble(&acc, secret + KX_SECRET_SIZE - KX_STRIPE);
    }
    const unsigned char *tail = p + blocks * KX_BLOCK;
    size_t stripes = (len - 1 - blocks * KX_BLOCK) / KX_STRIPE; /* full stripes before the last one */
    for (size_t n = 0; n < stripes; n++) kx_accumulate(&acc, tail + n * KX_STRIPE, secret + 8 * n);
    kx_accumulate(&acc, p + len - KX_STRIPE, secret + KX_LAST_STRIPE); /* may overlap the stripes before */

    uint64_t lanes[KX_LANES], result = len * KX_PRIME64_1;
    kx_acc_lanes(&acc, lanes);
    for (size_t i = 0; i < KX_LANES; i += 2)
        result += kx_mul128_fold64(lanes[i] ^ kx_le64(secret + KX_MERGE + 8 * i),
                                   lanes[i + 1] ^ kx_le64(secret + KX_MERGE + 8 * i + 8));
    return kx_avalanche(result);
}

/* With a seed, inputs over 240 bytes use a secret derived from it: the default secret read as 24
   little-endian u64s, the seed added to the even ones and subtracted from the odd ones. Seed 0
   derives the default secret itself, used as it is (the compiler folds its words in). */
static KX_NOINLINE uint64_t kx_len_long_seeded(const unsigned char *p, size_t len, uint64_t seed) {
    if (seed == 0) return kx_len_long(p, len, kx_default_secret);
    unsigned char derived[KX_SECRET_SIZE];
    for (size_t i = 0; i < KX_SECRET_SIZE; i += 16) {
        kx_put_le64(derived + i, kx_le64(kx_default_secret + i) + seed);
        kx_put_le64(derived + i + 8, kx_le64(kx_default_secret + i + 8) - seed);
    }
    return kx_len_long(p, len, derived);
}

/* ---- the hash ------------------------------------------------------------------------------- */

static KX_ALWAYS_INLINE uint64_t kx_xxh3_64(const void *data, size_t len, uint64_t seed) {
    const unsigned char *p = (const unsigned char *)data, *secret = kx_default_secret;
    if (len <= 16) {
        if (len > 8) return kx_len_9to16(p, len, secret, seed);
        if (len >= 4) return kx_len_4to8(p, len, secret, seed);
        return len ? kx_len_1to3(p, len, secret, seed) : kx_len_0(secret, seed);
    }
    if (len <= 128) return kx_len_17to128(p, len, secret, seed);
    if (len <= 240) return kx_len_129to240(p, len, secret, seed);
    return kx_len_long_seeded(p, len, seed);
}

#endif /* KVINDEX_XXH3_H */
