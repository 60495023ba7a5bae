// Native edge runner: runs a TVM Relax library on preprocessed tensors, no Python needed.
//
// Made by `appliance package`: cross-compiled with zig (`zig c++ -target aarch64-linux-gnu.2.28`)
// against libtvm_runtime.so and libtvm_ffi.so from the aarch64 apache-tvm wheels, which travel in
// lib/. It talks to them through the tvm-ffi C ABI only: zig links its own libc++, so no C++
// exception or class of the TVM libraries (built with libstdc++) may cross into this program.
//
//   run --input tensor.npy [--top-k K] [--output logits.npy] [--masks DIR] [--model model.so]
//   run --selftest [--json] [--model model.so]
//   run --bench [--warmup N] [--runs N] [--threads N] [--cores LIST] [--json] [--max-fluctuation F] [--input tensor.npy]
//   run --show-cores [--threads N] [--cores LIST] [--sysfs-root DIR]
//   run --verify-signature FILE --signature FILE.minisig --pubkey KEY.pub
//
// tensor.npy is float32, C order, shaped like the model input in model.json (N, C, H, W); a
// batch larger than the compiled batch runs sample by sample. --input prints one JSON line per
// sample with the top-k class indices and logits; --output writes all logits as float32 .npy.
// A segmentation model (model.json "task": {"kind": "segmentation"}, logits (N, K, H, W)) writes
// instead one class map per image, DIR/NNNN.png (8-bit greyscale, one class id per pixel; --masks,
// default masks/), and prints per sample its path, size and pixels per class.
// --selftest runs the golden inputs in selftest/ and compares with the host's outputs recorded
// at packaging (segmentation: per pixel against the host's golden class maps, selftest/masks.npy)
// (exit 0 pass, 1 fail). --bench times the model (exit 1 when --max-fluctuation
// is given and exceeded). --verify-signature checks a minisign signature of FILE with the
// public key (signature.h): exit 0 and the trusted comment, or exit 1 and one line saying why;
// install.sh runs it from the already-installed runner on a new package's SHA256SUMS.
// Threads: on the big cores of a big.LITTLE device by default, one per core (cores.h); --cores and
// --threads override; --bench and --show-cores say what was chosen.
// Every error is one line on stderr and exit status 2.
#include <tvm/ffi/c_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include "class_map_png.h"
#include "cores.h"
#include "detection_decode.h"  // decoding + per-class NMS of detectors' raw outputs (the host's definition)
#include "signature.h"

namespace {

[[noreturn]] void Fail(const std::string& message) {
  std::fprintf(stderr, "run: error: %s\n", message.c_str());
  std::exit(2);
}

std::string FirstLine(const std::string& text) {
  size_t start = text.find_first_not_of(" \n");
  if (start == std::string::npos) return "";
  return text.substr(start, text.find('\n', start) - start);
}

// ---- files -------------------------------------------------------------------------------

bool ReadFile(const std::string& path, std::string* out) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  char buf[1 << 16];
  size_t n;
  out->clear();
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out->append(buf, n);
  bool ok = !std::ferror(f);
  std::fclose(f);
  return ok;
}

void RequireFile(const std::string& path, const std::string& what) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) Fail(path + ": no such file (" + what + ")");
  if (!S_ISREG(st.st_mode)) Fail(path + ": not a regular file (" + what + ")");
  if (access(path.c_str(), R_OK) != 0) Fail(path + ": not readable (" + what + ")");
}

std::string PackageDir() {
  // The package layout is bin/run, with model.so, model.json and selftest/ one level up.
  char exe[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) return ".";
  exe[n] = '\0';
  std::string dir(exe);
  dir = dir.substr(0, dir.rfind('/'));
  return dir + "/..";
}

// ---- .npy ----------------------------------------------------------------------------------

