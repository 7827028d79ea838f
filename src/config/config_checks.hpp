// The checks a Config must pass, whether it came from YAML or was built in code: every value in the
// range the engine can run, and the settings consistent with each other. The YAML reader and
// zest::validate share them, so one problem reads the same either way; the reader adds
// file:line:col.
#pragma once

#include <climits>
#include <cstddef>
#include <initializer_list>
#include <string>
#include <string_view>

#include "zest/config.hpp"

namespace zest::detail {

// Where a check's findings go. The YAML reader places them at the key's line and column; validate
// collects them without a position.
class ProblemSink {
 public:
  virtual ~ProblemSink() = default;
  // Reports at the first of `anchors` the source sets, else at `key`.
  virtual void report(const std::string& key, std::string message,
                      std::initializer_list<std::string_view> anchors = {}) = 0;
  // False when `key` (or a section above it) already has a problem, e.g. a value of the wrong
  // type in YAML: a value is range-checked, and combined with others, only once it is valid, so
  // one mistake is not reported twice.
  virtual bool valid(const std::string& key) const = 0;
};

// The accepted range of each integer key. Upper bounds are what the engine can run: more threads
// than this exhaust the thread library (10^7 TBB threads crash), more buffers than this are pinned
// memory no pipeline uses.
struct IntRange {
  int lo;
  int hi;
};
inline constexpr IntRange kStageRange{0, 3};
inline constexpr IntRange kOptimizerThreadsRange{0, 1024};
inline constexpr IntRange kInitialScalePowerRange{0, 127};  // 2^127: the largest power a float holds
inline constexpr IntRange kAtLeastOne{1, INT_MAX};
inline constexpr IntRange kBufferCountRange{2, 64};
inline constexpr IntRange kQueueDepthRange{1, 4096};
inline constexpr IntRange kIoThreadsRange{1, 64};
inline constexpr IntRange kSeedRange{0, INT_MAX};

// "an integer from 0 to 3", "an integer >= 1".
std::string expected_integer(IntRange range);

// What each number key accepts, said once for the message and once as the test. Every rule also
// requires a finite value.
struct NumberRule {
  std::string_view expected;
  bool (*accepts)(double);
};
extern const NumberRule kPositive;        // lr, eps, loss scales
extern const NumberRule kNonNegative;     // weight decay
extern const NumberRule kUnitInterval;    // betas
extern const NumberRule kClipping;        // gradient_clipping (0 turns it off)
extern const NumberRule kOffloadRatio;    // offload.optimizer.ratio: (0, 1]

// bucket and sub_group are physical floors: smaller values could only be rounded up silently.
enum class SizeRule { any, positive, io_block, bucket, sub_group };
// The floors (bytes): a bucket holds at least one element (of the widest dtype, fp32); a sub-group
// holds at least 64 parameters (the shard alignment) of 12 bytes of states each.
inline constexpr std::size_t kMinBucketBytes = 4;
inline constexpr std::size_t kMinSubGroupBytes = 64 * 12;
// "a size of at least 1 byte (e.g. 512KiB, 25MiB)" and the like.
std::string expected_size(SizeRule rule);

// Shortest text that reads back to `value` ("0.001", "1e+300").
std::string number_text(double value);

// Checks every value of `config` against its range and the settings against each other.
void check_config(const Config& config, ProblemSink& sink);

}  // namespace zest::detail
