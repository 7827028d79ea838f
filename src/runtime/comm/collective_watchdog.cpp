#include "runtime/comm/collective_watchdog.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <list>
#include <map>
#include <memory>
#include <vector>

#include <fmt/core.h>

#include "runtime/comm/mpi_check.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

// Queries carry the tag their answer must use, so answers to an earlier, abandoned query never
// match a later one.
constexpr int kQueryTag = 1;
constexpr int kFirstReplyTag = 2;
// Answers take one poll of the responder (kPollInterval) on a loaded machine; a rank silent for
// this long is not answering at all.
constexpr auto kPollInterval = std::chrono::milliseconds(20);

std::string seconds_text(std::chrono::milliseconds duration) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g s", static_cast<double>(duration.count()) / 1000.0);
  return text;
}

const char* lane_noun(CollectiveWatchdog::Lane lane) {
  return lane == CollectiveWatchdog::Lane::collective ? "collective" : "barrier";
}

std::string operation_text(const char* name, std::int64_t number) { return fmt::format("{} #{}", name, number); }

std::string rank_list(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i != 0) text.append(", ");
    text.append(std::to_string(ranks[i]));
  }
  return text;
}

// Where rank r is, seen from an operation (`lane`, `name` #`number`) that timed out.
std::string describe(const CollectiveWatchdog::RankState& state, CollectiveWatchdog::Lane lane,
                     const char* name, std::int64_t number) {
  const auto& own = state.lanes[static_cast<std::size_t>(lane)];
  std::string text;
  if (own.active != 0 && own.issued == number && std::strcmp(own.name, name) == 0) {
    text = "blocked in " + operation_text(name, number) + " as well";
  } else {
    if (own.active != 0)
      text = "in " + operation_text(own.name, own.issued);
    else
      text = fmt::format("not in a {}, after {}", lane_noun(lane), own.issued);
    if (own.issued < number)
      text += fmt::format(": behind (it skipped a {} or has not reached #{})", lane_noun(lane), number);
    else if (own.issued > number || own.active == 0)
      text += std::string(": ahead (it issued a ") + lane_noun(lane) +
              " this rank has not, or this rank skipped one)";
  }
  if (state.failed[0] != '\0') text += std::string(", and has given up on ") + state.failed;
  // The other lane shows what blocks a rank that is not in this one.
  const auto& other = state.lanes[1 - static_cast<std::size_t>(lane)];
  if (other.active != 0)
    text += fmt::format(", and waiting {} s in {}", other.waited_ms / 1000, operation_text(other.name, other.issued));
  return text;
}

}  // namespace

CollectiveWatchdog::CollectiveWatchdog(MPI_Comm comm, std::chrono::milliseconds timeout, Responder responder)
    : timeout_(timeout), responder_mode_(responder) {
  ZEST_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
  try {
    // A peer's death must come back as an error code, not abort this rank.
    ZEST_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    ZEST_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    ZEST_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  } catch (...) {
    MPI_Comm_free(&comm_);
    throw;
  }
  if (timeout_.count() > 0 && size_ > 1 && responder_mode_ == Responder::run)
    responder_ = std::thread([this] { respond(); });
}

CollectiveWatchdog::~CollectiveWatchdog() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (responder_.joinable()) responder_.join();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&comm_);
}

CollectiveWatchdog::Operation::~Operation() { owner_.end(lane_); }

CollectiveWatchdog::Operation CollectiveWatchdog::begin(Lane lane, const char* name) {
  std::lock_guard lock(mutex_);
  if (!broken_.empty()) {
    throw CommError(std::string(name) +
                    ": not started, this communicator is unusable since an earlier operation "
                    "timed out or failed (end the process): " +
                    broken_);
  }
  LaneState& state = state_.lanes[static_cast<std::size_t>(lane)];
  ++state.issued;
  state.active = 1;
  std::snprintf(state.name, sizeof state.name, "%s", name);
  since_[static_cast<std::size_t>(lane)] = std::chrono::steady_clock::now();
  return Operation(*this, lane, static_cast<std::uint64_t>(state.issued));
}