struct Npy {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

std::string HeaderValue(const std::string& header, const std::string& key) {
  size_t at = header.find("'" + key + "'");
  if (at == std::string::npos) return "";
  at = header.find(':', at);
  if (at == std::string::npos) return "";
  size_t start = header.find_first_not_of(' ', at + 1);
  if (start == std::string::npos) return "";
  char open = header[start];
  if (open == '\'') return header.substr(start, header.find('\'', start + 1) - start + 1);
  if (open == '(') return header.substr(start, header.find(')', start) - start + 1);
  return header.substr(start, header.find_first_of(",}", start) - start);
}

// Reads a float32 (or, with class_ids, uint8 class maps) little-endian C-order .npy (format 1.0-3.0),
// which is what numpy.save writes; uint8 values are returned as floats.
Npy ReadNpy(const std::string& path, bool class_ids = false) {
  RequireFile(path, class_ids ? "golden class maps" : "input tensor");
  std::string bytes;
  if (!ReadFile(path, &bytes)) Fail(path + ": cannot read");
  if (bytes.size() < 10 || std::memcmp(bytes.data(), "\x93NUMPY", 6) != 0) Fail(path + ": not a .npy file");
  unsigned char major = static_cast<unsigned char>(bytes[6]);
  size_t header_len, offset;
  const unsigned char* b = reinterpret_cast<const unsigned char*>(bytes.data());
  if (major == 1) {
    header_len = b[8] | (b[9] << 8);
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) Fail(path + ": .npy header cut short");
    header_len = b[8] | (b[9] << 8) | (b[10] << 16) | (static_cast<size_t>(b[11]) << 24);
    offset = 12;
  } else {
    Fail(path + ": unsupported .npy format version " + std::to_string(major));
  }
  if (bytes.size() < offset + header_len) Fail(path + ": .npy header cut short (file truncated)");
  std::string header = bytes.substr(offset, header_len);
  std::string descr = HeaderValue(header, "descr");
  size_t item = class_ids && descr == "'|u1'" ? 1 : 4;
  if (descr != "'<f4'" && item != 1)
    Fail(path + ": dtype is " + (descr.empty() ? "missing" : descr) + ", the model needs float32 ('<f4')");
  if (HeaderValue(header, "fortran_order") != "False") Fail(path + ": Fortran-order data; save it in C order");
  std::string dims = HeaderValue(header, "shape");
  if (dims.size() < 2 || dims.front() != '(') Fail(path + ": .npy header has no shape");
  Npy npy;
  const char* p = dims.c_str() + 1;
  while (*p != '\0' && *p != ')') {
    char* end;
    long long v = std::strtoll(p, &end, 10);
    if (end == p) {
      ++p;
      continue;
    }
    if (v < 0) Fail(path + ": negative dimension in .npy shape " + dims);
    npy.shape.push_back(v);
    p = end;
  }
  uint64_t count = 1;
  for (int64_t d : npy.shape) {
    if (d != 0 && count > UINT64_MAX / 4 / static_cast<uint64_t>(d)) Fail(path + ": shape " + dims + " too large");
    count *= static_cast<uint64_t>(d);
  }
  uint64_t have = bytes.size() - offset - header_len;
  if (have < count * item)
    Fail(path + ": truncated: header says shape " + dims + " (" + std::to_string(count * item) +
         " bytes), file holds " + std::to_string(have));
  npy.data.resize(count);
  const char* data = bytes.data() + offset + header_len;
  if (item == 1)
    for (uint64_t i = 0; i < count; ++i) npy.data[i] = static_cast<unsigned char>(data[i]);
  else
    std::memcpy(npy.data.data(), data, count * sizeof(float));
  return npy;
}

void WriteNpy(const std::string& path, const std::vector<int64_t>& shape, const std::vector<float>& data) {
  std::string dims;
  for (size_t i = 0; i < shape.size(); ++i)
    dims += std::to_string(shape[i]) + (shape.size() == 1 || i + 1 < shape.size() ? "," : "");
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) Fail(path + ": cannot write");
  uint16_t len = static_cast<uint16_t>(header.size());
  char prefix[10] = {'\x93', 'N', 'U', 'M', 'P', 'Y', 1, 0, static_cast<char>(len & 0xff), static_cast<char>(len >> 8)};
  bool ok = std::fwrite(prefix, 1, 10, f) == 10 && std::fwrite(header.data(), 1, header.size(), f) == header.size() &&
            std::fwrite(data.data(), sizeof(float), data.size(), f) == data.size();
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) Fail(path + ": cannot write");
}

// ---- model.json (written by `appliance package`; a few known keys, no general JSON needed) ---

struct ModelInfo {
  std::vector<int64_t> input_shape;  // as compiled; [0] is the batch
  double selftest_max_abs_diff = -1;
  double selftest_min_agreement = 1.0;  // of the top-1 per sample, or of the class per pixel
  bool segmentation = false;            // "task": {"kind": "segmentation"}: logits (N, K, H, W), class maps out
};

size_t FindKey(const std::string& json, const std::string& key, size_t from = 0) {
  size_t at = json.find("\"" + key + "\"", from);
  if (at == std::string::npos) return at;
  at = json.find(':', at);
  return at == std::string::npos ? at : at + 1;
}

