// Where `zest checkpoint consolidate` may write its safetensors file: zest never overwrites or
// deletes what it did not create, so the output is checked before any work.
#pragma once

#include <string>

namespace zest::checkpoint {

// Throws Error, saying what is there and what to do, unless `out` may be written: a new file's
// path outside the checkpoint `dir` being read, or an existing regular file that zest wrote
// (a safetensors file whose header begins as consolidate's do), which is then replaced. Refused:
// an empty path, '.', '..', a path ending in '/', a directory, a FIFO, a device or other special
// file, a symbolic link, any other existing file, and any path inside `dir`.
// Returns whether `out` exists (a file zest wrote, to be replaced).
bool check_output_target(const std::string& out, const std::string& dir);

}  // namespace zest::checkpoint
