#include "memory_report.hpp"

#include <algorithm>
#include <array>
#include <cstdio>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace zest::bench {
namespace {

double mib(std::size_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

std::string printf_string(const char* format, auto... args) {
  char line[512];
  std::snprintf(line, sizeof line, format, args...);
  return line;
}

nlohmann::ordered_json by_purpose(const std::array<std::size_t, kHostPurposeCount>& bytes) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (std::size_t p = 0; p < kHostPurposeCount; ++p)
    out[std::string(host_purpose_name(static_cast<HostPurpose>(p)))] = bytes[p];
  return out;
}

nlohmann::ordered_json record_json(const MemoryRecord& r) {
  nlohmann::ordered_json out = {
      {"name", r.name},
      {"system", r.system},
      {"error", r.error},
      {"stage", r.stage},
      {"offload_optimizer", r.offload_optimizer},
      {"offload_param", r.offload_param},
      {"offload_ratio", r.offload_ratio},
      {"states", r.states},
      {"ranks", r.ranks},
      {"params", r.params},
      {"peak_device_bytes", r.peak_device_bytes},
      {"peak_params_bytes", r.peak_params_bytes},
      {"peak_grads_bytes", r.peak_grads_bytes},
      {"peak_optimizer_states_bytes", r.peak_optimizer_bytes},
      {"peak_buffers_bytes", r.peak_buffers_bytes},
      {"peak_host_pinned_bytes", r.peak_host_pinned_bytes},
      {"nvme_bytes", r.nvme_bytes},
      {"start_host_rss_bytes", r.start_host_rss_bytes},
      {"peak_host_rss_bytes", r.peak_host_rss_bytes},
      {"host_need_bytes", r.host_need_bytes},
      {"estimate_pinned_bytes", r.estimate_pinned_bytes},
      {"peak_pinned_by_purpose", by_purpose(r.peak_pinned_by)},
      {"estimate_pinned_by_purpose", by_purpose(r.estimate_pinned_by)},
      {"ratio_to_ddp", r.ratio_to_ddp},
      {"formula_bytes", r.formula_bytes},
      {"formula_deviation", r.formula_deviation},
      {"estimate_device_bytes", r.estimate_device_bytes},
      {"estimate_deviation", r.estimate_deviation},
      {"wire_bytes_per_step", r.wire_bytes},
      {"wire_across_hosts_bytes_per_step", r.wire_across_bytes},
      {"wire_formula_bytes", r.wire_formula_bytes},
      {"step_seconds", r.step_seconds},
      {"step_time_ratio_to_ddp", r.step_time_ratio_to_ddp},
      {"final_loss", r.final_loss},
      {"loss_matches_ddp", r.loss_matches_ddp},
      {"loss_difference_to_torch_ddp", nullptr},
      {"loss_matches_torch_ddp", nullptr}};
  if (r.loss_difference_to_torch_ddp) {
    out["loss_difference_to_torch_ddp"] = *r.loss_difference_to_torch_ddp;
    out["loss_matches_torch_ddp"] = r.loss_matches_torch_ddp;
  }
  return out;
}

}  // namespace

std::string format_table(const std::vector<MemoryRecord>& records) {
  std::string out = printf_string("%-42s %9s %8s %8s %8s %8s %7s %10s %8s %8s %8s %8s %7s %-10s %s\n",
                                  "configuration (per rank)", "peak MiB", "params", "grads", "optim", "buffers",
                                  "vs DDP", "formula", "dev", "pinned", "nvme", "step ms", "vs DDP", "loss = DDP",
                                  "loss = torch DDP");
  for (const MemoryRecord& r : records) {
    if (!r.error.empty()) {
      out += printf_string("%-42s could not run: %s\n", r.name.c_str(), r.error.c_str());
      continue;
    }
    const std::string torch_ddp =
        r.loss_difference_to_torch_ddp
            ? printf_string("%s (%.1e)", r.loss_matches_torch_ddp ? "yes" : "NO", *r.loss_difference_to_torch_ddp)
            : std::string("-");
    // A peer has no buffers, pinned or NVMe bytes, formula or estimate of zest's: dashes, not zeros.
    const auto zest_only = [&](const char* format, double value) {
      return r.peer() ? std::string("-") : printf_string(format, value);
    };
    out += printf_string("%-42s %9.1f %8.1f %8.1f %8.1f %8s %6.2fx %10s %8s %8s %8s %8.1f %6.2fx %-10s %s\n",
                         r.name.c_str(), mib(r.peak_device_bytes), mib(r.peak_params_bytes), mib(r.peak_grads_bytes),
                         mib(r.peak_optimizer_bytes), zest_only("%.1f", mib(r.peak_buffers_bytes)).c_str(),
                         r.ratio_to_ddp, zest_only("%.1f", mib(r.formula_bytes)).c_str(),
                         zest_only("%+.1f%%", 100 * r.formula_deviation).c_str(),
                         zest_only("%.1f", mib(r.peak_host_pinned_bytes)).c_str(),
                         zest_only("%.1f", mib(r.nvme_bytes)).c_str(), 1000 * r.step_seconds,
                         r.step_time_ratio_to_ddp, r.loss_matches_ddp ? "yes" : "NO", torch_ddp.c_str());
  }
  return out;
}

