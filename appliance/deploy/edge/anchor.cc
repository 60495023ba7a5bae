// The device's trust anchor verifier: `verify --verify-signature FILE --signature FILE.minisig --pubkey KEY.pub`
// checks what `minisign -Vm FILE -p KEY.pub` checks (edge/signature.h, the same code as bin/run's
// --verify-signature), with no TVM runtime and no library beside libc. Made by `appliance edge anchor`,
// installed once on each device with the site's public key; the anchor's install-package asks it to
// check every later package's SHA256SUMS before any byte of that package runs.
#include <cstdio>
#include <string>

#include "signature.h"

int main(int argc, char** argv) {
  std::string signed_file, signature, pubkey;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "verify: error: %s needs a value (usage: verify --verify-signature FILE --signature "
                   "FILE.minisig --pubkey KEY.pub)\n", arg.c_str());
      return 2;
    }
    std::string value = argv[++i];
    if (arg == "--verify-signature") signed_file = value;
    else if (arg == "--signature") signature = value;
    else if (arg == "--pubkey") pubkey = value;
    else {
      std::fprintf(stderr, "verify: error: unknown argument %s\n", arg.c_str());
      return 2;
    }
  }
  if (signed_file.empty() || signature.empty() || pubkey.empty()) {
    std::fprintf(stderr, "verify: error: usage: verify --verify-signature FILE --signature FILE.minisig --pubkey KEY.pub\n");
    return 2;
  }
  std::string said;
  if (!edgesig::VerifyMinisign(signed_file, signature, pubkey, &said)) {
    std::fprintf(stderr, "verify: refused: %s\n", said.c_str());
    return 1;
  }
  std::printf("%s: signature OK (trusted comment: %s)\n", signed_file.c_str(), said.c_str());
  return 0;
}
