#include "engine/checkpoint_io.hpp"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "checkpoint/format.hpp"
#include "checkpoint/publish.hpp"
#include "checkpoint/reader.hpp"
#include "optim/states_layout.hpp"
#include "runtime/host/half.hpp"
#include "zest/error.hpp"

namespace zest::engine {
namespace {

// The checkpoint layer's format, reader and publish, which this file drives for the engine.
using namespace zest::checkpoint;

// The tensor ranges rank `q` of a layout stores in a checkpoint (`saved`: one partition writes
// only on rank 0) or holds in its optimizer shard (every rank when there is one partition), in
// shard order.
std::vector<Range> ranges_of(const Layout& layout, int q, bool saved) {
  std::vector<Range> ranges;
  if (saved && layout.partitions() == 1 && q != 0) return ranges;
  for (std::size_t t = 0; t < layout.tensor_count(); ++t) {
    const auto part = layout.shard_part(t, q);
    const std::size_t offset = layout.tensor(t).offset;
    if (!part.empty()) ranges.push_back({t, part.lo - offset, part.hi - offset});
  }
  return ranges;
}

// Where tensor element `j` sits in rank `q`'s shard buffer (optimizer states), and in its group's
// shard.
std::size_t in_group_shard(const Layout& layout, int q, std::size_t tensor, std::size_t j) {
  const auto& place = layout.tensor(tensor);
  return place.offset + j - layout.shard_begin(place.group, q);
}
std::size_t shard_position(const Layout& layout, int q, std::size_t tensor, std::size_t j) {
  return layout.group(layout.tensor(tensor).group).shard_offset + in_group_shard(layout, q, tensor, j);
}

// The settings a checkpoint records, as key=value words.
std::string fingerprint(const Config& c) {
  const auto& o = c.optimizer;
  char text[320];
  std::snprintf(text, sizeof text,
                "stage=%d dtype=%s optimizer=%s lr=%.9g beta1=%.9g beta2=%.9g eps=%.9g weight_decay=%.9g "
                "gradient_clipping=%.9g states=%s master=%s seed=%d",
                c.stage, std::string(dtype_name(c.precision.dtype)).c_str(),
                o.type == OptimizerType::adam ? "adam" : "adamw", o.lr, o.beta1, o.beta2, o.eps, o.weight_decay,
                c.gradient_clipping, std::string(states_format_name(o.states)).c_str(),
                std::string(dtype_name(o.master)).c_str(), o.seed);
  return text;
}

// "key: A in the checkpoint, B now" for each key whose value differs.
std::vector<std::string> config_changes(const std::string& saved, const std::string& now) {
  auto words = [](const std::string& text) {
    std::vector<std::pair<std::string, std::string>> result;
    std::istringstream in(text);
    for (std::string word; in >> word;) {
      const std::size_t eq = word.find('=');
      if (eq != std::string::npos) result.emplace_back(word.substr(0, eq), word.substr(eq + 1));
    }
    return result;
  };
  std::vector<std::string> changes;
  const auto before = words(saved);
  for (const auto& [key, value] : words(now)) {
    const auto it = std::find_if(before.begin(), before.end(), [&](const auto& w) { return w.first == key; });
    // Checkpoints written before a key existed ran with its default (states and master fp32, seed 0).
    const std::string missing = key == "states" || key == "master" ? "fp32" : key == "seed" ? "0" : "unset";
    const std::string old = it == before.end() ? missing : it->second;
    if (old != value)
      changes.push_back(fmt::format("{}: {} in the checkpoint, {} now", key, old, value));
  }
  return changes;
}


// Calls visit(range, a, b, at) for the parts [a, b) (tensor elements) of `ranges` inside shard
// positions [lo, lo + n), `at` being a's place from lo. `ranges` are in shard order.
template <class Visit>
void for_each_overlap(const Layout& layout, int q, const std::vector<Range>& ranges, std::size_t lo,
                      std::size_t n, Visit visit) {
  for (const Range& r : ranges) {
    const std::size_t begin = shard_position(layout, q, r.tensor, r.lo), end = begin + (r.hi - r.lo);
    const std::size_t a = std::max(lo, begin), b = std::min(lo + n, end);
    if (a < b) visit(r, r.lo + (a - begin), r.lo + (b - begin), a - lo);
  }
}

// Every rank's `words` (the same count on each), in rank order: status and values the ranks agree
// on. 32-bit words travel as fp32 bit patterns, which the gather copies without arithmetic.
std::vector<std::uint32_t> gather_words(Device& device, Communicator& comm, Stream& stream,
                                               const std::vector<std::uint32_t>& words) {
  const std::size_t n = words.size(), ranks = static_cast<std::size_t>(comm.size());
  if (ranks == 1) return words;
  HostBuffer host = device.allocate_pinned(ranks * n * sizeof(std::uint32_t));
  DeviceBuffer buffer = device.allocate(ranks * n * sizeof(std::uint32_t), MemoryCategory::buffers);
  char* mine = buffer.as<char>() + static_cast<std::size_t>(comm.rank()) * n * sizeof(std::uint32_t);
  std::memcpy(host.data(), words.data(), n * sizeof(std::uint32_t));
  device.copy_async(mine, host.data(), n * sizeof(std::uint32_t), stream);
  comm.all_gather(mine, buffer.data(), n, DType::f32, stream);
  device.copy_async(host.data(), buffer.data(), ranks * n * sizeof(std::uint32_t), stream);
  stream.synchronize();
  std::vector<std::uint32_t> all(ranks * n);
  std::memcpy(all.data(), host.data(), all.size() * sizeof(std::uint32_t));
  return all;
}

// Every rank learns whether any failed; a failed rank rethrows its own error, the others say which
// rank failed (and `consequence`), so that no rank goes on to the next collective phase alone.
// When one failed, every rank first runs `undo` (collective: all ranks run it, or none).
void agree(Device& device, Communicator& comm, Stream& stream, const std::exception_ptr& failure,
           const std::string& operation, const std::string& consequence = "nothing was changed",
           const std::function<void()>& undo = {}) {
  const auto flags = gather_words(device, comm, stream, {failure ? 1u : 0u});
  if (undo && std::find(flags.begin(), flags.end(), 1u) != flags.end()) undo();
  if (failure) std::rethrow_exception(failure);
  for (std::size_t r = 0; r < flags.size(); ++r)
    if (flags[r])
      throw Error(fmt::format("{}: rank {} failed (its error says why); {}", operation, r, consequence));
}

// A save that fails once its temporary directory exists removes what it wrote there, so that a
// failed save leaves nothing behind: each rank its own state files (by name in `dir`, the handle it
// holds, null where it could not open it), then (once every rank has) rank 0 the manifest and the
// directory, if its path still names it. Only names this save writes are unlinked, and rmdir
// removes the directory only when that emptied it. A failure here must not hide the save's own
// error: it leaves the directory, which the next save skips (create_temp_dir never reuses one).
void discard_temp(const CheckpointParts& e, const Directory* dir) {
  try {
    const int rank = e.comm.rank();
    if (dir)
      for (int k = 0; k < kStates; ++k) ::unlinkat(dir->fd(), state_file_name(rank, StateKind(k)).c_str(), 0);
    gather_words(e.device, e.comm, e.stream, {0u});  // every rank's files are gone
    if (rank == 0 && dir) {
      ::unlinkat(dir->fd(), kManifestName, 0);
      if (path_names(dir->path(), dir->identity())) ::rmdir(dir->path().c_str());
    }
  } catch (...) {
  }
}

std::string shape_text(const std::vector<std::size_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) text.append(i ? ", " : "").append(std::to_string(shape[i]));
  return text.append("]");
}

// Throws Error unless the checkpoint holds exactly `specs` (names, shapes, groups, in order).
void require_model(const Manifest& m, const std::vector<ParamSpec>& specs, const std::string& dir) {
  const std::string where = std::string("checkpoint ").append(dir).append(": ");
  if (m.tensors.size() != specs.size())
    throw Error(fmt::format("{}it holds {} tensors, this model has {}: it is a checkpoint of another model", where,
                            m.tensors.size(), specs.size()));
  for (std::size_t t = 0; t < specs.size(); ++t) {
    const auto& e = m.tensors[t];
    if (e.name != specs[t].name || e.shape != specs[t].shape || e.group != specs[t].group ||
        e.numel != specs[t].numel())
      throw Error(fmt::format(
          "{}tensor {} is '{}' {} group {} there and '{}' {} group {} here: it is a checkpoint of another model", where,
          t, e.name, shape_text(e.shape), e.group, specs[t].name, shape_text(specs[t].shape), specs[t].group));
  }
}

// m and v into their checkpoint files in the run's optimizer.states form (checkpoint::Manifest::states):
// fp32 as they are; bf16 rounded to nearest (the widened bf16 values come back exactly); int8
// quantized per block from each range's start, which are the engine's own blocks (ranges start at
// multiples of kInt8Block in the shard), so the codes and scales are the engine's too. The scales
// wait in memory (an eighth of a byte per value) until finish() puts them after the codes.
class MomentWriter {
 public:
  explicit MomentWriter(StatesFormat states) : states_(states) {}

