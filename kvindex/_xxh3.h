/* XXH3-64 with a seed, written for kvindex from the published algorithm description
 * (the XXH3 section of the xxHash specification, doc/xxhash_spec.md of the xxHash project).
 *
 * Only what block keys need: the 64-bit hash of a byte string with a 64-bit seed and the default
 * secret, every input length class (0-16, 17-128, 129-240 and the long, stripe-based path).
 * A block of B tokens is 4*B bytes, 64 bytes at the usual B = 16, where the scalar mid-size paths
 * do all the work; blocks of more than 60 tokens take the long path, whose stripe loop uses SSE2
 * where the compiler targets it (every x86-64) and plain 64-bit arithmetic elsewhere.
 *
 * Results equal the `xxhash` package's xxh3_64 for every length and seed: tests/unit/test_keys.py checks
 * random inputs of 0..4096 bytes with random seeds and the vectors in proto/vectors.
 */
#ifndef KVINDEX_XXH3_H
#define KVINDEX_XXH3_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define KVX_P32_1 0x9E3779B1U
#define KVX_P32_2 0x85EBCA77U
#define KVX_P32_3 0xC2B2AE3DU
#define KVX_P64_1 0x9E3779B185EBCA87ULL
#define KVX_P64_2 0xC2B2AE3D27D4EB4FULL
#define KVX_P64_3 0x165667B19E3779F9ULL
#define KVX_P64_4 0x85EBCA77C2B2AE63ULL
#define KVX_P64_5 0x27D4EB2F165667C5ULL
#define KVX_PMX_1 0x165667919E3779F9ULL
#define KVX_PMX_2 0x9FB21C651E98DF25ULL

#define KVX_SECRET_SIZE 192
#define KVX_STRIPE 64
#define KVX_SECRET_CONSUME 8
#define KVX_MIDSIZE_MAX 240

/* The default secret of the specification (192 bytes). */
static const uint8_t kvx_secret[KVX_SECRET_SIZE] = {
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

/* Little-endian loads whatever the host order (memcpy compiles to one load). */
static inline uint32_t kvx_r32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline uint64_t kvx_r64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline void kvx_w64(uint8_t *p, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

static inline uint32_t kvx_swap32(uint32_t x) {
    return ((x << 24) & 0xff000000U) | ((x << 8) & 0x00ff0000U) | ((x >> 8) & 0x0000ff00U) |
           ((x >> 24) & 0x000000ffU);
}

static inline uint64_t kvx_swap64(uint64_t x) {
    return ((uint64_t)kvx_swap32((uint32_t)x) << 32) | kvx_swap32((uint32_t)(x >> 32));
}

static inline uint64_t kvx_rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

/* The 128-bit product of a and b, folded to 64 bits by XOR of its halves. */
static inline uint64_t kvx_mul128_fold64(uint64_t a, uint64_t b) {
#if defined(__SIZEOF_INT128__)
    __uint128_t p = (__uint128_t)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
#else
    /* Schoolbook product of 32-bit halves (compilers without a 128-bit type). */
    uint64_t lo_lo = (a & 0xFFFFFFFFULL) * (b & 0xFFFFFFFFULL);
    uint64_t hi_lo = (a >> 32) * (b & 0xFFFFFFFFULL);
    uint64_t lo_hi = (a & 0xFFFFFFFFULL) * (b >> 32);
    uint64_t hi_hi = (a >> 32) * (b >> 32);
    uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFULL) + lo_hi;
    uint64_t upper = (hi_lo >> 32) + (cross >> 32) + hi_hi;
    uint64_t lower = (cross << 32) | (lo_lo & 0xFFFFFFFFULL);
    return lower ^ upper;
#endif
}

static inline uint64_t kvx_xxh64_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= KVX_P64_2;
    h ^= h >> 29;
    h *= KVX_P64_3;
    h ^= h >> 32;
    return h;
}

static inline uint64_t kvx_avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= KVX_PMX_1;
    h ^= h >> 32;
    return h;
}

static inline uint64_t kvx_rrmxmx(uint64_t h, uint64_t len) {
    h ^= kvx_rotl64(h, 49) ^ kvx_rotl64(h, 24);
    h *= KVX_PMX_2;
    h ^= (h >> 35) + len;
    h *= KVX_PMX_2;
    return h ^ (h >> 28);
}

static inline uint64_t kvx_len_1to3(const uint8_t *in, size_t len, const uint8_t *secret,
                                    uint64_t seed) {
    uint32_t c1 = in[0], c2 = in[len >> 1], c3 = in[len - 1];
    uint32_t combined = (c1 << 16) | (c2 << 24) | c3 | ((uint32_t)len << 8);
    uint64_t bitflip = (uint64_t)(kvx_r32(secret) ^ kvx_r32(secret + 4)) + seed;
    return kvx_xxh64_avalanche((uint64_t)combined ^ bitflip);
}

