// zest::torch::Optimizer: a torch::optim::Optimizer whose parameters, gradients and step are the
// Engine's. See zest/torch.hpp for the contract.
#include <torch/autograd.h>
#include <torch/csrc/autograd/function_hook.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <map>
#include <mutex>
#include <unordered_set>
#include <optional>
#include <string>

#include "base/trace.hpp"
#include "torch/cuda_tensors.hpp"
#include "torch/param_residency.hpp"
#include "torch/process_group.hpp"
#include "zest/error.hpp"
#include "zest/torch.hpp"

namespace zest::torch {
namespace {

DType zest_dtype(const ::torch::Tensor& param, const std::string& name) {
  switch (param.scalar_type()) {
    case ::torch::kFloat: return DType::f32;
    case ::torch::kBFloat16: return DType::bf16;
    case ::torch::kHalf: return DType::f16;
    default:
      throw Error("zest::torch::Optimizer: parameter '" + name + "' is " +
                  std::string(c10::toString(param.scalar_type())) +
                  "; zest trains float32, bfloat16 and float16 parameters");
  }
}

// An fnmatch pattern matching exactly `name`.
std::string exact_pattern(const std::string& name) {
  std::string pattern;
  for (char c : name) {
    if (c == '*' || c == '?' || c == '[' || c == '\\') pattern += '\\';
    pattern += c;
  }
  return pattern;
}

// The communication group of each tensor: consecutive tensors of one module ("blocks.0.attn.weight"
// and "blocks.0.attn.bias") form one layer.
std::vector<int> layer_groups(const std::vector<std::string>& names) {
  std::vector<int> groups;
  std::string previous;
  for (const std::string& name : names) {
    const auto dot = name.rfind('.');
    std::string owner = dot == std::string::npos ? std::string() : name.substr(0, dot);
    if (groups.empty() || owner != previous) groups.push_back(groups.empty() ? 0 : groups.back() + 1);
    else groups.push_back(groups.back());
    previous = std::move(owner);
  }
  return groups;
}

// Whether the bytes the two tensors can reach overlap.
bool share_memory(const ::torch::Tensor& a, const ::torch::Tensor& b) {
  if (!a.has_storage() || !b.has_storage() || a.storage().nbytes() == 0 || b.storage().nbytes() == 0) return false;
  if (!a.storage().is_alias_of(b.storage())) return false;
  const auto extent = [](const ::torch::Tensor& t) {
    std::int64_t last = 0;
    for (std::int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const std::int64_t begin = t.storage_offset() * static_cast<std::int64_t>(t.element_size());
    return std::pair{begin, begin + (last + 1) * static_cast<std::int64_t>(t.element_size())};
  };
  const auto [a_begin, a_end] = extent(a);
  const auto [b_begin, b_end] = extent(b);
  return a_begin < b_end && b_begin < a_end;
}

// A 63-bit FNV-1a hash of every parameter's bytes: equal on every rank iff (almost surely) the
// values are.
std::int64_t values_hash(const std::vector<::torch::Tensor>& tensors) {
  std::uint64_t hash = 1469598103934665603ull;
  for (const ::torch::Tensor& t : tensors) {
    const ::torch::Tensor bytes = t.detach().to(::torch::kCPU).contiguous();
    const auto* p = static_cast<const unsigned char*>(bytes.data_ptr());
    for (std::size_t i = 0; i < bytes.nbytes(); ++i) hash = (hash ^ p[i]) * 1099511628211ull;
  }
  return static_cast<std::int64_t>(hash >> 1);
}

OptimizerGroupOptions from_torch(const ::torch::optim::OptimizerOptions& options, std::size_t group) {
  const auto* adamw = dynamic_cast<const ::torch::optim::AdamWOptions*>(&options);
  if (!adamw)
    throw Error("zest::torch::Optimizer: param_groups()[" + std::to_string(group) +
                "] has options of another optimizer; give it torch::optim::AdamWOptions");
  if (adamw->amsgrad())
    throw Error("zest::torch::Optimizer: param_groups()[" + std::to_string(group) +
                "] asks for amsgrad, which zest's Adam does not do; set amsgrad(false)");
  return {adamw->lr(), std::get<0>(adamw->betas()), std::get<1>(adamw->betas()), adamw->eps(),
          adamw->weight_decay()};
}

::torch::optim::AdamWOptions to_torch(const OptimizerGroupOptions& o) {
  return ::torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay);
}

bool same(const OptimizerGroupOptions& a, const OptimizerGroupOptions& b) {
  return a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps && a.weight_decay == b.weight_decay;
}

}  // namespace

struct Optimizer::Impl {
  std::unique_ptr<Runtime> owned_runtime;
  Runtime* runtime = nullptr;
  std::unique_ptr<Engine> engine;
  std::vector<::torch::Tensor> tensors;           // engine order
  std::vector<std::vector<std::size_t>> members;  // tensors of each communication group
  // This contribution (micro-batch) of each group: which tensors were handed over, how many wait.
  std::vector<char> handed;
  std::vector<std::size_t> waiting;
  // Which tensors got a gradient since the last step, in any micro-batch.
  std::vector<char> got_grad;
  // What .grad holds once the gradient is handed over: the tensor's shape, no bytes, and a message
  // naming where the gradient went, raised by any read (clip_grad_norm_, p.grad().norm()).
  std::vector<::torch::Tensor> grad_placeholders;
  std::vector<std::shared_ptr<::torch::autograd::Node>> accumulators;  // autograd holds them weakly
  std::vector<std::pair<std::string, ::torch::Tensor>> aliases;  // a tied tensor's later names
  // Backward passes (contributions) of each group since the last step: gradient_accumulation_steps.
  std::vector<int> passes;
  int accumulation_steps = 1;
  std::vector<int> zest_group;                    // torch param group -> engine optimizer group
  std::unique_ptr<detail::TorchComputeStream> compute;  // cuda: torch's current stream, the engine's compute stream
  std::unique_ptr<detail::ParamResidency> residency;  // stage 3
  StepResult last;
  std::size_t peak_grad_bytes = 0;
  double grad_scale = 1.0;  // set_grad_scale: e.g. 1 / world size for DDP's mean
  // The hooks' way back to this optimizer: gone with it, so a backward after that leaves the
  // gradients in .grad as plain torch does.
  std::shared_ptr<Impl*> link = std::make_shared<Impl*>(this);
  bool claimed = false;  // `tensors` are this optimizer's in the registry below
  Optimizer* owner = nullptr;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl();
  void hand_over(std::size_t tensor);
  void clear_placeholder(std::size_t tensor);
  void group_ready(int group);
  void finish_backward();
  void apply_group_options();
  void give_parameters_back() noexcept;