  // Elements [offset, offset + n) of a range (offset counted from its start) of m and v.
  void append(FileWriter& m_file, FileWriter& v_file, const float* m, const float* v, std::size_t offset,
              std::size_t n) {
    if (states_ == StatesFormat::f32) {
      m_file.append(m, n * sizeof(float));
      v_file.append(v, n * sizeof(float));
      return;
    }
    if (states_ == StatesFormat::int8 && offset % optim::kInt8Block != 0)
      throw Error("Engine::save: int8 states visited from inside a block; every piece of a range must start a block");
    const std::size_t element = states_ == StatesFormat::bf16 ? sizeof(std::uint16_t) : 1;
    for (std::size_t at = 0; at < n; at += kSlice) {
      const std::size_t len = std::min(kSlice, n - at);
      encode(m + at, len, true, m_scales_);
      m_file.append(slice_.data(), len * element);
      encode(v + at, len, false, v_scales_);
      v_file.append(slice_.data(), len * element);
    }
  }

  void finish(FileWriter& m_file, FileWriter& v_file) {
    m_file.append(m_scales_.data(), m_scales_.size() * sizeof(float));
    v_file.append(v_scales_.data(), v_scales_.size() * sizeof(float));
  }

 private:
  static constexpr std::size_t kSlice = std::size_t{1} << 16;
  static_assert(kSlice % optim::kInt8Block == 0);