void CollectiveWatchdog::end(Lane lane) {
  std::lock_guard lock(mutex_);
  state_.lanes[static_cast<std::size_t>(lane)].active = 0;
}

CollectiveWatchdog::RankState CollectiveWatchdog::snapshot() const {
  std::lock_guard lock(mutex_);
  RankState state = state_;
  const auto now = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < kLanes; ++i)
    if (state.lanes[i].active != 0)
      state.lanes[i].waited_ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(now - since_[i]).count();
  return state;
}

void CollectiveWatchdog::wait(MPI_Request& request, const Operation& operation) {
  if (timeout_.count() == 0) {
    ZEST_MPI_CHECK(MPI_Wait(&request, MPI_STATUS_IGNORE));
    return;
  }
  std::chrono::steady_clock::time_point deadline;
  {
    std::lock_guard lock(mutex_);
    deadline = since_[static_cast<std::size_t>(operation.lane_)] + timeout_;
  }
  for (;;) {
    int done = 0;
    const int code = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) {
      char text[MPI_MAX_ERROR_STRING];
      int length = 0;
      if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) length = 0;
      fail(operation, "MPI reported an error (" + std::string(text, static_cast<std::size_t>(length)) +
                          "), a peer may have died");
    }
    if (done != 0) return;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline)
      fail(operation, "not complete after " + seconds_text(timeout_) + " (comm.timeout)");
    // Poll as MPI_Wait does (Open MPI: progress, then sched_yield with mpi_yield_when_idle):
    // nonblocking collectives progress only inside MPI calls on this rank, and a sleep here
    // delayed every hop, doubling a small all_reduce's time with 4 ranks on 2 cores.
    std::this_thread::yield();
  }
}

void CollectiveWatchdog::respond() {
  struct Answer {
    RankState state;
    MPI_Request request = MPI_REQUEST_NULL;
  };
  std::list<Answer> answers;  // in flight; a list keeps each buffer in place until it is sent
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    lock.unlock();
    for (;;) {
      int found = 0;
      MPI_Status status;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kQueryTag, comm_, &found, &status) != MPI_SUCCESS || !found)
        break;
      int reply_tag = 0;
      if (MPI_Recv(&reply_tag, 1, MPI_INT, status.MPI_SOURCE, kQueryTag, comm_,
                   MPI_STATUS_IGNORE) != MPI_SUCCESS)
        break;
      Answer& answer = answers.emplace_back();
      answer.state = snapshot();
      if (MPI_Isend(&answer.state, sizeof answer.state, MPI_BYTE, status.MPI_SOURCE, reply_tag,
                    comm_, &answer.request) != MPI_SUCCESS)
        answers.pop_back();
    }
    answers.remove_if([](Answer& answer) {
      int done = 0;
      // An answer to a rank that died fails or never completes; either way it is finished with.
      return MPI_Test(&answer.request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done != 0;
    });
    lock.lock();
    stop_cv_.wait_for(lock, kPollInterval, [&] { return stopping_; });
  }
  lock.unlock();
  for (Answer& answer : answers) {
    MPI_Cancel(&answer.request);
    MPI_Request_free(&answer.request);
  }
}

