// YAML text -> validated Config. The schema is written once, below in ConfigReader::read, as a
// tree of fields; walking it type-checks every value, then check_combinations looks at the
// settings together. Every problem is collected, and one ConfigError carries them all, so a user
// fixes a file in one pass.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "config/config_names.hpp"
#include "config/duration_parse.hpp"
#include "config/size_parse.hpp"
#include "zest/config.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

using detail::EnumName;

constexpr std::size_t kKiB = std::size_t{1} << 10;
constexpr std::size_t kMiB = std::size_t{1} << 20;
// Working space the device needs beyond the two buckets (scalars, norms, flags).
constexpr std::size_t kDeviceHeadroom = kMiB;

std::string quoted(std::string_view text) {
  std::string out = "'";
  return out.append(text).append("'");
}

bool is_quoted_string(const YAML::Node& node) {
  return node.Tag() == "!" || node.Tag() == "tag:yaml.org,2002:str";
}

// What a user wrote, for "found ..." in messages.
std::string describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map: return "a map";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Scalar: return quoted(node.Scalar());
    case YAML::NodeType::Null:
    case YAML::NodeType::Undefined: break;
  }
  return "nothing (null)";
}

std::string join(const std::vector<std::string>& items, std::string_view separator) {
  std::string out;
  for (const std::string& item : items) {
    if (!out.empty()) out.append(separator);
    out.append(item);
  }
  return out;
}

std::string number_text(double value) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof buffer, value);
  return std::string(buffer, result.ptr);
}

// Optimal string alignment distance: edits plus adjacent transpositions ("stgae" -> "stage" is 1).
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

// Short keys tolerate fewer edits, or every short typo would "mean" some other short key.
std::size_t typo_tolerance(std::string_view key) {
  if (key.size() <= 3) return 1;
  if (key.size() <= 6) return 2;
  return 3;
}

std::string child_path(const std::string& parent, std::string_view key) {
  std::string path = parent;
  if (!path.empty()) path.append(".");
  return path.append(key);
}

std::string parent_of(const std::string& path) {
  const std::size_t dot = path.rfind('.');
  return dot == std::string::npos ? std::string() : path.substr(0, dot);
}

class ConfigReader {
 public:
  ConfigReader(std::string file, std::vector<std::string> application_sections)
      : file_(std::move(file)), application_sections_(std::move(application_sections)) {}

  // Walks `root` (nullptr for an empty file) against the schema and checks the combinations.
  Config read(const YAML::Node* root);

  void report_at(const YAML::Mark& mark, const std::string& key, std::string message) {
    ConfigProblem problem;
    problem.file = file_;
    if (!mark.is_null()) {
      problem.line = mark.line + 1;
      problem.column = mark.column + 1;
    }
    problem.key = key;
    problem.message = std::move(message);
    problems_.push_back(std::move(problem));
    invalid_.insert(key);
  }

  std::vector<ConfigProblem> take_problems() {
    // Line order reads like the file; problems about the whole file (line 0) go last.
    std::stable_sort(problems_.begin(), problems_.end(),
                     [](const ConfigProblem& a, const ConfigProblem& b) {
                       const int line_a = a.line == 0 ? INT_MAX : a.line;
                       const int line_b = b.line == 0 ? INT_MAX : b.line;
                       return line_a != line_b ? line_a < line_b : a.column < b.column;
                     });
    return std::move(problems_);
  }

 private:
  // Reads the value at `path`; `value` is nullptr when the key is absent (keep the default, but
  // still walk nested sections so every valid path is known for "did you mean").
  using Reader = std::function<void(const YAML::Node* value, const std::string& path)>;
  struct Field {
    std::string_view key;
    Reader read;
  };
  struct UnknownKey {
    YAML::Mark mark;
    std::string parent;
    std::string key;
    std::vector<std::string> valid_here;
  };

