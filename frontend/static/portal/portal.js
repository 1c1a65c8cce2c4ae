// Live parts of the portal, over the tenant's websockets (the session signs them in):
// - [data-events]: the tenant's events; task events make the parts showing tasks reload (klique:tasks).
// - [data-follow]: a task's output, appended as it comes, until the task ends.
// - #gpu-chart, #utilization-chart: the dashboard's charts, drawn with Chart.js from the JSON the page
//   carries, and redrawn from the new JSON each time the dashboard's figures (#live) reload in place.
// - canvas[data-trend]: a queue-wait objective's trend (measured wait and target, hour by hour), drawn
//   from the JSON element it names, again each time the objectives (#objectives) reload.
"use strict";

// A refusal (403) carries a sentence saying why: show it where the answer would have gone.
window.htmx.config.responseHandling = [
  { code: "204", swap: false },
  { code: "[23]..", swap: true },
  { code: "403", swap: true },
  { code: "[45]..", swap: false, error: true },
];

// A form with data-clear-on-success="#field" empties that field once its request succeeded (a secret's
// value is not left on the page). Handlers live here, not in hx-on attributes: the pages' Content
// Security Policy runs no inline script.
document.body.addEventListener("htmx:afterRequest", (event) => {
  const form = event.detail.elt;
  const target = form && form.dataset ? form.dataset.clearOnSuccess : null;
  if (!target || !event.detail.successful) return;
  const field = form.querySelector(target);
  if (field) field.value = "";
});

// [data-refresh-seconds]: a part that reloads itself every so often (hx-trigger="klique:refresh"), but
// not while focus is inside it, so that nobody's click or typing is swapped away.
for (const element of document.querySelectorAll("[data-refresh-seconds]")) {
  const seconds = Number(element.dataset.refreshSeconds) || 30;
  setInterval(() => {
    if (!element.contains(document.activeElement)) element.dispatchEvent(new CustomEvent("klique:refresh"));
  }, seconds * 1000);
}

function socketUrl(path) {
  const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${window.location.host}${path}`;
}

// A busy tenant's tasks change many times a second: the parts of the page that show them (htmx,
// hx-trigger="klique:tasks from:body") reload once per half second at most, and always after the last.
let tasksTimer = null;
function tasksChanged() {
  if (tasksTimer !== null) return;
  tasksTimer = setTimeout(() => {
    tasksTimer = null;
    document.body.dispatchEvent(new CustomEvent("klique:tasks"));
  }, 500);
}

function followEvents(element) {
  const socket = new WebSocket(socketUrl(element.dataset.events));
  const log = element.dataset.log ? document.querySelector(element.dataset.log) : null;
  socket.addEventListener("message", (message) => {
    const event = JSON.parse(message.data);
    if (event.type !== "event") return;
    if (String(event.kind).startsWith("task")) tasksChanged();
    if (log) {
      const item = document.createElement("li");
      item.textContent = `${new Date(event.at).toLocaleTimeString([], { hour12: false })} ${event.kind}`;
      log.prepend(item);
    }
  });
  socket.addEventListener("close", () => setTimeout(() => followEvents(element), 2000));
}

function followLog(element) {
  const state = document.getElementById("log-state");
  const socket = new WebSocket(socketUrl(element.dataset.follow));
  socket.addEventListener("message", (message) => {
    const chunk = JSON.parse(message.data);
    if (chunk.type === "log") {
      element.append(chunk.lines.map((line) => `${line}\n`).join(""));
      element.scrollTop = element.scrollHeight;
    } else if (chunk.type === "end") {
      state.textContent = `The task ${chunk.state}.`;
      document.getElementById("state").textContent = chunk.state;
    } else if (chunk.type === "error") {
      state.textContent = chunk.detail;
    }
  });
}

function dataOf(id) {
  return JSON.parse(document.getElementById(id).textContent);
}

function drawGpus(canvas) {
  const data = dataOf("gpus-data");
  canvas.chart = new window.Chart(canvas, {
    type: "bar",
    data: {
      labels: data.labels,
      datasets: [
        { label: "GPUs in use", data: data.used, backgroundColor: "#2563eb" },
        { label: "GPUs free", data: data.free, backgroundColor: "#cbd5e1" },
      ],
    },
    options: { animation: false, scales: { x: { stacked: true }, y: { stacked: true, beginAtZero: true } } },
  });
}

function drawUtilization(canvas) {
  const data = dataOf("utilization-data");
  canvas.chart = new window.Chart(canvas, {
    type: "line",
    data: { labels: data.labels, datasets: [{ label: "GPUs in use (%)", data: data.percent, borderColor: "#2563eb", fill: false }] },
    options: { animation: false, scales: { y: { beginAtZero: true, suggestedMax: 100 } } },
  });
}

// The dashboard's figures came back (htmx): the charts take the new data without being rebuilt.
function redraw() {
  const gpus = document.getElementById("gpu-chart");
  if (gpus && gpus.chart) {
    const data = dataOf("gpus-data");
    gpus.chart.data.labels = data.labels;
    gpus.chart.data.datasets[0].data = data.used;
    gpus.chart.data.datasets[1].data = data.free;
    gpus.chart.update();
  }
  const utilization = document.getElementById("utilization-chart");
  if (utilization && utilization.chart) {
    const data = dataOf("utilization-data");
    utilization.chart.data.labels = data.labels;
    utilization.chart.data.datasets[0].data = data.percent;
    utilization.chart.update();
  }
}

function drawTrend(canvas) {
  const data = dataOf(canvas.dataset.trend);
  canvas.chart = new window.Chart(canvas, {
    type: "line",
    data: {
      labels: data.labels,
      datasets: [
        { label: "Measured wait (min)", data: data.value_minutes, borderColor: "#2563eb", fill: false, spanGaps: false, pointRadius: 0 },
        { label: "Target (min)", data: data.target_minutes, borderColor: "#b91c1c", borderDash: [6, 4], fill: false, spanGaps: true, pointRadius: 0 },
      ],
    },
    options: { animation: false, aspectRatio: 4, scales: { y: { beginAtZero: true }, x: { ticks: { maxTicksLimit: 8 } } } },
  });
}

function drawTrends(root) {
  root.querySelectorAll("canvas[data-trend]").forEach(drawTrend);
}

function drawUsage(canvas) {
  const data = JSON.parse(document.getElementById("usage-data").textContent);
  const colors = ["#2563eb", "#16a34a", "#d97706", "#9333ea", "#dc2626", "#0891b2"];
  canvas.chart = new window.Chart(canvas, {
    type: "line",
    data: {
      labels: data.labels,
      datasets: data.series.map((series, index) => ({
        label: series.tenant, data: series.cost, borderColor: colors[index % colors.length], tension: 0.2,
      })),
    },
    options: { animation: false, scales: { y: { beginAtZero: true } } },
  });
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-events]").forEach(followEvents);
  document.querySelectorAll("[data-follow]").forEach(followLog);
  const chart = document.getElementById("gpu-chart");
  if (chart) drawGpus(chart);
  const utilization = document.getElementById("utilization-chart");
  if (utilization) drawUtilization(utilization);
  const usage = document.getElementById("usage-chart");
  if (usage) drawUsage(usage);
  drawTrends(document);
  document.body.addEventListener("htmx:afterSettle", (event) => {
    if (event.detail.target && event.detail.target.id === "live") redraw();
    if (event.detail.target && event.detail.target.id === "objectives") drawTrends(event.detail.target);
  });
});