static inline uint64_t kvx_len_4to8(const uint8_t *in, size_t len, const uint8_t *secret,
                                    uint64_t seed) {
    seed ^= (uint64_t)kvx_swap32((uint32_t)seed) << 32;
    uint32_t in1 = kvx_r32(in), in2 = kvx_r32(in + len - 4);
    uint64_t bitflip = (kvx_r64(secret + 8) ^ kvx_r64(secret + 16)) - seed;
    uint64_t in64 = in2 + ((uint64_t)in1 << 32);
    return kvx_rrmxmx(in64 ^ bitflip, len);
}

static inline uint64_t kvx_len_9to16(const uint8_t *in, size_t len, const uint8_t *secret,
                                     uint64_t seed) {
    uint64_t bitflip1 = (kvx_r64(secret + 24) ^ kvx_r64(secret + 32)) + seed;
    uint64_t bitflip2 = (kvx_r64(secret + 40) ^ kvx_r64(secret + 48)) - seed;
    uint64_t lo = kvx_r64(in) ^ bitflip1;
    uint64_t hi = kvx_r64(in + len - 8) ^ bitflip2;
    uint64_t acc = (uint64_t)len + kvx_swap64(lo) + hi + kvx_mul128_fold64(lo, hi);
    return kvx_avalanche(acc);
}

static inline uint64_t kvx_len_0to16(const uint8_t *in, size_t len, const uint8_t *secret,
                                     uint64_t seed) {
    if (len > 8) return kvx_len_9to16(in, len, secret, seed);
    if (len >= 4) return kvx_len_4to8(in, len, secret, seed);
    if (len) return kvx_len_1to3(in, len, secret, seed);
    return kvx_xxh64_avalanche(seed ^ (kvx_r64(secret + 56) ^ kvx_r64(secret + 64)));
}

static inline uint64_t kvx_mix16(const uint8_t *in, const uint8_t *secret, uint64_t seed) {
    uint64_t lo = kvx_r64(in), hi = kvx_r64(in + 8);
    return kvx_mul128_fold64(lo ^ (kvx_r64(secret) + seed), hi ^ (kvx_r64(secret + 8) - seed));
}

static inline uint64_t kvx_len_17to128(const uint8_t *in, size_t len, const uint8_t *secret,
                                       uint64_t seed) {
    uint64_t acc = (uint64_t)len * KVX_P64_1;
    if (len > 32) {
        if (len > 64) {
            if (len > 96) {
                acc += kvx_mix16(in + 48, secret + 96, seed);
                acc += kvx_mix16(in + len - 64, secret + 112, seed);
            }
            acc += kvx_mix16(in + 32, secret + 64, seed);
            acc += kvx_mix16(in + len - 48, secret + 80, seed);
        }
        acc += kvx_mix16(in + 16, secret + 32, seed);
        acc += kvx_mix16(in + len - 32, secret + 48, seed);
    }
    acc += kvx_mix16(in, secret, seed);
    acc += kvx_mix16(in + len - 16, secret + 16, seed);
    return kvx_avalanche(acc);
}

static inline uint64_t kvx_len_129to240(const uint8_t *in, size_t len, const uint8_t *secret,
                                        uint64_t seed) {
    /* The first 8 rounds read the secret from its start; later rounds from offset 3, and the last
     * 16 input bytes from 136 - 17 = 119 (the spec's minimum secret size less its last offset). */
    size_t rounds = len / 16, i;
    uint64_t acc = (uint64_t)len * KVX_P64_1;
    for (i = 0; i < 8; i++) acc += kvx_mix16(in + 16 * i, secret + 16 * i, seed);
    acc = kvx_avalanche(acc);
    for (i = 8; i < rounds; i++) acc += kvx_mix16(in + 16 * i, secret + 16 * (i - 8) + 3, seed);
    acc += kvx_mix16(in + len - 16, secret + 119, seed);
    return kvx_avalanche(acc);
}

/* One 64-byte stripe into the 8 accumulators: acc[i] += lo32(d^k) * hi32(d^k), acc[i^1] += d. */
#if defined(__SSE2__) && !defined(KVX_SCALAR) /* KVX_SCALAR: tests build the portable path */
#include <emmintrin.h>
/* SSE2 (every x86-64): two lanes per register; the odd/even swap is one shuffle. */
static inline void kvx_accumulate_512(uint64_t *acc, const uint8_t *in, const uint8_t *secret) {
    __m128i *xacc = (__m128i *)(void *)acc;
    for (int i = 0; i < 4; i++) {
        __m128i data = _mm_loadu_si128((const __m128i *)(const void *)(in + 16 * i));
        __m128i key = _mm_loadu_si128((const __m128i *)(const void *)(secret + 16 * i));
        __m128i dk = _mm_xor_si128(data, key);
        __m128i dk_hi = _mm_shuffle_epi32(dk, _MM_SHUFFLE(0, 3, 0, 1));
        __m128i product = _mm_mul_epu32(dk, dk_hi);
        __m128i swapped = _mm_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
        __m128i a = _mm_loadu_si128(xacc + i);
        _mm_storeu_si128(xacc + i, _mm_add_epi64(product, _mm_add_epi64(a, swapped)));
    }
}