  void read_map(const YAML::Node* node, const std::string& path, const std::vector<Field>& fields);
  void report_unknown_keys();
  void check_combinations(const Config& config);
  void check_offload_target(const std::string& prefix, const OffloadTarget& target);
  void check_directory(const std::string& key, const std::string& directory);

  // Reports at the first of `anchors` the file sets, else at `key` or its nearest given ancestor.
  void report(const std::string& key, std::string message,
              std::initializer_list<std::string_view> anchors = {}) {
    for (std::string_view anchor : anchors) {
      const auto found = marks_.find(std::string(anchor));
      if (found != marks_.end()) return report_at(found->second, key, std::move(message));
    }
    for (std::string path = key;; path = parent_of(path)) {
      const auto found = marks_.find(path);
      if (found != marks_.end()) return report_at(found->second, key, std::move(message));
      if (path.empty()) break;
    }
    report_at(YAML::Mark::null_mark(), key, std::move(message));
  }

  bool given(const std::string& path) const { return marks_.count(path) != 0; }
  // A value, and every section above it, passed its own checks; combinations of settings are
  // checked only between valid values, so one mistake is not reported twice.
  bool valid(const std::string& path) const {
    for (std::string p = path; !p.empty(); p = parent_of(p))
      if (invalid_.count(p) != 0) return false;
    return true;
  }

  // Field readers: each returns the Reader for one kind of value.
  Reader section(std::vector<Field> fields) {
    return [this, fields = std::move(fields)](const YAML::Node* value, const std::string& path) {
      read_map(value, path, fields);
    };
  }
  Reader integer(int& out, int lo, int hi);
  Reader number(double& out, std::string_view expected, bool (*in_range)(double));
  Reader number_pair(double& first, double& second, std::string_view expected,
                     bool (*in_range)(double));
  enum class SizeRule { any, positive, io_block };
  Reader size(std::size_t& out, SizeRule rule = SizeRule::any);
  Reader flag(bool& out);
  Reader duration(std::chrono::milliseconds& out);
  Reader text(std::string& out);
  template <typename Enum, std::size_t N>
  Reader choice(const std::array<EnumName<Enum>, N>& names, Enum& out);

  // A scalar's text, or a problem "expected <expected>, found <what it is>".
  const std::string* scalar(const YAML::Node& node, const std::string& path,
                            std::string_view expected) {
    if (node.IsScalar()) return &node.Scalar();
    expected_found(path, expected, node);
    return nullptr;
  }
  // "expected <expected>, found '<value>' (<note>)[: <reason>]"
  void expected_found(const std::string& path, std::string_view expected, const YAML::Node& node,
                      std::string_view note = {}, std::string_view reason = {}) {
    std::string message = "expected ";
    message.append(expected).append(", found ").append(describe(node));
    std::string remark;
    if (node.IsScalar() && is_quoted_string(node)) remark = "a quoted string";
    if (!note.empty()) remark.append(remark.empty() ? "" : "; ").append(note);
    if (!remark.empty()) message.append(" (").append(remark).append(")");
    if (!reason.empty()) message.append(": ").append(reason);
    report(path, std::move(message));
  }
  std::optional<double> parse_number(const YAML::Node& node, const std::string& path,
                                     std::string_view expected);

  std::string file_;
  std::vector<ConfigProblem> problems_;
  std::map<std::string, YAML::Mark> marks_;  // every key the file sets -> where its value is
  std::set<std::string> invalid_;            // keys with a problem
  std::vector<std::string> schema_paths_;    // every valid dotted key, from walking the schema
  std::vector<UnknownKey> unknown_keys_;
  // Top-level sections that belong to the program (zest-train's "model", "train"): not zest's.
  std::vector<std::string> application_sections_;
};