ModelInfo ReadModelInfo(const std::string& path) {
  RequireFile(path, "model metadata");
  std::string json;
  if (!ReadFile(path, &json)) Fail(path + ": cannot read");
  ModelInfo info;
  size_t input = FindKey(json, "input");
  size_t shape = input == std::string::npos ? input : FindKey(json, "shape", input);
  if (shape == std::string::npos || json.find('[', shape) == std::string::npos)
    Fail(path + ": no \"input\": {\"shape\": [...]} (not made by `appliance package`?)");
  const char* p = json.c_str() + json.find('[', shape) + 1;
  while (*p != '\0' && *p != ']') {
    char* end;
    long long v = std::strtoll(p, &end, 10);
    if (end == p) {
      ++p;
      continue;
    }
    info.input_shape.push_back(v);
    p = end;
  }
  size_t selftest = FindKey(json, "selftest");
  if (selftest != std::string::npos) {
    size_t diff = FindKey(json, "max_abs_diff", selftest);
    size_t agreement = FindKey(json, "min_top1_agreement", selftest);
    if (agreement == std::string::npos) agreement = FindKey(json, "min_pixel_agreement", selftest);
    if (diff != std::string::npos) info.selftest_max_abs_diff = std::strtod(json.c_str() + diff, nullptr);
    if (agreement != std::string::npos) info.selftest_min_agreement = std::strtod(json.c_str() + agreement, nullptr);
  }
  // model.json's top-level "task" comes first in the file (the model card repeats it further down).
  size_t task = FindKey(json, "task");
  size_t kind = task == std::string::npos ? task : FindKey(json, "kind", task);
  if (kind != std::string::npos) {
    size_t start = json.find('"', kind), end = start == std::string::npos ? start : json.find('"', start + 1);
    info.segmentation = end != std::string::npos && json.substr(start + 1, end - start - 1) == "segmentation";
  }
  return info;
}

// ---- the TVM runtime, through the tvm-ffi C ABI only ------------------------------------------

std::string RaisedError() {
  TVMFFIObjectHandle err = nullptr;
  TVMFFIErrorMoveFromRaised(&err);
  if (err == nullptr) return "unknown TVM error";
  const TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(err);
  std::string kind(cell->kind.data, cell->kind.size), message(cell->message.data, cell->message.size);
  TVMFFIObjectDecRef(err);
  return kind + ": " + FirstLine(message);
}

TVMFFIAny None() {
  TVMFFIAny any;
  std::memset(&any, 0, sizeof(any));
  any.type_index = kTVMFFINone;
  return any;
}

TVMFFIAny Str(const char* s) {
  TVMFFIAny any = None();
  any.type_index = kTVMFFIRawStr;
  any.v_c_str = s;
  return any;
}

TVMFFIAny Int(int64_t v, int32_t type_index = kTVMFFIInt) {
  TVMFFIAny any = None();
  any.type_index = type_index;
  any.v_int64 = v;
  return any;
}

TVMFFIAny Obj(TVMFFIObjectHandle h) {
  TVMFFIAny any = None();
  any.type_index = TVMFFIObjectGetTypeIndex(h);
  any.v_obj = static_cast<TVMFFIObject*>(h);
  return any;
}

void Release(TVMFFIAny* any) {
  if (any->type_index >= kTVMFFIStaticObjectBegin && any->v_obj != nullptr) TVMFFIObjectDecRef(any->v_obj);
  *any = None();
}

// Calls f(args...) and returns the owned result; on error, returns false and sets *error.
bool Call(TVMFFIObjectHandle f, std::vector<TVMFFIAny> args, TVMFFIAny* result, std::string* error) {
  *result = None();
  if (TVMFFIFunctionCall(f, args.data(), static_cast<int32_t>(args.size()), result) != 0) {
    *error = RaisedError();
    *result = None();
    return false;
  }
  return true;
}

TVMFFIObjectHandle Global(const char* name) {
  TVMFFIByteArray bytes{name, std::strlen(name)};
  TVMFFIObjectHandle f = nullptr;
  if (TVMFFIFunctionGetGlobal(&bytes, &f) != 0) Fail(std::string(name) + ": " + RaisedError());
  if (f == nullptr) Fail(std::string("the TVM runtime in lib/ has no function ") + name + " (wrong libtvm_runtime.so?)");
  return f;
}

// A function of a module, or failure naming `where`.
TVMFFIObjectHandle ModuleFunction(TVMFFIObjectHandle module, const char* name, const std::string& where) {
  TVMFFIAny f;
  std::string error;
  if (!Call(Global("ffi.ModuleGetFunction"), {Obj(module), Str(name), Int(1, kTVMFFIBool)}, &f, &error))
    Fail(where + ": " + error);
  if (f.type_index != kTVMFFIFunction) Fail(where + ": has no function " + name + " (not a TVM Relax library?)");
  return f.v_obj;
}