  // The constructor's steps, in order.
  // The trained tensors (frozen ones stay torch's) into `tensors`, in the module's order, each
  // checked; returns their names.
  std::vector<std::string> take_parameters(const NamedParameters& params, DType dtype);
  // The runtime the engine runs on: `given`, or one of its own over `world` (or MPI's). The
  // engine's config follows the parameters' device.
  void start_runtime(Config& engine_config, Runtime* given, std::shared_ptr<World> world, const std::string& first);
  // The engine over the tensors (layer groups `layer`), holding their values; the tensors alias its
  // parameters (stages 0-2) or are released until gathered (stage 3).
  void build_engine(const Config& engine_config, const std::vector<std::string>& names, const std::vector<int>& layer);
  // Each tensor's gradient goes to the engine as autograd makes it; .grad holds a placeholder.
  void take_gradients(const std::vector<std::string>& names, const std::vector<int>& layer, int accumulation);
};

namespace {

// Runs before autograd accumulates a parameter's gradient: takes the placeholder out of .grad, so
// that autograd stores the new gradient instead of adding to a tensor that holds nothing.
class ClearPlaceholderHook : public ::torch::autograd::FunctionPreHook {
 public:
  ClearPlaceholderHook(std::weak_ptr<Optimizer::Impl*> impl, std::size_t tensor)
      : impl_(std::move(impl)), tensor_(tensor) {}
  ::torch::autograd::variable_list operator()(const ::torch::autograd::variable_list& grads) override {
    if (const auto impl = impl_.lock()) (*impl)->clear_placeholder(tensor_);
    return grads;
  }

