// SHA-512 (FIPS 180-4) and BLAKE2b-512 (RFC 7693), written from their specifications, for
// signature.h (Ed25519 hashes with SHA-512; minisign prehashes the signed file with BLAKE2b-512).
// Checked against hashlib by tests/deploy/test_edge_signature.py.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace edgesig {

const uint64_t kSha512K[80] = {
    0x428a2f98d728ae22ULL, 0x7137449123ef65cdULL, 0xb5c0fbcfec4d3b2fULL, 0xe9b5dba58189dbbcULL,
    0x3956c25bf348b538ULL, 0x59f111f1b605d019ULL, 0x923f82a4af194f9bULL, 0xab1c5ed5da6d8118ULL,
    0xd807aa98a3030242ULL, 0x12835b0145706fbeULL, 0x243185be4ee4b28cULL, 0x550c7dc3d5ffb4e2ULL,
    0x72be5d74f27b896fULL, 0x80deb1fe3b1696b1ULL, 0x9bdc06a725c71235ULL, 0xc19bf174cf692694ULL,
    0xe49b69c19ef14ad2ULL, 0xefbe4786384f25e3ULL, 0x0fc19dc68b8cd5b5ULL, 0x240ca1cc77ac9c65ULL,
    0x2de92c6f592b0275ULL, 0x4a7484aa6ea6e483ULL, 0x5cb0a9dcbd41fbd4ULL, 0x76f988da831153b5ULL,
    0x983e5152ee66dfabULL, 0xa831c66d2db43210ULL, 0xb00327c898fb213fULL, 0xbf597fc7beef0ee4ULL,
    0xc6e00bf33da88fc2ULL, 0xd5a79147930aa725ULL, 0x06ca6351e003826fULL, 0x142929670a0e6e70ULL,
    0x27b70a8546d22ffcULL, 0x2e1b21385c26c926ULL, 0x4d2c6dfc5ac42aedULL, 0x53380d139d95b3dfULL,
    0x650a73548baf63deULL, 0x766a0abb3c77b2a8ULL, 0x81c2c92e47edaee6ULL, 0x92722c851482353bULL,
    0xa2bfe8a14cf10364ULL, 0xa81a664bbc423001ULL, 0xc24b8b70d0f89791ULL, 0xc76c51a30654be30ULL,
    0xd192e819d6ef5218ULL, 0xd69906245565a910ULL, 0xf40e35855771202aULL, 0x106aa07032bbd1b8ULL,
    0x19a4c116b8d2d0c8ULL, 0x1e376c085141ab53ULL, 0x2748774cdf8eeb99ULL, 0x34b0bcb5e19b48a8ULL,
    0x391c0cb3c5c95a63ULL, 0x4ed8aa4ae3418acbULL, 0x5b9cca4f7763e373ULL, 0x682e6ff3d6b2b8a3ULL,
    0x748f82ee5defb2fcULL, 0x78a5636f43172f60ULL, 0x84c87814a1f0ab72ULL, 0x8cc702081a6439ecULL,
    0x90befffa23631e28ULL, 0xa4506cebde82bde9ULL, 0xbef9a3f7b2c67915ULL, 0xc67178f2e372532bULL,
    0xca273eceea26619cULL, 0xd186b8c721c0c207ULL, 0xeada7dd6cde0eb1eULL, 0xf57d4f7fee6ed178ULL,
    0x06f067aa72176fbaULL, 0x0a637dc5a2c898a6ULL, 0x113f9804bef90daeULL, 0x1b710b35131c471bULL,
    0x28db77f523047d84ULL, 0x32caab7b40c72493ULL, 0x3c9ebe0a15c9bebcULL, 0x431d67c49c100d4cULL,
    0x4cc5d4becb3e42b6ULL, 0x597f299cfc657e2aULL, 0x5fcb6fab3ad6faecULL, 0x6c44198c4a475817ULL};
const uint64_t kSha512H[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

inline uint64_t Rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }
inline uint64_t Load64Le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
inline uint64_t Load64Be(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
  return v;
}

// ---- SHA-512 (FIPS 180-4) ------------------------------------------------------------------

