// The peers of `zest bench adam --peers`: DeepSpeed's CPU Adam and torch's AdamW (foreach, fused),
// timed by bench/adam_peers.py in a Python child kept alive for the whole run, so its rounds
// interleave with zest's (the protocol is described in that file).
#pragma once

#include <array>
#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>

#include <sys/types.h>

#include "optim/adam_math.hpp"

namespace zest::cli {

class AdamPeers {
 public:
  // The rows, in the order of round()'s and check()'s results.
  static constexpr std::array<const char*, 3> kNames = {"DeepSpeed CPU Adam", "torch AdamW (foreach)",
                                                        "torch AdamW (fused)"};

  // Starts `python` on the script and waits until every peer holds `params` parameters (its
  // states allocated). Throws zest::Error naming the fix when Python, torch or DeepSpeed is
  // missing; a peer that cannot run (torch without fused AdamW on CPU) is not an error: why_not()
  // says why.
  AdamPeers(const std::string& python, std::size_t params, const optim::AdamHyperParams& hyper);
  ~AdamPeers();  // ends the child (end of its input), waits for it a while, then kills it
  AdamPeers(const AdamPeers&) = delete;
  AdamPeers& operator=(const AdamPeers&) = delete;

  // Empty where peer i runs, else its error.
  const std::string& why_not(std::size_t i) const { return why_not_[i]; }
  const std::string& versions() const { return versions_; }

  // One timed step of each peer at `threads` threads: seconds, NaN where a peer cannot run.
  std::array<double, 3> round(int threads);

  // `steps` steps of each peer on `count` parameters from check_inputs(): the final parameters,
  // empty where a peer cannot run.
  std::array<std::vector<float>, 3> check(std::size_t count, int steps);

  // The parameters (k = 0) or step k's gradient of element i of a check: the script's formula.
  static float check_input(std::size_t i, int k);

 private:
  void await_ready();  // reads the child's first line: the versions, and which peers run
  void end_child();    // closes the pipes, waits for the child a while, then kills it
  std::string request(const std::string& line);  // writes a line, returns the answer's line
  // The child's next line: bounded in length and in the time it may take (Error past either).
  std::string read_line();

  pid_t pid_ = -1;
  std::FILE* to_ = nullptr;
  int from_ = -1;        // the child's stdout, read with poll() so that a hung child is an error
  std::string pending_;  // read from it, not yet returned as a line
  std::array<std::string, 3> why_not_;
  std::string versions_;
};

}  // namespace zest::cli
