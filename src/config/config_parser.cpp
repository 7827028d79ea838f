// YAML text -> validated Config. The schema is written once, below in ConfigReader::read, as a
// tree of fields; walking it type-checks every value, then detail::check_config (shared with
// zest::validate) checks ranges and the settings together. Every problem is collected, and one ConfigError carries them
// all, so a user fixes a file in one pass. A deprecated key (a field's old name, still read) is no
// problem: it leaves a warning in Config::warnings.
#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include "config/config_checks.hpp"
#include "config/config_names.hpp"
#include "config/duration_parse.hpp"
#include "config/size_parse.hpp"
#include "zest/config.hpp"
#include "zest/error.hpp"
#include "base/files.hpp"
#include "base/text.hpp"

namespace zest {
namespace {

using detail::EnumName;
using detail::IntRange;
using detail::NumberRule;
using detail::SizeRule;

bool is_quoted_string(const YAML::Node& node) {
  return node.Tag() == "!" || node.Tag() == "tag:yaml.org,2002:str";
}

// What a user wrote, for "found ..." in messages.
std::string describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map: return "a map";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Scalar: return in_quotes(node.Scalar());
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

class ConfigReader final : public detail::ProblemSink {
 public:
  // `program_sections` non-null: every top-level key that is not zest's, nor a near miss or a
  // misplacement of one of zest's keys, is the program's; its name is appended there.
  ConfigReader(std::string file, std::vector<std::string> application_sections,
               std::vector<std::string>* program_sections = nullptr)
      : file_(std::move(file)),
        application_sections_(std::move(application_sections)),
        program_sections_(program_sections) {}

  // Walks `root` (nullptr for an empty file) against the schema and checks the combinations.
  Config read(const YAML::Node* root);

  // What `message` says of `key`, at `mark` in this file.
  ConfigProblem problem_at(const YAML::Mark& mark, const std::string& key, std::string message) const {
    ConfigProblem problem;
    problem.file = file_;
    if (!mark.is_null()) {
      problem.line = mark.line + 1;
      problem.column = mark.column + 1;
    }
    problem.key = key;
    problem.message = std::move(message);
    return problem;
  }

  void report_at(const YAML::Mark& mark, const std::string& key, std::string message) {
    problems_.push_back(problem_at(mark, key, std::move(message)));
    invalid_.insert(key);
  }