struct Model {
  TVMFFIObjectHandle main = nullptr;
  std::string path;
};

Model LoadModel(const std::string& path) {
  RequireFile(path, "model library");
  TVMFFIAny lib;
  std::string error;
  if (!Call(Global("ffi.ModuleLoadFromFile"), {Str(path.c_str())}, &lib, &error))
    Fail(path + ": cannot load the model library: " + error);
  if (lib.type_index != kTVMFFIModule) Fail(path + ": loading did not give a module");
  TVMFFIAny vm;
  if (!Call(ModuleFunction(lib.v_obj, "vm_load_executable", path), {}, &vm, &error) || vm.type_index != kTVMFFIModule)
    Fail(path + ": vm_load_executable failed: " + error);
  constexpr int64_t kCPU = 1, kPooledAllocator = 2;
  TVMFFIAny ignored;
  if (!Call(ModuleFunction(vm.v_obj, "vm_initialization", path), {Int(kCPU), Int(0), Int(kPooledAllocator)},
            &ignored, &error))
    Fail(path + ": vm_initialization failed: " + error);
  Release(&ignored);
  return Model{ModuleFunction(vm.v_obj, "main", path), path};
}

// The DLPack view of one input; the tensor object owns it (and frees it when the VM lets go),
// the caller owns the data and keeps it alive for the call.
struct InputView {
  DLManagedTensor managed;
  std::vector<int64_t> shape;
};

void FreeView(DLManagedTensor* managed) { delete static_cast<InputView*>(managed->manager_ctx); }

TVMFFIObjectHandle WrapTensor(float* data, const std::vector<int64_t>& shape) {
  InputView* view = new InputView();
  view->shape = shape;
  std::memset(&view->managed, 0, sizeof(view->managed));
  view->managed.dl_tensor.data = data;
  view->managed.dl_tensor.device = DLDevice{kDLCPU, 0};
  view->managed.dl_tensor.ndim = static_cast<int32_t>(view->shape.size());
  view->managed.dl_tensor.dtype = DLDataType{kDLFloat, 32, 1};
  view->managed.dl_tensor.shape = view->shape.data();
  view->managed.manager_ctx = view;
  view->managed.deleter = FreeView;
  TVMFFIObjectHandle tensor = nullptr;
  if (TVMFFITensorFromDLPack(&view->managed, 64, 1, &tensor) != 0) Fail("cannot make an input tensor: " + RaisedError());
  return tensor;
}

struct AlignedBuffer {
  float* data;
  explicit AlignedBuffer(size_t count) {
    size_t bytes = ((count * sizeof(float) + 63) / 64) * 64;
    data = static_cast<float*>(std::aligned_alloc(64, bytes == 0 ? 64 : bytes));
    if (data == nullptr) Fail("out of memory");
  }
  ~AlignedBuffer() { std::free(data); }
};

// Runs the model on each sample of `batch`, returning its outputs (`classes` values per sample:
// the class logits, or K*H*W of a segmentation model; *out_shape the output's shape, batch 1) or
// false + *error on a TVM error (the caller decides whether that is a usage error or a failed self-test).
bool RunBatch(const Model& model, const Npy& batch, std::vector<float>* logits, int64_t* classes,
              std::string* error, const std::vector<int64_t>& sample_shape,
              std::vector<int64_t>* out_shape = nullptr) {
  int64_t n = batch.shape[0];
  size_t sample_size = n == 0 ? 0 : batch.data.size() / n;
  AlignedBuffer buffer(sample_size);
  logits->clear();
  for (int64_t s = 0; s < n; ++s) {
    std::memcpy(buffer.data, batch.data.data() + s * sample_size, sample_size * sizeof(float));
    TVMFFIObjectHandle x = WrapTensor(buffer.data, sample_shape);
    TVMFFIAny y;
    bool ok = Call(model.main, {Obj(x)}, &y, error);
    TVMFFIObjectDecRef(x);
    if (!ok) return false;
    if (y.type_index != kTVMFFITensor) {
      *error = "the model returned type index " + std::to_string(y.type_index) + ", not one tensor";
      Release(&y);
      return false;
    }
    const DLTensor* t = TVMFFITensorGetDLTensorPtr(y.v_obj);
    if (t->dtype.code != kDLFloat || t->dtype.bits != 32 || t->device.device_type != kDLCPU) {
      *error = "the model's output is not a float32 CPU tensor";
      Release(&y);
      return false;
    }
    int64_t count = 1;
    for (int i = 0; i < t->ndim; ++i) count *= t->shape[i];
    if (out_shape != nullptr) out_shape->assign(t->shape, t->shape + t->ndim);
    const float* out = reinterpret_cast<const float*>(static_cast<const char*>(t->data) + t->byte_offset);
    logits->insert(logits->end(), out, out + count);
    *classes = count;
    Release(&y);
  }
  return true;
}