  void encode(const float* x, std::size_t n, bool is_signed, std::vector<float>& scales) {
    slice_.resize(kSlice * sizeof(std::uint16_t));
    if (states_ == StatesFormat::bf16) {
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint16_t bits = float_to_bf16(x[i]);
        std::memcpy(slice_.data() + 2 * i, &bits, sizeof bits);
      }
      return;
    }
    auto* const codes = reinterpret_cast<std::uint8_t*>(slice_.data());
    for (std::size_t at = 0; at < n; at += optim::kInt8Block) {
      const std::size_t len = std::min(optim::kInt8Block, n - at);
      scales.push_back(optim::quantize_block(optim::dynamic_code(is_signed), is_signed, x + at, len, codes + at));
    }
  }

  const StatesFormat states_;
  std::vector<char> slice_;
  std::vector<float> m_scales_, v_scales_;
};

// Rank 0 of a save: checks the target and creates the temporary directory, held open in `held`;
// returns what every rank needs to find it (its token, its inode's low and high halves).
std::vector<std::uint32_t> make_temp_dir(const std::string& target, std::optional<Directory>& held) {
  check_save_target(target);
  TempDir made = create_temp_dir(target, static_cast<std::uint32_t>(::getpid()));
  const std::uint64_t inode = made.dir.identity().inode;
  held.emplace(std::move(made.dir));
  return {made.token, static_cast<std::uint32_t>(inode), static_cast<std::uint32_t>(inode >> 32)};
}