std::string format_host_table(const std::vector<MemoryRecord>& records) {
  std::string out = printf_string("\nhost memory per rank, MiB (measured / what the placement needs by formula):\n"
                                  "%-42s %23s %15s", "configuration", "RSS start/peak/need", "pinned / est");
  for (std::size_t p = 0; p < kHostPurposeCount; ++p) {
    const std::string_view name = host_purpose_name(static_cast<HostPurpose>(p));
    out += printf_string(" %19.*s", static_cast<int>(name.size()), name.data());
  }
  out += "\n";
  for (const MemoryRecord& r : records) {
    if (!r.error.empty()) continue;
    if (r.peer()) {  // its RSS; pinned memory and a placement formula are zest's
      out += printf_string("%-42s %7.1f/%7.1f/%-7s\n", r.name.c_str(), mib(r.start_host_rss_bytes),
                           mib(r.peak_host_rss_bytes), "-");
      continue;
    }
    out += printf_string("%-42s %7.1f/%7.1f/%-7.1f %7.1f/%-7.1f", r.name.c_str(), mib(r.start_host_rss_bytes),
                         mib(r.peak_host_rss_bytes), mib(r.host_need_bytes),
                         mib(r.peak_host_pinned_bytes), mib(r.estimate_pinned_bytes));
    for (std::size_t p = 0; p < kHostPurposeCount; ++p)
      out += printf_string(" %9.2f/%-9.2f", mib(r.peak_pinned_by[p]), mib(r.estimate_pinned_by[p]));
    out += "\n";
  }
  return out;
}

std::string format_wire_table(const std::vector<MemoryRecord>& records) {
  std::string out = printf_string(
      "\nbytes sent per rank per step, MiB (rank 0's last step; ZeRO's formula: 2 or 3 x the "
      "parameters' bytes x (n-1)/n):\n%-42s %12s %12s %14s %10s\n",
      "configuration", "sent", "across hosts", "ZeRO's formula", "vs formula");
  for (const MemoryRecord& r : records) {
    if (!r.error.empty() || r.peer()) continue;
    const double vs = r.wire_formula_bytes > 0
                          ? static_cast<double>(r.wire_bytes) / static_cast<double>(r.wire_formula_bytes) - 1
                          : 0;
    out += printf_string("%-42s %12.2f %12.2f %14.2f %+9.1f%%\n", r.name.c_str(), mib(r.wire_bytes),
                         mib(r.wire_across_bytes), mib(r.wire_formula_bytes), 100 * vs);
  }
  return out;
}

std::string format_fit_table(const std::vector<FitRecord>& fits) {
  if (fits.empty()) return "";
  std::string out = printf_string("\nlargest model that trains within %.0f MiB of device memory per rank:\n",
                                  mib(fits.front().device_budget));
  const double base = static_cast<double>(fits.front().largest_params);
  out += printf_string("  %-40s %12s %8s %8s   %-16s %s\n", "configuration", "parameters", "layers", "vs DDP",
                       "bound by", "device MiB per rank: params grads optim buffers");
  for (const FitRecord& f : fits) {
    const auto device_mib = [&](MemoryCategory c) { return mib(f.device.device_of(c)); };
    out += printf_string("  %-40s %s%9.2fM %8zu %7.1fx   %-16s %6.1f %5.1f %5.1f %5.1f\n", f.name.c_str(),
                         f.at_least ? ">=" : "  ", static_cast<double>(f.largest_params) / 1e6, f.layers,
                         base > 0 ? static_cast<double>(f.largest_params) / base : 0.0, f.bound.c_str(),
                         device_mib(MemoryCategory::params), device_mib(MemoryCategory::grads),
                         device_mib(MemoryCategory::optimizer_states), device_mib(MemoryCategory::buffers));
  }
  return out;
}

