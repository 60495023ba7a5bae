// minisign signature verification for the edge runner: `run --verify-signature FILE --signature
// FILE.minisig --pubkey KEY.pub` checks what `minisign -Vm FILE -p KEY.pub` checks, with no library.
//
// The package's install.sh asks the ALREADY-INSTALLED bin/run (trusted since the first install) to
// verify a new package's SHA256SUMS before any file of the new package is run. Verification only:
// public data, so timing does not matter. Ed25519 verification after TweetNaCl (public domain,
// Bernstein, van Gastel, Janssen, Lange, Schwabe, Smetsers), with canonical-encoding checks
// (s < L, y < p) as RFC 8032 section 5.1.7 asks; SHA-512 (FIPS 180-4) and BLAKE2b-512 (RFC 7693)
// written from their specifications. minisign's files: public key "Ed" | key id (8) | key (32);
// signature "ED" | key id (8) | ed25519(blake2b-512(file)) (64), a trusted comment line, and
// ed25519(signature | trusted comment). Legacy "Ed" signatures (minisign -l) are refused.
// tests/deploy/test_edge_signature.py compiles this header for the host and checks it against
// RFC 8032's vectors, hashlib, and the Python verifier on good and damaged signatures.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "hashes.h"

namespace edgesig {

using Gf = int64_t[16];

const Gf kD = {
    0x78a3, 0x1359, 0x4dca, 0x75eb, 0xd8ab, 0x4141, 0x0a4d, 0x0070,
    0xe898, 0x7779, 0x4079, 0x8cc7, 0xfe73, 0x2b6f, 0x6cee, 0x5203};
const Gf kD2 = {
    0xf159, 0x26b2, 0x9b94, 0xebd6, 0xb156, 0x8283, 0x149a, 0x00e0,
    0xd130, 0xeef3, 0x80f2, 0x198e, 0xfce7, 0x56df, 0xd9dc, 0x2406};
const Gf kX = {
    0xd51a, 0x8f25, 0x2d60, 0xc956, 0xa7b2, 0x9525, 0xc760, 0x692c,
    0xdc5c, 0xfdd6, 0xe231, 0xc0a4, 0x53fe, 0xcd6e, 0x36d3, 0x2169};
const Gf kY = {
    0x6658, 0x6666, 0x6666, 0x6666, 0x6666, 0x6666, 0x6666, 0x6666,
    0x6666, 0x6666, 0x6666, 0x6666, 0x6666, 0x6666, 0x6666, 0x6666};
const Gf kI = {
    0xa0b0, 0x4a0e, 0x1b27, 0xc4ee, 0xe478, 0xad2f, 0x1806, 0x2f43,
    0xd7a7, 0x3dfb, 0x0099, 0x2b4d, 0xdf0b, 0x4fc1, 0x2480, 0x2b83};

// ---- Ed25519 verification (TweetNaCl's arithmetic: 16 limbs of 16 bits) ------------------------

inline void Set(Gf r, const Gf a) { for (int i = 0; i < 16; ++i) r[i] = a[i]; }
inline void Carry(Gf o) {
  for (int i = 0; i < 16; ++i) {
    o[i] += (int64_t(1) << 16);
    int64_t c = o[i] >> 16;
    o[(i + 1) * (i < 15)] += c - 1 + 37 * (c - 1) * (i == 15);
    o[i] -= c * (int64_t(1) << 16);
  }
}
inline void Select(Gf p, Gf q, int b) {
  int64_t c = ~(int64_t(b) - 1);
  for (int i = 0; i < 16; ++i) {
    int64_t t = c & (p[i] ^ q[i]);
    p[i] ^= t;
    q[i] ^= t;
  }
}
inline void Pack(uint8_t o[32], const Gf n) {
  Gf m, t;
  Set(t, n);
  Carry(t); Carry(t); Carry(t);
  for (int j = 0; j < 2; ++j) {
    m[0] = t[0] - 0xffed;
    for (int i = 1; i < 15; ++i) {
      m[i] = t[i] - 0xffff - ((m[i - 1] >> 16) & 1);
      m[i - 1] &= 0xffff;
    }
    m[15] = t[15] - 0x7fff - ((m[14] >> 16) & 1);
    int b = static_cast<int>((m[15] >> 16) & 1);
    m[14] &= 0xffff;
    Select(t, m, 1 - b);
  }
  for (int i = 0; i < 16; ++i) {
    o[2 * i] = static_cast<uint8_t>(t[i] & 0xff);
    o[2 * i + 1] = static_cast<uint8_t>(t[i] >> 8);
  }
}
inline bool Differ(const Gf a, const Gf b) {
  uint8_t c[32], d[32];
  Pack(c, a);
  Pack(d, b);
  return std::memcmp(c, d, 32) != 0;
}
inline int Parity(const Gf a) {
  uint8_t d[32];
  Pack(d, a);
  return d[0] & 1;
}
inline void Unpack(Gf o, const uint8_t n[32]) {
  for (int i = 0; i < 16; ++i) o[i] = n[2 * i] + (int64_t(n[2 * i + 1]) << 8);
  o[15] &= 0x7fff;
}
inline void Add(Gf o, const Gf a, const Gf b) { for (int i = 0; i < 16; ++i) o[i] = a[i] + b[i]; }
inline void Sub(Gf o, const Gf a, const Gf b) { for (int i = 0; i < 16; ++i) o[i] = a[i] - b[i]; }
inline void Mul(Gf o, const Gf a, const Gf b) {
  int64_t t[31] = {0};
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) t[i + j] += a[i] * b[j];
  for (int i = 0; i < 15; ++i) t[i] += 38 * t[i + 16];
  for (int i = 0; i < 16; ++i) o[i] = t[i];
  Carry(o);
  Carry(o);
}
inline void Square(Gf o, const Gf a) { Mul(o, a, a); }
inline void Invert(Gf o, const Gf in) {
  Gf c;
  Set(c, in);
  for (int a = 253; a >= 0; --a) {
    Square(c, c);
    if (a != 2 && a != 4) Mul(c, c, in);
  }
  Set(o, c);
}
inline void Pow2523(Gf o, const Gf in) {
  Gf c;
  Set(c, in);
  for (int a = 250; a >= 0; --a) {
    Square(c, c);
    if (a != 1) Mul(c, c, in);
  }
  Set(o, c);
}

