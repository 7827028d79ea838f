#include "zest/estimate.hpp"

#include <string>

#include "engine/layout.hpp"
#include "engine/memory_plan.hpp"
#include "zest/error.hpp"

namespace zest {

MemoryEstimate estimate_memory(const Config& config, const std::vector<ParamSpec>& params, int ranks) {
  if (ranks < 1)
    throw Error(std::string("estimate_memory: ranks must be at least 1, got ").append(std::to_string(ranks)));
  // The engine partitions over the world from stage 1 on; stage 0 keeps everything on every rank.
  const engine::Layout layout(params, config.stage == 0 ? 1 : ranks);
  const engine::MemoryPlan plan = engine::plan_memory(config, layout);
  MemoryEstimate e;
  e.ranks = ranks;
  e.numel = layout.numel();
  e.device = plan.device;
  e.device_total = plan.device_total;
  e.pinned = plan.pinned_total;
  e.nvme = plan.nvme_total;
  return e;
}

std::vector<ParamSpec> uniform_model(std::size_t params, int layers) {
  if (layers < 1)
    throw Error(std::string("uniform_model: layers must be at least 1, got ").append(std::to_string(layers)));
  const std::size_t count = static_cast<std::size_t>(layers);
  if (params < count)
    throw Error(std::string("uniform_model: ").append(std::to_string(params)).append(" parameters cannot fill ")
                    .append(std::to_string(layers)).append(" layers; give at least one parameter per layer"));
  std::vector<ParamSpec> specs;
  specs.reserve(count);
  for (std::size_t g = 0; g < count; ++g) {
    const std::size_t numel = params / count + (g < params % count ? 1 : 0);
    specs.push_back({std::string("layer").append(std::to_string(g)), {numel}, static_cast<int>(g)});
  }
  return specs;
}

}  // namespace zest