void ConfigReader::read_map(const YAML::Node* node, const std::string& path,
                            const std::vector<Field>& fields) {
  for (const Field& field : fields) schema_paths_.push_back(child_path(path, field.key));
  // An absent section or an empty one ("offload:" with nothing under it) keeps every default.
  if (node == nullptr || node->IsNull()) {
    for (const Field& field : fields) field.read(nullptr, child_path(path, field.key));
    return;
  }
  if (!node->IsMap()) {
    std::vector<std::string> keys;
    for (const Field& field : fields) keys.emplace_back(field.key);
    const std::string what = path.empty() ? std::string("at the top level") : std::string();
    std::string expected = "a map of settings";
    if (!what.empty()) expected.append(" ").append(what);
    expected.append(" (keys: ").append(join(keys, ", ")).append(")");
    // The top level has no key of its own to point at; point at the document.
    if (path.empty()) marks_.emplace(path, node->Mark());
    expected_found(path, expected, *node);
    for (const Field& field : fields) field.read(nullptr, child_path(path, field.key));
    return;
  }

  std::map<std::string, YAML::Node> values;
  for (const auto& entry : *node) {
    const YAML::Node key_node = entry.first;
    if (!key_node.IsScalar()) {
      std::string message = "a key must be a plain name, found ";
      report_at(key_node.Mark(), path, message.append(describe(key_node)));
      continue;
    }
    const std::string& key = key_node.Scalar();
    if (path.empty() && std::find(application_sections_.begin(), application_sections_.end(), key) !=
                            application_sections_.end())
      continue;
    const std::string key_path = child_path(path, key);
    const bool known = std::any_of(fields.begin(), fields.end(),
                                   [&](const Field& field) { return field.key == key; });
    if (!known) {
      UnknownKey unknown{key_node.Mark(), path, key, {}};
      for (const Field& field : fields) unknown.valid_here.emplace_back(field.key);
      unknown_keys_.push_back(std::move(unknown));
      continue;
    }
    if (values.count(key) != 0) {
      std::string message = "duplicate key ";
      message.append(quoted(key)).append(" (first set at line ");
      message.append(std::to_string(marks_[key_path].line + 1)).append("); keep one of them");
      report_at(key_node.Mark(), key_path, std::move(message));
      continue;
    }
    const YAML::Node value = entry.second;
    // yaml-cpp places an empty value ("key:") on the next line; the key is where the user looks.
    marks_[key_path] = value.IsNull() || value.Mark().is_null() ? key_node.Mark() : value.Mark();
    values.emplace(key, value);
  }
  for (const Field& field : fields) {
    const auto value = values.find(std::string(field.key));
    field.read(value == values.end() ? nullptr : &value->second, child_path(path, field.key));
  }
}

void ConfigReader::report_unknown_keys() {
  for (const UnknownKey& unknown : unknown_keys_) {
    std::string message = "unknown key ";
    message.append(quoted(unknown.key));

    std::string_view best;
    std::size_t best_distance = typo_tolerance(unknown.key) + 1;
    for (const std::string& candidate : unknown.valid_here) {
      const std::size_t distance = edit_distance(unknown.key, candidate);
      if (distance < best_distance) {
        best_distance = distance;
        best = candidate;
      }
    }
    // A key valid elsewhere in the schema ("lr" at the top level) is misplaced, not misspelled.
    std::vector<std::string> homes;
    for (const std::string& path : schema_paths_) {
      const std::size_t dot = path.rfind('.');
      const std::string_view last =
          dot == std::string::npos ? std::string_view(path) : std::string_view(path).substr(dot + 1);
      if (last == unknown.key && parent_of(path) != unknown.parent &&
          std::find(homes.begin(), homes.end(), path) == homes.end())
        homes.push_back(path);
    }

    if (!best.empty()) {
      message.append("; did you mean ").append(quoted(best)).append("?");
    } else if (!homes.empty()) {
      std::vector<std::string> quoted_homes;
      for (const std::string& home : homes) quoted_homes.push_back(quoted(home));
      message.append(" here; it belongs at ").append(join(quoted_homes, " or "));
    } else {
      message.append("; valid keys here: ").append(join(unknown.valid_here, ", "));
    }
    report_at(unknown.mark, child_path(unknown.parent, unknown.key), std::move(message));
  }
}

