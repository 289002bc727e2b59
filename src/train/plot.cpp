// A small self-contained SVG line chart: axes, ticks, one polyline per series, a legend.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>

#include "octet/train.h"

namespace octet {

void write_loss_svg(const std::string& path, const std::string& title,
                    const std::vector<std::pair<std::string, std::vector<CurvePoint>>>& series) {
  const double width = 800, height = 480, left = 70, right = 20, top = 40, bottom = 50;
  double x_min = std::numeric_limits<double>::max(), x_max = -x_min;
  double y_min = x_min, y_max = -x_min;
  for (const auto& [name, points] : series) {
    for (const CurvePoint& p : points) {
      if (!std::isfinite(p.y)) continue;
      x_min = std::min(x_min, p.x);
      x_max = std::max(x_max, p.x);
      y_min = std::min(y_min, p.y);
      y_max = std::max(y_max, p.y);
    }
  }
  if (x_min > x_max) x_min = 0, x_max = 1, y_min = 0, y_max = 1;
  if (x_max == x_min) x_max = x_min + 1;
  if (y_max == y_min) y_max = y_min + 1;
  const double pad = 0.05 * (y_max - y_min);
  y_min -= pad;
  y_max += pad;
  auto sx = [&](double x) { return left + (x - x_min) / (x_max - x_min) * (width - left - right); };
  auto sy = [&](double y) { return top + (y_max - y) / (y_max - y_min) * (height - top - bottom); };

  std::string svg;
  char buffer[512];
  auto add = [&](const char* format, auto... args) {
    std::snprintf(buffer, sizeof buffer, format, args...);
    svg += buffer;
  };
  add("<svg xmlns='http://www.w3.org/2000/svg' width='%g' height='%g' font-family='sans-serif' "
      "font-size='12'>\n<rect width='100%%' height='100%%' fill='white'/>\n",
      width, height);
  add("<text x='%g' y='24' font-size='16' text-anchor='middle'>%s</text>\n", width / 2,
      title.c_str());
  add("<line x1='%g' y1='%g' x2='%g' y2='%g' stroke='black'/>\n", left, height - bottom,
      width - right, height - bottom);
  add("<line x1='%g' y1='%g' x2='%g' y2='%g' stroke='black'/>\n", left, top, left, height - bottom);
  for (int i = 0; i <= 5; ++i) {
    double yv = y_min + (y_max - y_min) * i / 5, xv = x_min + (x_max - x_min) * i / 5;
    add("<text x='%g' y='%g' text-anchor='end'>%.3g</text>\n", left - 6, sy(yv) + 4, yv);
    add("<line x1='%g' y1='%g' x2='%g' y2='%g' stroke='#ddd'/>\n", left, sy(yv), width - right,
        sy(yv));
    add("<text x='%g' y='%g' text-anchor='middle'>%.0f</text>\n", sx(xv), height - bottom + 18, xv);
  }
  add("<text x='%g' y='%g' text-anchor='middle'>step</text>\n", (left + width - right) / 2,
      height - 10);
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd"};
  int index = 0;
  for (const auto& [name, points] : series) {
    const char* color = colors[index % 4];
    svg += "<polyline fill='none' stroke-width='2' stroke='";
    svg += color;
    svg += "' points='";
    for (const CurvePoint& p : points) {
      if (!std::isfinite(p.y)) continue;
      add("%.1f,%.1f ", sx(p.x), sy(p.y));
    }
    svg += "'/>\n";
    add("<rect x='%g' y='%g' width='14' height='3' fill='%s'/>\n", width - right - 150,
        top + 10 + 18.0 * index, color);
    add("<text x='%g' y='%g'>%s</text>\n", width - right - 130, top + 15 + 18.0 * index,
        name.c_str());
    ++index;
  }
  svg += "</svg>\n";
  const std::string temp = path + ".tmp";
  {
    std::ofstream out(temp, std::ios::trunc);
    out << svg;
    OCTET_CHECK(out.good(), "write_loss_svg: cannot write '", temp, "'");
  }
  std::rename(temp.c_str(), path.c_str());
}

}  // namespace octet
