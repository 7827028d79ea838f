// zest._C: the Python package's view of the libtorch adapter (zest::torch::Optimizer and the
// stage-3 holds). The Python parts (torch.optim.Optimizer, module hooks, schedulers) are in
// python/zest/torch.py; this file only converts.
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "zest/config.hpp"
#include "zest/error.hpp"
#include "zest/runtime.hpp"
#include "zest/torch.hpp"
#include "zest/trace.hpp"

namespace py = pybind11;

namespace {

// MPI is initialized once per process and may not be initialized again after MPI_Finalize, while
// Python programs build and drop optimizers freely: this Runtime keeps MPI up from the first
// optimizer until finalize() (the package calls it at exit), and each optimizer's own Runtime
// finds MPI initialized and leaves it be.
std::unique_ptr<zest::Runtime>& mpi_keeper() {
  static std::unique_ptr<zest::Runtime> keeper;
  return keeper;
}

zest::Runtime& keep_mpi() {
  if (!mpi_keeper()) mpi_keeper() = std::make_unique<zest::Runtime>(zest::Config{});
  return *mpi_keeper();
}

// An optimizer Python can close before the interpreter goes away (closing is collective at stage
// 3: the parameters are gathered back), after which every call says so.
class PyOptimizer {
 public:
  // `trace`: a new file for the step's trace (empty: none), recorded from here to close().
  // `group`: the name of the torch.distributed process group whose ranks zest takes (its
  // group_name; empty: MPI's ranks, or a world of one); `new_group(ranks)` makes zest's own groups
  // over its ranks (dist.new_group: every rank calls it for every group) and returns the name of
  // this rank's (empty where it is not a member).
  PyOptimizer(const std::vector<std::pair<std::string, at::Tensor>>& named, const zest::Config& config,
              const std::string& trace, const std::string& group, py::object new_group) {
    zest::torch::NamedParameters params;
    for (const auto& [name, tensor] : named) params.insert(name, tensor);
    if (group.empty()) {
      keep_mpi();
      opt_ = std::make_unique<zest::torch::Optimizer>(params, config);
    } else {
      // dist.new_group's groups, not the C++ default (splitGroup): gloo's splits of one parent in
      // torch 2.11 hang after a few are made, and bind to the address the hostname resolves to,
      // where new_group's honour GLOO_SOCKET_IFNAME.
      zest::torch::GroupMaker make_group = [new_group](const std::vector<int>& ranks) -> zest::torch::ProcessGroup {
        py::gil_scoped_acquire gil;
        const auto name = new_group(ranks).cast<std::string>();
        return name.empty() ? zest::torch::ProcessGroup() : c10d::resolve_process_group(name);
      };
      opt_ = std::make_unique<zest::torch::Optimizer>(
          params, config,
          zest::torch::process_group_world(c10d::resolve_process_group(group), config.comm.timeout,
                                           std::move(make_group)));
    }
    if (!trace.empty()) trace_.emplace(trace, opt_->runtime().comm(), "zest.torch.Optimizer(trace=...)");
  }

  zest::torch::Optimizer& get() {
    if (!opt_) throw zest::Error("zest.torch.Optimizer: this optimizer was closed; build a new one");
    return *opt_;
  }
  // Writes the trace (collective), then ends the optimizer even if that failed.
  void close() {
    try {
      if (trace_) trace_->write();
    } catch (...) {
      trace_.reset();
      opt_.reset();
      throw;
    }
    trace_.reset();
    opt_.reset();
  }

 private:
  std::unique_ptr<zest::torch::Optimizer> opt_;
  std::optional<zest::TraceFile> trace_;  // over opt_'s communicator: goes first
};

torch::optim::AdamWOptions& adamw(zest::torch::Optimizer& opt, std::size_t group) {
  if (group >= opt.param_groups().size())
    throw zest::Error("zest.torch.Optimizer: param group " + std::to_string(group) + " does not exist");
  return static_cast<torch::optim::AdamWOptions&>(opt.param_groups()[group].options());
}

using Options = std::tuple<double, double, double, double, double>;  // lr, beta1, beta2, eps, weight decay

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "zest's libtorch adapter for the Python package (use zest.torch)";
  // zest.Error (a RuntimeError) for every zest::Error; translators are tried last registered
  // first, so the subclass goes second.
  const auto& error = py::register_exception<zest::Error>(m, "Error", PyExc_RuntimeError);
  py::register_exception<zest::ConfigError>(m, "ConfigError", error.ptr());
  // Out of device memory is both zest's error (it names zest's budget and categories) and torch's
  // (torch.cuda.OutOfMemoryError), so code written for torch's catches it as it would torch's own.
  static PyObject* out_of_memory = nullptr;
  const py::tuple bases = py::make_tuple(error, py::module_::import("torch").attr("OutOfMemoryError"));
  out_of_memory = PyErr_NewException("zest._C.OutOfMemoryError", bases.ptr(), nullptr);
  if (out_of_memory == nullptr) throw py::error_already_set();
  m.attr("OutOfMemoryError") = py::handle(out_of_memory);
  py::register_exception_translator([](std::exception_ptr raised) {
    try {
      if (raised) std::rethrow_exception(raised);
    } catch (const zest::OutOfDeviceMemory& e) {
      PyErr_SetString(out_of_memory, e.what());
    }
  });