std::optional<double> ConfigReader::parse_number(const YAML::Node& node, const std::string& path,
                                                 std::string_view expected) {
  const std::string* text = scalar(node, path, expected);
  if (text == nullptr) return std::nullopt;
  if (is_quoted_string(node)) {
    expected_found(path, expected, node, "remove the quotes");
    return std::nullopt;
  }
  std::string_view digits = *text;
  if (!digits.empty() && digits.front() == '+') digits.remove_prefix(1);
  double value = 0;
  const auto result = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (result.ec != std::errc() || result.ptr != digits.data() + digits.size() ||
      !std::isfinite(value)) {
    expected_found(path, expected, node);
    return std::nullopt;
  }
  return value;
}

ConfigReader::Reader ConfigReader::integer(int& out, int lo, int hi) {
  return [this, &out, lo, hi](const YAML::Node* value, const std::string& path) {
    if (value == nullptr) return;
    std::string expected = "an integer ";
    if (hi == INT_MAX)
      expected.append(">= ").append(std::to_string(lo));
    else
      expected.append("from ").append(std::to_string(lo)).append(" to ").append(std::to_string(hi));
    const std::string* text = scalar(*value, path, expected);
    if (text == nullptr) return;
    if (is_quoted_string(*value)) return expected_found(path, expected, *value, "remove the quotes");
    std::string_view digits = *text;
    if (!digits.empty() && digits.front() == '+') digits.remove_prefix(1);
    long long parsed = 0;
    const auto result = std::from_chars(digits.data(), digits.data() + digits.size(), parsed);
    if (result.ec == std::errc::result_out_of_range)
      return expected_found(path, expected, *value, "out of range");
    if (result.ec != std::errc() || result.ptr != digits.data() + digits.size())
      return expected_found(path, expected, *value);
    if (parsed < lo || parsed > hi) return expected_found(path, expected, *value);
    out = static_cast<int>(parsed);
  };
}

ConfigReader::Reader ConfigReader::number(double& out, std::string_view expected,
                                          bool (*in_range)(double)) {
  return [this, &out, expected, in_range](const YAML::Node* value, const std::string& path) {
    if (value == nullptr) return;
    const std::optional<double> parsed = parse_number(*value, path, expected);
    if (!parsed) return;
    if (!in_range(*parsed)) return expected_found(path, expected, *value);
    out = *parsed;
  };
}

ConfigReader::Reader ConfigReader::number_pair(double& first, double& second,
                                               std::string_view expected,
                                               bool (*in_range)(double)) {
  return [this, &first, &second, expected, in_range](const YAML::Node* value,
                                                     const std::string& path) {
    if (value == nullptr) return;
    std::string expected_list = "a list of two numbers, each ";
    expected_list.append(expected);
    if (!value->IsSequence()) return expected_found(path, expected_list, *value);
    if (value->size() != 2) {
      std::string found = "a list of ";
      found.append(std::to_string(value->size())).append(value->size() == 1 ? " item" : " items");
      report(path, std::string("expected ").append(expected_list).append(", found ").append(found));
      return;
    }
    double* const outs[2] = {&first, &second};
    for (std::size_t i = 0; i < 2; ++i) {
      const YAML::Node item = (*value)[i];
      std::string item_path = path;
      item_path.append("[").append(std::to_string(i)).append("]");
      marks_[item_path] = item.Mark();
      const std::optional<double> parsed = parse_number(item, item_path, expected);
      if (!parsed) continue;
      if (!in_range(*parsed)) {
        expected_found(item_path, expected, item);
        continue;
      }
      *outs[i] = *parsed;
    }
  };
}