struct Point { Gf x, y, z, t; };

inline void PointAdd(Point& p, const Point& q) {
  Gf a, b, c, d, t, e, f, g, h;
  Sub(a, p.y, p.x); Sub(t, q.y, q.x); Mul(a, a, t);
  Add(b, p.x, p.y); Add(t, q.x, q.y); Mul(b, b, t);
  Mul(c, p.t, q.t); Mul(c, c, kD2);
  Mul(d, p.z, q.z); Add(d, d, d);
  Sub(e, b, a); Sub(f, d, c); Add(g, d, c); Add(h, b, a);
  Mul(p.x, e, f); Mul(p.y, h, g); Mul(p.z, g, f); Mul(p.t, e, h);
}
inline void PointSwap(Point& p, Point& q, int b) {
  Select(p.x, q.x, b); Select(p.y, q.y, b); Select(p.z, q.z, b); Select(p.t, q.t, b);
}
inline void PointPack(uint8_t r[32], const Point& p) {
  Gf tx, ty, zi;
  Invert(zi, p.z);
  Mul(tx, p.x, zi);
  Mul(ty, p.y, zi);
  Pack(r, ty);
  r[31] ^= static_cast<uint8_t>(Parity(tx) << 7);
}
// p = s * q (s: 32 little-endian bytes); q is consumed.
inline void ScalarMult(Point& p, Point& q, const uint8_t s[32]) {
  const Gf zero = {0}, one = {1};
  Set(p.x, zero); Set(p.y, one); Set(p.z, one); Set(p.t, zero);
  for (int i = 255; i >= 0; --i) {
    int b = (s[i / 8] >> (i & 7)) & 1;
    PointSwap(p, q, b);
    PointAdd(q, p);
    PointAdd(p, p);
    PointSwap(p, q, b);
  }
}
inline void ScalarBase(Point& p, const uint8_t s[32]) {
  Point q;
  const Gf one = {1};
  Set(q.x, kX); Set(q.y, kY); Set(q.z, one); Mul(q.t, kX, kY);
  ScalarMult(p, q, s);
}

const uint8_t kLBytes[32] = {0xed, 0xd3, 0xf5, 0x5c, 0x1a, 0x63, 0x12, 0x58, 0xd6, 0x9c, 0xf7,
                             0xa2, 0xde, 0xf9, 0xde, 0x14, 0,    0,    0,    0,    0,    0,
                             0,    0,    0,    0,    0,    0,    0,    0,    0,    0x10};  // the group order L
