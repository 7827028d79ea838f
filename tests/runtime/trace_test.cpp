// The step's trace (base/trace.hpp, runtime/comm/trace_file.cpp, runtime/device/stream_span.hpp): nothing is
// recorded while off; spans from any thread land on their lanes; the capacity bounds what is kept
// and the rest is counted; a stream's span is timed when the stream runs the work; the file is
// one JSON document (python3's json module reads it back), written only where no file was, and a
// trace never written leaves nothing behind.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/trace.hpp"
#include "silent_communicator.hpp"
#include "runtime/device/stream_span.hpp"
#include "zest/trace.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

namespace fs = std::filesystem;

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::size_t count_of(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Runs python3 on `script` with the file as argv[1]; its exit status (0: every assert held).
int check_with_python(const fs::path& file, const std::string& script) {
  const fs::path py = fs::path(testing::TempDir()) / ("trace_check_" + std::to_string(::getpid()) + ".py");
  std::ofstream(py) << "import json, sys\ndoc = json.load(open(sys.argv[1]))\n" << script << "\n";
  const std::string command = "python3 " + py.string() + " " + file.string();
  const int status = std::system(command.c_str());
  fs::remove(py);
  return status;
}

class TraceTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(testing::TempDir()) / ("zest_trace_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override {
    trace::stop();
    fs::remove_all(dir_);
  }
  fs::path dir_;
  // A world of one: the host all-reduce of one rank is the identity (a trace uses no other call).
  test::SilentCommunicator comm_{0, 1, "one rank"};
};

TEST_F(TraceTest, OffRecordsNothing) {
  { const trace::Span span("off", trace::Lane::host); }
  EXPECT_EQ(trace::reserve("off", trace::Lane::host, -1), nullptr);
  EXPECT_EQ(trace::begin_transfer("off", trace::Lane::nvme_read, 1), nullptr);
  trace::start(16);
  trace::stop();
  const std::string json = trace::events_json(0);
  EXPECT_EQ(count_of(json, R"("ph":"X")"), 0u) << json;
  EXPECT_EQ(trace::dropped(), 0u);
}