ConfigReader::Reader ConfigReader::size(std::size_t& out, SizeRule rule) {
  return [this, &out, rule](const YAML::Node* value, const std::string& path) {
    if (value == nullptr) return;
    std::string expected = "a size (e.g. 4096, 512KiB, 25MiB, 1.5GiB)";
    if (rule == SizeRule::positive) expected = "a size of at least 1 byte (e.g. 512KiB, 25MiB)";
    if (rule == SizeRule::io_block)
      expected = "a power of two of at least 4KiB (O_DIRECT moves whole aligned blocks)";
    const std::string* text = scalar(*value, path, expected);
    if (text == nullptr) return;
    std::size_t bytes = 0;
    std::string why;
    if (!detail::parse_size_into(*text, bytes, why)) return expected_found(path, expected, *value, {}, why);
    const bool ok = rule == SizeRule::any ||
                    (rule == SizeRule::positive && bytes > 0) ||
                    (rule == SizeRule::io_block && bytes >= 4 * kKiB && (bytes & (bytes - 1)) == 0);
    if (!ok) {
      std::string note = std::to_string(bytes);
      return expected_found(path, expected, *value, note.append(" bytes"));
    }
    out = bytes;
  };
}

ConfigReader::Reader ConfigReader::duration(std::chrono::milliseconds& out) {
  return [this, &out](const YAML::Node* value, const std::string& path) {
    if (value == nullptr) return;
    constexpr std::string_view kExpected = "a duration (e.g. 500ms, 300s, 10min, 1h; 0 = off)";
    const std::string* text = scalar(*value, path, kExpected);
    if (text == nullptr) return;
    std::string why;
    if (!detail::parse_duration_into(*text, out, why)) expected_found(path, kExpected, *value, {}, why);
  };
}

ConfigReader::Reader ConfigReader::flag(bool& out) {
  return [this, &out](const YAML::Node* value, const std::string& path) {
    if (value == nullptr) return;
    constexpr std::string_view kExpected = "true or false";
    const std::string* text = scalar(*value, path, kExpected);
    if (text == nullptr) return;
    // YAML 1.2's booleans only: "yes"/"on" are strings there, and guessing would hide typos.
    if (!is_quoted_string(*value)) {
      if (*text == "true" || *text == "True" || *text == "TRUE") {
        out = true;
        return;
      }
      if (*text == "false" || *text == "False" || *text == "FALSE") {
        out = false;
        return;
      }
    }
    expected_found(path, kExpected, *value);
  };
}

ConfigReader::Reader ConfigReader::text(std::string& out) {
  return [this, &out](const YAML::Node* value, const std::string& path) {
    if (value == nullptr) return;
    const std::string* path_text = scalar(*value, path, "a path (text)");
    if (path_text != nullptr) out = *path_text;
  };
}

template <typename Enum, std::size_t N>
ConfigReader::Reader ConfigReader::choice(const std::array<EnumName<Enum>, N>& names, Enum& out) {
  return [this, &names, &out](const YAML::Node* value, const std::string& path) {
    if (value == nullptr) return;
    std::vector<std::string> spelled;
    for (const EnumName<Enum>& entry : names) spelled.emplace_back(entry.name);
    const std::string expected = "one of " + join(spelled, ", ");
    const std::string* text = scalar(*value, path, expected);
    if (text == nullptr) return;
    for (const EnumName<Enum>& entry : names) {
      if (entry.name == *text) {
        out = entry.value;
        return;
      }
    }
    expected_found(path, expected, *value);
  };
}

bool positive(double x) { return x > 0; }
bool non_negative(double x) { return x >= 0; }
bool unit_interval(double x) { return x >= 0 && x < 1; }