std::string to_json(const std::vector<MemoryRecord>& records, const std::vector<FitRecord>& fits) {
  nlohmann::ordered_json out = {{"records", nlohmann::ordered_json::array()},
                                {"largest_model_that_fits", nlohmann::ordered_json::array()}};
  for (const MemoryRecord& r : records) out["records"].push_back(record_json(r));
  for (const FitRecord& f : fits)
    out["largest_model_that_fits"].push_back({{"name", f.name},
                                              {"device_budget_bytes", f.device_budget},
                                              {"params", f.largest_params},
                                              {"layers", f.layers},
                                              {"bound_by", f.bound},
                                              {"at_least", f.at_least}});
  // A peer's error text is whatever its library printed: bytes that are not UTF-8 are replaced,
  // not a reason to lose the report.
  return out.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

std::string to_csv(const std::vector<MemoryRecord>& records) {
  std::string out =
      "name,stage,offload_optimizer,offload_param,offload_ratio,ranks,params,peak_device_bytes,peak_params_bytes,"
      "peak_grads_bytes,peak_optimizer_states_bytes,peak_buffers_bytes,peak_host_pinned_bytes,nvme_bytes,"
      "ratio_to_ddp,formula_bytes,formula_deviation,step_seconds,step_time_ratio_to_ddp,final_loss,"
      "loss_matches_ddp,start_host_rss_bytes,peak_host_rss_bytes,host_need_bytes,estimate_pinned_bytes,system,error,"
      "loss_difference_to_torch_ddp,loss_matches_torch_ddp,states";
  for (std::size_t p = 0; p < kHostPurposeCount; ++p) {
    const std::string name(host_purpose_name(static_cast<HostPurpose>(p)));
    out += ",peak_pinned_" + name + "_bytes,estimate_pinned_" + name + "_bytes";
  }
  out += "\n";
  for (const MemoryRecord& r : records) {
    out += printf_string("\"%s\",%d,%s,%s,%g,%d,%zu,%zu,%zu,%zu,%zu,%zu,%zu,%zu,%.6f,%zu,%.6f,%.6f,%.6f,%.6f,%s",
                         r.name.c_str(), r.stage, r.offload_optimizer.c_str(), r.offload_param.c_str(),
                         r.offload_ratio, r.ranks,
                         r.params, r.peak_device_bytes, r.peak_params_bytes, r.peak_grads_bytes,
                         r.peak_optimizer_bytes, r.peak_buffers_bytes, r.peak_host_pinned_bytes, r.nvme_bytes,
                         r.ratio_to_ddp, r.formula_bytes, r.formula_deviation, r.step_seconds,
                         r.step_time_ratio_to_ddp, r.final_loss, r.loss_matches_ddp ? "true" : "false");
    out += printf_string(",%zu,%zu,%zu,%zu", r.start_host_rss_bytes, r.peak_host_rss_bytes, r.host_need_bytes,
                         r.estimate_pinned_bytes);
    std::string error = r.error;  // CSV quoting: a quote doubles
    for (std::size_t at = error.find('"'); at != std::string::npos; at = error.find('"', at + 2))
      error.insert(at, 1, '"');
    out += ",\"" + r.system + "\",\"" + error + "\"," +
           (r.loss_difference_to_torch_ddp ? printf_string("%.6g,%s", *r.loss_difference_to_torch_ddp,
                                                           r.loss_matches_torch_ddp ? "true" : "false")
                                           : std::string(","));
    out += "," + r.states;
    for (std::size_t p = 0; p < kHostPurposeCount; ++p)
      out += printf_string(",%zu,%zu", r.peak_pinned_by[p], r.estimate_pinned_by[p]);
    out += "\n";
  }
  return out;
}

namespace {

// One horizontal bar chart: a row per label (names on the left, right-aligned), stacked segments,
// a value after each bar, and a legend under it. Rows without segments show `note` instead.
struct BarRow {
  std::string label;
  std::vector<std::pair<double, int>> segments;  // (value, series index)
  std::string value_text, note;
};
struct Series {
  const char* name;
  const char* color;
};

std::string xml_text(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else out += c;
  }
  return out;
}

// The chart at vertical offset `top`; returns its SVG and advances `top` past it.
std::string bar_chart(const std::string& title, const std::string& unit, const std::vector<BarRow>& rows,
                      const std::vector<Series>& series, int& top) {
  constexpr int kLabel = 330, kBars = 520, kRow = 22, kBar = 15;
  double largest = 0;
  for (const BarRow& r : rows) {
    double sum = 0;
    for (const auto& [value, _] : r.segments) sum += value;
    largest = std::max(largest, sum);
  }
  if (largest <= 0) largest = 1;
  std::string out = printf_string("<text x=\"10\" y=\"%d\" font-size=\"16\">%s</text>\n", top + 20,
                                  xml_text(title).c_str());
  const int axis_top = top + 34, axis_bottom = axis_top + static_cast<int>(rows.size()) * kRow;
  for (int t = 0; t <= 4; ++t) {  // grid and scale along the bottom
    const int x = kLabel + kBars * t / 4;
    out += printf_string("<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#ddd\"/>\n"
                         "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" fill=\"#555\">%.0f</text>\n",
                         x, axis_top, x, axis_bottom, x, axis_bottom + 14, largest * t / 4);
  }
  out += printf_string("<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" fill=\"#555\">%s</text>\n",
                       kLabel + kBars / 2, axis_bottom + 30, xml_text(unit).c_str());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const BarRow& r = rows[i];
    const int y = axis_top + static_cast<int>(i) * kRow + (kRow - kBar) / 2;
    out += printf_string("<text x=\"%d\" y=\"%d\" text-anchor=\"end\">%s</text>\n", kLabel - 8, y + kBar - 3,
                         xml_text(r.label).c_str());
    double x = kLabel;
    for (const auto& [value, s] : r.segments) {
      const double w = kBars * value / largest;
      out += printf_string("<rect x=\"%.1f\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"%s\"><title>%s: %.1f %s"
                           "</title></rect>\n", x, y, w, kBar, series[static_cast<std::size_t>(s)].color,
                           series[static_cast<std::size_t>(s)].name, value, xml_text(unit).c_str());
      x += w;
    }
    const std::string text = r.segments.empty() ? r.note : r.value_text;
    out += printf_string("<text x=\"%.1f\" y=\"%d\" fill=\"#333\">%s</text>\n", x + 6, y + kBar - 3,
                         xml_text(text).c_str());
  }
  int legend_y = axis_bottom + 44;
  for (std::size_t s = 0; s < series.size(); ++s) {
    const int x = 10 + static_cast<int>(s % 4) * 215;
    if (s > 0 && s % 4 == 0) legend_y += 18;
    out += printf_string("<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"12\" fill=\"%s\"/>"
                         "<text x=\"%d\" y=\"%d\">%s</text>\n",
                         x, legend_y, series[s].color, x + 16, legend_y + 11, series[s].name);
  }
  top = legend_y + 36;
  return out;
}

}  // namespace