// This rank's three files in `dir`: each state of each of its ranges, in shard order, then read
// back through the handle (synced: what a crash would leave), so that only a checkpoint whose every
// byte checks out is published. Returns its entry of the manifest.
RankEntry write_state_files(const CheckpointParts& e, const Directory& dir, const char* op, const std::string& target) {
  const int rank = e.comm.rank();
  RankEntry mine;
  mine.ranges = ranges_of(e.layout, rank, true);
  std::vector<std::unique_ptr<FileWriter>> writers;
  MomentWriter moments(e.config.optimizer.states);
  for (int k = 0; k < kStates; ++k)
    writers.push_back(std::make_unique<FileWriter>(dir, state_file_name(rank, StateKind(k))));
  if (!mine.ranges.empty()) {
    // One pass over the shard: each NVMe sub-group is read once, into pinned host memory.
    const auto& last = mine.ranges.back();
    const std::size_t from = shard_position(e.layout, rank, mine.ranges.front().tensor, mine.ranges.front().lo);
    const std::size_t to = shard_position(e.layout, rank, last.tensor, last.lo) + (last.hi - last.lo);
    e.states.visit_states(
        from, to - from, false, [&](float* master, float* m, float* v, std::size_t first, std::size_t n) {
          for_each_overlap(e.layout, rank, mine.ranges, from + first, n,
                           [&](const Range& range, std::size_t a, std::size_t b, std::size_t at) {
                             writers[0]->append(master + at, (b - a) * sizeof(float));
                             moments.append(*writers[1], *writers[2], m + at, v + at, a - range.lo, b - a);
                           });
        });
  }
  moments.finish(*writers[1], *writers[2]);
  for (int k = 0; k < kStates; ++k) {
    auto& w = *writers[static_cast<std::size_t>(k)];
    w.finish();
    mine.files[static_cast<std::size_t>(k)] = {state_file_name(rank, StateKind(k)), w.bytes(), w.chunk_crcs()};
  }
  if (const auto problems = check_saved_files(dir, mine.files, kChunkBytes, true); !problems.empty())
    throw Error(fmt::format("{}: rank {}'s file does not read back as written: {}; {} is unchanged: save again", op,
                            rank, problems.front(), target));
  return mine;
}

// Every rank's chunk checksums, gathered as 32-bit words: `per_rank` words from each rank (its
// own, padded to the most any rank has).
struct ChunkCrcs {
  std::vector<std::uint32_t> words;
  std::size_t per_rank = 0;
};

ChunkCrcs gather_chunk_crcs(const CheckpointParts& e, const RankEntry& mine) {
  std::vector<std::uint32_t> crcs;
  for (const auto& f : mine.files) crcs.insert(crcs.end(), f.chunk_crcs.begin(), f.chunk_crcs.end());
  const auto counts = gather_words(e.device, e.comm, e.stream, {static_cast<std::uint32_t>(crcs.size())});
  const std::size_t most = *std::max_element(counts.begin(), counts.end());
  crcs.resize(most);
  return {gather_words(e.device, e.comm, e.stream, crcs), most};
}

