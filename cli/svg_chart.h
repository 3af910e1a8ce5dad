// A small hand-written SVG line-chart writer (no dependencies): series of (x, y) points as lines or stacked areas,
// linear or log2 x axis, linear or log10 y axis, "nice" ticks, axis labels, a legend. Charts render standalone or
// side by side as the panels of one figure.
//
//   sg::svg::LineChart chart;
//   chart.set_title("time vs T").set_x_label("T (tokens)").set_y_label("seconds").set_log2_x(true);
//   chart.AddSeries({"full", {{1024, 0.5}, {2048, 1.2}}});
//   std::string svg = chart.ToSvg();                        // one chart
//   std::string fig = sg::svg::RenderPanels({a, b}, "title");  // several side by side
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace sg::svg {

struct Series {
  std::string name;                               // legend entry
  std::vector<std::pair<double, double>> points;  // (x, y); drawn in x order; non-finite points are skipped
  std::string color;                              // CSS colour; empty = next colour of the palette
  bool dashed = false;
  bool markers = true;                            // a dot at each point
};

class LineChart {
 public:
  LineChart& set_title(std::string t) { title_ = std::move(t); return *this; }
  LineChart& set_x_label(std::string l) { x_label_ = std::move(l); return *this; }
  LineChart& set_y_label(std::string l) { y_label_ = std::move(l); return *this; }
  // x axis in log2 scale (ticks at powers of two); points with x <= 0 are skipped.
  LineChart& set_log2_x(bool on) { log2_x_ = on; return *this; }
  // y axis in log10 scale (ticks at 1, 2, 5 x 10^k); points with y <= 0 are skipped.
  LineChart& set_log_y(bool on) { log_y_ = on; return *this; }
  // Whether the linear y axis starts at 0 (default) or at the data minimum.
  LineChart& set_y_from_zero(bool on) { y_from_zero_ = on; return *this; }
  // The linear y axis covers at least [lo, hi] (e.g. 0 to 1 for an accuracy), more if the data need it.
  LineChart& set_y_range(double lo, double hi) { y_lo_ = lo; y_hi_ = hi; return *this; }
  // Stacked areas: each series is drawn as a filled band on top of the ones before it (its y added to theirs at
  // the same x; a series without a point at some x contributes 0 there). For parts of a whole, e.g. memory by
  // category. The y axis then spans the totals.
  LineChart& set_stacked(bool on) { stacked_ = on; return *this; }
  // Where the legend goes: inside the plot area at the top left (default) or top right, or right of the plot
  // area (which narrows to make room). Stacked charts list their series top band first.
  enum class Legend { kTopLeft, kTopRight, kOutsideRight };
  LineChart& set_legend(Legend where) { legend_ = where; return *this; }
  LineChart& set_size(double width, double height) { width_ = width; height_ = height; return *this; }
  LineChart& AddSeries(Series s) { series_.push_back(std::move(s)); return *this; }

  double width() const { return width_; }
  double height() const { return height_; }
  const std::vector<Series>& series() const { return series_; }

  // A standalone SVG document.
  std::string ToSvg() const;
  // The chart as an SVG group translated to (x0, y0) of an enclosing document.
  std::string RenderGroup(double x0, double y0) const;

 private:
  std::string title_, x_label_, y_label_;
  bool log2_x_ = false, log_y_ = false, y_from_zero_ = true, stacked_ = false;
  Legend legend_ = Legend::kTopLeft;
  double y_lo_ = 0, y_hi_ = 0;  // equal: no requested range
  double width_ = 560, height_ = 400;
  std::vector<Series> series_;
};

// Several charts side by side in one SVG document, with an optional title above them.
std::string RenderPanels(const std::vector<LineChart>& panels, const std::string& title = "");

// Escapes &, <, >, " and ' for SVG text and attributes.
std::string XmlEscape(const std::string& s);

// The default palette (colour-blind friendly); Palette(i) cycles.
std::string Palette(int i);

}  // namespace sg::svg
