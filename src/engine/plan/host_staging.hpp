// The engine's block of pinned host memory: the step's scalars as the host reads them, then a
// staging area through which set_param/get_param, checkpoints and the device-resident optimizer
// states move values between the host and the device in chunks (EnginePlan::staging_elements fp32
// values, then as many in the working dtype). One host thread uses it at a time, synchronously:
// every user waits for its copies before it returns, so the next user finds it free.
#pragma once

#include <cstddef>

#include "engine/plan/memory_plan.hpp"
#include "zest/device.hpp"
#include "zest/dtype.hpp"

namespace zest::engine {

class HostStaging {
 public:
  HostStaging(Device& device, const EnginePlan& plan, DType dtype)
      : buffer_(device.allocate_pinned(plan.pinned, HostPurpose::engine)),
        elements_(plan.staging_elements),
        dtype_(dtype) {}

  void* scalars() const { return buffer_.data(); }  // kScalarsBytes
  std::size_t elements() const { return elements_; }
  float* f32() const { return reinterpret_cast<float*>(buffer_.as<char>() + kScalarsBytes); }
  // `elements()` values in the working dtype; fp32 shares f32(), so fp32 parameters upload from it.
  void* param() const {
    return dtype_ == DType::f32 ? static_cast<void*>(f32()) : static_cast<void*>(f32() + elements_);
  }

 private:
  HostBuffer buffer_;
  std::size_t elements_;
  DType dtype_;
};

}  // namespace zest::engine
