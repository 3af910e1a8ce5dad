#include "cli/svg_chart.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace sg::svg {
namespace {

constexpr double kMarginLeft = 74, kMarginRight = 18, kMarginTop = 36, kMarginBottom = 52;
constexpr const char* kFont = "font-family=\"Helvetica, Arial, sans-serif\"";

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  std::string s = buf;
  // Trim trailing zeros: coordinates stay short.
  while (!s.empty() && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s == "-0" ? "0" : s;
}

// A tick label: integers print in full, other values with up to 4 significant digits.
std::string TickLabel(double v) {
  char buf[32];
  if (std::fabs(v) < 1e15 && std::fabs(v - std::round(v)) < 1e-9 * std::max(1.0, std::fabs(v)))
    std::snprintf(buf, sizeof buf, "%.0f", v);
  else
    std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

// One axis: maps data values to [0, 1] and lists its ticks.
struct Axis {
  bool log = false;
  double base = 10;    // log base when log
  double lo = 0, hi = 1;  // in transformed units (exponents when log)
  std::vector<double> ticks;  // data values

  double T(double v) const { return log ? std::log(v) / std::log(base) : v; }
  double Frac(double v) const { return (T(v) - lo) / (hi - lo); }
};

double NiceStep(double range, int target_ticks) {
  const double raw = range / std::max(1, target_ticks);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0})
    if (m * mag >= raw) return m * mag;
  return 10 * mag;
}

Axis LinearAxis(double mn, double mx, bool from_zero) {
  Axis a;
  if (!(mn <= mx)) mn = 0, mx = 1;
  if (from_zero) {
    mn = std::min(mn, 0.0);
    mx = std::max(mx, 0.0);
  }
  if (mx - mn <= 0) {  // a single value: give it some room
    const double pad = mn == 0 ? 1 : std::fabs(mn) * 0.5;
    if (from_zero && mn >= 0) {
      mx += pad;
    } else {
      mn -= pad;
      mx += pad;
    }
  }
  const double step = NiceStep(mx - mn, 5);
  a.lo = std::floor(mn / step + 1e-9) * step;
  a.hi = std::ceil(mx / step - 1e-9) * step;
  if (a.hi <= a.lo) a.hi = a.lo + step;
  for (double v = a.lo; v <= a.hi + step * 1e-6; v += step) a.ticks.push_back(std::fabs(v) < step * 1e-9 ? 0 : v);
  return a;
}

Axis Log2Axis(double mn, double mx) {
  Axis a;
  a.log = true;
  a.base = 2;
  if (!(mn > 0 && mn <= mx)) mn = 1, mx = 2;
  double e0 = std::floor(std::log2(mn) + 1e-9), e1 = std::ceil(std::log2(mx) - 1e-9);
  if (e1 <= e0) e0 -= 1, e1 += 1;
  a.lo = e0;
  a.hi = e1;
  const int step = static_cast<int>(std::ceil((e1 - e0) / 9.0));
  for (double e = e0; e <= e1 + 1e-9; e += step) a.ticks.push_back(std::pow(2.0, e));
  return a;
}

Axis Log10Axis(double mn, double mx) {
  Axis a;
  a.log = true;
  a.base = 10;
  if (!(mn > 0 && mn <= mx)) mn = 1, mx = 10;
  double e0 = std::floor(std::log10(mn) + 1e-9), e1 = std::ceil(std::log10(mx) - 1e-9);
  if (e1 <= e0) e1 = e0 + 1;
  a.lo = e0;
  a.hi = e1;
  const bool minor = e1 - e0 <= 2;
  for (double e = e0; e <= e1 + 1e-9; e += 1) {
    const double p = std::pow(10.0, e);
    a.ticks.push_back(p);
    if (minor && e < e1) {
      a.ticks.push_back(2 * p);
      a.ticks.push_back(5 * p);
    }
  }
  return a;
}

bool Usable(double x, double y, bool log_x, bool log_y) {
  if (!std::isfinite(x) || !std::isfinite(y)) return false;
  if (log_x && x <= 0) return false;
  if (log_y && y <= 0) return false;
  return true;
}

}  // namespace

std::string XmlEscape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default:
        // Control characters are not allowed in XML 1.0.
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' && c != '\r') out += ' ';
        else out += c;
    }
  }
  return out;
}

