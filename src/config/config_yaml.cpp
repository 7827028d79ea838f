// Config -> YAML in the schema parse_config reads, every value resolved, so that
// parse_config(to_yaml(c)) == c. Doubles print in their shortest exact form (std::to_chars), so
// they read back bit for bit.
#include <charconv>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "config/config_names.hpp"
#include "config/duration_parse.hpp"
#include "zest/config.hpp"

namespace zest {
namespace {

class YamlWriter {
 public:
  void section(std::string_view key) {
    line(key).push_back('\n');
    indent_ += 2;
  }
  void end_section() { indent_ -= 2; }

  // Distinct names, not overloads: a const char* would silently pick an overload taking bool.
  void plain(std::string_view key, std::string_view text) {
    line(key).append(" ").append(text).push_back('\n');
  }
  void integer(std::string_view key, int number) { plain(key, std::to_string(number)); }
  void flag(std::string_view key, bool value) { plain(key, value ? "true" : "false"); }
  void number(std::string_view key, double value) { plain(key, number_text(value)); }
  void size(std::string_view key, std::size_t bytes) { plain(key, format_size(bytes)); }
  void quoted(std::string_view key, const std::string& text) {
    // The emitter quotes and escapes whatever a path may hold (spaces, '#', ':', non-ASCII).
    YAML::Emitter emitter;
    emitter << YAML::DoubleQuoted << text;
    plain(key, emitter.c_str());
  }

  void quoted_list(std::string_view key, const std::vector<std::string>& texts) {
    YAML::Emitter emitter;
    emitter << YAML::Flow << YAML::BeginSeq;
    for (const std::string& text : texts) emitter << YAML::DoubleQuoted << text;
    emitter << YAML::EndSeq;
    plain(key, emitter.c_str());
  }

  static std::string number_text(double number) {
    char buffer[64];
    const auto result = std::to_chars(buffer, buffer + sizeof buffer, number);
    return std::string(buffer, result.ptr);
  }

  std::string take() { return std::move(out_); }

 private:
  std::string& line(std::string_view key) {
    out_.append(static_cast<std::size_t>(indent_), ' ').append(key).append(":");
    return out_;
  }