  py::class_<zest::Config>(m, "Config")
      .def_readonly("stage", &zest::Config::stage)
      .def_readonly("gradient_accumulation_steps", &zest::Config::gradient_accumulation_steps)
      .def_readonly("gradient_clipping", &zest::Config::gradient_clipping)
      .def_readonly("source", &zest::Config::source)
      .def_property_readonly("comm_backend_mpi",
                             [](const zest::Config& c) { return c.comm.backend == zest::CommBackend::mpi; })
      .def("to_yaml", [](const zest::Config& c) { return zest::to_yaml(c); });
  m.def("load_config", [](const std::string& path) { return zest::load_config(path); }, py::arg("path"));
  m.def("parse_config", [](const std::string& text, const std::string& source) {
    return zest::parse_config(text, source);
  }, py::arg("text"), py::arg("source"));

  m.def("world", [] {
    zest::Runtime& runtime = keep_mpi();
    return std::make_pair(runtime.rank(), runtime.world_size());
  }, "(rank, world size) of this process; initializes MPI");
  m.def("finalize", [] { mpi_keeper().reset(); }, "Finalizes MPI if zest initialized it (at exit)");

  m.def("hold_for_forward", &zest::torch::hold_for_forward, py::arg("params"));
  m.def("drop_after_forward", &zest::torch::drop_after_forward, py::arg("params"));
  m.def("hold_for_backward", &zest::torch::hold_for_backward, py::arg("params"));

  py::class_<PyOptimizer>(m, "Optimizer")
      .def(py::init<const std::vector<std::pair<std::string, at::Tensor>>&, const zest::Config&, const std::string&,
                    const std::string&, py::object>(),
           py::arg("named_parameters"), py::arg("config"), py::arg("trace") = "", py::arg("group") = "",
           py::arg("new_group") = py::none())
      .def("close", &PyOptimizer::close)
      .def("group_count", [](PyOptimizer& o) { return o.get().param_groups().size(); })
      .def("group_params", [](PyOptimizer& o, std::size_t g) {
        adamw(o.get(), g);
        return o.get().param_groups()[g].params();
      })
      .def("group_options", [](PyOptimizer& o, std::size_t g) {
        const auto& a = adamw(o.get(), g);
        return Options{a.lr(), std::get<0>(a.betas()), std::get<1>(a.betas()), a.eps(), a.weight_decay()};
      })
      .def("set_group_options", [](PyOptimizer& o, std::size_t g, const Options& v) {
        auto& a = adamw(o.get(), g);
        a.lr(std::get<0>(v)).betas({std::get<1>(v), std::get<2>(v)}).eps(std::get<3>(v)).weight_decay(std::get<4>(v));
      })
      // The step, save and load run no Python: other Python threads (data loading) go on meanwhile.
      .def("step", [](PyOptimizer& o) {
        o.get().step();
        const zest::StepResult& r = o.get().last_step();
        return std::make_tuple(r.skipped, r.grad_norm, r.loss_scale);
      }, py::call_guard<py::gil_scoped_release>())
      .def("loss_scale", [](PyOptimizer& o) { return o.get().loss_scale(); })
      .def("set_grad_scale", [](PyOptimizer& o, double s) { o.get().set_grad_scale(s); })
      .def("save", [](PyOptimizer& o, const std::string& dir) { o.get().save(dir); },
           py::call_guard<py::gil_scoped_release>())
      .def("load", [](PyOptimizer& o, const std::string& dir) {
        zest::LoadResult r = o.get().load(dir);
        return std::make_pair(r.steps, r.config_changes);
      }, py::call_guard<py::gil_scoped_release>())
      .def("world", [](PyOptimizer& o) {
        return std::make_pair(o.get().runtime().rank(), o.get().runtime().world_size());
      })
      .def("full_parameters", [](PyOptimizer& o) {
        std::vector<std::pair<std::string, at::Tensor>> out;
        for (const auto& item : o.get().full_parameters()) out.emplace_back(item.key(), item.value());
        return out;
      })
      .def("torch_param_bytes", [](PyOptimizer& o) { return o.get().torch_param_bytes(); })
      .def("peak_transient_grad_bytes", [](PyOptimizer& o) { return o.get().peak_transient_grad_bytes(); });
}