Config ConfigReader::read(const YAML::Node* root) {
  Config c;
  c.source = file_;
  const auto offload_target = [this](OffloadTarget& target) {
    return section({
        {"device", choice(detail::kOffloadDeviceNames, target.device)},
        {"path", text(target.path)},
        {"pinned", flag(target.pinned)},
        {"buffer_count", integer(target.buffer_count, 2, INT_MAX)},
    });
  };
  LossScaleConfig& scale = c.precision.loss_scale;
  const std::vector<Field> schema = {
      {"stage", integer(c.stage, 0, 3)},
      {"device", section({
                     {"type", choice(detail::kDeviceTypeNames, c.device.type)},
                     {"memory", size(c.device.memory)},
                 })},
      {"comm", section({
                   {"backend", choice(detail::kCommBackendNames, c.comm.backend)},
                   {"timeout", duration(c.comm.timeout)},
               })},
      {"buckets", section({
                      {"reduce", size(c.buckets.reduce_bytes, SizeRule::positive)},
                      {"allgather", size(c.buckets.allgather_bytes, SizeRule::positive)},
                      {"overlap_comm", flag(c.buckets.overlap_comm)},
                  })},
      {"stage3", section({
                     {"prefetch", size(c.stage3.prefetch_bytes)},
                     {"max_live", size(c.stage3.max_live_bytes, SizeRule::positive)},
                     {"persistence_threshold", size(c.stage3.persistence_threshold_bytes)},
                 })},
      {"optimizer", section({
                        {"type", choice(detail::kOptimizerTypeNames, c.optimizer.type)},
                        {"lr", number(c.optimizer.lr, "a number > 0", positive)},
                        {"betas", number_pair(c.optimizer.beta1, c.optimizer.beta2,
                                              "a number >= 0 and < 1", unit_interval)},
                        {"eps", number(c.optimizer.eps, "a number > 0", positive)},
                        {"weight_decay", number(c.optimizer.weight_decay, "a number >= 0",
                                                non_negative)},
                        {"threads", integer(c.optimizer.threads, 0, INT_MAX)},
                    })},
      {"precision",
       section({
           {"dtype", choice(detail::kDTypeNames, c.precision.dtype)},
           {"loss_scale", section({
                              {"dynamic", flag(scale.dynamic)},
                              {"static_scale", number(scale.static_scale, "a number > 0", positive)},
                              // 2^127 is the largest power of two a float holds.
                              {"initial_scale_power", integer(scale.initial_scale_power, 0, 127)},
                              {"window", integer(scale.window, 1, INT_MAX)},
                              {"hysteresis", integer(scale.hysteresis, 1, INT_MAX)},
                              {"min_scale", number(scale.min_scale, "a number > 0", positive)},
                          })},
       })},
      {"gradient_clipping", number(c.gradient_clipping, "a number >= 0 (0 turns clipping off)",
                                   non_negative)},
      {"gradient_accumulation_steps", integer(c.gradient_accumulation_steps, 1, INT_MAX)},
      {"offload", section({
                      {"optimizer", offload_target(c.offload.optimizer)},
                      {"param", offload_target(c.offload.param)},
                      {"sub_group", size(c.offload.sub_group_bytes, SizeRule::positive)},
                  })},
      {"io", section({
                 {"block_size", size(c.io.block_size, SizeRule::io_block)},
                 {"queue_depth", integer(c.io.queue_depth, 1, 4096)},
                 {"threads", integer(c.io.threads, 1, INT_MAX)},
                 {"direct", flag(c.io.direct)},
                 {"checksum", flag(c.io.checksum)},
             })},
  };
  read_map(root, "", schema);
  report_unknown_keys();

  // Unset, loss scaling follows the dtype: dynamic for fp16, whose gradients underflow without
  // it; a static scale of 1 for fp32 and bf16, which have fp32's exponent range.
  if (!given("precision.loss_scale.dynamic")) scale.dynamic = c.precision.dtype == DType::f16;
  check_combinations(c);
  return c;
}