 private:
  std::weak_ptr<Optimizer::Impl*> impl_;
  std::size_t tensor_;
};

// Runs after autograd accumulated a parameter's gradient into .grad: moves it to zest's bucket.
class HandOverHook : public ::torch::autograd::FunctionPostHook {
 public:
  HandOverHook(std::weak_ptr<Optimizer::Impl*> impl, std::size_t tensor) : impl_(std::move(impl)), tensor_(tensor) {}
  ::torch::autograd::variable_list operator()(const ::torch::autograd::variable_list& outputs,
                                              const ::torch::autograd::variable_list& /*inputs*/) override {
    if (const auto impl = impl_.lock()) (*impl)->hand_over(tensor_);
    return outputs;
  }

 private:
  std::weak_ptr<Optimizer::Impl*> impl_;
  std::size_t tensor_;
};

// The parameters some zest optimizer trains: a second one over the same tensors would hand each
// gradient over twice.
std::mutex claimed_mutex;
std::unordered_set<const void*>& claimed_tensors() {
  static std::unordered_set<const void*> set;
  return set;
}

void claim(const std::vector<::torch::Tensor>& tensors, const std::vector<std::string>& names) {
  std::lock_guard lock(claimed_mutex);
  for (std::size_t t = 0; t < tensors.size(); ++t)
    if (claimed_tensors().count(tensors[t].unsafeGetTensorImpl()))
      throw Error("zest::torch::Optimizer: parameter '" + names[t] +
                  "' is already trained by another zest::torch::Optimizer; build one optimizer per set of parameters");
  for (const ::torch::Tensor& t : tensors) claimed_tensors().insert(t.unsafeGetTensorImpl());
}

void unclaim(const std::vector<::torch::Tensor>& tensors) {
  std::lock_guard lock(claimed_mutex);
  for (const ::torch::Tensor& t : tensors) claimed_tensors().erase(t.unsafeGetTensorImpl());
}

}  // namespace

Optimizer::Impl::~Impl() {
  link.reset();
  give_parameters_back();
  if (claimed) unclaim(tensors);
}

// When the optimizer goes, the module keeps working: .grad holds no placeholder, and each parameter
// gets storage of its own with its current values (stages 0-2 copy zest's device parameters; stage 3 gathers them,
// collectively, unless an exception is unwinding, when a collective could wait for ranks that went on: the parameters
// then stay released, and using one raises torch's error for a storage of size 0).
void Optimizer::Impl::give_parameters_back() noexcept {
  if (!engine) return;
  try {
    for (std::size_t t = 0; t < tensors.size(); ++t) clear_placeholder(t);
    ::torch::NoGradGuard no_grad;
    if (residency) {
      residency->drop_all();
      if (std::uncaught_exceptions() > 0) return;
      for (std::size_t t = 0; t < tensors.size(); ++t) {
        ::torch::Tensor values = ::torch::empty(tensors[t].sizes(), ::torch::kFloat);
        engine->get_param(t, {values.data_ptr<float>(), static_cast<std::size_t>(values.numel())});
        tensors[t].set_data(values.to(tensors[t].device(), tensors[t].scalar_type()));
      }
    } else {
      for (::torch::Tensor& tensor : tensors) tensor.set_data(tensor.detach().clone());
    }
  } catch (...) {
  }
}

void Optimizer::Impl::hand_over(std::size_t t) {
  ::torch::Tensor& param = tensors[t];
  const ::torch::Tensor grad = param.grad();
  if (!grad.defined()) return;
  if (grad.layout() != ::torch::kStrided)
    throw Error("zest::torch::Optimizer: parameter '" + engine->spec(t).name + "' got a " +
                std::string(grad.is_sparse() ? "sparse" : "non-strided") +
                " gradient (nn.Embedding(sparse=True)?); zest reduces dense gradients: build the module with "
                "sparse=False");
  const trace::Span span("gradient hand-off", trace::Lane::backward, static_cast<std::int64_t>(t));
  peak_grad_bytes = std::max(peak_grad_bytes, grad.nbytes());
  const TensorView view = engine->grad(t);
  ::torch::NoGradGuard no_grad;
  ::torch::Tensor slot = ::torch::from_blob(view.data, param.sizes(), param.options().requires_grad(false));
  // A second gradient in one contribution (a tensor used twice, e.g. tied weights) adds up.
  if (handed[t]) slot.add_(grad, grad_scale);
  else slot.copy_(grad);
  if (!handed[t] && grad_scale != 1.0) slot.mul_(grad_scale);
  param.mutable_grad() = grad_placeholders[t];
  got_grad[t] = 1;
  const int group = engine->spec(t).group;
  if (!handed[t]) {
    handed[t] = 1;
    if (--waiting[static_cast<std::size_t>(group)] == 0) group_ready(group);
  }
}

void Optimizer::Impl::clear_placeholder(std::size_t t) {
  ::torch::Tensor& grad = tensors[t].mutable_grad();
  if (grad.defined() && grad.unsafeGetTensorImpl() == grad_placeholders[t].unsafeGetTensorImpl()) grad.reset();
}

void Optimizer::Impl::group_ready(int group) {
  // On cuda the copies into the bucket were queued on this thread's current stream (autograd's
  // device thread in backward): the reduction waits for them there.
  compute->follow();
  engine->grads_ready(group);
  ++passes[static_cast<std::size_t>(group)];
  const auto& tensors_of = members[static_cast<std::size_t>(group)];
  for (std::size_t t : tensors_of) handed[t] = 0;
  waiting[static_cast<std::size_t>(group)] = tensors_of.size();
  if (residency) residency->drop_backward(group);
}

// Before a step: a group some of whose tensors got no gradient in this contribution (micro-batch)
// gets zeros for them, as torch's accumulation in .grad adds nothing for them. A tensor that got no
// gradient in the whole step is refused: torch's AdamW leaves such a parameter alone, but zest
// updates every shard whole (momentum and weight decay would move it), so it says so here instead.
void Optimizer::Impl::finish_backward() {
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    if (got_grad[t]) continue;
    throw Error("zest::torch::Optimizer::step: parameter '" + engine->spec(t).name +
                "' got no gradient since the last step. torch.optim.AdamW would leave it unchanged; zest "
                "updates every trained parameter at every step (momentum and weight decay would still move "
                "it), so it refuses instead. Freeze it for the whole run (requires_grad false before "
                "building the optimizer), or make it take part in the loss (adding 0 * p.sum() gives it a "
                "zero gradient and zest's update)");
  }
  for (std::size_t g = 0; g < members.size(); ++g) {
    if (waiting[g] == members[g].size()) continue;
    for (std::size_t t : members[g]) {
      if (handed[t]) continue;
      const TensorView view = engine->grad(t);
      ::torch::from_blob(view.data, tensors[t].sizes(), tensors[t].options().requires_grad(false)).zero_();
    }
    group_ready(static_cast<int>(g));
  }
  std::fill(got_grad.begin(), got_grad.end(), 0);
  // torch's optimizers take whatever .grad accumulated; zest's updates ahead (offload update_ahead) and
  // its reading of gradient_accumulation_steps count backward passes, so a mismatch is refused.
  const int made = *std::max_element(passes.begin(), passes.end());
  std::fill(passes.begin(), passes.end(), 0);
  if (const int expected = accumulation_steps; made != expected)
    throw Error("zest::torch::Optimizer::step: " + std::to_string(made) + " backward pass(es) since the last step, "
                "but gradient_accumulation_steps is " + std::to_string(expected) + ": call backward " +
                std::to_string(expected) + " time(s) per step() (each loss divided by " + std::to_string(expected) +
                "), or set gradient_accumulation_steps to the number of micro-batches");
}