// The per-sample shape the model was compiled for, after checking `batch` can feed it.
std::vector<int64_t> CheckShape(const Npy& batch, const ModelInfo& info, const std::string& path) {
  auto text = [](const std::vector<int64_t>& v, size_t from) {
    std::string s = "(";
    for (size_t i = from; i < v.size(); ++i) s += (i > from ? ", " : "") + std::to_string(v[i]);
    return s + ")";
  };
  const std::vector<int64_t>& want = info.input_shape;
  bool ok = batch.shape.size() == want.size() && !want.empty();
  for (size_t i = 1; ok && i < want.size(); ++i) ok = want[i] <= 0 || batch.shape[i] == want[i];
  if (!ok)
    Fail(path + ": shape " + text(batch.shape, 0) + ", the model needs (N, " + text(want, 1).substr(1));
  if (batch.shape[0] == 0) Fail(path + ": holds no samples (shape " + text(batch.shape, 0) + ")");
  std::vector<int64_t> sample(batch.shape);
  sample[0] = 1;
  return sample;
}

std::string JsonEscape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out;
}

int ArgMax(const float* v, int64_t n) { return static_cast<int>(std::max_element(v, v + n) - v); }

std::string Num(double v, const char* format = "%.9g") {
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, v);
  return buf;
}

// The class of each of `pixels` positions: argmax over the k logits at stride `pixels` (the first
// of equal maxima, as numpy's argmax); pixels == 1 is one top-1 class.
void ClassMap(const float* logits, int64_t k, int64_t pixels, std::vector<uint8_t>* map) {
  map->assign(pixels, 0);
  for (int64_t p = 0; p < pixels; ++p) {
    int64_t best = 0;
    for (int64_t c = 1; c < k; ++c)
      if (logits[c * pixels + p] > logits[best * pixels + p]) best = c;
    (*map)[p] = static_cast<uint8_t>(best);
  }
}

// One segmentation sample: its class map written to masks/NNNN.png, and its JSON line.
std::string WriteClassMap(const std::vector<float>& logits, const std::vector<int64_t>& shape, int64_t sample,
                          const std::string& masks) {
  if (shape.size() != 4) Fail("model.json says segmentation, but the model returns a rank-" +
                              std::to_string(shape.size()) + " output, not logits (1, K, H, W)");
  if (shape[1] > 256) Fail("the model has " + std::to_string(shape[1]) + " classes; an 8-bit class map holds 256");
  std::vector<uint8_t> map;
  ClassMap(logits.data(), shape[1], shape[2] * shape[3], &map);
  char name[32];
  std::snprintf(name, sizeof(name), "/%04lld.png", static_cast<long long>(sample));
  std::string path = masks + name;
  if (!classmap::Write(path, map, static_cast<uint32_t>(shape[2]), static_cast<uint32_t>(shape[3])))
    Fail(path + ": cannot write the class map (does " + masks + " exist and is it writable?)");
  std::vector<int64_t> counts(shape[1], 0);
  for (uint8_t c : map) ++counts[c];
  std::string line = "{\"sample\": " + std::to_string(sample) + ", \"mask\": \"" + JsonEscape(path) +
                     "\", \"height\": " + std::to_string(shape[2]) + ", \"width\": " + std::to_string(shape[3]) +
                     ", \"class_pixels\": [";
  for (size_t c = 0; c < counts.size(); ++c) line += (c ? ", " : "") + std::to_string(counts[c]);
  return line + "]}";
}

// ---- verbs ---------------------------------------------------------------------------------