static inline void kvx_scramble(uint64_t *acc, const uint8_t *secret) {
    __m128i *xacc = (__m128i *)(void *)acc;
    const __m128i prime = _mm_set1_epi32((int)KVX_P32_1);
    for (int i = 0; i < 4; i++) {
        __m128i a = _mm_loadu_si128(xacc + i);
        a = _mm_xor_si128(a, _mm_srli_epi64(a, 47));
        a = _mm_xor_si128(a, _mm_loadu_si128((const __m128i *)(const void *)(secret + 16 * i)));
        /* a * P32_1 in 64-bit lanes from 32x32->64 products: lo*P + (hi*P << 32). */
        __m128i a_hi = _mm_shuffle_epi32(a, _MM_SHUFFLE(0, 3, 0, 1));
        __m128i prod_lo = _mm_mul_epu32(a, prime);
        __m128i prod_hi = _mm_mul_epu32(a_hi, prime);
        _mm_storeu_si128(xacc + i, _mm_add_epi64(prod_lo, _mm_slli_epi64(prod_hi, 32)));
    }
}
#else
static inline void kvx_accumulate_512(uint64_t *acc, const uint8_t *in, const uint8_t *secret) {
    for (int i = 0; i < 8; i++) {
        uint64_t data = kvx_r64(in + 8 * i);
        uint64_t key = data ^ kvx_r64(secret + 8 * i);
        acc[i ^ 1] += data;
        acc[i] += (uint64_t)(uint32_t)key * (key >> 32);
    }
}

static inline void kvx_scramble(uint64_t *acc, const uint8_t *secret) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= kvx_r64(secret + 8 * i);
        acc[i] = a * KVX_P32_1;
    }
}
#endif

static inline uint64_t kvx_hash_long(const uint8_t *in, size_t len, const uint8_t *secret) {
    uint64_t acc[8] = {KVX_P32_3, KVX_P64_1, KVX_P64_2, KVX_P64_3,
                       KVX_P64_4, KVX_P32_2, KVX_P64_5, KVX_P32_1};
    const size_t stripes_per_block = (KVX_SECRET_SIZE - KVX_STRIPE) / KVX_SECRET_CONSUME; /* 16 */
    const size_t block_len = KVX_STRIPE * stripes_per_block;                               /* 1024 */
    size_t blocks = (len - 1) / block_len, b, s;
    for (b = 0; b < blocks; b++) {
        for (s = 0; s < stripes_per_block; s++)
            kvx_accumulate_512(acc, in + b * block_len + s * KVX_STRIPE, secret + s * KVX_SECRET_CONSUME);
        kvx_scramble(acc, secret + KVX_SECRET_SIZE - KVX_STRIPE);
    }
    /* The last, partial block, then the last stripe (overlapping what came before it). */
    size_t stripes = ((len - 1) - block_len * blocks) / KVX_STRIPE;
    for (s = 0; s < stripes; s++)
        kvx_accumulate_512(acc, in + blocks * block_len + s * KVX_STRIPE, secret + s * KVX_SECRET_CONSUME);
    kvx_accumulate_512(acc, in + len - KVX_STRIPE, secret + KVX_SECRET_SIZE - KVX_STRIPE - 7);
    /* Merge: four pairs of accumulators with the secret from offset 11. */
    uint64_t result = (uint64_t)len * KVX_P64_1;
    for (int i = 0; i < 4; i++)
        result += kvx_mul128_fold64(acc[2 * i] ^ kvx_r64(secret + 11 + 16 * i),
                                    acc[2 * i + 1] ^ kvx_r64(secret + 11 + 16 * i + 8));
    return kvx_avalanche(result);
}

/* XXH3-64 of in[0:len) with seed. */
static inline uint64_t kvx_xxh3_64(const void *data, size_t len, uint64_t seed) {
    const uint8_t *in = (const uint8_t *)data;
    if (len <= 16) return kvx_len_0to16(in, len, kvx_secret, seed);
    if (len <= 128) return kvx_len_17to128(in, len, kvx_secret, seed);
    if (len <= KVX_MIDSIZE_MAX) return kvx_len_129to240(in, len, kvx_secret, seed);
    if (seed == 0) return kvx_hash_long(in, len, kvx_secret);
    /* A seeded long hash uses a secret derived from the seed: each 16-byte pair gets +seed, -seed. */
    uint8_t custom[KVX_SECRET_SIZE];
    for (int i = 0; i < KVX_SECRET_SIZE / 16; i++) {
        kvx_w64(custom + 16 * i, kvx_r64(kvx_secret + 16 * i) + seed);
        kvx_w64(custom + 16 * i + 8, kvx_r64(kvx_secret + 16 * i + 8) - seed);
    }
    return kvx_hash_long(in, len, custom);
}

#endif /* KVINDEX_XXH3_H */
