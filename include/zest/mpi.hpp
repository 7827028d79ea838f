// A zest Communicator over an MPI communicator the program already has (a sub-communicator of the
// world from MPI_Comm_split, say), so zest's collectives run among exactly those ranks. Only in
// builds with MPI (-Dmpi=enabled, or auto with MPI found); includes <mpi.h>.
#pragma once

#include <mpi.h>

#include <memory>

#include "zest/communicator.hpp"
#include "zest/device.hpp"

namespace zest {

// Collective over `comm`: each of its ranks calls it, with its own host-accessible (cpu) Device.
// zest duplicates `comm` (its traffic never matches the program's), so the program may free
// `comm` right after. MPI must be initialized with MPI_THREAD_MULTIPLE and stay initialized until
// the returned communicator is destroyed. Rank and size are comm's. Throws CommError for
// MPI_COMM_NULL, a lesser thread level, or a device MPI cannot read.
std::unique_ptr<Communicator> make_communicator(MPI_Comm comm, Device& device);

}  // namespace zest