  std::string out_;
  int indent_ = 0;
};

// optimizer.param_groups in flow style, e.g. [{match: ["*.bias"], weight_decay: 0}]: only what
// each group sets (betas as a pair, the unset one the optimizer's).
std::string param_groups_text(const OptimizerConfig& o) {
  std::string text = "[";
  for (const OptimizerParamGroup& g : o.param_groups) {
    if (text.size() > 1) text.append(", ");
    text.append("{match: [");
    for (std::size_t i = 0; i < g.match.size(); ++i) {
      YAML::Emitter pattern;
      pattern << YAML::DoubleQuoted << g.match[i];
      text.append(i ? ", " : "").append(pattern.c_str());
    }
    text.append("]");
    const auto add = [&](const char* key, double value) {
      text.append(", ").append(key).append(": ").append(YamlWriter::number_text(value));
    };
    if (g.lr) add("lr", *g.lr);
    if (g.beta1 || g.beta2)
      text.append(", betas: [").append(YamlWriter::number_text(g.beta1.value_or(o.beta1))).append(", ")
          .append(YamlWriter::number_text(g.beta2.value_or(o.beta2))).append("]");
    if (g.eps) add("eps", *g.eps);
    if (g.weight_decay) add("weight_decay", *g.weight_decay);
    text.append("}");
  }
  return text.append("]");
}

// `ratio`, `update_ahead`: the optimizer's offload.optimizer.ratio and .update_ahead (the parameters'
// target has neither). Only the current name is written, never the deprecated alias `overlap`.
void write_target(YamlWriter& out, std::string_view key, const OffloadTarget& target,
                  std::optional<double> ratio = std::nullopt, std::optional<bool> update_ahead = std::nullopt) {
  out.section(key);
  out.plain("device", detail::enum_name(detail::kOffloadDeviceNames, target.device));
  // One directory as a string, as most configs write it; several as a list.
  if (target.paths.size() == 1) out.quoted("path", target.paths.front());
  else if (target.paths.size() > 1) out.quoted_list("path", target.paths);
  else out.quoted("path", "");
  out.flag("pinned", target.pinned);
  out.integer("buffer_count", target.buffer_count);
  if (ratio) out.number("ratio", *ratio);
  if (update_ahead) out.flag("update_ahead", *update_ahead);
  out.end_section();
}

}  // namespace

std::string to_yaml(const Config& c) {
  YamlWriter out;
  out.integer("stage", c.stage);

  out.section("device");
  out.plain("type", detail::enum_name(detail::kDeviceTypeNames, c.device.type));
  out.size("memory", c.device.memory);
  out.end_section();

  out.section("comm");
  out.plain("backend", detail::enum_name(detail::kCommBackendNames, c.comm.backend));
  out.plain("timeout", detail::format_duration(c.comm.timeout));
  out.section("quantize");
  out.plain("params", detail::enum_name(detail::kQuantizeParamsNames, c.comm.quantize.params));
  out.plain("grads", detail::enum_name(detail::kQuantizeGradsNames, c.comm.quantize.grads));
  out.end_section();
  out.end_section();

  out.section("buckets");
  out.size("reduce", c.buckets.reduce_bytes);
  out.size("allgather", c.buckets.allgather_bytes);
  out.flag("overlap_comm", c.buckets.overlap_comm);
  out.end_section();

  out.section("stage3");
  out.size("prefetch", c.stage3.prefetch_bytes);
  out.size("max_live", c.stage3.max_live_bytes);
  out.size("persistence_threshold", c.stage3.persistence_threshold_bytes);
  out.end_section();

  out.section("partition");
  out.plain("secondary", detail::enum_name(detail::kSecondaryPartitionNames, c.partition.secondary));
  out.end_section();

  out.section("optimizer");
  out.plain("type", detail::enum_name(detail::kOptimizerTypeNames, c.optimizer.type));
  out.number("lr", c.optimizer.lr);
  std::string betas = "[";
  betas.append(YamlWriter::number_text(c.optimizer.beta1)).append(", ");
  betas.append(YamlWriter::number_text(c.optimizer.beta2)).append("]");
  out.plain("betas", betas);
  out.number("eps", c.optimizer.eps);
  out.number("weight_decay", c.optimizer.weight_decay);
  out.integer("threads", c.optimizer.threads);
  out.plain("param_groups", param_groups_text(c.optimizer));
  out.plain("states", detail::enum_name(detail::kStatesFormatNames, c.optimizer.states));
  out.plain("master", detail::enum_name(detail::kDTypeNames, c.optimizer.master));
  out.integer("seed", c.optimizer.seed);
  out.end_section();

  const LossScaleConfig& scale = c.precision.loss_scale;
  out.section("precision");
  out.plain("dtype", detail::enum_name(detail::kDTypeNames, c.precision.dtype));
  out.section("loss_scale");
  out.flag("dynamic", scale.dynamic);
  out.number("static_scale", scale.static_scale);
  out.integer("initial_scale_power", scale.initial_scale_power);
  out.integer("window", scale.window);
  out.integer("hysteresis", scale.hysteresis);
  out.number("min_scale", scale.min_scale);
  out.end_section();
  out.end_section();

  out.number("gradient_clipping", c.gradient_clipping);
  out.integer("gradient_accumulation_steps", c.gradient_accumulation_steps);

  out.section("offload");
  write_target(out, "optimizer", c.offload.optimizer, c.offload.optimizer_ratio, c.offload.optimizer_update_ahead);
  write_target(out, "param", c.offload.param);
  out.size("sub_group", c.offload.sub_group_bytes);
  out.end_section();

  out.section("io");
  out.size("block_size", c.io.block_size);
  out.integer("queue_depth", c.io.queue_depth);
  out.integer("threads", c.io.threads);
  out.flag("direct", c.io.direct);
  out.flag("checksum", c.io.checksum);
  out.end_section();
  return out.take();
}

}  // namespace zest