std::vector<std::string> Optimizer::Impl::take_parameters(const NamedParameters& params, DType dtype) {
  // A tensor listed twice (tied weights: libtorch's named_parameters() lists a shared module's
  // tensors under each name) is one parameter with one update, as in torch, under its first name;
  // two tensors sharing memory cannot be two parameters of zest's (each gets memory of its own),
  // so they are refused.
  std::vector<std::string> names;
  std::unordered_set<const void*> listed;
  for (const auto& item : params) {
    if (!item.value().requires_grad()) continue;
    if (!listed.insert(item.value().unsafeGetTensorImpl()).second) {
      aliases.emplace_back(item.key(), item.value());  // tied: full_parameters() gives this name too
      continue;
    }
    if (!item.value().is_leaf())
      throw Error("zest::torch::Optimizer: parameter '" + item.key() + "' is not a leaf tensor (it was computed from "
                  "others, so autograd gives it no gradient of its own); give the module's parameters");
    for (std::size_t t = 0; t < tensors.size(); ++t)
      if (share_memory(tensors[t], item.value()))
        throw Error("zest::torch::Optimizer: parameters '" + names[t] + "' and '" + item.key() +
                    "' are different tensors over the same memory (views of one another); zest gives each "
                    "parameter memory of its own, which would untie them. Register one tensor and use it in "
                    "both places (tied weights), or make them separate tensors");
    const DType given = zest_dtype(item.value(), item.key());
    if (given != dtype)
      throw Error("zest::torch::Optimizer: parameter '" + item.key() + "' is " + std::string(dtype_name(given)) +
                  " but precision.dtype is " + std::string(dtype_name(dtype)) +
                  ": convert the module (module->to(...)) before building the optimizer, or change precision.dtype");
    if (!item.value().is_cpu() && !item.value().is_cuda())
      throw Error("zest::torch::Optimizer: parameter '" + item.key() + "' is on " + item.value().device().str() +
                  "; zest trains cpu and cuda tensors: move the module to one of them before building the optimizer");
    if (!tensors.empty() && item.value().device() != tensors.front().device())
      throw Error("zest::torch::Optimizer: parameter '" + names.front() + "' is on " + tensors.front().device().str() +
                  " but '" + item.key() + "' is on " + item.value().device().str() +
                  "; zest trains one device per rank: move the whole module to one device (one GPU per rank)");
    names.push_back(item.key());
    tensors.push_back(item.value());
  }
  if (tensors.empty()) throw Error("zest::torch::Optimizer: no parameter requires a gradient; nothing to train");
  return names;
}