std::string Palette(int i) {
  static const char* kColors[] = {"#0072B2", "#D55E00", "#009E73", "#CC79A7",
                                  "#E69F00", "#56B4E9", "#000000", "#999999"};
  constexpr int n = sizeof(kColors) / sizeof(kColors[0]);
  return kColors[((i % n) + n) % n];
}

std::string LineChart::RenderGroup(double x0, double y0) const {
  // Legend entries and size (drawn last, inside the plot area at the top left, or right of it).
  std::vector<size_t> shown;
  for (size_t i = 0; i < series_.size(); ++i)
    if (!series_[i].name.empty()) shown.push_back(i);
  size_t longest = 0;
  for (size_t i : shown) longest = std::max(longest, series_[i].name.size());
  const double lw = 40 + 6.5 * static_cast<double>(longest), lh = 8 + 17.0 * static_cast<double>(shown.size());
  if (stacked_) std::reverse(shown.begin(), shown.end());
  const double legend_room = legend_ == Legend::kOutsideRight && !shown.empty() ? lw + 12 : 0;
  const double pw = std::max(10.0, width_ - kMarginLeft - kMarginRight - legend_room);
  const double ph = std::max(10.0, height_ - kMarginTop - kMarginBottom);
  const double px = kMarginLeft, py = kMarginTop;  // plot area origin within the group

  // Stacked: every series becomes the band between the running total before it (lower) and after it (its points),
  // over the union of the series' x values.
  std::vector<Series> drawn = series_;
  std::vector<std::vector<std::pair<double, double>>> lower(series_.size());
  if (stacked_) {
    std::vector<double> xs;
    for (const Series& s : series_)
      for (const auto& [x, y] : s.points)
        if (std::isfinite(x) && std::isfinite(y)) xs.push_back(x);
    std::sort(xs.begin(), xs.end());
    xs.erase(std::unique(xs.begin(), xs.end()), xs.end());
    std::vector<double> total(xs.size(), 0.0);
    for (size_t i = 0; i < series_.size(); ++i) {
      std::vector<double> y(xs.size(), 0.0);
      for (const auto& [xv, yv] : series_[i].points) {
        if (!std::isfinite(xv) || !std::isfinite(yv)) continue;
        y[std::lower_bound(xs.begin(), xs.end(), xv) - xs.begin()] = yv;
      }
      drawn[i].points.clear();
      for (size_t k = 0; k < xs.size(); ++k) {
        lower[i].emplace_back(xs[k], total[k]);
        total[k] += y[k];
        drawn[i].points.emplace_back(xs[k], total[k]);
      }
    }
  }

  // Data ranges.
  double xmin = std::numeric_limits<double>::infinity(), xmax = -xmin, ymin = xmin, ymax = -xmin;
  bool any = false;
  for (const Series& s : drawn)
    for (const auto& [x, y] : s.points) {
      if (!Usable(x, y, log2_x_, log_y_)) continue;
      any = true;
      xmin = std::min(xmin, x);
      xmax = std::max(xmax, x);
      ymin = std::min(ymin, y);
      ymax = std::max(ymax, y);
    }
  if (!any) xmin = log2_x_ ? 1 : 0, xmax = log2_x_ ? 2 : 1, ymin = log_y_ ? 1 : 0, ymax = log_y_ ? 10 : 1;
  if (y_lo_ < y_hi_ && (!log_y_ || y_lo_ > 0)) {
    ymin = any ? std::min(ymin, y_lo_) : y_lo_;
    ymax = any ? std::max(ymax, y_hi_) : y_hi_;
  }
  const Axis ax = log2_x_ ? Log2Axis(xmin, xmax) : LinearAxis(xmin, xmax, false);
  const Axis ay = log_y_ ? Log10Axis(ymin, ymax) : LinearAxis(ymin, ymax, y_from_zero_);
  auto X = [&](double v) { return px + ax.Frac(v) * pw; };
  auto Y = [&](double v) { return py + (1 - ay.Frac(v)) * ph; };

  std::string o;
  o += "<g transform=\"translate(" + Num(x0) + "," + Num(y0) + ")\">\n";
  o += "<rect x=\"0\" y=\"0\" width=\"" + Num(width_) + "\" height=\"" + Num(height_) + "\" fill=\"white\"/>\n";
  if (!title_.empty())
    o += "<text x=\"" + Num(px + pw / 2) + "\" y=\"" + Num(py - 14) + "\" text-anchor=\"middle\" font-size=\"15\" " +
         kFont + " font-weight=\"bold\">" + XmlEscape(title_) + "</text>\n";

  // Grid and ticks.
  o += "<g stroke=\"#e4e4e4\" stroke-width=\"1\">\n";
  for (double t : ax.ticks) o += "<line x1=\"" + Num(X(t)) + "\" y1=\"" + Num(py) + "\" x2=\"" + Num(X(t)) +
                                 "\" y2=\"" + Num(py + ph) + "\"/>\n";
  for (double t : ay.ticks) o += "<line x1=\"" + Num(px) + "\" y1=\"" + Num(Y(t)) + "\" x2=\"" + Num(px + pw) +
                                 "\" y2=\"" + Num(Y(t)) + "\"/>\n";
  o += "</g>\n";
  o += "<rect x=\"" + Num(px) + "\" y=\"" + Num(py) + "\" width=\"" + Num(pw) + "\" height=\"" + Num(ph) +
       "\" fill=\"none\" stroke=\"#333\" stroke-width=\"1\"/>\n";
  o += std::string("<g font-size=\"11\" ") + kFont + " fill=\"#333\">\n";
  for (double t : ax.ticks) {
    o += "<line x1=\"" + Num(X(t)) + "\" y1=\"" + Num(py + ph) + "\" x2=\"" + Num(X(t)) + "\" y2=\"" +
         Num(py + ph + 5) + "\" stroke=\"#333\"/>\n";
    o += "<text x=\"" + Num(X(t)) + "\" y=\"" + Num(py + ph + 18) + "\" text-anchor=\"middle\">" +
         XmlEscape(TickLabel(t)) + "</text>\n";
  }
  for (double t : ay.ticks) {
    o += "<line x1=\"" + Num(px - 5) + "\" y1=\"" + Num(Y(t)) + "\" x2=\"" + Num(px) + "\" y2=\"" + Num(Y(t)) +
         "\" stroke=\"#333\"/>\n";
    o += "<text x=\"" + Num(px - 8) + "\" y=\"" + Num(Y(t) + 4) + "\" text-anchor=\"end\">" +
         XmlEscape(TickLabel(t)) + "</text>\n";
  }
  o += "</g>\n";

  // Axis labels.
  if (!x_label_.empty())
    o += "<text x=\"" + Num(px + pw / 2) + "\" y=\"" + Num(py + ph + 40) + "\" text-anchor=\"middle\" font-size=\"13\" " +
         kFont + ">" + XmlEscape(x_label_) + "</text>\n";
  if (!y_label_.empty()) {
    const double lx = 16, ly = py + ph / 2;
    o += "<text x=\"" + Num(lx) + "\" y=\"" + Num(ly) + "\" transform=\"rotate(-90 " + Num(lx) + " " + Num(ly) +
         ")\" text-anchor=\"middle\" font-size=\"13\" " + kFont + ">" + XmlEscape(y_label_) + "</text>\n";
  }
  if (!any)
    o += "<text x=\"" + Num(px + pw / 2) + "\" y=\"" + Num(py + ph / 2) +
         "\" text-anchor=\"middle\" font-size=\"13\" fill=\"#999\" " + kFont + ">no data</text>\n";

  // Series.
  std::vector<std::string> colors;
  int next_color = 0;
  for (const Series& s : series_) colors.push_back(s.color.empty() ? Palette(next_color++) : s.color);
  if (stacked_) {
    for (size_t i = 0; i < drawn.size(); ++i) {
      const std::vector<std::pair<double, double>>& up = drawn[i].points;
      if (up.empty()) continue;
      o += "<polygon fill=\"" + XmlEscape(colors[i]) + "\" fill-opacity=\"0.8\" stroke=\"" + XmlEscape(colors[i]) +
           "\" stroke-width=\"1\" points=\"";
      for (size_t k = 0; k < up.size(); ++k) o += (k ? " " : "") + Num(X(up[k].first)) + "," + Num(Y(up[k].second));
      for (size_t k = lower[i].size(); k-- > 0;) o += " " + Num(X(lower[i][k].first)) + "," + Num(Y(lower[i][k].second));
      o += "\"/>\n";
    }
  }
  for (size_t i = 0; i < series_.size() && !stacked_; ++i) {
    const Series& s = series_[i];
    std::vector<std::pair<double, double>> pts;
    for (const auto& [x, y] : s.points)
      if (Usable(x, y, log2_x_, log_y_)) pts.emplace_back(x, y);
    std::stable_sort(pts.begin(), pts.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    if (pts.empty()) continue;
    const std::string& c = colors[i];
    if (pts.size() > 1) {
      o += "<polyline fill=\"none\" stroke=\"" + XmlEscape(c) + "\" stroke-width=\"2\"";
      if (s.dashed) o += " stroke-dasharray=\"6,4\"";
      o += " points=\"";
      for (size_t k = 0; k < pts.size(); ++k) o += (k ? " " : "") + Num(X(pts[k].first)) + "," + Num(Y(pts[k].second));
      o += "\"/>\n";
    }
    if (s.markers || pts.size() == 1)
      for (const auto& [x, y] : pts)
        o += "<circle cx=\"" + Num(X(x)) + "\" cy=\"" + Num(Y(y)) + "\" r=\"3\" fill=\"" + XmlEscape(c) + "\"/>\n";
  }

  // Legend (top left inside the plot area, or right of it).
  if (!shown.empty()) {
    const double lx = legend_ == Legend::kOutsideRight ? px + pw + 12
                      : legend_ == Legend::kTopRight    ? px + pw - 8 - lw
                                                        : px + 8;
    const double ly = legend_ == Legend::kOutsideRight ? py : py + 8;
    o += "<g class=\"legend\">\n";
    o += "<rect x=\"" + Num(lx) + "\" y=\"" + Num(ly) + "\" width=\"" + Num(lw) + "\" height=\"" + Num(lh) +
         "\" fill=\"white\" fill-opacity=\"0.85\" stroke=\"#bbb\"/>\n";
    for (size_t k = 0; k < shown.size(); ++k) {
      const Series& s = series_[shown[k]];
      const double yy = ly + 13 + 17.0 * static_cast<double>(k);
      if (stacked_)
        o += "<rect x=\"" + Num(lx + 10) + "\" y=\"" + Num(yy - 10) + "\" width=\"16\" height=\"11\" fill=\"" +
             XmlEscape(colors[shown[k]]) + "\" fill-opacity=\"0.8\"/>\n";
      else
        o += "<line x1=\"" + Num(lx + 6) + "\" y1=\"" + Num(yy - 4) + "\" x2=\"" + Num(lx + 30) + "\" y2=\"" +
             Num(yy - 4) + "\" stroke=\"" + XmlEscape(colors[shown[k]]) + "\" stroke-width=\"2\"" +
             (s.dashed ? " stroke-dasharray=\"6,4\"" : "") + "/>\n";
      o += "<text x=\"" + Num(lx + 36) + "\" y=\"" + Num(yy) + "\" font-size=\"11\" " + kFont + ">" +
           XmlEscape(s.name) + "</text>\n";
    }
    o += "</g>\n";
  }
  o += "</g>\n";
  return o;
}

namespace {
std::string Document(double w, double h, const std::string& body) {
  return "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + Num(w) +
         "\" height=\"" + Num(h) + "\" viewBox=\"0 0 " + Num(w) + " " + Num(h) + "\">\n" + body + "</svg>\n";
}
}  // namespace

std::string LineChart::ToSvg() const { return Document(width_, height_, RenderGroup(0, 0)); }

std::string RenderPanels(const std::vector<LineChart>& panels, const std::string& title) {
  const double top = title.empty() ? 0 : 34;
  double w = 0, h = 0;
  for (const LineChart& p : panels) {
    w += p.width();
    h = std::max(h, p.height());
  }
  std::string body = "<rect x=\"0\" y=\"0\" width=\"" + Num(w) + "\" height=\"" + Num(h + top) + "\" fill=\"white\"/>\n";
  if (!title.empty())
    body += "<text x=\"" + Num(w / 2) + "\" y=\"24\" text-anchor=\"middle\" font-size=\"16\" " + std::string(kFont) +
            " font-weight=\"bold\">" + XmlEscape(title) + "</text>\n";
  double x = 0;
  for (const LineChart& p : panels) {
    body += p.RenderGroup(x, top);
    x += p.width();
  }
  return Document(std::max(w, 1.0), std::max(h + top, 1.0), body);
}

}  // namespace sg::svg
