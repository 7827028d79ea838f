// How Engine::save reaches its directory without losing anything the user has: zest never deletes
// or overwrites what it did not create.
//
// The target is checked before any work: it may be absent, an empty directory, or a zest
// checkpoint whose directory holds only its manifest and the files that manifest lists. The new
// checkpoint is written into a temporary directory this save created (an exclusive mkdir, so it is
// never a path that already existed), through a handle held open on it, and published by one
// rename (an atomic exchange where the file system has it). Of the replaced checkpoint, only its
// manifest and the files it lists are deleted, by name in the directory that was checked, then
// that directory if that left it empty.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "checkpoint/format.hpp"

namespace zest::checkpoint {

// `dir` lexically normalized, without a trailing '/'. Throws Error when it names no directory a
// save can create ("", ".", "..", "/", or a path ending in one of those).
std::string save_target(const std::string& dir);

// Throws unless a save may replace what is at `target` (a save_target): nothing, an empty
// directory, or a readable zest checkpoint holding nothing but its own files. The error (Error, or
// IoError with the path and errno when it cannot be looked at) says what is there and what to do.
void check_save_target(const std::string& target);

// The temporary directory of a save of `target`: "<target>.tmp-<token>".
std::string temp_dir(const std::string& target, std::uint32_t token);

// A save's temporary directory, held open: every file of the save is created in it by name
// relative to the handle, so nothing put at its path during the save (by anyone who can write the
// target's parent) receives a byte.
struct TempDir {
  std::uint32_t token = 0;
  Directory dir;
};

// Creates temp_dir(target, token) for the first token from `first` on whose path does not exist
// (and the target's parent directories if missing), and opens it, checking that what it opened is
// the empty directory of this user it made. Throws IoError or Error.
TempDir create_temp_dir(const std::string& target, std::uint32_t first);

// Opens, on another rank, the temporary directory at `path` that rank 0 created: throws Error
// unless it is a directory (not a link) of this user with inode `inode`, the one rank 0 holds.
Directory open_temp_dir(const std::string& path, std::uint64_t inode);

// What is wrong with `files` in `dir`, looked at through its handle (so a directory swapped in at
// its path is not what is checked): one line per file missing, not a regular file, of another size
// than listed, or (with `checksums`, chunks of `chunk_bytes`) holding a chunk whose CRC32C differs.
// Empty: every file is there and intact.
std::vector<std::string> check_saved_files(const Directory& dir, std::span<const StateFile> files,
                                           std::uint64_t chunk_bytes, bool checksums);

// Publishes `temp` (a complete checkpoint, synced and checked) as `target`, checking the target
// again first, then checks `files` (every file its manifest lists) in the published directory again (existence and
// sizes: something may have removed one from the temporary directory meanwhile), and only then
// deletes the files of the checkpoint it replaced and fsyncs the parent directory. A crash at any
// moment leaves the previous or the new checkpoint at `target`. Should anything be put at either
// path meanwhile, or the published files not check out, nothing is deleted (where the file system
// exchanges directories atomically the previous checkpoint goes back to `target`) and Error says
// what is where. Throws Error or IoError.
void publish(const Directory& temp, const std::string& target, std::span<const StateFile> files);

}  // namespace zest::checkpoint