void Optimizer::Impl::start_runtime(Config& engine_config, Runtime* given, std::shared_ptr<World> world,
                                    const std::string& first) {
  // The engine runs where the parameters are: the config's device.type follows them.
  const ::torch::Device where = tensors.front().device();
  // A config written for the cpu budgets host memory (device.memory, 2 GiB by default); on a GPU
  // that cap would be arbitrary, so the whole GPU is the budget unless the config names cuda itself.
  if (where.is_cuda() && engine_config.device.type != DeviceType::cuda) engine_config.device.memory = 0;
  engine_config.device.type = where.is_cuda() ? DeviceType::cuda : DeviceType::cpu;
  if (where.is_cuda() && !detail::cuda_tensors_unavailable().empty())
    throw Error("zest::torch::Optimizer: parameter '" + first + "' is on " + where.str() + ", but " +
                detail::cuda_tensors_unavailable());
  if (given) {
    const Device& device = given->device();
    const bool same =
        where.is_cuda() ? detail::cuda_ordinal(device) == where.index() : device.type() == DeviceType::cpu;
    if (!same)
      throw Error(
          "zest::torch::Optimizer: the parameters are on " + where.str() + " but the Runtime given runs on " +
          device.name() + "; build the Runtime with device.type " + (where.is_cuda() ? "cuda" : "cpu") +
          (where.is_cuda() ? " and RuntimeOptions::cuda_ordinal " + std::to_string(where.index()) : std::string()) +
          ", or let the optimizer make its own");
    runtime = given;
    return;
  }
  RuntimeOptions options;
  if (world) {
    if (engine_config.comm.backend == CommBackend::mpi)
      throw Error("zest::torch::Optimizer: a torch.distributed process group was given, but the config's "
                  "comm.backend is mpi; set comm.backend auto (or nccl on a GPU) to use the group, or give no group "
                  "to use MPI");
    options.world = std::move(world);
  }
  if (where.is_cuda()) {
    options.cuda_ordinal = where.index();
    options.device_memory = detail::torch_cuda_memory(where.index());
  }
  owned_runtime = std::make_unique<Runtime>(engine_config, std::move(options));
  runtime = owned_runtime.get();
}

