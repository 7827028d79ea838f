#include "train_config.hpp"

#include <yaml-cpp/yaml.h>

#include <functional>
#include <map>
#include <vector>

#include "zest/error.hpp"

namespace zest::train {
namespace {

class SectionReader {
 public:
  explicit SectionReader(std::string file) : file_(std::move(file)) {}

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
        if (value < min || value > max || (std::is_integral_v<T> && value != static_cast<double>(static_cast<long long>(value))))
          return problem(node, key, "expected " + std::string(std::is_integral_v<T> ? "an integer" : "a number") +
                                        " in [" + format(min) + ", " + format(max) + "], found '" + node.Scalar() + "'");
        target = static_cast<T>(value);
      } catch (const YAML::Exception&) {
        problem(node, key, "expected a number, found '" + (node.IsScalar() ? node.Scalar() : std::string("a map or list")) + "'");
      }
    };
  }

  Setter text(std::string& target) {
    return [this, &target](const YAML::Node& node, const std::string& key) {
      if (!node.IsScalar()) return problem(node, key, "expected text");
      target = node.Scalar();
    };
  }

  Setter activation(charlm::Activation& target) {
    return [this, &target](const YAML::Node& node, const std::string& key) {
      const std::string value = node.IsScalar() ? node.Scalar() : "";
      if (value == "gelu") target = charlm::Activation::gelu;
      else if (value == "tanh") target = charlm::Activation::tanh;
      else problem(node, key, "expected gelu or tanh, found '" + value + "'");
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

}  // namespace

TrainConfig load_train_config(const std::string& path) {
  TrainConfig c;
  SectionReader reader(path);
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::Exception& error) {
    reader.problem(YAML::Node(), "", std::string("cannot read ").append(path).append(": ").append(error.what()));
    throw ConfigError(reader.problems());
  }
  if (!root.IsMap()) return c;  // zest's own parser reports a malformed file
  constexpr double kBig = 1e12;
  reader.read(root, "model", {
      {"context", reader.number(c.model.context, 1, 4096)},
      {"embed", reader.number(c.model.embed, 1, 1 << 20)},
      {"hidden", reader.number(c.model.hidden, 1, 1 << 20)},
      {"layers", reader.number(c.model.layers, 0, 1024)},
      {"activation", reader.activation(c.model.activation)},
  });
  reader.read(root, "train", {
      {"text", reader.text(c.text)},
      {"seed", reader.number(c.seed, 0, kBig)},
      {"global_batch", reader.number(c.global_batch, 1, 1 << 24)},
      {"steps", reader.number(c.steps, 0, 1e9)},
      {"log_every", reader.number(c.log_every, 1, 1e9)},
  });
  if (!reader.problems().empty()) throw ConfigError(reader.problems());
  return c;
}

}  // namespace zest::train