inline void Sha512Block(uint64_t h[8], const uint8_t* block) {
  uint64_t w[80];
  for (int i = 0; i < 16; ++i) w[i] = Load64Be(block + 8 * i);
  for (int i = 16; i < 80; ++i) {
    uint64_t s0 = Rotr(w[i - 15], 1) ^ Rotr(w[i - 15], 8) ^ (w[i - 15] >> 7);
    uint64_t s1 = Rotr(w[i - 2], 19) ^ Rotr(w[i - 2], 61) ^ (w[i - 2] >> 6);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint64_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
  for (int i = 0; i < 80; ++i) {
    uint64_t t1 = k + (Rotr(e, 14) ^ Rotr(e, 18) ^ Rotr(e, 41)) + ((e & f) ^ (~e & g)) + kSha512K[i] + w[i];
    uint64_t t2 = (Rotr(a, 28) ^ Rotr(a, 34) ^ Rotr(a, 39)) + ((a & b) ^ (a & c) ^ (b & c));
    k = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
  }
  h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += k;
}

inline void Sha512(const uint8_t* data, size_t n, uint8_t out[64]) {
  uint64_t h[8];
  std::memcpy(h, kSha512H, sizeof(h));
  size_t full = n / 128 * 128;
  for (size_t i = 0; i < full; i += 128) Sha512Block(h, data + i);
  uint8_t tail[256] = {0};
  size_t rest = n - full;
  std::memcpy(tail, data + full, rest);
  tail[rest] = 0x80;
  size_t blocks = rest + 17 <= 128 ? 1 : 2;
  uint64_t bits = static_cast<uint64_t>(n) * 8;  // messages here are far below 2^61 bytes
  for (int i = 0; i < 8; ++i) tail[blocks * 128 - 1 - i] = static_cast<uint8_t>(bits >> (8 * i));
  for (size_t b = 0; b < blocks; ++b) Sha512Block(h, tail + 128 * b);
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) out[8 * i + j] = static_cast<uint8_t>(h[i] >> (56 - 8 * j));
}

// ---- BLAKE2b-512, unkeyed (RFC 7693): minisign's prehash -------------------------------------

const uint8_t kSigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

inline void Blake2bMix(uint64_t v[16], int a, int b, int c, int d, uint64_t x, uint64_t y) {
  v[a] = v[a] + v[b] + x; v[d] = Rotr(v[d] ^ v[a], 32);
  v[c] = v[c] + v[d];     v[b] = Rotr(v[b] ^ v[c], 24);
  v[a] = v[a] + v[b] + y; v[d] = Rotr(v[d] ^ v[a], 16);
  v[c] = v[c] + v[d];     v[b] = Rotr(v[b] ^ v[c], 63);
}

inline void Blake2bCompress(uint64_t h[8], const uint8_t block[128], uint64_t counted, bool last) {
  uint64_t v[16], m[16];
  for (int i = 0; i < 8; ++i) { v[i] = h[i]; v[i + 8] = kSha512H[i]; }  // BLAKE2b's IV is SHA-512's
  v[12] ^= counted;  // the high half of the 128-bit counter stays 0 for anything this small
  if (last) v[14] = ~v[14];
  for (int i = 0; i < 16; ++i) m[i] = Load64Le(block + 8 * i);
  for (int r = 0; r < 12; ++r) {
    const uint8_t* s = kSigma[r];
    Blake2bMix(v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
    Blake2bMix(v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
    Blake2bMix(v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
    Blake2bMix(v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
    Blake2bMix(v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
    Blake2bMix(v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
    Blake2bMix(v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
    Blake2bMix(v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
  }
  for (int i = 0; i < 8; ++i) h[i] ^= v[i] ^ v[i + 8];
}

inline void Blake2b512(const uint8_t* data, size_t n, uint8_t out[64]) {
  uint64_t h[8];
  std::memcpy(h, kSha512H, sizeof(h));
  h[0] ^= 0x01010000ULL ^ 64;  // depth 1, fanout 1, no key, 64-byte digest
  size_t done = 0;
  while (n - done > 128) {  // the last block (full or not) is compressed with the final flag
    done += 128;
    Blake2bCompress(h, data + done - 128, done, false);
  }
  uint8_t last[128] = {0};
  std::memcpy(last, data + done, n - done);
  Blake2bCompress(h, last, n, true);
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) out[8 * i + j] = static_cast<uint8_t>(h[i] >> (8 * j));
}

}  // namespace edgesig
