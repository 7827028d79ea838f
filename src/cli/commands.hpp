// The `zest` command's subcommands. Each returns the process exit code: 0 success, 1 failure of
// the work itself, 2 invalid input (usage, config).
#pragma once

#include <string>
#include <vector>

namespace zest::cli {

// The top-level sections that the shipped programs read beside zest's keys: zest-train's and
// zest-gpt's `model:` and `train:` (examples/train_config.cpp, examples/gpt/gpt_config.cpp). Every
// command that takes a config accepts these and refuses any other unknown key, as the programs do;
// `zest config check --sections` names another program's.
inline const std::vector<std::string>& shipped_program_sections() {
  static const std::vector<std::string> sections{"model", "train"};
  return sections;
}

// zest config check FILE
int config_check(int argc, char** argv);
// zest smoke [--config FILE]: a multi-rank run of the runtime (devices, memory, collectives)
int smoke(int argc, char** argv);
int estimate(int argc, char** argv);  // zest estimate --params N [options] (estimate.cpp)
// zest checkpoint inspect DIR [--no-verify] | consolidate DIR OUT [--dtype D] (checkpoint.cpp)
int checkpoint(int argc, char** argv);
// zest bench NAME: bench/bench_commands.hpp

}  // namespace zest::cli
