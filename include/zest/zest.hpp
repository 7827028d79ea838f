// The whole public API of zest.
#pragma once

#include "zest/checkpoint.hpp"
#include "zest/communicator.hpp"
#include "zest/config.hpp"
#include "zest/device.hpp"
#include "zest/dtype.hpp"
#include "zest/engine.hpp"
#include "zest/error.hpp"
#include "zest/estimate.hpp"
#include "zest/host_purpose.hpp"
#include "zest/runtime.hpp"
#include "zest/topology.hpp"
#include "zest/trace.hpp"
