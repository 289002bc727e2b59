// The simulated timeline as a picture: one panel per schedule, one row per rank, one box per
// compute action labelled with its micro-batch, all panels on the same time scale.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>

#include "octet/error.h"
#include "octet/pipeline.h"

namespace octet::pipeline {
namespace {

constexpr double kLeft = 70.0;     // room for the rank labels
constexpr double kWidth = 1100.0;  // of the longest makespan
constexpr double kRow = 18.0;
constexpr double kTitle = 22.0;
constexpr double kGap = 14.0;

const char* fill(const Action& a) {
  // Chunk 1 (second model copy / return leg of the V) a shade darker.
  const bool second = a.chunk % 2 == 1;
  switch (a.kind) {
    case ActionKind::Forward:
      return second ? "#5b8fd6" : "#8fb8ee";
    case ActionKind::Backward:
      return second ? "#4fa35a" : "#86cc8e";
    case ActionKind::BackwardInput:
      return second ? "#7fbf6a" : "#b6e3a8";
    case ActionKind::BackwardWeight:
      return "#f2c14e";
    case ActionKind::ForwardBackward:
      return "#b48ad8";
    default:
      return "#cccccc";
  }
}

std::string label(const Action& a) {
  if (a.kind == ActionKind::ForwardBackward) {
    return std::to_string(a.micro_batch) + "|" + std::to_string(a.backward_micro_batch);
  }
  return std::to_string(a.micro_batch);
}

std::string escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '&') {
      out += "&amp;";
    } else if (c == '<') {
      out += "&lt;";
    } else if (c == '>') {
      out += "&gt;";
    } else {
      out += c;
    }
  }
  return out;
}

std::string number(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", value);
  return text;
}

}  // namespace

void write_timeline_svg(const std::vector<TimelinePanel>& panels, const std::string& path) {
  double longest = 0.0;
  double height = kGap;
  for (const TimelinePanel& p : panels) {
    OCTET_CHECK(p.schedule != nullptr && p.report != nullptr,
                "timeline: a panel needs its schedule and its report");
    longest = std::max(longest, p.report->makespan);
    height += kTitle + kRow * p.schedule->ranks + kGap;
  }
  const double scale = longest > 0 ? kWidth / longest : 1.0;
  std::string svg;
  svg += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + number(kLeft + kWidth + 20) +
         "\" height=\"" + number(height + 20) + "\" font-family=\"sans-serif\" font-size=\"10\">\n";
  svg += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  double y = kGap;
  for (const TimelinePanel& p : panels) {
    const Schedule& s = *p.schedule;
    const SimulationReport& r = *p.report;
    svg += "<text x=\"4\" y=\"" + number(y + 14) + "\" font-size=\"13\" font-weight=\"bold\">" +
           schedule_name(s.kind) + "</text><text x=\"" + number(kLeft + 60) + "\" y=\"" +
           number(y + 14) + "\" font-size=\"11\">makespan " + number(r.makespan) + ", bubble " +
           number(r.bubble) + " (" + number(100 * r.bubble_fraction) +
           "%); F blue, B green, BI light green, W yellow, F&amp;B purple; second chunk darker" +
           "</text>\n";
    y += kTitle;
    for (int rank = 0; rank < s.ranks; ++rank) {
      svg +=
          "<text x=\"4\" y=\"" + number(y + 13) + "\">rank " + std::to_string(rank) + "</text>\n";
      svg += "<rect x=\"" + number(kLeft) + "\" y=\"" + number(y + 1) + "\" width=\"" +
             number(r.makespan * scale) + "\" height=\"" + number(kRow - 2) +
             "\" fill=\"#f3f3f3\"/>\n";
      for (const TimedAction& t : r.ranks[rank].timeline) {
        const Action& a = s.actions[rank][t.index];
        const double x = kLeft + t.start * scale;
        const double w = (t.end - t.start) * scale;
        svg += "<rect x=\"" + number(x) + "\" y=\"" + number(y + 1) + "\" width=\"" + number(w) +
               "\" height=\"" + number(kRow - 2) + "\" fill=\"" + fill(a) +
               "\" stroke=\"#333\" stroke-width=\"0.5\"><title>" + escape(describe(a)) + " " +
               number(t.start) + ".." + number(t.end) + "</title></rect>\n";
        if (w >= 9) {
          svg += "<text x=\"" + number(x + w / 2) + "\" y=\"" + number(y + 12.5) +
                 "\" text-anchor=\"middle\" font-size=\"9\">" + escape(label(a)) + "</text>\n";
        }
      }
      y += kRow;
    }
    y += kGap;
  }
  svg += "</svg>\n";
  const std::string temp = path + ".tmp";
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    OCTET_CHECK(out.good(), "timeline: cannot write ", temp);
    out << svg;
    OCTET_CHECK(out.good(), "timeline: writing ", temp, " failed");
  }
  OCTET_CHECK(std::rename(temp.c_str(), path.c_str()) == 0, "timeline: cannot rename ", temp,
              " to ", path);
}

}  // namespace octet::pipeline
