// Which cores the runner's threads use, included by runner.cc. On a big.LITTLE device (RK3588: 4x
// Cortex-A76 + 4x Cortex-A55; many phones and boards) a thread pool spread over all cores waits for
// its slowest, little-core worker, so by default the model runs on the big cores only: those with
// the highest cpu_capacity (the kernel's relative speed, 1024 = the fastest), or where the kernel
// gives none, the highest cpufreq/cpuinfo_max_freq. --cores LIST and --threads N override. The
// sysfs root is a parameter (--sysfs-root, default /sys) so that the choice can be tested with a
// made-up device tree.
#pragma once

#include <sched.h>
#include <unistd.h>

#include <algorithm>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace cores {

struct Choice {
  std::vector<int> cores;  // the chosen cores, ascending
  int threads = 0;
  std::string why;         // one phrase: how they were chosen
  std::string pinned;      // "" when pinned, else why the process could not be pinned
};

inline std::string ReadSmall(const std::string& path, bool* ok) {
  *ok = false;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return "";
  char buf[256];
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  *ok = true;
  return std::string(buf, n);
}

// "0-3,6,8-9" -> {0,1,2,3,6,8,9}; false for anything else (or a core past 4095).
inline bool ParseList(const std::string& raw, std::vector<int>* out) {
  std::string text = raw;
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  out->clear();
  if (text.empty()) return false;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    std::string part = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    char* end;
    long lo = std::strtol(part.c_str(), &end, 10), hi = lo;
    if (end == part.c_str() || lo < 0) return false;
    if (*end == '-') {
      const char* rest = end + 1;
      hi = std::strtol(rest, &end, 10);
      if (end == rest) return false;
    }
    if (*end != '\0' || hi < lo || hi > 4095) return false;
    for (long c = lo; c <= hi; ++c) out->push_back(static_cast<int>(c));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return true;
}

inline std::string Show(const std::vector<int>& list) {
  std::string s;
  for (size_t i = 0; i < list.size();) {
    size_t j = i;
    while (j + 1 < list.size() && list[j + 1] == list[j] + 1) ++j;
    if (!s.empty()) s += ",";
    s += std::to_string(list[i]) + (j > i ? "-" + std::to_string(list[j]) : "");
    i = j + 1;
  }
  return s;
}

// The cores with the largest value of cpu<N>/<file> among online; empty when a core lacks the file.
inline std::vector<int> Fastest(const std::string& cpu_dir, const std::vector<int>& online, const char* file,
                                long* best, bool* alike) {
  std::vector<long> values;
  for (int c : online) {
    bool ok;
    std::string text = ReadSmall(cpu_dir + "/cpu" + std::to_string(c) + "/" + file, &ok);
    char* end;
    long v = ok ? std::strtol(text.c_str(), &end, 10) : -1;
    if (!ok || end == text.c_str() || v <= 0) return {};
    values.push_back(v);
  }
  *best = 0;
  for (long v : values) *best = std::max(*best, v);
  std::vector<int> fastest;
  for (size_t i = 0; i < online.size(); ++i)
    if (values[i] == *best) fastest.push_back(online[i]);
  *alike = fastest.size() == online.size();
  return fastest;
}

// Fails (one line, via fail) on a --cores list that is malformed or names a core that is not online.
template <typename FailFn>
Choice Choose(const std::string& sysfs_root, const std::string& cores_flag, int threads_flag, FailFn fail) {
  std::string cpu_dir = sysfs_root + "/devices/system/cpu";
  Choice choice;
  bool ok;
  std::vector<int> online;
  if (!ParseList(ReadSmall(cpu_dir + "/online", &ok), &online)) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    online.clear();
    for (long c = 0; c < std::max(1L, n); ++c) online.push_back(static_cast<int>(c));
  }
  if (!cores_flag.empty()) {
    if (!ParseList(cores_flag, &choice.cores))
      fail("--cores: expected a core list such as 4-7 or 0,2, got '" + cores_flag + "'");
    for (int c : choice.cores) {
      bool found = false;
      for (int o : online) found = found || o == c;
      if (!found) fail("--cores: core " + std::to_string(c) + " is not online (online: " + Show(online) + ")");
    }
    choice.why = "given by --cores";
  } else {
    long best = 0;
    bool alike = false;
    const char* files[] = {"cpu_capacity", "cpufreq/cpuinfo_max_freq"};
    for (const char* file : files) {
      choice.cores = Fastest(cpu_dir, online, file, &best, &alike);
      if (choice.cores.empty()) continue;
      choice.why = alike ? "all " + std::to_string(online.size()) + " online cores alike (" + file + " " +
                               std::to_string(best) + ")"
                         : "the big cores: highest " + std::string(file) + " " + std::to_string(best) + " of " +
                               std::to_string(online.size()) + " online (" + Show(online) + ")";
      break;
    }
    if (choice.cores.empty()) {
      choice.cores = online;
      choice.why = "all online cores (sysfs gives no cpu_capacity or cpuinfo_max_freq)";
    }
  }
  choice.threads = threads_flag > 0 ? threads_flag : static_cast<int>(choice.cores.size());
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : choice.cores)
    if (c < CPU_SETSIZE) CPU_SET(c, &set);
  if (sched_setaffinity(0, sizeof set, &set) != 0) choice.pinned = std::strerror(errno);
  return choice;
}

// "4-7 (the big cores: ...)": where --bench says its threads ran.
inline std::string Where(const Choice& c) {
  return Show(c.cores) + " (" + c.why + (c.pinned.empty() ? "" : "; not pinned: " + c.pinned) + ")";
}

inline std::string Json(const Choice& c) {
  std::string s = "{\"threads\": " + std::to_string(c.threads) + ", \"cores\": [";
  for (size_t i = 0; i < c.cores.size(); ++i) s += (i ? ", " : "") + std::to_string(c.cores[i]);
  s += "], \"chosen\": \"" + c.why + "\", \"pinned\": " + (c.pinned.empty() ? "true" : "false") + "}";
  return s;
}

}  // namespace cores