std::string to_svg(const std::vector<MemoryRecord>& records, const std::vector<FitRecord>& fits) {
  // zest's categories in blues and oranges, a peer's in purples: the two systems read apart at once.
  const std::vector<Series> series = {{"zest params", "#4e79a7"},         {"zest grads", "#f28e2b"},
                                      {"zest optimizer states", "#e15759"}, {"zest buffers", "#76b7b2"},
                                      {"peer params", "#54278f"},          {"peer grads", "#807dba"},
                                      {"peer optimizer states", "#bcbddc"}};
  std::vector<BarRow> memory;
  for (const MemoryRecord& r : records) {
    // The error's start: the table and the JSON have all of it.
    const std::string why = r.error.size() > 60 ? r.error.substr(0, 60) + "..." : r.error;
    BarRow row{r.name, {}, printf_string("%.1f", mib(r.peak_device_bytes)), "could not run: " + why};
    if (r.error.empty()) {
      const int base = r.peer() ? 4 : 0;
      row.segments = {{mib(r.peak_params_bytes), base}, {mib(r.peak_grads_bytes), base + 1},
                      {mib(r.peak_optimizer_bytes), base + 2}};
      if (!r.peer()) row.segments.push_back({mib(r.peak_buffers_bytes), 3});
    }
    memory.push_back(row);
  }
  int top = 0;
  std::string charts = bar_chart("Peak memory per rank by category", "MiB per rank", memory, series, top);
  if (!fits.empty()) {
    std::vector<BarRow> sizes;
    for (const FitRecord& f : fits)
      sizes.push_back({f.name,
                       {{static_cast<double>(f.largest_params) / 1e6, 0}},
                       printf_string("%s%.1fM (bound by %s)", f.at_least ? ">=" : "",
                                     static_cast<double>(f.largest_params) / 1e6, f.bound.c_str()),
                       ""});
    charts += bar_chart(printf_string("Largest model that trains within %.0f MiB of device memory per rank",
                                      mib(fits.front().device_budget)),
                        "million parameters", sizes, {{"zest", "#4e79a7"}}, top);
  }
  return printf_string("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"1060\" height=\"%d\" "
                       "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" "
                       "fill=\"white\"/>\n", top) + charts + "</svg>\n";
}

}  // namespace zest::bench
