// zest config check FILE: validates a config the way a run would, before any rank starts.
#include <fmt/core.h>
#include <yaml-cpp/yaml.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "args/args.hpp"
#include "cli/commands.hpp"
#include "gpt/gpt_config.hpp"
#include "train_config.hpp"
#include "zest/config.hpp"
#include "zest/error.hpp"

namespace zest::cli {
namespace {

constexpr const char* kConfigCheckUsage =
    "usage: zest config check FILE [--program zest-train|zest-gpt | --sections NAME,NAME...]\n"
    "\n"
    "Validates FILE. Valid: prints \"FILE: valid\" and the resolved config (every default filled\n"
    "in) and exits 0, a deprecated key warned of on stderr (zest: warning: file:line:col: key: ...)\n"
    "as a run warns of it. Invalid: prints every problem as file:line:col: key: message to stderr\n"
    "and exits 2. configs/reference.yaml documents every key.\n"
    "\n"
    "It checks zest's keys, and that every other top-level key is a section of the program that\n"
    "reads the file: model: and train: (zest-train's and zest-gpt's), or those named with --sections\n"
    "for another program. Any other top-level key (STAGE:, sta:, gradient_accumulation:) is refused\n"
    "here as every zest program refuses it. --program zest-train or zest-gpt checks model: and train:\n"
    "as that program does, so FILE is valid here exactly when the program accepts it. Without it, the\n"
    "program's sections present are listed on stderr as not checked: the program checks them when it\n"
    "starts, with the same file:line:col messages.\n";

// "a,b" -> {"a", "b"}; empty names are refused.
std::vector<std::string> section_names(const std::string& list) {
  std::vector<std::string> names;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = list.find(',', start);
    const std::string name = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (name.empty()) return {};
    names.push_back(name);
    if (comma == std::string::npos) return names;
    start = comma + 1;
  }
}

}  // namespace

int config_check(int argc, char** argv) {
  if (args::asks_for_help(argc, argv)) return args::print_usage(kConfigCheckUsage);
  std::string path;
  bool have_path = false;
  std::vector<std::string> sections = shipped_program_sections();
  std::string program;
  std::string problem;  // empty: none
  for (int i = 0; i < argc && problem.empty(); ++i) {
    if (std::strcmp(argv[i], "--program") == 0) {
      if (i + 1 == argc) problem = "--program needs a value: zest-train or zest-gpt";
      else if ((program = argv[++i]) != "zest-train" && program != "zest-gpt")
        problem = "--program: expected zest-train or zest-gpt (use --sections for another program's sections)";
    } else if (std::strcmp(argv[i], "--sections") == 0) {
      if (i + 1 == argc) problem = "--sections needs a value: NAME,NAME...";
      else if ((sections = section_names(argv[++i])).empty())
        problem = "--sections: expected top-level section names separated by commas (model,train), found an empty name";
    } else if (argv[i][0] == '-' && argv[i][1] == '-') {
      problem = fmt::format("unknown option '{0}' (a FILE named so: ./{0})", argv[i]);
    } else if (have_path) {
      problem = "expected exactly one FILE";
    } else {
      path = argv[i];
      have_path = true;
      if (path.empty()) problem = "FILE is empty; give the path of a config file";
    }
  }
  if (problem.empty() && !have_path) problem = "missing the config FILE";
  if (!problem.empty()) {
    std::fprintf(stderr, "zest config check: %s\n\n%s", problem.c_str(), kConfigCheckUsage);
    return 2;
  }
  if (!program.empty() && sections != shipped_program_sections()) {
    std::fprintf(stderr, "zest config check: --program and --sections exclude each other\n\n%s", kConfigCheckUsage);
    return 2;
  }
  try {
    const Config config = load_config(path, sections);
    // The same readers as the programs, so the two cannot disagree.
    if (program == "zest-train") train::load_train_config(path);
    if (program == "zest-gpt") gpt::load_gpt_train_config(path);
    std::printf("%s: valid\n%s", path.c_str(), to_yaml(config).c_str());
    std::fflush(stdout);
    // A deprecated key is valid: warned of as a run warns of it.
    for (const std::string& warning : config.warnings) std::fprintf(stderr, "zest: warning: %s\n", warning.c_str());
    if (!program.empty()) return 0;
    // The program's sections the file has (load_config read it already): the program checks them.
    std::string names;
    try {
      const YAML::Node root = YAML::LoadFile(path);
      for (const std::string& name : sections)
        if (root.IsMap() && root[name]) names.append(names.empty() ? "" : ", ").append(name);
    } catch (const YAML::Exception&) {
      // Replaced since load_config read it: the listing is only a note, the verdict stands.
    }
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