  // The config's warnings: each "file:line:col: key: message", in the order found.
  std::vector<std::string> take_warnings() {
    std::vector<std::string> texts;
    for (const ConfigProblem& warning : warnings_) texts.push_back(warning.to_string());
    return texts;
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
  // `renamed_to` set: `key` is the deprecated old name of the sibling field `renamed_to`, read
  // the same way (`read` writes the same setting), with a warning; both set is a problem. The old
  // name is no valid key for suggestions ("did you mean", "valid keys here").
  struct Field {
    std::string_view key;
    Reader read;
    std::string_view renamed_to = {};
  };
  struct UnknownKey {
    YAML::Mark mark;
    std::string parent;
    std::string key;
    std::vector<std::string> valid_here;
  };

  void read_map(const YAML::Node* node, const std::string& path, const std::vector<Field>& fields);
  // Of the deprecated names (Field::renamed_to) among `values`: warns of each, and drops one whose
  // new name is set too, as a problem naming both.
  void read_old_names(const std::string& path, const std::vector<Field>& fields,
                      std::map<std::string, YAML::Node>& values);
  void report_unknown_keys();
  // The closest key of `valid_here` within typo distance of `key`, or empty.
  static std::string_view near_miss(const std::string& key, const std::vector<std::string>& valid_here);
  // Every place in the schema other than `parent` where a key named `key` belongs.
  std::vector<std::string> homes_of(const std::string& key, const std::string& parent) const;

 public:
  // Reports at the first of `anchors` the file sets, else at `key` or its nearest given ancestor.
  void report(const std::string& key, std::string message,
              std::initializer_list<std::string_view> anchors = {}) override {
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

  bool valid(const std::string& path) const override {
    for (std::string p = path; !p.empty(); p = parent_of(p))
      if (invalid_.count(p) != 0) return false;
    return true;
  }

 private:
  // Field readers: each returns the Reader for one kind of value.
  Reader section(std::vector<Field> fields) {
    return [this, fields = std::move(fields)](const YAML::Node* value, const std::string& path) {
      read_map(value, path, fields);
    };
  }
  // The readers check that a value has the right type; detail::check_config checks its range,
  // for YAML and code alike. The rule is passed only to say what is expected.
  Reader integer(int& out, IntRange range);
  Reader number(double& out, const NumberRule& rule);
  Reader number_pair(double& first, double& second, const NumberRule& rule);
  Reader size(std::size_t& out, SizeRule rule = SizeRule::any);
  Reader flag(bool& out);
  Reader duration(std::chrono::milliseconds& out);
  Reader directories(std::vector<std::string>& out);
  Reader param_groups(std::vector<OptimizerParamGroup>& out);
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
    std::string message = fmt::format("expected {}, found {}", expected, describe(node));
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
  std::vector<ConfigProblem> warnings_;      // deprecated keys: file, line, column, key, message
  std::map<std::string, YAML::Mark> marks_;  // every key the file sets -> where its value is
  std::set<std::string> invalid_;            // keys with a problem
  std::vector<std::string> schema_paths_;    // every valid dotted key, from walking the schema
  std::vector<UnknownKey> unknown_keys_;
  // Top-level sections that belong to the program (zest-train's "model", "train"): not zest's.
  std::vector<std::string> application_sections_;
  std::vector<std::string>* program_sections_;
};

void ConfigReader::read_map(const YAML::Node* node, const std::string& path,
                            const std::vector<Field>& fields) {
  for (const Field& field : fields)
    if (field.renamed_to.empty()) schema_paths_.push_back(child_path(path, field.key));
  // An absent section or an empty one ("offload:" with nothing under it) keeps every default.
  if (node == nullptr || node->IsNull()) {
    for (const Field& field : fields) field.read(nullptr, child_path(path, field.key));
    return;
  }
  if (!node->IsMap()) {
    std::vector<std::string> keys;
    for (const Field& field : fields)
      if (field.renamed_to.empty()) keys.emplace_back(field.key);
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
      for (const Field& field : fields)
        if (field.renamed_to.empty()) unknown.valid_here.emplace_back(field.key);
      unknown_keys_.push_back(std::move(unknown));
      continue;
    }
    if (values.count(key) != 0) {
      std::string message = fmt::format("duplicate key {} (first set at line {}); keep one of them", in_quotes(key),
                                        marks_[key_path].line + 1);
      report_at(key_node.Mark(), key_path, std::move(message));
      continue;
    }
    const YAML::Node value = entry.second;
    // yaml-cpp places an empty value ("key:") on the next line; the key is where the user looks.
    marks_[key_path] = value.IsNull() || value.Mark().is_null() ? key_node.Mark() : value.Mark();
    values.emplace(key, value);
  }
  read_old_names(path, fields, values);
  for (const Field& field : fields) {
    const auto value = values.find(std::string(field.key));
    field.read(value == values.end() ? nullptr : &value->second, child_path(path, field.key));
  }
}

void ConfigReader::read_old_names(const std::string& path, const std::vector<Field>& fields,
                                  std::map<std::string, YAML::Node>& values) {
  for (const Field& field : fields) {
    if (field.renamed_to.empty() || values.count(std::string(field.key)) == 0) continue;
    const std::string old_path = child_path(path, field.key);
    const std::string new_path = child_path(path, field.renamed_to);
    const YAML::Mark mark = marks_[old_path];
    if (values.count(std::string(field.renamed_to)) != 0) {
      report_at(mark, old_path,
                fmt::format("both {} and {} are set, but they are one setting ({} is the deprecated old name of "
                            "{}); keep {} only",
                            old_path, new_path, field.key, field.renamed_to, field.renamed_to));
      values.erase(std::string(field.key));
      continue;
    }
    warnings_.push_back(
        problem_at(mark, old_path,
                   fmt::format("deprecated: renamed {}; the old name is read as the new one for now and will "
                               "be removed in a later release",
                               new_path)));
    // The checks of the setting name its new key: they point at the line that sets it.
    marks_.emplace(new_path, mark);
  }
}

std::string_view ConfigReader::near_miss(const std::string& key,
                                         const std::vector<std::string>& valid_here) {
  std::string_view best;
  std::size_t best_distance = typo_tolerance(key) + 1;
  for (const std::string& candidate : valid_here) {
    const std::size_t distance = edit_distance(key, candidate);
    if (distance < best_distance) {
      best_distance = distance;
      best = candidate;
    }
  }
  return best;
}

std::vector<std::string> ConfigReader::homes_of(const std::string& key,
                                                const std::string& parent) const {
  std::vector<std::string> homes;
  for (const std::string& path : schema_paths_) {
    const std::size_t dot = path.rfind('.');
    const std::string_view last =
        dot == std::string::npos ? std::string_view(path) : std::string_view(path).substr(dot + 1);
    if (last == key && parent_of(path) != parent &&
        std::find(homes.begin(), homes.end(), path) == homes.end())
      homes.push_back(path);
  }
  return homes;
}

void ConfigReader::report_unknown_keys() {
  for (const UnknownKey& unknown : unknown_keys_) {
    const std::string_view best = near_miss(unknown.key, unknown.valid_here);
    // A key valid elsewhere in the schema ("lr" at the top level) is misplaced, not misspelled.
    const std::vector<std::string> homes = homes_of(unknown.key, unknown.parent);
    // A top-level key that is neither is the program's own section; a near miss stays an error,
    // so "stgae:" is never silently taken for a program's setting.
    if (program_sections_ != nullptr && unknown.parent.empty() && best.empty() && homes.empty()) {
      program_sections_->push_back(unknown.key);
      continue;
    }
    std::string message = "unknown key ";
    message.append(in_quotes(unknown.key));
    if (!best.empty()) {
      message.append("; did you mean ").append(in_quotes(best)).append("?");
    } else if (!homes.empty()) {
      std::vector<std::string> quoted_homes;
      for (const std::string& home : homes) quoted_homes.push_back(in_quotes(home));
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

ConfigReader::Reader ConfigReader::integer(int& out, IntRange range) {
  return [this, &out, range](const YAML::Node* value, const std::string& path) {
    if (value == nullptr) return;
    const std::string expected = detail::expected_integer(range);
    const std::string* text = scalar(*value, path, expected);
    if (text == nullptr) return;
    if (is_quoted_string(*value)) return expected_found(path, expected, *value, "remove the quotes");
    std::string_view digits = *text;
    if (!digits.empty() && digits.front() == '+') digits.remove_prefix(1);
    int parsed = 0;
    const auto result = std::from_chars(digits.data(), digits.data() + digits.size(), parsed);
    if (result.ec == std::errc::result_out_of_range)
      return expected_found(path, expected, *value, "out of range");
    if (result.ec != std::errc() || result.ptr != digits.data() + digits.size())
      return expected_found(path, expected, *value);
    out = parsed;
  };
}

ConfigReader::Reader ConfigReader::number(double& out, const NumberRule& rule) {
  return [this, &out, &rule](const YAML::Node* value, const std::string& path) {
    if (value == nullptr) return;
    const std::optional<double> parsed = parse_number(*value, path, rule.expected);
    if (parsed) out = *parsed;
  };
}

ConfigReader::Reader ConfigReader::number_pair(double& first, double& second,
                                               const NumberRule& rule) {
  return [this, &first, &second, &rule](const YAML::Node* value, const std::string& path) {
    if (value == nullptr) return;
    std::string expected_list = "a list of two numbers, each ";
    expected_list.append(rule.expected);
    if (!value->IsSequence()) return expected_found(path, expected_list, *value);
    if (value->size() != 2) {
      std::string found = fmt::format("a list of {} {}", value->size(), value->size() == 1 ? "item" : "items");
      report(path, fmt::format("expected {}, found {}", expected_list, found));
      return;
    }
    double* const outs[2] = {&first, &second};
    for (std::size_t i = 0; i < 2; ++i) {
      const YAML::Node item = (*value)[i];
      std::string item_path = path;
      item_path.append("[").append(std::to_string(i)).append("]");
      marks_[item_path] = item.Mark();
      const std::optional<double> parsed = parse_number(item, item_path, rule.expected);
      if (parsed) *outs[i] = *parsed;
    }
  };
}

ConfigReader::Reader ConfigReader::size(std::size_t& out, SizeRule rule) {
  return [this, &out, rule](const YAML::Node* value, const std::string& path) {
    if (value == nullptr) return;
    const std::string expected = detail::expected_size(rule);
    const std::string* text = scalar(*value, path, expected);
    if (text == nullptr) return;
    std::size_t bytes = 0;
    std::string why;
    if (!detail::parse_size_into(*text, bytes, why)) return expected_found(path, expected, *value, {}, why);
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

// offload.*.path: one directory (a string), or a list of them, one per drive. An empty string is
// "no path" (what to_yaml writes for a target without one); an empty list is a mistake.
ConfigReader::Reader ConfigReader::directories(std::vector<std::string>& out) {
  return [this, &out](const YAML::Node* value, const std::string& path) {
    if (value == nullptr) return;
    constexpr std::string_view kExpected = "a directory, or a list of directories (one per drive)";
    if (value->IsSequence()) {
      if (value->size() == 0) {
        report(path,
               std::string("expected ").append(kExpected).append(", found an empty list; list at least one directory"));
        return;
      }
      std::vector<std::string> items;
      for (std::size_t i = 0; i < value->size(); ++i) {
        const YAML::Node item = (*value)[i];
        const std::string item_path = std::string(path).append("[").append(std::to_string(i)).append("]");
        marks_[item_path] = item.Mark();
        const std::string* text = scalar(item, path, "a directory (text)");
        if (text == nullptr) return;
        if (text->empty()) {
          report(item_path, "expected a directory, found an empty string; remove the item or name a directory");
          return;
        }
        items.push_back(*text);
      }
      out = std::move(items);
      return;
    }
    const std::string* text = scalar(*value, path, kExpected);
    if (text == nullptr) return;
    out.clear();
    if (!text->empty()) out.push_back(*text);
  };
}

template <typename Enum, std::size_t N>
ConfigReader::Reader ConfigReader::choice(const std::array<EnumName<Enum>, N>& names, Enum& out) {
  return [this, &names, &out](const YAML::Node* value, const std::string& path) {
    if (value == nullptr) return;
    const std::string expected = detail::expected_choice(names);
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

// optimizer.param_groups: a list of maps, each `match` (a pattern or a list of patterns) and any of
// the optimizer's hyper-parameters; unset ones stay unset (the optimizer's apply).
ConfigReader::Reader ConfigReader::param_groups(std::vector<OptimizerParamGroup>& out) {
  return [this, &out](const YAML::Node* value, const std::string& path) {
    if (value == nullptr) return;
    constexpr std::string_view kExpected =
        "a list of parameter groups, each {match: [patterns], lr/betas/eps/weight_decay: ...}";
    if (!value->IsSequence()) return expected_found(path, kExpected, *value);
    out.assign(value->size(), {});
    for (std::size_t i = 0; i < value->size(); ++i) {
      const YAML::Node item = (*value)[i];
      const std::string item_path = std::string(path).append("[").append(std::to_string(i)).append("]");
      marks_[item_path] = item.Mark();
      OptimizerParamGroup& group = out[i];
      // A key present sets its value, whatever it holds: check_config then names a bad one.
      const auto optional = [this](std::optional<double>& target, const NumberRule& rule) -> Reader {
        return [this, &target, &rule](const YAML::Node* node, const std::string& key) {
          if (node == nullptr) return;
          double v = std::numeric_limits<double>::quiet_NaN();
          number(v, rule)(node, key);
          target = v;
        };
      };
      const Reader betas = [this, &group](const YAML::Node* node, const std::string& key) {
        if (node == nullptr) return;
        double b1 = std::numeric_limits<double>::quiet_NaN(), b2 = b1;
        number_pair(b1, b2, detail::kUnitInterval)(node, key);
        group.beta1 = b1;
        group.beta2 = b2;
      };
      const Reader patterns = [this, &group](const YAML::Node* node, const std::string& key) {
        if (node == nullptr) return;
        if (node->IsSequence()) {
          for (std::size_t k = 0; k < node->size(); ++k) {
            const std::string* text = scalar((*node)[k], key, "a tensor-name pattern (text)");
            if (text != nullptr) group.match.push_back(*text);
          }
        } else if (const std::string* text = scalar(*node, key, "a tensor-name pattern or a list of them")) {
          group.match.push_back(*text);
        }
      };
      read_map(&item, item_path, {
          {"match", patterns},
          {"lr", optional(group.lr, detail::kPositive)},
          {"betas", betas},
          {"eps", optional(group.eps, detail::kPositive)},
          {"weight_decay", optional(group.weight_decay, detail::kNonNegative)},
      });
    }
  };
}

Config ConfigReader::read(const YAML::Node* root) {
  Config c;
  c.source = file_;
  // `more`: the keys only one of the targets has.
  const auto offload_target = [this](OffloadTarget& target, std::vector<Field> more = {}) {
    std::vector<Field> fields = {
        {"device", choice(detail::kOffloadDeviceNames, target.device)},
        {"path", directories(target.paths)},
        {"pinned", flag(target.pinned)},
        {"buffer_count", integer(target.buffer_count, detail::kBufferCountRange)},
    };
    fields.insert(fields.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
    return section(std::move(fields));
  };
  LossScaleConfig& scale = c.precision.loss_scale;
  const std::vector<Field> schema = {
      {"stage", integer(c.stage, detail::kStageRange)},
      {"device", section({
                     {"type", choice(detail::kDeviceTypeNames, c.device.type)},
                     {"memory", size(c.device.memory)},
                 })},
      {"comm", section({
                   {"backend", choice(detail::kCommBackendNames, c.comm.backend)},
                   {"timeout", duration(c.comm.timeout)},
                   {"quantize", section({
                                    {"params", choice(detail::kQuantizeParamsNames, c.comm.quantize.params)},
                                    {"grads", choice(detail::kQuantizeGradsNames, c.comm.quantize.grads)},
                                })},
               })},
      {"buckets", section({
                      {"reduce", size(c.buckets.reduce_bytes, SizeRule::bucket)},
                      {"allgather", size(c.buckets.allgather_bytes, SizeRule::bucket)},
                      {"overlap_comm", flag(c.buckets.overlap_comm)},
                  })},
      {"stage3", section({
                     {"prefetch", size(c.stage3.prefetch_bytes)},
                     {"max_live", size(c.stage3.max_live_bytes, SizeRule::positive)},
                     {"persistence_threshold", size(c.stage3.persistence_threshold_bytes)},
                 })},
      {"partition", section({
                        {"secondary", choice(detail::kSecondaryPartitionNames, c.partition.secondary)},
                    })},
      {"optimizer", section({
                        {"type", choice(detail::kOptimizerTypeNames, c.optimizer.type)},
                        {"lr", number(c.optimizer.lr, detail::kPositive)},
                        {"betas", number_pair(c.optimizer.beta1, c.optimizer.beta2,
                                              detail::kUnitInterval)},
                        {"eps", number(c.optimizer.eps, detail::kPositive)},
                        {"weight_decay", number(c.optimizer.weight_decay,
                                                detail::kNonNegative)},
                        {"threads", integer(c.optimizer.threads, detail::kOptimizerThreadsRange)},
                        {"param_groups", param_groups(c.optimizer.param_groups)},
                        {"states", choice(detail::kStatesFormatNames, c.optimizer.states)},
                        {"master", choice(detail::kDTypeNames, c.optimizer.master)},
                        {"seed", integer(c.optimizer.seed, detail::kSeedRange)},
                    })},
      {"precision",
       section({
           {"dtype", choice(detail::kDTypeNames, c.precision.dtype)},
           {"loss_scale", section({
                              {"dynamic", flag(scale.dynamic)},
                              {"static_scale", number(scale.static_scale, detail::kPositive)},
                              {"initial_scale_power",
                               integer(scale.initial_scale_power, detail::kInitialScalePowerRange)},
                              {"window", integer(scale.window, detail::kAtLeastOne)},
                              {"hysteresis", integer(scale.hysteresis, detail::kAtLeastOne)},
                              {"min_scale", number(scale.min_scale, detail::kPositive)},
                          })},
       })},
      {"gradient_clipping", number(c.gradient_clipping, detail::kClipping)},
      {"gradient_accumulation_steps", integer(c.gradient_accumulation_steps, detail::kAtLeastOne)},
      {"offload", section({
                      {"optimizer", offload_target(c.offload.optimizer,
                                                   {{"ratio", number(c.offload.optimizer_ratio, detail::kOffloadRatio)},
                                                    {"update_ahead", flag(c.offload.optimizer_update_ahead)},
                                                    // Its deprecated old name, read until a later release.
                                                    {"overlap", flag(c.offload.optimizer_update_ahead),
                                                     "update_ahead"}})},
                      {"param", offload_target(c.offload.param)},
                      {"sub_group", size(c.offload.sub_group_bytes, SizeRule::sub_group)},
                  })},
      {"io", section({
                 {"block_size", size(c.io.block_size, SizeRule::io_block)},
                 {"queue_depth", integer(c.io.queue_depth, detail::kQueueDepthRange)},
                 {"threads", integer(c.io.threads, detail::kIoThreadsRange)},
                 {"direct", flag(c.io.direct)},
                 {"checksum", flag(c.io.checksum)},
             })},
  };
  read_map(root, "", schema);
  report_unknown_keys();

  // An unset key keeps the struct's default, so a Config from YAML and one built in code agree.
  detail::check_config(c, *this);
  return c;
}

// Where each YAML document of `text` starts, read with yaml-cpp's parser instead of YAML::LoadAll:
// on some syntax errors yaml-cpp 0.7 (Debian 12) reports a new document at the same place forever
// without consuming input, and LoadAll loops, allocating a null document each time (found by the
// config fuzz target: `,stage: 3`, `&a ,`, `"x" ,`; yaml-cpp issue 1040, LoadAll fixed upstream in 2024).
// A document that starts where the one before it did is that error: thrown as a YAML::ParserException
// at its place. Every other document consumes input, so the loop ends.
class DocumentStarts final : public YAML::EventHandler {
 public:
  std::vector<YAML::Mark> marks;
  void OnDocumentStart(const YAML::Mark& mark) override {
    if (!marks.empty() && marks.back().pos == mark.pos)
      throw YAML::ParserException(mark, "yaml-cpp cannot read past this point (a stray ',' or the like)");
    marks.push_back(mark);
  }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

std::vector<YAML::Mark> document_starts(const std::string& text) {
  std::istringstream in(text);
  YAML::Parser parser(in);
  DocumentStarts starts;
  while (parser.HandleNextDocument(starts)) {
  }
  return std::move(starts.marks);
}

// Shared by parse_config and the loaders; `program_sections` as in ConfigReader.
Config parse(const std::string& yaml_text, const std::string& source_name,
             const std::vector<std::string>& application_sections,
             std::vector<std::string>* program_sections) {
  ConfigReader reader(source_name, application_sections, program_sections);
  std::vector<YAML::Mark> documents;
  YAML::Node first;
  try {
    documents = document_starts(yaml_text);
    if (!documents.empty()) first = YAML::Load(yaml_text);  // the first document only
  } catch (const YAML::Exception& error) {
    std::string message = "YAML syntax error: ";
    reader.report_at(error.mark, "", message.append(error.msg));
    throw ConfigError(reader.take_problems());
  }
  if (documents.size() > 1) {
    std::string message = fmt::format("the file holds {} YAML documents (separated by '---'); a config is one document",
                                      documents.size());
    reader.report_at(documents[1], "", std::move(message));
  }
  Config config = reader.read(documents.empty() ? nullptr : &first);
  std::vector<ConfigProblem> problems = reader.take_problems();
  if (!problems.empty()) throw ConfigError(std::move(problems));
  config.warnings = reader.take_warnings();
  return config;
}

ConfigError file_problem(const std::string& path, std::string message) {
  ConfigProblem problem;
  problem.file = path;
  problem.message = std::move(message);
  return ConfigError({std::move(problem)});
}

ConfigError unreadable(const std::string& path, int error) {
  std::string message = fmt::format("cannot read the config file: {} (errno {})", std::strerror(error), error);
  return file_problem(path, std::move(message));
}

std::string too_large(const std::string& size) {
  return fmt::format("the file is {}, above the {} limit for a config file (a config is a few KiB); check the path",
                     size, format_size(kMaxConfigFileBytes));
}

// A config file read whole, as base/files.hpp reads: never blocking on a FIFO, never reading a
// device, never past the size limit.
std::string read_config_file(const std::string& path) {
  FileProblem problem;
  UniqueFd fd = open_regular(AT_FDCWD, path, true, problem);
  std::string text = fd ? read_whole(fd.get(), kMaxConfigFileBytes, problem) : std::string();
  switch (problem.kind) {
    case FileProblem::Kind::none:
      return text;
    case FileProblem::Kind::system:
      throw unreadable(path, problem.error);
    case FileProblem::Kind::not_regular:
      throw file_problem(path, std::string("cannot read the config file: it is ").append(problem.file_kind)
                                   .append(", not a regular file; point at a YAML file"));
    case FileProblem::Kind::too_large:
      throw file_problem(path, too_large(fmt::format("{} bytes", problem.size)));
    case FileProblem::Kind::grew:
      break;
  }
  throw file_problem(path, too_large("more than " + format_size(kMaxConfigFileBytes)));
}

// Collects validate's findings: no file position, since a Config built in code has no file.
class ProblemList final : public detail::ProblemSink {
 public:
  explicit ProblemList(std::string source) : source_(std::move(source)) {}
  void report(const std::string& key, std::string message,
              std::initializer_list<std::string_view>) override {
    ConfigProblem problem;
    problem.file = source_;
    problem.key = key;
    problem.message = std::move(message);
    problems_.push_back(std::move(problem));
  }
  bool valid(const std::string& key) const override {
    return std::none_of(problems_.begin(), problems_.end(),
                        [&](const ConfigProblem& problem) { return problem.key == key; });
  }
  std::vector<ConfigProblem> take() { return std::move(problems_); }

 private:
  std::string source_;
  std::vector<ConfigProblem> problems_;
};

}  // namespace

Config parse_config(const std::string& yaml_text, const std::string& source_name,
                    const std::vector<std::string>& application_sections) {
  return parse(yaml_text, source_name, application_sections, nullptr);
}

Config load_config(const std::string& path, const std::vector<std::string>& application_sections) {
  return parse(read_config_file(path), path, application_sections, nullptr);
}

Config load_config_with_program_sections(const std::string& path,
                                         std::vector<std::string>& program_sections) {
  return parse(read_config_file(path), path, {}, &program_sections);
}

void validate(const Config& config) {
  ProblemList problems(config.source);
  detail::check_config(config, problems);
  std::vector<ConfigProblem> found = problems.take();
  if (!found.empty()) throw ConfigError(std::move(found));
}

}  // namespace zest
