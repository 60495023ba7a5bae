// A segmentation class map as an 8-bit greyscale PNG (one class id per pixel), with no library:
// the image data goes into zlib "stored" (uncompressed) deflate blocks, so the writer needs only
// the PNG chunk CRC-32 and zlib's Adler-32. Any PNG reader (PIL, libpng, browsers) decodes it.
// A 512 x 512 map is 263 KB; class maps are for checking and post-processing, not for storage.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace classmap {

inline uint32_t Crc32(const std::string& bytes, size_t from) {
  static uint32_t table[256] = {0};
  if (table[1] == 0)
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
      table[n] = c;
    }
  uint32_t c = 0xffffffffu;
  for (size_t i = from; i < bytes.size(); ++i) c = table[(c ^ static_cast<unsigned char>(bytes[i])) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

inline void Big32(std::string* out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out->push_back(static_cast<char>((v >> shift) & 0xff));
}

// length | type | data | CRC-32 of type and data
inline void Chunk(std::string* png, const char* type, const std::string& data) {
  Big32(png, static_cast<uint32_t>(data.size()));
  size_t start = png->size();
  png->append(type, 4);
  png->append(data);
  Big32(png, Crc32(*png, start));
}

// The PNG bytes of a height x width map of class ids (row-major).
inline std::string Encode(const std::vector<uint8_t>& map, uint32_t height, uint32_t width) {
  std::string raw;  // each row: filter type 0 (none), then the row's bytes
  raw.reserve(static_cast<size_t>(height) * (width + 1));
  for (uint32_t y = 0; y < height; ++y) {
    raw.push_back(0);
    raw.append(reinterpret_cast<const char*>(map.data()) + static_cast<size_t>(y) * width, width);
  }
  std::string zlib("\x78\x01", 2);  // deflate, 32 KB window, no preset dictionary, fastest
  size_t at = 0;
  do {  // stored blocks of at most 65535 bytes: BFINAL bit, LEN, NLEN (little-endian), the bytes
    size_t n = raw.size() - at < 65535 ? raw.size() - at : 65535;
    zlib.push_back(at + n == raw.size() ? 1 : 0);
    uint16_t len = static_cast<uint16_t>(n), nlen = static_cast<uint16_t>(~len);
    zlib.push_back(static_cast<char>(len & 0xff));
    zlib.push_back(static_cast<char>(len >> 8));
    zlib.push_back(static_cast<char>(nlen & 0xff));
    zlib.push_back(static_cast<char>(nlen >> 8));
    zlib.append(raw, at, n);
    at += n;
  } while (at < raw.size());
  uint32_t a = 1, b = 0;  // Adler-32 of the uncompressed bytes
  for (unsigned char c : raw) {
    a = (a + c) % 65521;
    b = (b + a) % 65521;
  }
  Big32(&zlib, (b << 16) | a);
  std::string ihdr;
  Big32(&ihdr, width);
  Big32(&ihdr, height);
  ihdr.append("\x08\x00\x00\x00\x00", 5);  // 8 bits, greyscale, deflate, filter method 0, no interlace
  std::string png("\x89PNG\r\n\x1a\n", 8);
  Chunk(&png, "IHDR", ihdr);
  Chunk(&png, "IDAT", zlib);
  Chunk(&png, "IEND", "");
  return png;
}

inline bool Write(const std::string& path, const std::vector<uint8_t>& map, uint32_t height, uint32_t width) {
  std::string png = Encode(map, height, width);
  std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return false;
  bool ok = std::fwrite(png.data(), 1, png.size(), f) == png.size();
  ok = (std::fclose(f) == 0) && ok;
  return ok && std::rename(tmp.c_str(), path.c_str()) == 0;
}

}  // namespace classmap
