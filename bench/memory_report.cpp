#include "memory_report.hpp"

#include <algorithm>
#include <array>
#include <cstdio>

namespace zest::bench {
namespace {

double mib(std::size_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

std::string printf_string(const char* format, auto... args) {
  char line[512];
  std::snprintf(line, sizeof line, format, args...);
  return line;
}

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string purposes_json(const std::array<std::size_t, kHostPurposeCount>& bytes) {
  std::string out = "{";
  for (std::size_t p = 0; p < kHostPurposeCount; ++p)
    out += (p ? ", " : "") + json_string(std::string(host_purpose_name(static_cast<HostPurpose>(p)))) +
           printf_string(": %zu", bytes[p]);
  return out + "}";
}

}  // namespace

std::string format_table(const std::vector<MemoryRecord>& records) {
  std::string out = printf_string("%-42s %9s %8s %8s %8s %8s %7s %10s %8s %8s %8s %8s %7s %s\n",
                                  "configuration (per rank)", "peak MiB", "params", "grads", "optim", "buffers",
                                  "vs DDP", "formula", "dev", "pinned", "nvme", "step ms", "vs DDP", "loss = DDP");
  for (const MemoryRecord& r : records) {
    out += printf_string("%-42s %9.1f %8.1f %8.1f %8.1f %8.1f %6.2fx %10.1f %+7.1f%% %8.1f %8.1f %8.1f %6.2fx %s\n",
                         r.name.c_str(), mib(r.peak_device_bytes), mib(r.peak_params_bytes), mib(r.peak_grads_bytes),
                         mib(r.peak_optimizer_bytes), mib(r.peak_buffers_bytes), r.ratio_to_ddp, mib(r.formula_bytes),
                         100 * r.formula_deviation, mib(r.peak_host_pinned_bytes), mib(r.nvme_bytes),
                         1000 * r.step_seconds, r.step_time_ratio_to_ddp, r.loss_matches_ddp ? "yes" : "NO");
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
    out += printf_string("%-42s %7.1f/%7.1f/%-7.1f %7.1f/%-7.1f", r.name.c_str(), mib(r.start_host_rss_bytes),
                         mib(r.peak_host_rss_bytes), mib(r.host_need_bytes),
                         mib(r.peak_host_pinned_bytes), mib(r.estimate_pinned_bytes));
    for (std::size_t p = 0; p < kHostPurposeCount; ++p)
      out += printf_string(" %9.2f/%-9.2f", mib(r.peak_pinned_by[p]), mib(r.estimate_pinned_by[p]));
    out += "\n";
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
  std::string out = "{\n  \"records\": [\n";
  for (std::size_t i = 0; i < records.size(); ++i) {
    const MemoryRecord& r = records[i];
    out += "    {\"name\": " + json_string(r.name) + printf_string(", \"stage\": %d", r.stage) +
           ", \"offload_optimizer\": " + json_string(r.offload_optimizer) +
           ", \"offload_param\": " + json_string(r.offload_param) +
           printf_string(", \"offload_ratio\": %g", r.offload_ratio) +
           printf_string(", \"ranks\": %d, \"params\": %zu", r.ranks, r.params) +
           printf_string(", \"peak_device_bytes\": %zu, \"peak_params_bytes\": %zu, \"peak_grads_bytes\": %zu",
                         r.peak_device_bytes, r.peak_params_bytes, r.peak_grads_bytes) +
           printf_string(", \"peak_optimizer_states_bytes\": %zu, \"peak_buffers_bytes\": %zu",
                         r.peak_optimizer_bytes, r.peak_buffers_bytes) +
           printf_string(", \"peak_host_pinned_bytes\": %zu, \"nvme_bytes\": %zu", r.peak_host_pinned_bytes,
                         r.nvme_bytes) +
           printf_string(", \"start_host_rss_bytes\": %zu, \"peak_host_rss_bytes\": %zu, \"host_need_bytes\": %zu",
                         r.start_host_rss_bytes, r.peak_host_rss_bytes, r.host_need_bytes) +
           printf_string(", \"estimate_pinned_bytes\": %zu", r.estimate_pinned_bytes) +
           ", \"peak_pinned_by_purpose\": " + purposes_json(r.peak_pinned_by) +
           ", \"estimate_pinned_by_purpose\": " + purposes_json(r.estimate_pinned_by) +
           printf_string(", \"ratio_to_ddp\": %.6f, \"formula_bytes\": %zu, \"formula_deviation\": %.6f",
                         r.ratio_to_ddp, r.formula_bytes, r.formula_deviation) +
           printf_string(", \"estimate_device_bytes\": %zu, \"estimate_deviation\": %.6f",
                         r.estimate_device_bytes, r.estimate_deviation) +
           printf_string(", \"step_seconds\": %.6f, \"step_time_ratio_to_ddp\": %.6f", r.step_seconds,
                         r.step_time_ratio_to_ddp) +
           printf_string(", \"final_loss\": %.6f, \"loss_matches_ddp\": %s}", r.final_loss,
                         r.loss_matches_ddp ? "true" : "false") +
           (i + 1 < records.size() ? ",\n" : "\n");
  }
  out += "  ],\n  \"largest_model_that_fits\": [\n";
  for (std::size_t i = 0; i < fits.size(); ++i)
    out += "    {\"name\": " + json_string(fits[i].name) +
           printf_string(", \"device_budget_bytes\": %zu, \"params\": %zu, \"layers\": %zu", fits[i].device_budget,
                         fits[i].largest_params, fits[i].layers) +
           ", \"bound_by\": " + json_string(fits[i].bound) + ", \"at_least\": " + (fits[i].at_least ? "true" : "false") + "}" +
           (i + 1 < fits.size() ? ",\n" : "\n");
  return out + "  ]\n}\n";
}

std::string to_csv(const std::vector<MemoryRecord>& records) {
  std::string out =
      "name,stage,offload_optimizer,offload_param,offload_ratio,ranks,params,peak_device_bytes,peak_params_bytes,"
      "peak_grads_bytes,peak_optimizer_states_bytes,peak_buffers_bytes,peak_host_pinned_bytes,nvme_bytes,"
      "ratio_to_ddp,formula_bytes,formula_deviation,step_seconds,step_time_ratio_to_ddp,final_loss,"
      "loss_matches_ddp,start_host_rss_bytes,peak_host_rss_bytes,host_need_bytes,estimate_pinned_bytes";
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
    for (std::size_t p = 0; p < kHostPurposeCount; ++p)
      out += printf_string(",%zu,%zu", r.peak_pinned_by[p], r.estimate_pinned_by[p]);
    out += "\n";
  }
  return out;
}

std::string to_svg(const std::vector<MemoryRecord>& records) {
  constexpr int kWidth = 640, kBarWidth = 70, kGap = 40, kLeft = 80, kTop = 50, kHeight = 300;
  constexpr std::array<const char*, 4> kNames = {"params", "grads", "optimizer states", "buffers"};
  constexpr std::array<const char*, 4> kColors = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2"};
  std::size_t largest = 1;
  for (const MemoryRecord& r : records)
    largest = std::max(largest, r.peak_params_bytes + r.peak_grads_bytes + r.peak_optimizer_bytes + r.peak_buffers_bytes);
  const int width = std::max(kWidth, kLeft + static_cast<int>(records.size()) * (kBarWidth + kGap) + 40);
  std::string out = printf_string(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%d\" y=\"24\" font-size=\"16\">Peak device memory per rank by category (MiB)</text>\n",
      width, kTop + kHeight + 110, kLeft);
  // Axis with four ticks.
  for (int t = 0; t <= 4; ++t) {
    const double value = mib(largest) * t / 4;
    const int y = kTop + kHeight - kHeight * t / 4;
    out += printf_string("<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#ddd\"/>\n"
                         "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">%.0f</text>\n",
                         kLeft, y, width - 20, y, kLeft - 6, y + 4, value);
  }
  for (std::size_t i = 0; i < records.size(); ++i) {
    const MemoryRecord& r = records[i];
    const std::array<std::size_t, 4> parts = {r.peak_params_bytes, r.peak_grads_bytes, r.peak_optimizer_bytes,
                                              r.peak_buffers_bytes};
    const int x = kLeft + 20 + static_cast<int>(i) * (kBarWidth + kGap);
    double y = kTop + kHeight;
    for (std::size_t c = 0; c < parts.size(); ++c) {
      const double h = kHeight * static_cast<double>(parts[c]) / static_cast<double>(largest);
      y -= h;
      out += printf_string("<rect x=\"%d\" y=\"%.1f\" width=\"%d\" height=\"%.1f\" fill=\"%s\"><title>%s: %.1f MiB"
                           "</title></rect>\n", x, y, kBarWidth, h, kColors[c], kNames[c], mib(parts[c]));
    }
    out += printf_string("<text x=\"%d\" y=\"%.1f\" text-anchor=\"middle\">%.0f</text>\n", x + kBarWidth / 2, y - 4,
                         mib(parts[0] + parts[1] + parts[2] + parts[3]));
    out += printf_string("<text x=\"%d\" y=\"%d\" text-anchor=\"end\" transform=\"rotate(-30 %d %d)\">%s</text>\n",
                         x + kBarWidth / 2, kTop + kHeight + 16, x + kBarWidth / 2, kTop + kHeight + 16, r.name.c_str());
  }
  for (std::size_t c = 0; c < kNames.size(); ++c)
    out += printf_string("<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"12\" fill=\"%s\"/>"
                         "<text x=\"%d\" y=\"%d\">%s</text>\n",
                         kLeft + static_cast<int>(c) * 150, kTop + kHeight + 80, kColors[c],
                         kLeft + 16 + static_cast<int>(c) * 150, kTop + kHeight + 91, kNames[c]);
  return out + "</svg>\n";
}

}  // namespace zest::bench