int Predict(const Model& model, const ModelInfo& info, const Npy& batch, const std::vector<int64_t>& sample_shape,
            const std::string& output, int top_k, const std::string& masks) {
  std::vector<float> logits;
  int64_t classes = 0;
  std::string error;
  int64_t n = batch.shape[0];
  // One sample at a time so that each JSON line is flushed as soon as it exists (callers count them).
  Npy one{sample_shape, {}};
  size_t sample_size = batch.data.size() / n;
  std::vector<float> all;
  std::vector<int64_t> out_shape;
  if (info.segmentation) mkdir(masks.c_str(), 0755);  // an existing folder is fine; a failed write names it
  for (int64_t s = 0; s < n; ++s) {
    one.data.assign(batch.data.begin() + s * sample_size, batch.data.begin() + (s + 1) * sample_size);
    if (!RunBatch(model, one, &logits, &classes, &error, sample_shape, &out_shape)) Fail(model.path + ": " + error);
    all.insert(all.end(), logits.begin(), logits.end());
    if (info.segmentation) {
      std::printf("%s\n", WriteClassMap(logits, out_shape, s, masks).c_str());
      std::fflush(stdout);
      continue;
    }
    std::vector<int64_t> order(classes);
    for (int64_t i = 0; i < classes; ++i) order[i] = i;
    int64_t k = std::min<int64_t>(top_k, classes);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) { return logits[a] > logits[b]; });
    std::string line = "{\"sample\": " + std::to_string(s) + ", \"top_k\": [";
    for (int64_t j = 0; j < k; ++j)
      line += std::string(j ? ", " : "") + "{\"class\": " + std::to_string(order[j]) + ", \"logit\": " +
              Num(logits[order[j]]) + "}";
    std::printf("%s]}\n", line.c_str());
    std::fflush(stdout);
  }
  std::vector<int64_t> shape{n, classes};
  if (info.segmentation) {  // (N, K, H, W)
    shape.assign(out_shape.begin(), out_shape.end());
    shape[0] = n;
  }
  if (!output.empty()) WriteNpy(output, shape, all);
  return 0;
}

// Self-test of a classification model: top-1 per sample; of a segmentation model: the class per
// pixel against the host's golden class maps (golden: N x H x W, or empty for classification).
int SelfTest(const Model& model, const ModelInfo& info, const Npy& inputs, const Npy& expected, const Npy& golden,
             const std::vector<int64_t>& sample_shape, bool json) {
  std::vector<float> logits;
  int64_t classes = 0;
  std::string error;
  int64_t n = inputs.shape[0];
  std::vector<int64_t> out_shape;
  bool ran = RunBatch(model, inputs, &logits, &classes, &error, sample_shape, &out_shape);
  int64_t per_sample = 1;
  for (size_t i = 1; i < expected.shape.size(); ++i) per_sample *= expected.shape[i];
  if (ran && (expected.shape.empty() || expected.shape[0] != n || per_sample != classes ||
              (!info.segmentation && expected.shape.size() != 2))) {
    ran = false;
    error = "gives " + std::to_string(classes) + " outputs per sample, the packaged host outputs have " +
            (expected.shape.size() >= 2 ? std::to_string(per_sample) : std::string("another shape"));
  }
  // Positions per sample (H*W, or 1) and classes at each (K).
  int64_t pixels = info.segmentation && out_shape.size() == 4 ? out_shape[2] * out_shape[3] : 1;
  if (ran && info.segmentation && (out_shape.size() != 4 || golden.shape.size() != 3 || golden.shape[0] != n ||
                                   golden.shape[1] * golden.shape[2] != pixels)) {
    ran = false;
    error = "gives no (1, K, H, W) logits matching the golden class maps selftest/masks.npy";
  }
  if (!ran) {  // e.g. another model's library: one line either way
    if (json)
      std::printf("{\"passed\": false, \"samples\": %lld, \"error\": \"%s\"}\n", static_cast<long long>(n),
                  JsonEscape(model.path + ": " + error).c_str());
    else
      std::printf("selftest FAIL: %s: %s\n", model.path.c_str(), error.c_str());
    return 1;
  }
  int64_t agree = 0;
  double max_diff = 0;
  std::vector<uint8_t> map;
  for (int64_t s = 0; s < n; ++s) {
    const float* got = logits.data() + s * classes;
    const float* want = expected.data.data() + s * classes;
    if (info.segmentation) {
      ClassMap(got, classes / pixels, pixels, &map);
      for (int64_t p = 0; p < pixels; ++p) agree += map[p] == golden.data[s * pixels + p];
    } else {
      agree += ArgMax(got, classes) == ArgMax(want, classes);
    }
    for (int64_t c = 0; c < classes; ++c) {
      double d = std::fabs(static_cast<double>(got[c]) - want[c]);
      if (std::isnan(d)) max_diff = NAN;  // and stays NaN: a failure
      else if (!std::isnan(max_diff) && d > max_diff) max_diff = d;
    }
  }
  double agreement = static_cast<double>(agree) / (n * pixels);
  const char* what = info.segmentation ? "pixel" : "top1";
  bool passed = agreement >= info.selftest_min_agreement && max_diff <= info.selftest_max_abs_diff;  // false for NaN
  if (json) {
    std::printf("{\"passed\": %s, \"samples\": %lld, \"%s_agreement\": %s, \"min_%s_agreement\": %s, "
                "\"max_abs_diff\": %s, \"allowed_abs_diff\": %s}\n",
                passed ? "true" : "false", static_cast<long long>(n), what, Num(agreement).c_str(), what,
                Num(info.selftest_min_agreement).c_str(), std::isnan(max_diff) ? "null" : Num(max_diff).c_str(),
                Num(info.selftest_max_abs_diff).c_str());
  } else {
    std::printf("selftest %s: %lld golden samples: %s agreement %.4f (need %g), max logit diff %.3g "
                "(allowed %.3g)\n",
                passed ? "PASS" : "FAIL", static_cast<long long>(n), info.segmentation ? "pixel" : "top-1", agreement,
                info.selftest_min_agreement,
                max_diff, info.selftest_max_abs_diff);
  }
  return passed ? 0 : 1;
}

