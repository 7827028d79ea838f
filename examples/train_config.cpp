#include "train_config.hpp"

#include "section_reader.hpp"

namespace zest::train {
namespace {

// The activation's setter (gelu, tanh).
SectionReader::Setter activation(SectionReader& reader, charlm::Activation& target) {
  return [&reader, &target](const YAML::Node& node, const std::string& key) {
    const std::string value = node.IsScalar() ? node.Scalar() : "";
    if (value == "gelu") target = charlm::Activation::gelu;
    else if (value == "tanh") target = charlm::Activation::tanh;
    else reader.problem(node, key, "expected gelu or tanh, found '" + value + "'");
  };
}

}  // namespace

TrainConfig load_train_config(const std::string& path) {
  TrainConfig c;
  SectionReader reader(path);
  const YAML::Node root = reader.load();
  if (!root.IsMap()) return c;  // zest's own parser reports a malformed file
  constexpr double kBig = 1e12;
  reader.read(root, "model", {
      {"context", reader.number(c.model.context, 1, 4096)},
      {"embed", reader.number(c.model.embed, 1, 1 << 20)},
      {"hidden", reader.number(c.model.hidden, 1, 1 << 20)},
      {"layers", reader.number(c.model.layers, 0, 1024)},
      {"activation", activation(reader, c.model.activation)},
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