void Optimizer::Impl::build_engine(const Config& engine_config, const std::vector<std::string>& names,
                                   const std::vector<int>& layer) {
  std::vector<ParamSpec> specs;
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const auto sizes = tensors[t].sizes();
    specs.push_back({names[t], std::vector<std::size_t>(sizes.begin(), sizes.end()), layer[t]});
  }
  engine = std::make_unique<Engine>(engine_config, runtime->device(), runtime->comm(), std::move(specs));
  compute = std::make_unique<detail::TorchComputeStream>(*engine, runtime->device());
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const ::torch::Tensor values = tensors[t].detach().to(::torch::kCPU, ::torch::kFloat).contiguous();
    engine->set_param(t, {values.data_ptr<float>(), static_cast<std::size_t>(values.numel())});
  }
  if (engine_config.stage == 3) {
    residency = std::make_unique<detail::ParamResidency>(*engine, *compute, tensors, layer);
    return;
  }
  ::torch::NoGradGuard no_grad;
  for (int g = 0; g < engine->group_count(); ++g) {
    const Engine::GroupLease lease = engine->acquire(g);
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      if (layer[t] != g) continue;
      const TensorView view = lease.param(t);
      tensors[t].set_data(::torch::from_blob(view.data, tensors[t].sizes(), tensors[t].options().requires_grad(false)));
    }
  }
}

void Optimizer::Impl::take_gradients(const std::vector<std::string>& names, const std::vector<int>& layer,
                                     int accumulation) {
  members.resize(static_cast<std::size_t>(engine->group_count()));
  for (std::size_t t = 0; t < tensors.size(); ++t) members[static_cast<std::size_t>(layer[t])].push_back(t);
  handed.assign(tensors.size(), 0);
  passes.assign(members.size(), 0);
  accumulation_steps = accumulation;
  got_grad.assign(tensors.size(), 0);
  for (const auto& tensors_of : members) waiting.push_back(tensors_of.size());
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    grad_placeholders.push_back(detail::storage_that_raises(
        tensors[t], "zest: the gradient of parameter '" + names[t] +
                        "' is not in .grad: zest's optimizer took it into its reduce buckets as backward made "
                        "it (one copy, reduced while backward goes on), so .grad holds nothing to read or "
                        "zero. To clip, set gradient_clipping in zest's config (the step's norm: last_step "
                        "grad_norm); to clear gradients, nothing is needed (zero_grad() with set_to_none, "
                        "torch's default, also works; zero_grad(set_to_none=False) does not); to read one, "
                        "train this parameter with a torch optimizer"));
    tensors[t].mutable_grad().reset();
    auto accumulator = ::torch::autograd::impl::grad_accumulator(tensors[t]);
    accumulator->add_pre_hook(std::make_unique<ClearPlaceholderHook>(link, t));
    accumulator->add_post_hook(std::make_unique<HandOverHook>(link, t));
    accumulators.push_back(std::move(accumulator));
  }
}

namespace {

// torch's param groups as the engine's optimizer groups: one per torch group, matching exactly
// its tensors' names, with its options. Every trained tensor must be in exactly one.
std::vector<OptimizerParamGroup> groups_from_torch(const std::vector<::torch::optim::OptimizerParamGroup>& groups,
                                                   const std::vector<::torch::Tensor>& tensors,
                                                   const std::vector<std::string>& names) {
  std::map<const void*, std::string> name_of;
  for (std::size_t t = 0; t < tensors.size(); ++t) name_of[tensors[t].unsafeGetTensorImpl()] = names[t];
  std::map<const void*, std::size_t> group_of_tensor;
  std::vector<OptimizerParamGroup> zest_groups;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    OptimizerParamGroup zest_group;
    for (const ::torch::Tensor& tensor : groups[g].params()) {
      const auto found = name_of.find(tensor.unsafeGetTensorImpl());
      if (found == name_of.end())
        throw Error(
            "zest::torch::Optimizer: param group " + std::to_string(g) +
            " holds a tensor that is not among the trained named parameters given (or does not require a gradient)");
      if (!group_of_tensor.emplace(found->first, g).second)
        throw Error("zest::torch::Optimizer: parameter '" + found->second + "' is in more than one param group");
      zest_group.match.push_back(exact_pattern(found->second));
    }
    if (groups[g].has_options()) {
      const OptimizerGroupOptions o = from_torch(groups[g].options(), g);
      zest_group.lr = o.lr;
      zest_group.beta1 = o.beta1;
      zest_group.beta2 = o.beta2;
      zest_group.eps = o.eps;
      zest_group.weight_decay = o.weight_decay;
    }
    zest_groups.push_back(std::move(zest_group));
  }
  for (std::size_t t = 0; t < tensors.size(); ++t)
    if (!group_of_tensor.count(tensors[t].unsafeGetTensorImpl()))
      throw Error("zest::torch::Optimizer: parameter '" + names[t] +
                  "' is in no param group; put every trained parameter in one");
  return zest_groups;
}

