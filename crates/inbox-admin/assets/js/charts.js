// A set of time-series charts drawn by the bundled uPlot (window.uPlot, loaded before the
// modules), each under a key, kept across refreshes and resized with the page.

const HEIGHT = 180;

export class Charts {
  #charts = new Map(); // key -> uPlot
  #xRanges = new Map(); // key -> [from, to] in seconds, for charts that span a window

  /**
   * Draws `data` ([xs, ...one array per series]) in `container` under `key`; with `xRange`
   * ([from, to] in seconds), the x axis spans it.
   */
  draw(key, container, series, data, xRange) {
    if (xRange) this.#xRanges.set(key, xRange);
    let u = this.#charts.get(key);
    const width = Math.max(320, container.clientWidth || 600);
    // Recreated when its series change (the latency chart's source can).
    if (u && (u.series.length !== series.length + 1 ||
        series.some((s, i) => u.series[i + 1].label !== s.label))) {
      u.destroy();
      u = null;
    }
    if (!u) {
      const xRanges = this.#xRanges;
      u = new uPlot({
        width,
        height: HEIGHT,
        series: [{}, ...series.map((s) => ({
          // Points are drawn where the data is sparse (uPlot's default), so a single busy
          // minute shows.
          label: s.label, stroke: s.stroke, width: 1.5, spanGaps: false,
        }))],
        // A chart given a window spans it, however few its samples (one sample would
        // otherwise stretch the axis over years).
        scales: { x: { time: true, range: (self, min, max) => xRanges.get(key) || [min, max] } },
        axes: [{}, { size: 56 }],
        legend: { live: false },
      }, data, container);
      this.#charts.set(key, u);
    } else {
      u.setData(data);
    }
  }

  /** Fits every chart to its container's width (a hidden one keeps its size). */
  resize() {
    for (const u of this.#charts.values()) {
      const box = u.root.parentElement;
      if (box && box.clientWidth) u.setSize({ width: box.clientWidth, height: HEIGHT });
    }
  }
}
