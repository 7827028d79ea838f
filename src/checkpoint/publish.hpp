// How Engine::save reaches its directory without losing anything the user has: zest never deletes
// or overwrites what it did not create.
//
// The target is checked before any work: it may be absent, an empty directory, or a zest
// checkpoint whose directory holds only its manifest and the files that manifest lists. The new
// checkpoint is written into a temporary directory this save created (an exclusive mkdir, so it is
// never a path that already existed) and published by one rename (an atomic exchange where the
// file system has it). Of the replaced checkpoint, only its manifest and the files it lists are
// deleted, then its directory if that left it empty.
#pragma once

#include <cstdint>
#include <string>

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

// Creates temp_dir(target, token) for the first token from `first` on whose path does not exist
// (and the target's parent directories if missing); returns that token. Throws IoError.
std::uint32_t create_temp_dir(const std::string& target, std::uint32_t first);

// Publishes `temp` (a complete checkpoint, synced) as `target`, checking the target again first,
// then deletes the files of the checkpoint it replaced and fsyncs the parent directory. A crash at
// any moment leaves the previous or the new checkpoint at `target`. Throws Error or IoError.
void publish(const std::string& temp, const std::string& target);

}  // namespace zest::checkpoint