// The same values on every rank, or the shards would mix models.
void require_same_values(Communicator& comm, const std::vector<::torch::Tensor>& tensors) {
  std::int64_t hashes[2] = {values_hash(tensors), 0};
  hashes[1] = -hashes[0];
  comm.all_reduce_host(hashes, ReduceOp::max);
  if (hashes[0] != -hashes[1])
    throw Error("zest::torch::Optimizer: the parameters differ across ranks; initialise the model the same way on "
                "every rank (torch::manual_seed before building it) or load the same weights on each");
}

}  // namespace

std::shared_ptr<World> process_group_world(ProcessGroup group, std::chrono::milliseconds timeout,
                                           GroupMaker make_group) {
  return detail::make_process_group_world(std::move(group), timeout, std::move(make_group));
}

Optimizer::Optimizer(const NamedParameters& params, const Config& config, Runtime* runtime)
    : Optimizer(params, {}, config, runtime, {}) {}

Optimizer::Optimizer(const NamedParameters& params, std::vector<::torch::optim::OptimizerParamGroup> groups,
                     const Config& config, Runtime* runtime)
    : Optimizer(params, std::move(groups), config, runtime, {}) {}

Optimizer::Optimizer(const NamedParameters& params, const Config& config, std::shared_ptr<World> world)
    : Optimizer(params, {}, config, nullptr, std::move(world)) {}

Optimizer::Optimizer(const NamedParameters& params, std::vector<::torch::optim::OptimizerParamGroup> groups,
                     const Config& config, std::shared_ptr<World> world)
    : Optimizer(params, std::move(groups), config, nullptr, std::move(world)) {}

Optimizer::Optimizer(const NamedParameters& params, std::vector<::torch::optim::OptimizerParamGroup> groups,
                     const Config& config, Runtime* runtime, std::shared_ptr<World> world)
    : ::torch::optim::Optimizer(std::vector<::torch::optim::OptimizerParamGroup>{},
                                std::make_unique<::torch::optim::AdamWOptions>(config.optimizer.lr)),
      impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.owner = this;
  validate(config);
  const std::vector<std::string> names = s.take_parameters(params, config.precision.dtype);
  Config engine_config = config;
  s.start_runtime(engine_config, runtime, std::move(world), names.front());
  claim(s.tensors, names);
  s.claimed = true;
  // Optimizer groups: the config's, or one per torch group matching exactly its tensors' names.
  const bool torch_groups = !groups.empty();
  if (torch_groups) engine_config.optimizer.param_groups = groups_from_torch(groups, s.tensors, names);
  require_same_values(s.runtime->comm(), s.tensors);
  const std::vector<int> layer = layer_groups(names);
  s.build_engine(engine_config, names, layer);
  s.take_gradients(names, layer, config.gradient_accumulation_steps);

  // torch's param groups mirror the engine's optimizer groups (group 0, the unmatched, is empty
  // and left out when the groups are torch's).
  const Engine& engine = *s.engine;
  for (int g = torch_groups ? 1 : 0; g < engine.optimizer_group_count(); ++g) {
    std::vector<::torch::Tensor> of_group;
    for (std::size_t t = 0; t < s.tensors.size(); ++t)
      if (engine.optimizer_group_of(t) == g) of_group.push_back(s.tensors[t]);
    add_param_group(::torch::optim::OptimizerParamGroup(
        of_group, std::make_unique<::torch::optim::AdamWOptions>(to_torch(engine.optimizer_group(g)))));
    s.zest_group.push_back(g);
  }
}

Optimizer::~Optimizer() = default;

::torch::Tensor Optimizer::step(LossClosure closure) {
  Impl& s = *impl_;
  ::torch::Tensor loss;
  if (closure) loss = closure();
  s.finish_backward();
  if (s.residency) s.residency->drop_all();
  s.apply_group_options();
  s.compute->follow();
  s.last = s.engine->step();
  return loss;
}

// The param groups' hyper-parameters as torch code left them (a scheduler, a warm-up) become the
// engine's: before each step, and before a save, so a checkpoint holds them as they are then.
void Optimizer::Impl::apply_group_options() {
  for (std::size_t i = 0; i < owner->param_groups().size() && i < zest_group.size(); ++i) {
    const OptimizerGroupOptions wanted = from_torch(owner->param_groups()[i].options(), i);
    if (!same(wanted, engine->optimizer_group(zest_group[i]))) engine->set_optimizer_group(zest_group[i], wanted);
  }
}

