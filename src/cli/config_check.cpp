// zest config check FILE: validates a config the way a run would, before any rank starts.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cli/commands.hpp"
#include "zest/config.hpp"
#include "zest/error.hpp"

namespace zest::cli {
namespace {

constexpr const char* kConfigCheckUsage =
    "usage: zest config check FILE\n"
    "\n"
    "Validates FILE. Valid: prints \"FILE: valid\" and the resolved config (every default filled\n"
    "in) and exits 0. Invalid: prints every problem as file:line:col: key: message to stderr and\n"
    "exits 2. configs/reference.yaml documents every key.\n"
    "\n"
    "A top-level section that is not zest's (a trainer's model:, train:) belongs to the program:\n"
    "it is listed on stderr as not checked. A near miss of a zest key (stgae:) or a zest key out of\n"
    "place (lr: at the top level) is still a problem.\n";

}  // namespace

int config_check(int argc, char** argv) {
  if (argc == 1 && (std::strcmp(argv[0], "--help") == 0 || std::strcmp(argv[0], "-h") == 0)) {
    std::fputs(kConfigCheckUsage, stdout);
    return 0;
  }
  if (argc != 1) {
    std::fprintf(stderr, "zest config check: %s\n\n%s",
                 argc == 0 ? "missing the config FILE" : "expected exactly one FILE",
                 kConfigCheckUsage);
    return 2;
  }
  const std::string path = argv[0];
  try {
    std::vector<std::string> program_sections;
    const Config config = load_config_with_program_sections(path, program_sections);
    std::printf("%s: valid\n%s", path.c_str(), to_yaml(config).c_str());
    std::string names;
    for (const std::string& name : program_sections) names.append(names.empty() ? "" : ", ").append(name);
    if (!names.empty())
      std::fprintf(stderr, "%s: not checked (the program's own sections): %s\n", path.c_str(), names.c_str());
    return 0;
  } catch (const ConfigError& error) {
    for (const ConfigProblem& problem : error.problems())
      std::fprintf(stderr, "%s\n", problem.to_string().c_str());
    const std::size_t count = error.problems().size();
    std::fprintf(stderr, "%zu %s in %s\n", count, count == 1 ? "problem" : "problems",
                 path.c_str());
    return 2;
  }
}

}  // namespace zest::cli
