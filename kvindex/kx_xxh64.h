/* XXH64, written from the published xxHash specification (doc/xxhash_spec.md, "XXH64"), for the
 * approximate index's Kthena chain (kvindex/approx/hashing.py is the reference; tests compare the
 * C chain with the xxhash package on every block of their inputs). Portable C99, header only. */
#ifndef KX_XXH64_H
#define KX_XXH64_H

#include <stddef.h>
#include <stdint.h>

#define KX64_P1 0x9E3779B185EBCA87ULL
#define KX64_P2 0xC2B2AE3D27D4EB4FULL
#define KX64_P3 0x165667B19E3779F9ULL
#define KX64_P4 0x85EBCA77C2B2AE63ULL
#define KX64_P5 0x27D4EB2F165667C5ULL

static inline uint64_t kx64_rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t kx64_read64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static inline uint32_t kx64_read32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline uint64_t kx64_round(uint64_t acc, uint64_t lane) {
    return kx64_rotl(acc + lane * KX64_P2, 31) * KX64_P1;
}

static inline uint64_t kx64_merge(uint64_t acc, uint64_t v) {
    return (acc ^ kx64_round(0, v)) * KX64_P1 + KX64_P4;
}

static inline uint64_t kx_xxh64(const unsigned char *p, size_t len, uint64_t seed) {
    const unsigned char *end = p + len;
    uint64_t acc;
    if (len >= 32) {
        uint64_t v1 = seed + KX64_P1 + KX64_P2, v2 = seed + KX64_P2, v3 = seed, v4 = seed - KX64_P1;
        for (; end - p >= 32; p += 32) {
            v1 = kx64_round(v1, kx64_read64(p));
            v2 = kx64_round(v2, kx64_read64(p + 8));
            v3 = kx64_round(v3, kx64_read64(p + 16));
            v4 = kx64_round(v4, kx64_read64(p + 24));
        }
        acc = kx64_rotl(v1, 1) + kx64_rotl(v2, 7) + kx64_rotl(v3, 12) + kx64_rotl(v4, 18);
        acc = kx64_merge(acc, v1);
        acc = kx64_merge(acc, v2);
        acc = kx64_merge(acc, v3);
        acc = kx64_merge(acc, v4);
    } else {
        acc = seed + KX64_P5;
    }
    acc += (uint64_t)len;
    for (; end - p >= 8; p += 8) acc = kx64_rotl(acc ^ kx64_round(0, kx64_read64(p)), 27) * KX64_P1 + KX64_P4;
    if (end - p >= 4) {
        acc = kx64_rotl(acc ^ ((uint64_t)kx64_read32(p) * KX64_P1), 23) * KX64_P2 + KX64_P3;
        p += 4;
    }
    for (; p < end; p++) acc = kx64_rotl(acc ^ ((uint64_t)*p * KX64_P5), 11) * KX64_P1;
    acc ^= acc >> 33;
    acc *= KX64_P2;
    acc ^= acc >> 29;
    acc *= KX64_P3;
    acc ^= acc >> 32;
    return acc;
}

#endif
