// The memory benchmark's JSON: whatever a row's texts hold (a peer's error message with control
// characters or terminal colours, quotes, bytes that are not UTF-8), the file parses as JSON and
// gives the texts back.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "memory_report.hpp"

namespace zest::bench {
namespace {

TEST(MemoryReportJson, AnyTextParsesBack) {
  MemoryRecord zest_row;
  zest_row.name = "stage 2 \"quoted\" \\ back";
  zest_row.params = 1234;
  zest_row.peak_pinned_by[0] = 77;
  MemoryRecord peer;
  peer.name = "FSDP2 + AdamW";
  peer.system = "torch";
  peer.error = "RuntimeError:\tline\x01 \x1b[31mred\x1b[0m";
  peer.loss_difference_to_torch_ddp = 0.5;
  MemoryRecord latin1;
  latin1.name = "caf\xe9";
  FitRecord fit;
  fit.name = "tab\there";
  fit.largest_params = 99;

  const nlohmann::json doc = nlohmann::json::parse(to_json({zest_row, peer, latin1}, {fit}));
  const nlohmann::json& records = doc.at("records");
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[0].at("name"), zest_row.name);
  EXPECT_EQ(records[0].at("params"), 1234);
  EXPECT_EQ(records[0].at("peak_pinned_by_purpose").at(std::string(host_purpose_name(HostPurpose{}))), 77);
  EXPECT_TRUE(records[0].at("loss_difference_to_torch_ddp").is_null());
  EXPECT_TRUE(records[0].at("loss_matches_torch_ddp").is_null());
  EXPECT_EQ(records[1].at("error"), peer.error);
  EXPECT_EQ(records[1].at("system"), "torch");
  EXPECT_EQ(records[1].at("loss_difference_to_torch_ddp"), 0.5);
  EXPECT_EQ(records[1].at("loss_matches_torch_ddp"), false);
  EXPECT_EQ(records[2].at("name"), "caf\xef\xbf\xbd");  // the stray byte as U+FFFD, the rest kept
  EXPECT_EQ(doc.at("largest_model_that_fits").at(0).at("name"), fit.name);
  EXPECT_EQ(doc.at("largest_model_that_fits").at(0).at("params"), 99);
}

}  // namespace
}  // namespace zest::bench