TEST_F(TraceTest, SpansFromThreadsLandOnTheirLanes) {
  trace::start(1024);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([t] {
      for (int i = 0; i < 50; ++i) {
        const trace::Span outer("outer", t % 2 == 0 ? trace::Lane::host : trace::Lane::update_ahead, i);
        const trace::Span inner("inner", trace::Lane::comm_stream);
      }
    });
  for (auto& t : threads) t.join();
  trace::stop();
  EXPECT_EQ(trace::dropped(), 0u);
  const std::string json = "[" + trace::events_json(3) + "]";
  EXPECT_EQ(count_of(json, R"("ph":"X")"), 400u);
  EXPECT_EQ(count_of(json, R"("name":"outer")"), 200u);
  const fs::path file = dir_ / "events.json";
  std::ofstream(file) << json;
  EXPECT_EQ(check_with_python(file, R"(
x = [e for e in doc if e["ph"] == "X"]
assert len(x) == 400 and all(e["pid"] == 3 and e["dur"] >= 0 for e in x)
names = {e["tid"]: e["args"]["name"] for e in doc if e["ph"] == "M" and e["name"] == "thread_name"}
assert sorted(names.values()) == ["comm stream", "host", "update ahead"], names
assert {names[e["tid"]] for e in x if e["name"] == "inner"} == {"comm stream"}
assert sorted(e["args"]["n"] for e in x if e["name"] == "outer")[:4] == [0, 0, 0, 0]
assert [e for e in doc if e["ph"] == "M" and e["name"] == "process_name"][0]["args"]["name"] == "rank 3"
)"), 0);
}

TEST_F(TraceTest, CapacityBoundsWhatIsKeptAndCountsTheRest) {
  trace::start(10);
  for (int i = 0; i < 15; ++i) {
    const trace::Span span("s", trace::Lane::host, i);
  }
  trace::stop();
  EXPECT_EQ(trace::dropped(), 5u);
  EXPECT_EQ(trace::capacity(), 10u);
  const std::string json = trace::events_json(0);
  EXPECT_EQ(count_of(json, R"("ph":"X")"), 10u);
  EXPECT_EQ(count_of(json, R"("n":14)"), 0u) << "the first 10 are kept, not the last";
  EXPECT_THROW(trace::start(0), Error);
}

TEST_F(TraceTest, TransfersInFlightTakeTracksSideBySide) {
  trace::start(16);
  trace::Event* a = trace::begin_transfer("nvme read", trace::Lane::nvme_read, 4096);
  trace::Event* b = trace::begin_transfer("nvme read", trace::Lane::nvme_read, 4096);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_NE(a->tid, b->tid);
  trace::end_transfer(a);
  trace::Event* c = trace::begin_transfer("nvme read", trace::Lane::nvme_read, 4096);
  EXPECT_EQ(c->tid, a->tid) << "a track is free again once its transfer ended";
  trace::end_transfer(b);
  trace::end_transfer(c);
  trace::end_transfer(nullptr);
  trace::stop();
  const std::string json = trace::events_json(0);
  EXPECT_EQ(count_of(json, R"("name":"nvme read 0")"), 1u) << json;
  EXPECT_EQ(count_of(json, R"("name":"nvme read 1")"), 1u) << json;
}

TEST_F(TraceTest, StreamSpanIsTimedWhenTheStreamRunsTheWork) {
  std::unique_ptr<Device> device = make_cpu_device(1 << 20);
  std::unique_ptr<Stream> stream = device->create_stream();
  trace::start(16);
  // The stream is busy for 30 ms before the span's work, which itself takes 20 ms.
  stream->host_task([] { std::this_thread::sleep_for(std::chrono::milliseconds(30)); });
  const auto enqueued = trace::now_ns();
  {
    const StreamSpan span(*stream, "on stream", trace::Lane::comm_stream, 7);
    stream->host_task([] { std::this_thread::sleep_for(std::chrono::milliseconds(20)); });
  }
  stream->synchronize();
  trace::stop();
  const std::string json = trace::events_json(0);
  ASSERT_EQ(count_of(json, R"("name":"on stream")"), 1u) << json;
  const fs::path file = dir_ / "stream.json";
  std::ofstream(file) << "[" << json << "]";
  EXPECT_EQ(check_with_python(file, "e = [e for e in doc if e['name'] == 'on stream'][0]\n"
                                    "assert e['dur'] >= 19000, e\n"
                                    "assert e['ts'] >= " + std::to_string(enqueued / 1000 + 25000) + ", e\n"
                                    "assert e['args']['n'] == 7"),
            0);
}

TEST_F(TraceTest, FileIsOneJsonDocumentWithTheDroppedCount) {
  const fs::path file = dir_ / "step.json";
  {
    TraceFile trace(file.string(), comm_, "--trace", 4);
    EXPECT_THROW(TraceFile((dir_ / "second.json").string(), comm_), Error) << "one trace at a time";
    EXPECT_FALSE(fs::exists(dir_ / "second.json"));
    for (int i = 0; i < 6; ++i) {
      const trace::Span span("step", trace::Lane::host, i);
    }
    EXPECT_EQ(trace.write(), 2u);
    EXPECT_THROW(trace.write(), Error);
  }
  ASSERT_TRUE(fs::exists(file)) << "written, the file stays";
  EXPECT_EQ(check_with_python(file, R"(
x = [e for e in doc["traceEvents"] if e["ph"] == "X"]
assert len(x) == 4, x
assert doc["otherData"]["dropped_events"] == 2 and doc["otherData"]["dropped_events_per_rank"] == [2]
assert doc["otherData"]["capacity_per_rank"] == 4 and doc["otherData"]["ranks"] == 1
)"), 0);
}

TEST_F(TraceTest, ExistingFileIsRefusedAndLeftAsItWas) {
  const fs::path file = dir_ / "mine.json";
  std::ofstream(file) << "the user's";
  try {
    TraceFile trace(file.string(), comm_);
    FAIL() << "an existing file was taken";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("--trace"), std::string::npos) << message;
    EXPECT_NE(message.find("exists"), std::string::npos) << message;
    EXPECT_NE(message.find("remove it or name another"), std::string::npos) << message;
  }
  EXPECT_EQ(read_text(file), "the user's");
  EXPECT_FALSE(trace::on()) << "a refused trace does not record";
  // A symlink is not followed, even to a file that does not exist yet.
  fs::create_symlink(dir_ / "elsewhere.json", dir_ / "link.json");
  EXPECT_THROW(TraceFile((dir_ / "link.json").string(), comm_), Error);
  EXPECT_FALSE(fs::exists(dir_ / "elsewhere.json"));
  EXPECT_THROW(TraceFile((dir_ / "no such dir" / "t.json").string(), comm_), Error);
}

TEST_F(TraceTest, UnwrittenTraceRemovesOnlyTheFileItCreated) {
  const fs::path file = dir_ / "unwritten.json";
  { TraceFile trace(file.string(), comm_); }
  EXPECT_FALSE(fs::exists(file)) << "the run failed before write(): its empty file goes";
  EXPECT_FALSE(trace::on());
  // Someone put another file at the name meanwhile: that one stays.
  {
    TraceFile trace(file.string(), comm_);
    fs::remove(file);
    std::ofstream(file) << "someone else's";
  }
  EXPECT_EQ(read_text(file), "someone else's");
}

// A write that fails part-way (here: past the file size limit) is no trace: the file goes, the
// error names the file, and the capacity is checked before any file is made. In a child process,
// whose size limit and signals the test may change.
TEST_F(TraceTest, TraceWrittenInPartIsRemovedAndBadCapacitiesAreRefusedFirst) {
  EXPECT_THROW(TraceFile((dir_ / "none.json").string(), comm_, "--trace", 0), Error);
  EXPECT_THROW(TraceFile((dir_ / "huge.json").string(), comm_, "--trace", trace::kMaxCapacity + 1), Error);
  EXPECT_FALSE(fs::exists(dir_ / "none.json"));
  EXPECT_FALSE(fs::exists(dir_ / "huge.json"));

  const fs::path file = dir_ / "cut.json";
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG instead
    const rlimit limit{200, 200};
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) ::_exit(3);
    try {
      TraceFile trace(file.string(), comm_, "--trace", 64);
      for (int i = 0; i < 64; ++i) {
        const trace::Span span("a span long enough to pass the limit", trace::Lane::host, i);
      }
      trace.write();
      ::_exit(4);  // the write should have failed
    } catch (const IoError& error) {
      const std::string message = error.what();
      ::_exit(message.find(file.string()) == std::string::npos ? 5 : fs::exists(file) ? 6 : 0);
    } catch (...) {
      ::_exit(7);
    }
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: setrlimit failed, 4: the write passed the limit, 5: the error does not "
                                       "name the file, 6: the file is still there, 7: another error";
  EXPECT_FALSE(fs::exists(file));
}

}  // namespace
}  // namespace zest
