// Native edge runner: runs a TVM Relax library on preprocessed tensors, no Python needed.
//
// Made by `appliance package` (cross-compiled with aarch64-linux-gnu-g++ -std=c++17 against
// libtvm_runtime.so and libtvm_ffi.so from the aarch64 apache-tvm wheels, which travel in lib/).
//
//   run --input tensor.npy [--top-k K] [--output logits.npy] [--model model.so]
//
// tensor.npy is float32, C order, shaped like the model input (N,C,H,W); a batch larger than
// the compiled batch runs sample by sample. Prints one JSON line per sample with the top-k
// class indices and logits; --output writes all logits as a float32 .npy (N, classes).
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include <limits.h>
#include <unistd.h>

namespace ffi = tvm::ffi;

namespace {

[[noreturn]] void Fail(const std::string& message) {
  std::cerr << "run: error: " << message << std::endl;
  std::exit(2);
}

// Host memory for tensors we hand to the VM (the wheel's tensor.h helpers need headers it lacks).
struct CPUAlloc {
  void AllocData(DLTensor* tensor) {
    size_t bytes = (tensor->dtype.bits / 8) * tensor->dtype.lanes;
    for (int i = 0; i < tensor->ndim; ++i) bytes *= tensor->shape[i];
    tensor->data = std::aligned_alloc(64, ((bytes + 63) / 64) * 64);
  }
  void FreeData(DLTensor* tensor) { std::free(tensor->data); }
};

struct Npy {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

// Reads a float32 little-endian C-order .npy (format 1.0-3.0), which is what numpy.save writes.
Npy ReadNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) Fail(path + ": cannot open");
  char magic[6];
  in.read(magic, 6);
  if (!in || std::memcmp(magic, "\x93NUMPY", 6) != 0) Fail(path + ": not a .npy file");
  unsigned char version[2];
  in.read(reinterpret_cast<char*>(version), 2);
  uint32_t header_len = 0;
  if (version[0] == 1) {
    unsigned char b[2];
    in.read(reinterpret_cast<char*>(b), 2);
    header_len = b[0] | (b[1] << 8);
  } else {
    unsigned char b[4];
    in.read(reinterpret_cast<char*>(b), 4);
    header_len = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
  }
  std::string header(header_len, '\0');
  in.read(&header[0], header_len);
  if (header.find("'descr': '<f4'") == std::string::npos)
    Fail(path + ": expected float32 ('<f4') data, header is " + header);
  if (header.find("'fortran_order': False") == std::string::npos)
    Fail(path + ": expected C order data");
  size_t open = header.find('(', header.find("'shape'"));
  size_t close = header.find(')', open);
  std::stringstream dims(header.substr(open + 1, close - open - 1));
  Npy npy;
  std::string item;
  while (std::getline(dims, item, ',')) {
    if (item.find_first_not_of(' ') != std::string::npos) npy.shape.push_back(std::stoll(item));
  }
  int64_t count = std::accumulate(npy.shape.begin(), npy.shape.end(), int64_t{1}, std::multiplies<>());
  npy.data.resize(count);
  in.read(reinterpret_cast<char*>(npy.data.data()), count * sizeof(float));
  if (!in) Fail(path + ": file shorter than its header says");
  return npy;
}

void WriteNpy(const std::string& path, const std::vector<int64_t>& shape, const std::vector<float>& data) {
  std::string dims;
  for (size_t i = 0; i < shape.size(); ++i) dims += std::to_string(shape[i]) + (shape.size() == 1 || i + 1 < shape.size() ? "," : "");
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::binary);
  out.write("\x93NUMPY\x01\x00", 8);
  uint16_t len = static_cast<uint16_t>(header.size());
  out.put(static_cast<char>(len & 0xff));
  out.put(static_cast<char>(len >> 8));
  out << header;
  out.write(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(float));
  out.close();
  if (!out || std::rename(tmp.c_str(), path.c_str()) != 0) Fail(path + ": cannot write");
}

std::string DefaultModelPath() {
  // The package layout is bin/run next to model.so one level up.
  char exe[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) return "model.so";
  exe[n] = '\0';
  std::string dir(exe);
  dir = dir.substr(0, dir.rfind('/'));
  return dir + "/../model.so";
}

}  // namespace

int main(int argc, char** argv) {
  std::string input, output, model = DefaultModelPath();
  int top_k = 5;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Fail(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--input") input = value();
    else if (arg == "--output") output = value();
    else if (arg == "--model") model = value();
    else if (arg == "--top-k") top_k = std::stoi(value());
    else if (arg == "--help" || arg == "-h") {
      std::cout << "usage: run --input tensor.npy [--top-k K] [--output logits.npy] [--model model.so]\n";
      return 0;
    } else Fail("unknown argument " + arg);
  }
  if (input.empty()) Fail("--input tensor.npy is required");

  Npy batch = ReadNpy(input);
  if (batch.shape.size() < 2) Fail(input + ": expected a batch of tensors (N, ...), got rank " + std::to_string(batch.shape.size()));

  ffi::Module lib = ffi::Module::LoadFromFile(model);
  ffi::Module vm = lib->GetFunction("vm_load_executable").value()().cast<ffi::Module>();
  constexpr int kCPU = 1, kPooledAllocator = 2;
  vm->GetFunction("vm_initialization").value()(kCPU, 0, kPooledAllocator);
  ffi::Function run = vm->GetFunction("main").value();

  std::vector<int64_t> sample_shape(batch.shape.begin(), batch.shape.end());
  sample_shape[0] = 1;
  int64_t n = batch.shape[0];
  int64_t sample_size = batch.data.size() / n;
  std::vector<float> logits;
  int64_t classes = 0;
  DLDataType f32{kDLFloat, 32, 1};
  DLDevice cpu{kDLCPU, 0};
  for (int64_t s = 0; s < n; ++s) {
    ffi::Tensor x = ffi::Tensor::FromNDAlloc(CPUAlloc(), ffi::Shape(sample_shape), f32, cpu);
    std::memcpy(x.data_ptr(), batch.data.data() + s * sample_size, sample_size * sizeof(float));
    ffi::Any result = run(x);
    ffi::Tensor y = result.cast<ffi::Tensor>();
    int64_t count = y.numel();
    classes = count;
    const float* out = static_cast<const float*>(y.data_ptr());
    logits.insert(logits.end(), out, out + count);

    std::vector<int64_t> order(count);
    std::iota(order.begin(), order.end(), 0);
    int k = std::min<int64_t>(top_k, count);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) { return out[a] > out[b]; });
    std::cout << "{\"sample\": " << s << ", \"top_k\": [";
    for (int j = 0; j < k; ++j) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "%.9g", out[order[j]]);
      std::cout << (j ? ", " : "") << "{\"class\": " << order[j] << ", \"logit\": " << buf << "}";
    }
    std::cout << "]}" << std::endl;  // flushed: callers count lines for progress
  }
  if (!output.empty()) WriteNpy(output, {n, classes}, logits);
  return 0;
}