void ConfigReader::check_combinations(const Config& c) {
  const std::string stage_text = std::to_string(c.stage);
  if (valid("stage") && valid("offload.param.device") &&
      c.offload.param.device != OffloadDevice::none && c.stage != 3) {
    std::string message = "offloading parameters needs stage 3, but stage is ";
    message.append(stage_text).append(
        ": below stage 3 every rank keeps the full parameters on its device. Set stage: 3, or "
        "offload.param.device: none");
    report("offload.param.device", std::move(message));
  }
  if (valid("stage") && valid("offload.optimizer.device") &&
      c.offload.optimizer.device != OffloadDevice::none && c.stage == 0) {
    report("offload.optimizer.device",
           "offloading the optimizer needs stage 1 or higher: stage 0 keeps full optimizer states "
           "on every rank, with no partition to offload. Use stage 1+, or "
           "offload.optimizer.device: none");
  }
  check_offload_target("offload.optimizer", c.offload.optimizer);
  check_offload_target("offload.param", c.offload.param);

  if (valid("comm.backend") && valid("device.type")) {
    if (c.comm.backend == CommBackend::nccl && c.device.type == DeviceType::cpu)
      report("comm.backend",
             "nccl runs collectives on GPUs only, but device.type is cpu. Use backend: mpi (or "
             "auto, which picks mpi for cpu), or device.type: cuda");
    if (c.comm.backend == CommBackend::mpi && c.device.type == DeviceType::cuda)
      report("comm.backend",
             "with device.type cuda, collectives on device buffers run on nccl; mpi only serves "
             "cpu devices. Use backend: nccl (or auto, which picks nccl for cuda), or "
             "device.type: cpu");
  }

  // A cuda budget of 0 means "what the GPU has", so only a stated budget can be too small.
  if (valid("device.type") && valid("device.memory") && valid("buckets.reduce") &&
      valid("buckets.allgather") &&
      (c.device.type == DeviceType::cpu || c.device.memory != 0)) {
    std::size_t needed = 0;
    const bool overflow =
        __builtin_add_overflow(c.buckets.reduce_bytes, c.buckets.allgather_bytes, &needed) ||
        __builtin_add_overflow(needed, kDeviceHeadroom, &needed);
    if (overflow || c.device.memory < needed) {
      std::string message = format_size(c.device.memory);
      message.append(" cannot hold the buckets: it needs at least ");
      message.append(overflow ? std::string("more than 2^64 bytes") : format_size(needed));
      message.append(" (buckets.reduce ").append(format_size(c.buckets.reduce_bytes));
      message.append(" + buckets.allgather ").append(format_size(c.buckets.allgather_bytes));
      message.append(" + 1MiB of working space)");
      if (c.device.memory == 0) message.append("; 0 means \"all the GPU has\" only for cuda");
      message.append(". Raise device.memory or shrink the buckets");
      report("device.memory", std::move(message),
             {"device.memory", "buckets.reduce", "buckets.allgather", "device"});
    }
  }

  const LossScaleConfig& scale = c.precision.loss_scale;
  if (valid("precision.dtype") && c.precision.dtype != DType::f16) {
    const std::string dtype(detail::enum_name(detail::kDTypeNames, c.precision.dtype));
    if (given("precision.loss_scale.dynamic") && valid("precision.loss_scale.dynamic") &&
        scale.dynamic) {
      std::string message = "dynamic loss scaling is for fp16 only, but dtype is ";
      message.append(dtype).append(
          ": fp32 and bf16 have fp32's exponent range, so small gradients do not underflow and "
          "need no loss scaling. Remove the key or set it to false, or use dtype: fp16");
      report("precision.loss_scale.dynamic", std::move(message));
    }
    if (given("precision.loss_scale.static_scale") && valid("precision.loss_scale.static_scale") &&
        scale.static_scale != 1.0) {
      std::string message = number_text(scale.static_scale);
      message.append(" would be ignored: dtype ");
      message.append(dtype).append(
          " always uses a loss scale of 1 (only fp16 needs scaling). Remove the key or set it to "
          "1, or use dtype: fp16");
      report("precision.loss_scale.static_scale", std::move(message));
    }
  }
  if (valid("precision.dtype") && c.precision.dtype == DType::f16 && scale.dynamic &&
      valid("precision.loss_scale.initial_scale_power") &&
      valid("precision.loss_scale.min_scale")) {
    const double initial = std::ldexp(1.0, scale.initial_scale_power);
    if (scale.min_scale > initial) {
      std::string message = number_text(scale.min_scale);
      message.append(" is above the initial scale 2^");
      message.append(std::to_string(scale.initial_scale_power)).append(" = ");
      message.append(number_text(initial)).append(
          "; the scale would start below its own floor. Lower min_scale or raise "
          "initial_scale_power");
      report("precision.loss_scale.min_scale", std::move(message),
             {"precision.loss_scale.min_scale", "precision.loss_scale.initial_scale_power"});
    }
  }
}

