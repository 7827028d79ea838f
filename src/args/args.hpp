// Command-line values for every zest program (zest, its benchmarks, zest-train), parsed in one
// place so each flag refuses the same things the same way: negative, NaN, infinite, out-of-range
// values and trailing garbage, with a message that names the flag, the accepted range and what was
// given. Output paths are checked before any work starts, so a bad --json fails in a second, not
// after the benchmark.
//
// These are plain functions of (flag, text, range): the fuzz targets call them directly.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>

#include "zest/dtype.hpp"
#include "zest/error.hpp"

namespace zest::args {

// A bad command line. Programs print what() and their usage, and exit 2.
class UsageError : public Error {
 public:
  using Error::Error;
};

// A whole number from lo to hi, decimal digits with an optional sign: "4", "-1" (when lo < 0).
long long parse_integer(std::string_view flag, std::string_view text, long long lo, long long hi);

// A finite number from lo to hi: "0.5", "1e-3".
double parse_number(std::string_view flag, std::string_view text, double lo, double hi);

// A whole count from lo to hi, with an optional K, M, B (or G), T suffix (powers of 1000) or an
// exponent: "4000000", "350M", "7B", "1.5e9".
std::size_t parse_count(std::string_view flag, std::string_view text, std::size_t lo, std::size_t hi);

// A size in bytes (zest::parse_size's syntax: "4096", "512KiB", "1.5GiB", "1GB") from lo to hi.
std::size_t parse_size(std::string_view flag, std::string_view text, std::size_t lo, std::size_t hi);

// An optimizer.states name: fp32, bf16 or int8.
StatesFormat parse_states_format(std::string_view flag, std::string_view text);

// A file the program will write: not a directory or a special file, writable if it exists, in an
// existing, writable directory. Throws UsageError saying which and what to do.
void check_output_file(std::string_view flag, const std::string& path);

// A directory the program will write into (swap files, checkpoints): it exists and is writable.
void check_output_directory(std::string_view flag, const std::string& path);

// Outputs of one run, by flag (empty paths are unset): UsageError naming both flags when two name
// the same path (a trace file where the checkpoint directory goes would lose the run at its save).
void check_distinct_outputs(std::initializer_list<std::pair<std::string_view, std::string>> outputs);


// `argv[i]`'s value: the next argument, or UsageError "FLAG needs a value". Advances `i`.
std::string_view value_of(int argc, char** argv, int& i);

// As value_of, for a flag that names a file or directory: an empty value (`--save ''`, often an
// unset shell variable) is a UsageError naming the flag, never "no path" (which would silently
// skip a save or train from scratch).
std::string_view path_of(int argc, char** argv, int& i);

// Whether the command line asks for help: `--help` or `-h` anywhere in argv[0, argc). Every
// command and subcommand answers it with its usage on stdout and exit 0 (print_usage).
bool asks_for_help(int argc, char** argv);
int print_usage(const char* usage);  // prints `usage` on stdout; returns 0

}  // namespace zest::args
