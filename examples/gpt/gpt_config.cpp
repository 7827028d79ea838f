#include "gpt_config.hpp"

#include "section_reader.hpp"

namespace zest::gpt {

GptTrainConfig load_gpt_train_config(const std::string& path) {
  GptTrainConfig c;
  train::SectionReader reader(path);
  const YAML::Node root = reader.load();
  if (!root.IsMap()) return c;  // zest's own parser reports a malformed file
  reader.read(root, "model", {
      {"context", reader.number(c.model.context, 1, 4096)},
      {"embed", reader.number(c.model.embed, 1, 1 << 16)},
      {"heads", reader.number(c.model.heads, 1, 1024)},
      {"layers", reader.number(c.model.layers, 0, 1024)},
  });
  reader.read(root, "train", {
      {"text", reader.text(c.text)},
      {"seed", reader.number(c.seed, 0, 1e12)},
      {"global_batch", reader.number(c.global_batch, 1, 1 << 24)},
      {"steps", reader.number(c.steps, 0, 1e9)},
      {"log_every", reader.number(c.log_every, 1, 1e9)},
      {"lr_step_size", reader.number(c.lr_step_size, 0, 1e9)},
      {"lr_gamma", reader.number(c.lr_gamma, 0, 1)},
      {"no_decay", reader.texts(c.no_decay)},
  });
  if (c.model.embed % c.model.heads != 0)
    reader.problem(
        root["model"].IsMap() && root["model"]["heads"] ? root["model"]["heads"] : YAML::Node(), "model.heads",
        "must divide model.embed (" + std::to_string(c.model.embed) + "), found " + std::to_string(c.model.heads));
  if (!reader.problems().empty()) throw ConfigError(reader.problems());
  return c;
}

}  // namespace zest::gpt