void CollectiveWatchdog::fail(const Operation& operation, const std::string& cause) {
  const Lane lane = operation.lane_;
  const auto number = static_cast<std::int64_t>(operation.number_);
  char name[sizeof(LaneState::name)];
  {
    std::lock_guard lock(mutex_);
    std::memcpy(name, state_.lanes[static_cast<std::size_t>(lane)].name, sizeof name);
  }
  if (responder_mode_ == Responder::none) {
    std::string message = fmt::format(
        "{} on rank {}: {}. This communicator was split from another (a host's ranks, or the ranks across "
        "hosts) and does not ask where its peers are; every rank must issue the same "
        "collectives in the same order; a rank that is slow needs a larger comm.timeout, one that "
        "died or hangs stops them. The operation cannot be cancelled, so this communicator is "
        "unusable now: end the process.",
        operation_text(name, number), rank_, cause);
    std::lock_guard lock(mutex_);
    if (broken_.empty()) {
      broken_ = message;
      std::snprintf(state_.failed, sizeof state_.failed, "%s", operation_text(name, number).c_str());
    }
    throw CommError(message);
  }

  int reply_tag = kFirstReplyTag;
  {
    std::lock_guard lock(mutex_);
    reply_tag += queries_++;
  }

  // Ask every other rank where it is. The buffers are kept (never freed) for the process's life:
  // a rank that died may leave a send or receive that MPI still holds after it is abandoned.
  struct Query {
    int reply_tag;
    std::vector<RankState> states;
    std::vector<MPI_Request> sends, receives;
    std::vector<bool> answered;
  };
  static std::mutex leaked_mutex;
  static std::vector<std::unique_ptr<Query>> leaked;
  auto query = std::make_unique<Query>();
  Query& q = *query;
  {
    std::lock_guard lock(leaked_mutex);
    leaked.push_back(std::move(query));
  }
  const auto ranks = static_cast<std::size_t>(size_);
  q.reply_tag = reply_tag;
  q.states.resize(ranks);
  q.sends.assign(ranks, MPI_REQUEST_NULL);
  q.receives.assign(ranks, MPI_REQUEST_NULL);
  q.answered.assign(ranks, false);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const auto i = static_cast<std::size_t>(r);
    if (MPI_Irecv(&q.states[i], sizeof(RankState), MPI_BYTE, r, reply_tag, comm_, &q.receives[i]) !=
        MPI_SUCCESS)
      continue;
    if (MPI_Isend(&q.reply_tag, 1, MPI_INT, r, kQueryTag, comm_, &q.sends[i]) != MPI_SUCCESS)
      q.sends[i] = MPI_REQUEST_NULL;
  }
  // Long enough for a loaded peer's responder to wake a few times; bounded, so a dead rank costs
  // at most this on top of the timeout.
  const auto grace = std::clamp(timeout_, std::chrono::milliseconds(1000),
                                std::chrono::milliseconds(5000));
  const auto grace_end = std::chrono::steady_clock::now() + grace;
  for (;;) {
    bool pending = false;
    for (int r = 0; r < size_; ++r) {
      const auto i = static_cast<std::size_t>(r);
      if (r == rank_ || q.answered[i] || q.receives[i] == MPI_REQUEST_NULL) continue;
      int done = 0;
      if (MPI_Test(&q.receives[i], &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
        q.receives[i] = MPI_REQUEST_NULL;  // the peer is gone; MPI has finished the request
        continue;
      }
      if (done != 0)
        q.answered[i] = true;
      else
        pending = true;
    }
    if (!pending || std::chrono::steady_clock::now() >= grace_end) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  for (std::size_t i = 0; i < ranks; ++i) {
    if (q.receives[i] != MPI_REQUEST_NULL && !q.answered[i]) {
      MPI_Cancel(&q.receives[i]);
      MPI_Request_free(&q.receives[i]);
    }
    if (q.sends[i] != MPI_REQUEST_NULL) MPI_Request_free(&q.sends[i]);
  }

  // Ranks in the same situation are named together.
  std::map<std::string, std::vector<int>> situations;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const auto i = static_cast<std::size_t>(r);
    situations[q.answered[i] ? describe(q.states[i], lane, name, number)
                             : "gone: no answer within " + seconds_text(grace) +
                                   " (it died, or its process hangs outside zest)"]
        .push_back(r);
  }
  std::string message = fmt::format("{} on rank {}: {}.", operation_text(name, number), rank_, cause);
  for (const auto& [situation, ranks_there] : situations)
    message += fmt::format(" {}: {};", rank_list(ranks_there), situation);
  message.append(
      " Every rank must issue the same collectives and barriers in the same order: a rank behind "
      "skipped one or is slow (raise comm.timeout if such a pause is expected), a rank ahead "
      "issued one the others did not, a rank gone died or hangs; fix that rank. The operation "
      "cannot be cancelled, so this communicator is unusable now: end the process (MPI_Finalize "
      "would wait for a rank that is gone).");
  {
    std::lock_guard lock(mutex_);
    if (broken_.empty()) {
      broken_ = message;
      std::snprintf(state_.failed, sizeof state_.failed, "%s", operation_text(name, number).c_str());
    }
  }
  throw CommError(message);
}

}  // namespace zest
