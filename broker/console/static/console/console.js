/* WhaleZen console: the few behaviours the pages need, no inline script (the pages' CSP forbids it).
   - [data-autosubmit] selects submit their form on change;
   - [data-width] bars get their width (style attributes are refused by the CSP; the CSSOM is not);
   - canvas[data-chart] draws a Chart.js chart from the JSON of the <script type="application/json">
     element named by data-source ({"labels": [...], "values": [...]} or {"labels": [...], "datasets": [...]});
   - [data-confirm] buttons ask before their form is sent.
   Each runs again on what htmx swaps in. */
(function () {
  "use strict";
  var charts = new WeakMap();
  var palette = ["#0b5fff", "#12a36b", "#e8a000", "#d2405a", "#7a4cd9", "#1697b8", "#8a6d3b", "#5b6770"];

  function drawChart(canvas) {
    if (typeof Chart === "undefined") return;
    var source = document.getElementById(canvas.dataset.source);
    if (!source) return;
    var data = JSON.parse(source.textContent);
    var old = charts.get(canvas);
    if (old) old.destroy();
    var datasets = data.datasets || [{label: canvas.dataset.label || "", data: data.values}];
    var anything = datasets.some(function (set) {
      return (set.data || []).some(function (v) { return Number(v) !== 0; });
    });
    var empty = canvas.parentNode.querySelector(".chart-empty");
    if (!anything) {  // an empty chart reads as broken: say there is nothing to draw instead
      canvas.hidden = true;
      if (!empty) {
        empty = document.createElement("p");
        empty.className = "muted chart-empty";
        empty.textContent = canvas.dataset.empty || "Nothing to chart for this period.";
        canvas.parentNode.insertBefore(empty, canvas);
      }
      return;
    }
    canvas.hidden = false;
    if (empty) empty.remove();
    datasets.forEach(function (set, i) {
      var color = palette[i % palette.length];
      set.backgroundColor = set.backgroundColor || (canvas.dataset.chart === "doughnut" ? palette : color);
      set.borderColor = set.borderColor || color;
      set.maxBarThickness = set.maxBarThickness || 56;
    });
    var stacked = canvas.dataset.stacked === "true";
    charts.set(canvas, new Chart(canvas, {
      type: canvas.dataset.chart || "bar",
      data: {labels: data.labels, datasets: datasets},
      options: {
        responsive: true, maintainAspectRatio: false, animation: false,
        plugins: {legend: {display: datasets.length > 1 || canvas.dataset.chart === "doughnut"}},
        scales: canvas.dataset.chart === "doughnut" ? {} : {
          x: {stacked: stacked}, y: {stacked: stacked, beginAtZero: true}
        }
      }
    }));
  }

  function enhance(root) {
    root.querySelectorAll("[data-width]").forEach(function (el) {
      var pct = Math.max(0, Math.min(100, parseFloat(el.dataset.width) || 0));
      el.style.width = pct + "%";
    });
    root.querySelectorAll("canvas[data-chart]").forEach(drawChart);
    root.querySelectorAll("select[data-autosubmit]").forEach(function (el) {
      if (el.dataset.bound) return;
      el.dataset.bound = "1";
      el.addEventListener("change", function () { el.form.requestSubmit ? el.form.requestSubmit() : el.form.submit(); });
    });
    root.querySelectorAll("[data-confirm]").forEach(function (el) {
      if (el.dataset.bound) return;
      el.dataset.bound = "1";
      el.addEventListener("click", function (event) {
        if (!window.confirm(el.dataset.confirm)) { event.preventDefault(); event.stopImmediatePropagation(); }
      });
    });
  }

  document.addEventListener("DOMContentLoaded", function () { enhance(document); });
  document.addEventListener("htmx:afterSettle", function (event) { enhance(event.target); });
})();