double Percentile(const std::vector<double>& sorted, double q) {
  // Nearest rank: the smallest value with at least q of the runs at or below it.
  size_t rank = static_cast<size_t>(std::ceil(q * sorted.size()));
  return sorted[std::min(sorted.size() - 1, rank == 0 ? 0 : rank - 1)];
}

int Bench(const Model& model, const Npy& batch, const std::vector<int64_t>& sample_shape, int warmup, int runs,
          const cores::Choice& placed, bool json, double max_fluctuation) {
  int threads = placed.threads;
  Npy one{sample_shape, std::vector<float>(batch.data.begin(), batch.data.begin() + batch.data.size() / batch.shape[0])};
  std::vector<float> logits;
  int64_t classes = 0;
  std::string error;
  for (int i = 0; i < warmup; ++i)
    if (!RunBatch(model, one, &logits, &classes, &error, sample_shape)) Fail(model.path + ": " + error);
  std::vector<double> ms;
  for (int i = 0; i < runs; ++i) {
    auto start = std::chrono::steady_clock::now();
    if (!RunBatch(model, one, &logits, &classes, &error, sample_shape)) Fail(model.path + ": " + error);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  TVMFFIAny pool;
  int64_t pool_threads = threads;
  if (Call(Global("runtime.NumThreads"), {}, &pool, &error) && pool.type_index == kTVMFFIInt) pool_threads = pool.v_int64;
  std::sort(ms.begin(), ms.end());
  double median = Percentile(ms, 0.5), p90 = Percentile(ms, 0.9), p99 = Percentile(ms, 0.99);
  double mean = 0;
  for (double v : ms) mean += v / ms.size();
  double fluctuation = median > 0 ? (p99 - median) / median : 0;
  bool gated = max_fluctuation >= 0, passed = !gated || fluctuation <= max_fluctuation;
  if (json) {
    std::printf("{\"runs\": %d, \"warmup\": %d, \"threads\": %lld, \"median_ms\": %s, \"p90_ms\": %s, "
                "\"p99_ms\": %s, \"mean_ms\": %s, \"min_ms\": %s, \"max_ms\": %s, \"fluctuation\": %s, "
                "\"max_fluctuation\": %s, \"passed\": %s, \"placement\": %s}\n",
                runs, warmup, static_cast<long long>(pool_threads), Num(median).c_str(), Num(p90).c_str(),
                Num(p99).c_str(), Num(mean).c_str(), Num(ms.front()).c_str(), Num(ms.back()).c_str(),
                Num(fluctuation).c_str(), gated ? Num(max_fluctuation).c_str() : "null", passed ? "true" : "false",
                cores::Json(placed).c_str());
  } else {
    std::printf("bench: %d runs after %d warmup, %lld threads on cores %s: median %.3f ms, p90 %.3f ms, p99 %.3f ms, "
                "fluctuation (p99-median)/median %.3f%s\n",
                runs, warmup, static_cast<long long>(pool_threads), cores::Where(placed).c_str(), median, p90, p99,
                fluctuation,
                gated ? (passed ? (" (max " + Num(max_fluctuation, "%g") + "): PASS").c_str()
                                : (" (max " + Num(max_fluctuation, "%g") + "): FAIL").c_str())
                      : "");
  }
  return passed ? 0 : 1;
}

int PositiveInt(const std::string& flag, const std::string& text, int minimum) {
  char* end;
  long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < minimum || v > 1000000)
    Fail(flag + ": expected an integer >= " + std::to_string(minimum) + ", got '" + text + "'");
  return static_cast<int>(v);
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = PackageDir();
  std::string input, output, masks = "masks", model_path = dir + "/model.so", info_path = dir + "/model.json";
  int top_k = 5, warmup = 10, runs = 100, threads = 0;
  bool selftest = false, bench = false, json = false, show_cores = false;
  std::string cores_flag, sysfs_root = "/sys";
  double max_fluctuation = -1;
  std::string signed_file, signature, pubkey;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Fail(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--input") input = value();
    else if (arg == "--output") output = value();
    else if (arg == "--masks") masks = value();
    else if (arg == "--model") model_path = value();
    else if (arg == "--info") info_path = value();
    else if (arg == "--top-k") top_k = PositiveInt(arg, value(), 1);
    else if (arg == "--selftest") selftest = true;
    else if (arg == "--bench") bench = true;
    else if (arg == "--json") json = true;
    else if (arg == "--warmup") warmup = PositiveInt(arg, value(), 0);
    else if (arg == "--runs") runs = PositiveInt(arg, value(), 1);
    else if (arg == "--threads") threads = PositiveInt(arg, value(), 1);
    else if (arg == "--cores") cores_flag = value();
    else if (arg == "--sysfs-root") sysfs_root = value();
    else if (arg == "--show-cores") show_cores = true;
    else if (arg == "--verify-signature") signed_file = value();
    else if (arg == "--signature") signature = value();
    else if (arg == "--pubkey") pubkey = value();
    else if (arg == "--max-fluctuation") {
      std::string text = value();
      char* end;
      max_fluctuation = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0' || !(max_fluctuation >= 0) || std::isinf(max_fluctuation))
        Fail("--max-fluctuation: expected a finite number >= 0, got '" + text + "'");
    } else if (arg == "--help" || arg == "-h") {
      std::printf(
          "usage: run --input tensor.npy [--top-k K] [--output logits.npy] [--masks DIR] [--model model.so]\n"
          "       run --selftest [--json]\n"
          "       run --bench [--warmup N] [--runs N] [--threads N] [--cores LIST] [--json] [--max-fluctuation F] "
          "[--input tensor.npy]\n"
          "       run --show-cores [--threads N] [--cores LIST] [--sysfs-root DIR]\n"
          "       run --verify-signature FILE --signature FILE.minisig --pubkey KEY.pub\n");
      return 0;
    } else {
      Fail("unknown argument " + arg + " (see --help)");
    }
  }
  if (!signed_file.empty() || !signature.empty() || !pubkey.empty()) {
    if (signed_file.empty() || signature.empty() || pubkey.empty())
      Fail("--verify-signature FILE needs --signature FILE.minisig and --pubkey KEY.pub");
    std::string said;
    if (!edgesig::VerifyMinisign(signed_file, signature, pubkey, &said)) {
      std::fprintf(stderr, "run: refused: %s\n", said.c_str());
      return 1;
    }
    std::printf("%s: signature OK (trusted comment: %s)\n", signed_file.c_str(), said.c_str());
    return 0;
  }
  if (selftest + bench + show_cores > 1) Fail("--selftest, --bench and --show-cores are separate runs; give one");
  cores::Choice placed = cores::Choose(sysfs_root, cores_flag, threads, [](const std::string& m) { Fail(m); });
  if (show_cores) {
    std::printf("%s\n", cores::Json(placed).c_str());
    return 0;
  }
  if (!selftest && !bench && input.empty()) Fail("--input tensor.npy is required (or --selftest, --bench)");
  // The runtime's thread pool reads these when it starts, which is at the first model call. Its workers
  // inherit the process's affinity (set by cores::Choose); TVM's own binding, by its reading of
  // cpufreq, would move them off the chosen cores.
  setenv("TVM_NUM_THREADS", std::to_string(placed.threads).c_str(), threads > 0 || !cores_flag.empty() ? 1 : 0);
  setenv("TVM_BIND_THREADS", "0", 1);

  // Cheap checks of every file first, so that a bad input is named before the model loads.
  ModelInfo info = ReadModelInfo(info_path);
  if (selftest) {
    if (info.selftest_max_abs_diff < 0)
      Fail(info_path + ": no \"selftest\" tolerance (package made without golden samples)");
    std::string inputs_path = dir + "/selftest/inputs.npy";
    Npy inputs = ReadNpy(inputs_path);
    Npy expected = ReadNpy(dir + "/selftest/expected.npy");
    Npy golden = info.segmentation ? ReadNpy(dir + "/selftest/masks.npy", true) : Npy{};
    std::vector<int64_t> sample_shape = CheckShape(inputs, info, inputs_path);
    Model model = LoadModel(model_path);
    return SelfTest(model, info, inputs, expected, golden, sample_shape, json);
  }
  if (input.empty()) input = dir + "/selftest/inputs.npy";  // --bench on the golden samples
  Npy batch = ReadNpy(input);
  std::vector<int64_t> sample_shape = CheckShape(batch, info, input);
  Model model = LoadModel(model_path);
  if (bench) return Bench(model, batch, sample_shape, warmup, runs, placed, json, max_fluctuation);
  return Predict(model, info, batch, sample_shape, output, top_k, masks);
}