const int64_t kL[32] = {0xed, 0xd3, 0xf5, 0x5c, 0x1a, 0x63, 0x12, 0x58, 0xd6, 0x9c, 0xf7, 0xa2, 0xde, 0xf9, 0xde, 0x14,
                        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10};

// r = x mod L, for a 64-byte little-endian x.
inline void ReduceModL(uint8_t r[32], const uint8_t in[64]) {
  int64_t x[64];
  for (int i = 0; i < 64; ++i) x[i] = in[i];
  for (int i = 63; i >= 32; --i) {
    int64_t carry = 0;
    int j;
    for (j = i - 32; j < i - 12; ++j) {
      x[j] += carry - 16 * x[i] * kL[j - (i - 32)];
      carry = (x[j] + 128) >> 8;
      x[j] -= carry * 256;
    }
    x[j] += carry;
    x[i] = 0;
  }
  int64_t carry = 0;
  for (int j = 0; j < 32; ++j) {
    x[j] += carry - (x[31] >> 4) * kL[j];
    carry = x[j] >> 8;
    x[j] &= 255;
  }
  for (int j = 0; j < 32; ++j) x[j] -= carry * kL[j];
  for (int i = 0; i < 32; ++i) {
    x[i + 1] += x[i] >> 8;
    r[i] = static_cast<uint8_t>(x[i] & 255);
  }
}

// Little-endian 32-byte a < b (a, b public).
inline bool LessThan(const uint8_t a[32], const uint8_t b[32]) {
  for (int i = 31; i >= 0; --i)
    if (a[i] != b[i]) return a[i] < b[i];
  return false;
}

// -A from its encoding; false when it is not a canonical encoding of a curve point.
inline bool UnpackNegated(Point& r, const uint8_t p[32]) {
  static const uint8_t kP[32] = {0xed, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                                 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                                 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f};
  uint8_t y[32];
  std::memcpy(y, p, 32);
  y[31] &= 0x7f;
  if (!LessThan(y, kP)) return false;
  const Gf one = {1}, zero = {0};
  Gf t, chk, num, den, den2, den4, den6;
  Set(r.z, one);
  Unpack(r.y, p);
  Square(num, r.y);
  Mul(den, num, kD);
  Sub(num, num, r.z);
  Add(den, r.z, den);
  Square(den2, den); Square(den4, den2); Mul(den6, den4, den2); Mul(t, den6, num); Mul(t, t, den);
  Pow2523(t, t);
  Mul(t, t, num); Mul(t, t, den); Mul(t, t, den); Mul(r.x, t, den);
  Square(chk, r.x); Mul(chk, chk, den);
  if (Differ(chk, num)) Mul(r.x, r.x, kI);
  Square(chk, r.x); Mul(chk, chk, den);
  if (Differ(chk, num)) return false;
  if (Parity(r.x) == (p[31] >> 7)) Sub(r.x, zero, r.x);
  Mul(r.t, r.x, r.y);
  return true;
}

// RFC 8032 verification: [s]B == R + [SHA-512(R | A | M)]A, with s < L and canonical A.
inline bool Ed25519Verify(const uint8_t public_key[32], const uint8_t* message, size_t n, const uint8_t sig[64]) {
  if (!LessThan(sig + 32, kLBytes)) return false;
  Point p, q;
  if (!UnpackNegated(q, public_key)) return false;
  std::vector<uint8_t> m(64 + n);
  std::memcpy(m.data(), sig, 32);
  std::memcpy(m.data() + 32, public_key, 32);
  if (n) std::memcpy(m.data() + 64, message, n);
  uint8_t h[64], k[32], t[32];
  Sha512(m.data(), m.size(), h);
  ReduceModL(k, h);
  ScalarMult(p, q, k);  // -[k]A
  Point sb;
  ScalarBase(sb, sig + 32);
  PointAdd(p, sb);  // [s]B - [k]A, which must be R
  PointPack(t, p);
  return std::memcmp(t, sig, 32) == 0;
}

// ---- minisign files --------------------------------------------------------------------------

const size_t kMaxSignedFile = 16 << 20;  // SHA256SUMS is a few KB; anything larger is not ours
const size_t kMaxKeyOrSignature = 64 << 10;

