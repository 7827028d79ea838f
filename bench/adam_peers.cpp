#include "adam_peers.hpp"

#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include <fmt/core.h>

#include "adam_peers_script.h"  // kAdamPeersScript: bench/adam_peers.py, compiled in (meson.build)
#include "zest/error.hpp"

extern char** environ;

namespace zest::cli {
namespace {

// An answer is one line: a check's values (40009 floats, under 1 MB) are the longest. The slowest
// is the first, while DeepSpeed loads (or builds, about 30 s here) its op.
constexpr std::size_t kMaxAnswerBytes = std::size_t{16} << 20;
constexpr int kAnswerTimeoutSeconds = 600;

constexpr const char* kFix =
    "make it with scripts/python-env.sh (`source scripts/setup.sh` does, and sets ZEST_VENV), or pass "
    "--python PATH of an environment with python/requirements.txt and python/requirements-peers.txt";

std::string number(double x) {
  std::ostringstream s;
  s.precision(17);
  s << x;
  return s.str();
}

}  // namespace

AdamPeers::AdamPeers(const std::string& python, std::size_t params, const optim::AdamHyperParams& hyper) {
  // A child that dies makes our next write fail with EPIPE (reported below), not kill zest.
  std::signal(SIGPIPE, SIG_IGN);
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0) throw SystemError(std::string("--peers: pipe: ") + std::strerror(errno));
  if (pipe2(out, O_CLOEXEC) != 0) {
    const int e = errno;
    close(in[0]);
    close(in[1]);
    throw SystemError(std::string("--peers: pipe: ") + std::strerror(e));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[0], 0);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  std::vector<std::string> args = {python, "-c", kAdamPeersScript, "--params", std::to_string(params),
                                   "--lr", number(hyper.lr), "--beta1", number(hyper.beta1),
                                   "--beta2", number(hyper.beta2), "--eps", number(hyper.eps),
                                   "--weight-decay", number(hyper.weight_decay)};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const int rc = posix_spawnp(&pid_, python.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(in[0]);
  close(out[1]);
  if (rc != 0) {
    close(in[1]);
    close(out[0]);
    pid_ = -1;
    throw Error(
        fmt::format("--peers: cannot run the Python of the peers '{}' ({}): {}", python, std::strerror(rc), kFix));
  }
  from_ = out[0];
  to_ = fdopen(in[1], "w");
  if (to_ == nullptr) {
    const int e = errno;
    close(in[1]);
    end_child();
    throw SystemError(std::string("--peers: fdopen: ") + std::strerror(e));
  }
  try {
    await_ready();
  } catch (...) {
    end_child();  // the destructor does not run for an object not made
    throw;
  }
}

void AdamPeers::await_ready() {
  // "ready\ttorch:V deepspeed:V\t<ok or why not>\t..." (a field per peer)
  const std::string ready = read_line();
  if (ready.rfind("error ", 0) == 0) throw Error("--peers: " + ready.substr(6));
  std::vector<std::string> fields;
  for (std::size_t at = 0;;) {
    const std::size_t tab = ready.find('\t', at);
    fields.push_back(ready.substr(at, tab - at));
    if (tab == std::string::npos) break;
    at = tab + 1;
  }
  if (fields.size() != 2 + why_not_.size() || fields[0] != "ready")
    throw Error("--peers: unexpected answer from the peers: " + ready);
  versions_ = fields[1];
  for (std::size_t i = 0; i < why_not_.size(); ++i) why_not_[i] = fields[2 + i] == "ok" ? "" : fields[2 + i];
}

AdamPeers::~AdamPeers() { end_child(); }

void AdamPeers::end_child() {
  if (to_ != nullptr) std::fclose(to_);  // end of input: the script exits
  if (from_ >= 0) close(from_);
  to_ = nullptr;
  from_ = -1;
  if (pid_ <= 0) return;
  // It exits at once; one that has not after 10 s (hung in its teardown) is killed, so that zest
  // never waits for it forever.
  int status = 0;
  for (int tenths = 0; tenths < 100; ++tenths) {
    const pid_t done = waitpid(pid_, &status, WNOHANG);
    if (done == pid_ || (done < 0 && errno != EINTR)) {
      pid_ = -1;
      return;
    }
    usleep(100'000);
  }
  kill(pid_, SIGKILL);
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
}

std::string AdamPeers::read_line() {
  for (;;) {
    const std::size_t end = pending_.find('\n');
    if (end != std::string::npos) {
      std::string line = pending_.substr(0, end);
      pending_.erase(0, end + 1);
      return line;
    }
    if (pending_.size() > kMaxAnswerBytes)
      throw Error(fmt::format(
          "--peers: an answer of the peers' Python process exceeds {} bytes: it is not bench/adam_peers.py's",
          kMaxAnswerBytes));
    pollfd ready{from_, POLLIN, 0};
    const int polled = poll(&ready, 1, kAnswerTimeoutSeconds * 1000);
    if (polled < 0 && errno == EINTR) continue;
    if (polled == 0)
      throw Error(fmt::format("--peers: no answer from the peers' Python process in {} s (hung?); {}",
                              kAnswerTimeoutSeconds, kFix));
    char chunk[1 << 16];
    const ssize_t n = polled < 0 ? -1 : read(from_, chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw Error("--peers: the peers' Python process ended (its error is above); " + std::string(kFix));
    pending_.append(chunk, static_cast<std::size_t>(n));
  }
}

std::string AdamPeers::request(const std::string& line) {
  if (std::fputs((line + "\n").c_str(), to_) == EOF || std::fflush(to_) != 0)
    throw Error("--peers: the peers' Python process ended (its error is above)");
  return read_line();
}

std::array<double, 3> AdamPeers::round(int threads) {
  const std::string answer = request("round " + std::to_string(threads));
  std::istringstream words(answer);
  std::string word;
  words >> word;
  std::array<double, 3> seconds{};
  for (double& s : seconds) {
    std::string text;
    words >> text;
    s = std::strtod(text.c_str(), nullptr);  // "nan" where a peer cannot run
  }
  if (word != "times" || !words) throw Error("--peers: unexpected answer from the peers: " + answer);
  return seconds;
}

std::array<std::vector<float>, 3> AdamPeers::check(std::size_t count, int steps) {
  std::array<std::vector<float>, 3> values;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const std::string answer = i == 0 ? request("check " + std::to_string(count) + " " + std::to_string(steps))
                                      : read_line();
    if (answer.rfind("values", 0) != 0)
      throw Error("--peers: unexpected answer from the peers: " + answer.substr(0, 200));
    if (answer == "values unavailable") continue;
    const char* p = answer.c_str() + 6;
    for (char* end = nullptr;; p = end) {
      const float x = std::strtof(p, &end);
      if (end == p) break;
      values[i].push_back(x);
    }
    if (values[i].size() != count)
      throw Error(fmt::format("--peers: {} returned {} values for a check of {}", kNames[i], values[i].size(), count));
  }
  return values;
}

float AdamPeers::check_input(std::size_t i, int k) {
  if (k == 0) return 0.5f + static_cast<float>((i * 7) % 1000) * 1e-3f;
  return static_cast<float>((i * 13 + static_cast<std::size_t>(k) * 101) % 1000) * 1e-3f - 0.5f;
}

}  // namespace zest::cli