const StepResult& Optimizer::last_step() const { return impl_->last; }

double Optimizer::loss_scale() const { return impl_->engine->loss_scale(); }

void Optimizer::set_grad_scale(double scale) {
  if (!std::isfinite(scale) || scale <= 0)
    throw Error("zest::torch::Optimizer::set_grad_scale: " + std::to_string(scale) +
                " is not a finite number > 0; give e.g. 1.0 (sum over ranks) or 1.0 / world size (their mean)");
  impl_->grad_scale = scale;
}

double Optimizer::grad_scale() const { return impl_->grad_scale; }

void Optimizer::save(const std::string& dir) {
  if (impl_->residency) impl_->residency->drop_all();
  impl_->apply_group_options();
  impl_->compute->follow();
  impl_->engine->save(dir);
}

LoadResult Optimizer::load(const std::string& dir, ::torch::optim::LRScheduler* scheduler) {
  Impl& s = *impl_;
  if (s.residency) s.residency->drop_all();
  s.compute->follow();
  LoadResult result = s.engine->load(dir);
  // The scheduler's own position is its count of step() calls, which only step() changes: it is
  // stepped to the checkpoint's step count, and the learning rates it set on the way are then
  // replaced by the checkpoint's.
  if (scheduler) {
    // torch counts a scheduler's steps in an unsigned int; a checkpoint past what an int holds is
    // refused rather than stepped for minutes.
    if (result.steps > std::numeric_limits<int>::max())
      throw Error(
          "zest::torch::Optimizer::load: the checkpoint's step count " + std::to_string(result.steps) +
          " is more than a torch scheduler can count to; load without the scheduler and set its rates yourself");
    for (std::int64_t i = 0; i < result.steps; ++i) scheduler->step();
  }
  for (std::size_t i = 0; i < s.zest_group.size(); ++i)
    param_groups_[i].set_options(
        std::make_unique<::torch::optim::AdamWOptions>(to_torch(s.engine->optimizer_group(s.zest_group[i]))));
  return result;
}

void Optimizer::save(::torch::serialize::OutputArchive& /*archive*/) const {
  throw Error(
      "zest::torch::Optimizer: a torch archive cannot hold a sharded optimizer; use save(dir), a zest checkpoint");
}

void Optimizer::load(::torch::serialize::InputArchive& /*archive*/) {
  throw Error(
      "zest::torch::Optimizer: a torch archive cannot hold a sharded optimizer; use load(dir), a zest checkpoint");
}

NamedParameters Optimizer::full_parameters() {
  Impl& s = *impl_;
  NamedParameters full;
  for (std::size_t t = 0; t < s.tensors.size(); ++t) {
    ::torch::Tensor values = ::torch::empty(s.tensors[t].sizes(), ::torch::kFloat);
    s.engine->get_param(t, {values.data_ptr<float>(), static_cast<std::size_t>(values.numel())});
    full.insert(s.engine->spec(t).name, values.to(s.tensors[t].scalar_type()));
  }
  // Every name the module's state dict has: a tied tensor's later names share its values.
  for (const auto& [name, tensor] : s.aliases)
    for (std::size_t t = 0; t < s.tensors.size(); ++t)
      if (s.tensors[t].unsafeGetTensorImpl() == tensor.unsafeGetTensorImpl())
        full.insert(name, full[s.engine->spec(t).name]);
  return full;
}

Engine& Optimizer::engine() { return *impl_->engine; }
Runtime& Optimizer::runtime() { return *impl_->runtime; }

std::size_t Optimizer::torch_param_bytes() const {
  std::size_t bytes = 0;
  for (const ::torch::Tensor& t : impl_->tensors) {
    if (detail::bytes_held(t) == 0) continue;  // released (stage 3)
    const c10::DataPtr& data = t.storage().data_ptr();
    // Aliased or released storages hold a non-owning pointer (no context to free).
    if (data.get_context() != nullptr) bytes += t.storage().nbytes();
  }
  return bytes;
}

std::size_t Optimizer::peak_transient_grad_bytes() const { return impl_->peak_grad_bytes; }

}  // namespace zest::torch