// Reads at most `limit` bytes; false (with why) when the file is missing, unreadable or larger.
inline bool ReadBounded(const std::string& path, size_t limit, std::string* out, std::string* why) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    *why = path + ": cannot be read (" + std::strerror(errno) + ")";
    return false;
  }
  out->clear();
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) {
    out->append(buf, n);
    if (out->size() > limit) {
      std::fclose(f);
      *why = path + ": larger than " + std::to_string(limit) + " bytes (not a file this check reads)";
      return false;
    }
  }
  bool ok = !std::ferror(f);
  std::fclose(f);
  if (!ok) *why = path + ": read error";
  return ok;
}

inline bool Base64Decode(const std::string& text, std::vector<uint8_t>* out) {
  out->clear();
  uint32_t acc = 0;
  int bits = 0;
  size_t pad = 0;
  for (char ch : text) {
    int v;
    if (ch >= 'A' && ch <= 'Z') v = ch - 'A';
    else if (ch >= 'a' && ch <= 'z') v = ch - 'a' + 26;
    else if (ch >= '0' && ch <= '9') v = ch - '0' + 52;
    else if (ch == '+') v = 62;
    else if (ch == '/') v = 63;
    else if (ch == '=') { ++pad; continue; }
    else return false;
    if (pad) return false;  // data after padding
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out->push_back(static_cast<uint8_t>(acc >> bits));
    }
  }
  return (text.size() % 4 == 0) && pad <= 2;
}

inline std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(line);
    start = end + 1;
  }
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  return lines;
}

inline std::string KeyIdText(const uint8_t* id) {  // as minisign prints it: little-endian, hex
  char text[17];
  for (int i = 0; i < 8; ++i) std::snprintf(text + 2 * i, 3, "%02X", id[7 - i]);
  return std::string(text, 16);
}

// Checks `signature_path` (minisign, prehashed) over the file at `path` with the public key file
// `key_path`. True and the trusted comment in *said, or false and one line naming the file in *said.
inline bool VerifyMinisign(const std::string& path, const std::string& signature_path, const std::string& key_path,
                           std::string* said) {
  std::string key_text, sig_text, data;
  if (!ReadBounded(key_path, kMaxKeyOrSignature, &key_text, said)) return false;
  if (!ReadBounded(signature_path, kMaxKeyOrSignature, &sig_text, said)) return false;
  if (!ReadBounded(path, kMaxSignedFile, &data, said)) return false;
  std::vector<std::string> key_lines = Lines(key_text), sig_lines = Lines(sig_text);
  std::vector<uint8_t> key, sig, global;
  if (key_lines.empty() || !Base64Decode(key_lines.back(), &key) || key.size() != 42 || key[0] != 'E' ||
      key[1] != 'd') {
    *said = key_path + ": not a minisign Ed25519 public key";
    return false;
  }
  const std::string prefix = "trusted comment: ";
  if (sig_lines.size() < 4 || sig_lines[2].compare(0, prefix.size(), prefix) != 0 ||
      !Base64Decode(sig_lines[1], &sig) || sig.size() != 74 || !Base64Decode(sig_lines[3], &global) ||
      global.size() != 64) {
    *said = signature_path + ": not a minisign signature file";
    return false;
  }
  if (std::memcmp(sig.data() + 2, key.data() + 2, 8) != 0) {
    *said = signature_path + ": signed by key " + KeyIdText(sig.data() + 2) + ", not by the trusted key " +
            KeyIdText(key.data() + 2) + " (" + key_path + ")";
    return false;
  }
  if (sig[0] != 'E' || sig[1] != 'D') {
    *said = signature_path + ": not a prehashed (\"ED\") minisign signature; legacy signatures are refused";
    return false;
  }
  uint8_t digest[64];
  Blake2b512(reinterpret_cast<const uint8_t*>(data.data()), data.size(), digest);
  if (!Ed25519Verify(key.data() + 10, digest, sizeof(digest), sig.data() + 10)) {
    *said = signature_path + ": signature does not match " + path +
            " (changed after signing, or not signed with the trusted key)";
    return false;
  }
  std::string comment = sig_lines[2].substr(prefix.size());
  std::vector<uint8_t> signed_comment(sig.begin() + 10, sig.end());
  signed_comment.insert(signed_comment.end(), comment.begin(), comment.end());
  if (!Ed25519Verify(key.data() + 10, signed_comment.data(), signed_comment.size(), global.data())) {
    *said = signature_path + ": trusted comment was changed after signing";
    return false;
  }
  *said = comment;
  return true;
}

}  // namespace edgesig
