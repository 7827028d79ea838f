// zest/checkpoint.hpp's read_checkpoint_info and verify_checkpoint: the public view of what
// checkpoint::Reader parses and checks.
#include "checkpoint/reader.hpp"
#include "zest/checkpoint.hpp"

namespace zest {

CheckpointInfo read_checkpoint_info(const std::string& dir) {
  const checkpoint::Reader reader(dir);
  const checkpoint::Manifest& m = reader.manifest();
  CheckpointInfo info;
  info.format_version = m.version;
  info.world_size = m.world_size;
  info.stage = m.stage;
  info.steps = m.steps;
  info.skipped_steps = m.skipped;
  info.loss_scale = m.loss_scale;
  info.config = m.config;
  info.states = m.states;
  info.chunk_bytes = m.chunk_bytes;
  for (const checkpoint::TensorEntry& t : m.tensors) info.tensors.push_back({t.name, t.shape, t.group});
  for (const checkpoint::RankEntry& rank : m.ranks)
    for (const checkpoint::StateFile& file : rank.files)
      info.files.push_back({file.name, file.bytes, file.chunk_crcs.size()});
  return info;
}

std::vector<std::string> verify_checkpoint(const std::string& dir) {
  checkpoint::Reader reader(dir);
  return reader.verify_all();
}

}  // namespace zest