// The manifest of this save: the run, the model, and every rank's files with their checksums.
Manifest manifest_of(const CheckpointParts& e, const ChunkCrcs& crcs) {
  Manifest m;
  m.world_size = e.comm.size();
  m.stage = e.config.stage;
  m.steps = e.steps;
  m.skipped = e.skipped;
  m.loss_scale = e.scaler.scale();
  m.clean_steps = e.scaler.clean_steps();
  m.hysteresis_left = e.scaler.hysteresis_left();
  m.config = fingerprint(e.config);
  m.states = e.config.optimizer.states;
  for (const auto& h : e.optimizer_groups)
    m.optimizer_groups.push_back({h.lr, h.beta1, h.beta2, h.eps, h.weight_decay});
  for (const ParamSpec& p : e.specs) m.tensors.push_back({p.name, p.shape, p.group, p.numel()});
  for (int q = 0; q < e.comm.size(); ++q) {
    RankEntry entry;
    entry.ranges = ranges_of(e.layout, q, true);
    auto next = crcs.words.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(q) * crcs.per_rank);
    for (int k = 0; k < kStates; ++k) {
      const std::uint64_t bytes = state_file_bytes(m.states, StateKind(k), entry.ranges);
      const auto chunks = static_cast<std::ptrdiff_t>((bytes + m.chunk_bytes - 1) / m.chunk_bytes);
      entry.files[static_cast<std::size_t>(k)] = {state_file_name(q, StateKind(k)), bytes,
                                                  std::vector<std::uint32_t>(next, next + chunks)};
      next += chunks;
    }
    m.ranks.push_back(std::move(entry));
  }
  return m;
}

// Rank 0: the manifest into `dir`, synced with the directory; then every file it lists must still
// be there as it says (each rank checked its own files' bytes). Returns those files.
std::vector<StateFile> write_manifest(const Directory& dir, const Manifest& m, const char* op,
                                      const std::string& target) {
  const std::string text = serialize(m);
  write_file_synced(dir, kManifestName, text.data(), text.size());
  dir.sync();
  std::vector<StateFile> every_file;
  for (const RankEntry& entry : m.ranks) every_file.insert(every_file.end(), entry.files.begin(), entry.files.end());
  if (const auto problems = check_saved_files(dir, every_file, m.chunk_bytes, false); !problems.empty())
    throw Error(
        fmt::format("{}: a file of the new checkpoint is gone before it was published ({}; removed by someone "
                    "while the save ran?); {} is unchanged: save again",
                    op, problems.front(), target));
  return every_file;
}

// Rank 0: the complete checkpoint in `temp` put in place of `target`. A failure keeps it, and the
// error says where it is.
std::exception_ptr publish_or_keep(const Directory& held, const std::string& target, const std::string& temp,
                                   const std::vector<StateFile>& every_file, const char* op) {
  const std::string kept =
      fmt::format("; the new checkpoint is complete in {}: move it into place yourself, or save again", temp);
  try {
    publish(held, target, every_file);
  } catch (const Error& error) {
    return std::make_exception_ptr(Error(std::string(error.what()).append(kept)));
  } catch (const std::exception& error) {  // std::filesystem's
    return std::make_exception_ptr(Error(fmt::format("{}: {}{}", op, error.what(), kept)));
  }
  return nullptr;
}

}  // namespace