void ConfigReader::check_offload_target(const std::string& prefix, const OffloadTarget& target) {
  const std::string device_key = prefix + ".device";
  const std::string path_key = prefix + ".path";
  if (!valid(device_key) || !valid(path_key)) return;
  if (target.device == OffloadDevice::nvme) {
    if (target.path.empty()) {
      report(path_key,
             "device nvme needs a path: an existing, writable directory for this rank's swap "
             "files",
             {path_key, device_key});
    } else {
      check_directory(path_key, target.path);
    }
  } else if (!target.path.empty()) {
    std::string message = "path ";
    message.append(quoted(target.path)).append(" is set but ").append(device_key).append(" is ");
    message.append(quoted(detail::enum_name(detail::kOffloadDeviceNames, target.device)));
    message.append("; only nvme uses a path, so it would be silently ignored. Remove path, or set "
                   "device: nvme");
    report(path_key, std::move(message));
  }
}

void ConfigReader::check_directory(const std::string& key, const std::string& directory) {
  std::string message = "nvme path ";
  message.append(quoted(directory));
  struct stat info {};
  if (::stat(directory.c_str(), &info) != 0) {
    const int error = errno;
    if (error == ENOENT)
      message.append(" does not exist; create the directory, or point path at an existing one");
    else
      message.append(" cannot be inspected: ").append(std::strerror(error));
    return report(key, std::move(message));
  }
  if (!S_ISDIR(info.st_mode))
    return report(key, message.append(" is not a directory; point path at a directory"));
  if (::access(directory.c_str(), W_OK | X_OK) != 0) {
    const int error = errno;
    message.append(" is not writable (").append(std::strerror(error));
    message.append("); zest creates its swap files there, so choose a directory this user can "
                   "write");
    return report(key, std::move(message));
  }
}

}  // namespace

Config parse_config(const std::string& yaml_text, const std::string& source_name,
                    const std::vector<std::string>& application_sections) {
  ConfigReader reader(source_name, application_sections);
  std::vector<YAML::Node> documents;
  try {
    documents = YAML::LoadAll(yaml_text);
  } catch (const YAML::Exception& error) {
    std::string message = "YAML syntax error: ";
    reader.report_at(error.mark, "", message.append(error.msg));
    throw ConfigError(reader.take_problems());
  }
  if (documents.size() > 1) {
    std::string message = "the file holds ";
    message.append(std::to_string(documents.size()))
        .append(" YAML documents (separated by '---'); a config is one document");
    reader.report_at(documents[1].Mark(), "", std::move(message));
  }
  Config config = reader.read(documents.empty() ? nullptr : &documents.front());
  std::vector<ConfigProblem> problems = reader.take_problems();
  if (!problems.empty()) throw ConfigError(std::move(problems));
  return config;
}

Config load_config(const std::string& path, const std::vector<std::string>& application_sections) {
  const auto unreadable = [&path](int error) {
    ConfigProblem problem;
    problem.file = path;
    problem.message = "cannot read the config file: ";
    problem.message.append(std::strerror(error)).append(" (errno ").append(std::to_string(error));
    problem.message.append(")");
    return ConfigError({std::move(problem)});
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw unreadable(errno);
  std::string text;
  char buffer[16 * 1024];
  for (;;) {
    const ssize_t got = ::read(fd, buffer, sizeof buffer);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int error = errno;  // EISDIR for a directory
      ::close(fd);
      throw unreadable(error);
    }
    if (got == 0) break;
    text.append(buffer, static_cast<std::size_t>(got));
  }
  ::close(fd);
  return parse_config(text, path, application_sections);
}

}  // namespace zest
