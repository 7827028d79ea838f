// Reading a program's own sections of a zest YAML file (`model:`, `train:`) with the care zest's
// parser takes: every problem collected with file:line:col, the key, what was expected and what
// was found, then thrown together as one ConfigError.
#pragma once

#include <yaml-cpp/yaml.h>

#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "zest/error.hpp"

namespace zest::train {

class SectionReader {
 public:
  explicit SectionReader(std::string file) : file_(std::move(file)) {}

  // The file's root node. Call after zest's load_config accepted the file (it checks what the
  // file is and its size); a file that still fails to parse throws ConfigError at once.
  YAML::Node load() {
    try {
      return YAML::LoadFile(file_);
    } catch (const YAML::Exception& error) {
      problem(YAML::Node(), "", std::string("cannot read ").append(file_).append(": ").append(error.what()));
      throw ConfigError(problems_);
    }
  }

  using Setter = std::function<void(const YAML::Node&, const std::string& key)>;

  void read(const YAML::Node& root, const std::string& section, const std::map<std::string, Setter>& fields) {
    const YAML::Node node = root[section];
    if (!node || node.IsNull()) return;
    if (!node.IsMap()) return problem(node, section, "expected a map of settings");
    for (const auto& entry : node) {
      const std::string key = entry.first.Scalar();
      const auto field = fields.find(key);
      if (field == fields.end()) {
        std::string valid;
        for (const auto& [name, setter] : fields) valid.append(valid.empty() ? "" : ", ").append(name);
        problem(entry.first, section + "." + key, "unknown key; valid keys here: " + valid);
        continue;
      }
      field->second(entry.second, section + "." + key);
    }
  }

  template <class T>
  Setter number(T& target, double min, double max) {
    return [this, &target, min, max](const YAML::Node& node, const std::string& key) {
      try {
        const double value = node.as<double>();
        if (value < min || value > max ||
            (std::is_integral_v<T> && value != static_cast<double>(static_cast<long long>(value))))
          return problem(node, key,
                         "expected " + std::string(std::is_integral_v<T> ? "an integer" : "a number") + " in [" +
                             format(min) + ", " + format(max) + "], found '" + node.Scalar() + "'");
        target = static_cast<T>(value);
      } catch (const YAML::Exception&) {
        problem(node, key,
                "expected a number, found '" + (node.IsScalar() ? node.Scalar() : std::string("a map or list")) + "'");
      }
    };
  }

  Setter text(std::string& target) {
    return [this, &target](const YAML::Node& node, const std::string& key) {
      if (!node.IsScalar()) return problem(node, key, "expected text");
      target = node.Scalar();
    };
  }

  Setter texts(std::vector<std::string>& target) {
    return [this, &target](const YAML::Node& node, const std::string& key) {
      if (!node.IsSequence()) return problem(node, key, "expected a list of text");
      target.clear();
      for (const YAML::Node& item : node) {
        if (!item.IsScalar()) return problem(item, key, "expected a list of text");
        target.push_back(item.Scalar());
      }
    };
  }

  void problem(const YAML::Node& node, const std::string& key, std::string message) {
    ConfigProblem p;
    p.file = file_;
    p.line = node.Mark().is_null() ? 0 : node.Mark().line + 1;
    p.column = node.Mark().is_null() ? 0 : node.Mark().column + 1;
    p.key = key;
    p.message = std::move(message);
    problems_.push_back(std::move(p));
  }

  std::vector<ConfigProblem>& problems() { return problems_; }

 private:
  static std::string format(double value) {
    std::string s = std::to_string(value);
    s.erase(s.find_last_not_of('0') + 1);
    if (!s.empty() && s.back() == '.') s.pop_back();
    return s;
  }

  std::string file_;
  std::vector<ConfigProblem> problems_;
};

}  // namespace zest::train
