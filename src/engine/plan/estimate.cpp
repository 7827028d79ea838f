#include "zest/estimate.hpp"

#include <string>

#include <fmt/core.h>

#include "engine/plan/layout.hpp"
#include "engine/plan/memory_plan.hpp"
#include "optim/block_quant_math.hpp"
#include "zest/error.hpp"

namespace zest {

MemoryEstimate estimate_memory(const Config& config, const std::vector<ParamSpec>& params, int ranks,
                               int ranks_per_node) {
  if (ranks < 1)
    throw Error(fmt::format("estimate_memory: ranks must be at least 1, got {}", ranks));
  // The engine partitions over the world from stage 1 on; stage 0 keeps everything on every rank.
  const engine::Layout layout(params, config.stage == 0 ? 1 : ranks);
  const engine::MemoryPlan plan =
      engine::plan_memory(config, layout, engine::SubGroups::sizes_only, ranks_per_node);
  MemoryEstimate e;
  e.ranks = ranks;
  e.numel = layout.numel();
  e.device = plan.device;
  e.device_total = plan.device_total;
  e.pinned = plan.pinned_total;
  // By purpose, as the engine's allocations are labelled (Device::allocate_pinned).
  const auto set = [&e](HostPurpose p, std::size_t bytes) { e.pinned_by[static_cast<std::size_t>(p)] = bytes; };
  const engine::OptimizerOffloadPlan& opt = plan.optimizer_offload;
  const engine::ParamOffloadPlan& par = plan.param_offload;
  set(HostPurpose::engine, plan.engine.pinned);
  set(HostPurpose::optimizer_states, opt.states_bytes + opt.spare_states_bytes);
  set(HostPurpose::optimizer_staging, opt.grad_staging_bytes + opt.staging_bytes + opt.updated_params_bytes);
  set(HostPurpose::optimizer_swap, opt.state_slots_bytes);
  set(HostPurpose::param_shards, par.shards_bytes);
  set(HostPurpose::param_swap, par.staging_bytes + par.updates_bytes);
  set(HostPurpose::grad_shards, plan.reduce.host_grads + plan.reduce.grad_landing);
  e.nvme = plan.nvme_total;
  return e;
}

WireEstimate estimate_wire_bytes(const Config& config, const std::vector<ParamSpec>& params, int ranks,
                                 int ranks_per_node) {
  if (ranks < 1)
    throw Error(fmt::format("estimate_wire_bytes: ranks must be at least 1, got {}", ranks));
  if (ranks_per_node < 1 || ranks_per_node > ranks || ranks % ranks_per_node != 0)
    throw Error(
        fmt::format("estimate_wire_bytes: {} ranks per node do not divide {} ranks; give a divisor of the rank count",
                    ranks_per_node, ranks));
  // Products of counts that a huge model, rank count or accumulation could take past 64 bits.
  const auto times = [](std::uint64_t a, std::uint64_t b) {
    std::uint64_t product = 0;
    if (__builtin_mul_overflow(a, b, &product))
      throw Error("estimate_wire_bytes: the bytes per step do not fit in 64 bits; give fewer parameters, ranks or "
                  "gradient_accumulation_steps");
    return product;
  };
  WireEstimate w;
  const auto n = static_cast<std::uint64_t>(ranks);
  const std::uint64_t element = dtype_size(config.precision.dtype);
  const auto micro_batches = static_cast<std::uint64_t>(config.gradient_accumulation_steps);
  const engine::Layout layout(params, config.stage == 0 ? 1 : ranks);
  const std::uint64_t psi = times(layout.numel(), element);
  // (n - 1) / n of it, without the product's overflow: q (n - 1) + r (n - 1) / n, psi = q n + r.
  w.zero_formula = times(config.stage == 3 ? 3 : 2, psi / n * (n - 1) + psi % n * (n - 1) / n);
  if (ranks == 1) return w;
  const auto inside = static_cast<std::uint64_t>(ranks_per_node - 1), across = n - 1 - inside;
  // Bytes to each other rank: every collective sends each peer the same (stage 0's all-reduce
  // blocks differ by at most an element; counted as even), but qgZ's reduction, whose two
  // all-to-alls send each peer on the host one piece per host and each other host one piece.
  std::uint64_t reduce = 0, gather = 0;
  std::uint64_t reduce_inside = 0, reduce_across = 0;  // comm.quantize.grads: to all such peers
  std::uint64_t host_gather = 0;  // partition.secondary: host: sent to each other rank of the host
  if (config.stage == 0) {
    reduce = times(micro_batches, 2 * times(layout.full_numel(), element) / n);
  } else {
    const engine::MemoryPlan plan =
        engine::plan_memory(config, layout, engine::SubGroups::sizes_only, ranks_per_node);
    const auto grad_bits = engine::quantized_grad_bits(config);
    const std::uint64_t hosts = n / static_cast<std::uint64_t>(ranks_per_node);
    for (int g = 0; g < layout.group_count(); ++g) {
      const std::size_t shard_elements = layout.group(g).shard;
      const std::uint64_t shard = shard_elements * element;
      if (grad_bits) {
        // Each group's shard as a piece of its own: a bucket's pieces share their last block, so
        // the count may be a little lower.
        const std::uint64_t codes = optim::quantized_bytes(*grad_bits, shard_elements);
        reduce_inside += times(times(codes, hosts), inside);
        reduce_across += times(codes, hosts - 1);
      } else {
        reduce += shard;
      }
      // Stage 3 gathers a group on use each micro-batch, forward and backward; the others once,
      // after the step. With a secondary partition all but the first run inside the host; with
      // quantized parameters the gathers over every rank send int8 codes.
      const bool gathered_on_use = config.stage == 3 && plan.params.resident[static_cast<std::size_t>(g)] == 0;
      const std::uint64_t on_use = config.comm.quantize.params != QuantizeParams::none
                                       ? optim::quantized_bytes(optim::QuantBits::int8, shard_elements)
                                       : shard;
      if (!gathered_on_use) {
        gather += shard;
      } else if (plan.params.secondary_ranks > 0) {
        gather += on_use;
        host_gather += times(2 * micro_batches - 1, layout.group(g).padded * element /
                                                        static_cast<std::uint64_t>(plan.params.secondary_ranks));
      } else {
        gather += times(2 * micro_batches, on_use);
      }
    }
    reduce = times(micro_batches, reduce);
    reduce_inside = times(micro_batches, reduce_inside);
    reduce_across = times(micro_batches, reduce_across);
  }
  w.reduce = times(reduce, n - 1) + reduce_inside + reduce_across;
  w.gather = times(gather, n - 1) + times(host_gather, inside);
  w.inside = times(reduce + gather, inside) + times(host_gather, inside) + reduce_inside;
  w.across = times(reduce + gather, across) + reduce_across;
  return w;
}

std::vector<ParamSpec> uniform_model(std::size_t params, int layers) {
  if (layers < 1)
    throw Error(fmt::format("uniform_model: layers must be at least 1, got {}", layers));
  const std::size_t count = static_cast<std::size_t>(layers);
  if (params < count)
    throw Error(fmt::format("uniform_model: {} parameters cannot fill {} layers; give at least one parameter per layer",
                            params, layers));
  std::vector<ParamSpec> specs;
  specs.reserve(count);
  for (std::size_t g = 0; g < count; ++g) {
    const std::size_t numel = params / count + (g < params % count ? 1 : 0);
    specs.push_back({std::string("layer").append(std::to_string(g)), {numel}, static_cast<int>(g)});
  }
  return specs;
}

}  // namespace zest