// Each step's failure on any rank is every rank's (agree): the ranks go on together or throw
// together, the target untouched until the last step.
void save_checkpoint(const CheckpointParts& e, const std::string& dir) {
  Stream& stream = e.stream;
  const int rank = e.comm.rank();
  const char* op = "Engine::save";
  const std::string target = save_target(dir);

  // Rank 0 checks the target and creates the temporary directory; every rank learns its name and
  // inode, and holds it open to write its files there.
  std::exception_ptr failure;
  std::optional<Directory> held;
  std::vector<std::uint32_t> words{0, 0, 0};
  if (rank == 0) {
    try {
      words = make_temp_dir(target, held);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  agree(e.device, e.comm, stream, failure, op);
  const auto made = gather_words(e.device, e.comm, stream, words);
  const std::string temp = temp_dir(target, made[0]);

  RankEntry mine;
  try {
    if (rank != 0) held.emplace(open_temp_dir(temp, made[1] | std::uint64_t{made[2]} << 32));
    mine = write_state_files(e, *held, op, target);
  } catch (...) {
    failure = std::current_exception();
  }
  const auto discard = [&] { discard_temp(e, held ? &*held : nullptr); };
  agree(e.device, e.comm, stream, failure, op, std::string(target).append(" is unchanged"), discard);

  // Rank 0 writes the manifest.
  const ChunkCrcs crcs = gather_chunk_crcs(e, mine);
  std::vector<StateFile> every_file;  // rank 0: what the manifest lists, checked again once published
  if (rank == 0) {
    try {
      every_file = write_manifest(*held, manifest_of(e, crcs), op, target);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  agree(e.device, e.comm, stream, failure, op, std::string(target).append(" is unchanged"), discard);

  // The new checkpoint is complete: a failure to put it in place keeps it, and says where it is.
  if (rank == 0) failure = publish_or_keep(*held, target, temp, every_file, op);
  agree(e.device, e.comm, stream, failure, op);
}

LoadResult load_checkpoint(const CheckpointParts& e, const std::string& dir) {
  Stream& stream = e.stream;
  const int rank = e.comm.rank();
  const char* op = "Engine::load";

  // First everything this rank will read is checked, the engine unchanged: the manifest against
  // this model, the files' sizes, and the CRC32C of every chunk holding one of this rank's ranges
  // (only those: a rank reads its own shard's ranges, wherever the saving ranks put them).
  std::unique_ptr<Reader> reader;
  const auto mine = ranges_of(e.layout, rank, false);
  std::exception_ptr failure;
  try {
    reader = std::make_unique<Reader>(dir);
    require_model(reader->manifest(), e.specs, dir);
    reader->check_files();
    for (int k = 0; k < kStates; ++k)
      for (const auto& r : mine) reader->read(StateKind(k), r.tensor, r.lo, r.hi, nullptr);
  } catch (...) {
    failure = std::current_exception();
  }
  agree(e.device, e.comm, stream, failure, op);

  // Then the states of this rank's shard and its part of the parameters, read again (the page
  // cache usually still holds them) and checked again as they are read. The gathered copies and
  // secondary slices go first, on every rank, so that a rank whose read fails agrees with the others
  // on what the next gather is.
  e.params.drop_prefetched();
  try {
    e.states.visit_states(
        0, e.layout.shard_numel(), true, [&](float* master, float* m, float* v, std::size_t first, std::size_t n) {
          float* states[] = {master, m, v};
          for (float* state : states) std::fill(state, state + n, 0.0f);  // padding
          for_each_overlap(e.layout, rank, mine, first, n,
                           [&](const Range& r, std::size_t a, std::size_t b, std::size_t at) {
                             for (int k = 0; k < kStates; ++k)
                               reader->read(StateKind(k), r.tensor, a, b, states[k] + at);
                             e.params.write_shard(e.layout.tensor(r.tensor).group,
                                                  in_group_shard(e.layout, rank, r.tensor, a), master + at, b - a);
                           });
        });
  } catch (...) {
    failure = std::current_exception();
  }
  agree(e.device, e.comm, stream, failure, op,
        "this engine is partly loaded: load a checkpoint again before training");
  e.params.gather_all();
  const Manifest& m = reader->manifest();
  e.steps = m.steps;
  e.skipped = m.skipped;
  e.scaler.restore(m.loss_scale, m.clean_steps, m.hysteresis_left);
  LoadResult result{m.steps, config_changes(m.config, fingerprint(e.config))};
  // The optimizer groups' current values (a schedule's) resume; a checkpoint with another number of
  // groups (or none: format 2) leaves this engine's, and says so.
  if (m.optimizer_groups.size() == e.optimizer_groups.size()) {
    for (std::size_t i = 0; i < m.optimizer_groups.size(); ++i) {
      const auto& g = m.optimizer_groups[i];
      auto& h = e.optimizer_groups[i];
      h.lr = g.lr;
      h.beta1 = g.beta1;
      h.beta2 = g.beta2;
      h.eps = g.eps;
      h.weight_decay = g.weight_decay;
    }
  } else {
    result.config_changes.push_back(
        fmt::format("optimizer groups: {} in the checkpoint, {} now (this engine's values are kept)",
                    m.optimizer_groups.size(), e.optimizer_groups.size()));
  }
  return result;
}

}  // namespace zest::engine
