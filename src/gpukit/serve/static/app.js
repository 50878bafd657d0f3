// gpukit dashboard: polls /api/state and draws one card per GPU. No library, no CDN.
// Every value from the machine (user names, command lines) goes in as text, never as HTML.
"use strict";

const GiB = 1024 ** 3;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value !== undefined && value !== null) node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function svgEl(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  return node;
}

function bytes(n) {
  if (n === null || n === undefined) return "n/a";
  if (n >= GiB) return (n / GiB).toFixed(1) + " GiB";
  return (n / 1024 ** 2).toFixed(0) + " MiB";
}

function meter(label, kind, fraction, text) {
  const width = fraction === null ? 0 : Math.max(0, Math.min(1, fraction)) * 100;
  const fill = el("div", {});
  fill.style.width = width.toFixed(1) + "%"; // CSSOM: the CSP forbids style attributes
  return el("div", { class: "meter" },
    el("span", { class: "label" }, label),
    el("div", { class: "bar " + kind, role: "meter", "aria-label": label,
                "aria-valuenow": fraction === null ? null : Math.round(width) }, fill),
    el("span", { class: kind + "-value" }, text));
}

function line(values, kind) {
  // values: 0..1 or null, oldest first, drawn on a 100 x 40 box; gaps break the line.
  const groups = [];
  let current = [];
  const step = values.length > 1 ? 100 / (values.length - 1) : 100;
  values.forEach((v, i) => {
    if (v === null) {
      if (current.length) groups.push(current);
      current = [];
    } else {
      current.push((i * step).toFixed(2) + "," + (40 - Math.min(1, v) * 38 - 1).toFixed(2));
    }
  });
  if (current.length) groups.push(current);
  return groups.map((points) => {
    if (points.length === 1) {
      // One reading so far: a short dash, since a line of zero length draws nothing.
      const [x, y] = points[0].split(",").map(Number);
      points.push(Math.min(100, x + Math.max(step, 2)).toFixed(2) + "," + y.toFixed(2));
    }
    return svgEl("polyline", { class: kind, points: points.join(" ") });
  });
}

function chart(history) {
  const svg = svgEl("svg", { class: "chart", viewBox: "0 0 100 40", preserveAspectRatio: "none",
                             role: "img", "aria-label": "utilisation and memory, last hour" });
  if (history) {
    for (const p of line(history.memory, "mem")) svg.append(p);
    for (const p of line(history.util, "util")) svg.append(p);
  }
  return svg;
}

function processList(procs) {
  if (!procs.length) return el("p", { class: "none" }, "no processes");
  return el("ul", { class: "procs" }, ...procs.map((p) =>
    el("li", {},
      el("span", { class: "user" }, p.user ?? "?"),
      el("span", { class: "cmd", title: p.command ?? "" }, (p.command ?? "?") + " (" + p.pid + ")"),
      el("span", { class: "amount" }, bytes(p.used_memory)))));
}

// "2 h 05 min" for a claim held since `since` (Unix seconds, from its holder's record: may be
// anything), as of `now`; "?" when the record's time is not one.
function heldFor(since, now) {
  if (typeof since !== "number" || !Number.isFinite(since) || since > now + 60) return "?";
  const minutes = Math.floor(Math.max(0, now - since) / 60);
  if (minutes < 1) return "under a minute";
  if (minutes < 60) return minutes + " min";
  const hours = Math.floor(minutes / 60);
  if (hours < 48) return hours + " h " + String(minutes % 60).padStart(2, "0") + " min";
  return Math.floor(hours / 24) + " days " + (hours % 24) + " h";
}

function claimLine(claim, now) {
  // The holder's user is in the card's badge already: the line is for what runs, and since when.
  return el("p", { class: "claim" },
    el("span", { class: "cmd", title: claim.command ?? "" },
      (claim.command ?? "?") + (claim.pid === null || claim.pid === undefined ? "" : " (" + claim.pid + ")")),
    el("span", { class: "held" }, "held " + heldFor(claim.since, now)));
}

// `claims` is null when they are unknown (the lock folder was refused or could not be read):
// then no GPU is called free.
function card(gpu, claims, history, now) {
  const claim = claims ? claims.get(gpu.index) : undefined;
  const title = el("h2", {}, "GPU " + gpu.index,
    el("span", { class: "model" }, (gpu.name || "").replace(/^NVIDIA /, "")));
  if (gpu.error) {
    title.append(el("span", { class: "badge error" }, gpu.error));
    return el("section", { class: "card", "data-gpu": gpu.index }, title);
  }
  if (claim) {
    title.append(el("span", { class: "badge claimed", title: claim.command ?? "" },
      "claimed by " + (claim.user ?? "?")));
  } else if (!claims) {
    title.append(el("span", { class: "badge unknown", title: "the claims could not be read" },
      "claim unknown"));
  } else if (!gpu.processes.length) {
    title.append(el("span", { class: "badge free" }, "free"));
  }
  const memFraction = gpu.memory_total ? gpu.memory_used / gpu.memory_total : null;
  const util = gpu.utilization_gpu;
  const memText = gpu.memory_total === null ? "n/a"
    : (gpu.memory_used / GiB).toFixed(1) + " / " + (gpu.memory_total / GiB).toFixed(0) + " GiB";
  const temp = gpu.temperature_c === null ? "n/a °C" : gpu.temperature_c + " °C";
  const power = gpu.power_draw_w === null ? "n/a W"
    : gpu.power_draw_w.toFixed(0) + (gpu.power_limit_w === null ? "" : " / " + gpu.power_limit_w.toFixed(0)) + " W";
  const facts = el("p", { class: "facts" },
    el("span", { class: "temp" + (gpu.temperature_c >= 85 ? " hot" : "") }, temp), " · ",
    el("span", { class: "power" }, power));
  const parts = [title,
    meter("util", "util", util === null ? null : util / 100, util === null ? "n/a" : util + " %"),
    meter("mem", "mem", memFraction, memText), facts, chart(history)];
  for (const mig of gpu.mig_instances) {
    const frac = mig.memory_total ? mig.memory_used / mig.memory_total : null;
    parts.push(meter("MIG " + mig.index, "mem", frac, bytes(mig.memory_used) + " / " + bytes(mig.memory_total)));
  }
  if (claim) parts.push(claimLine(claim, now));
  parts.push(processList(gpu.processes));
  return el("section", { class: "card", "data-gpu": gpu.index, "data-uuid": gpu.uuid }, ...parts);
}

function clock(seconds) {
  return typeof seconds === "number" ? new Date(seconds * 1000).toLocaleTimeString() : "?";
}

// What failed in this sample, part by part, as the sampler says it; an older server sends only
// `error`, for the GPUs' reading.
function problems(state) {
  const failed = state.failed && typeof state.failed === "object" ? state.failed : null;
  if (!failed) return state.error ? ["Last reading failed: " + state.error] : [];
  const lines = [];
  if (failed.gpus) {
    const inv = state.inventory;
    lines.push("Reading the GPUs failed" +
      (inv ? " (showing the reading of " + clock(inv.taken_at) + ")" : "") + ": " + failed.gpus);
  }
  for (const [part, why] of Object.entries(failed)) if (part !== "gpus") lines.push(String(why));
  return lines;
}

function render(state) {
  const inv = state.inventory;
  const queue = state.queue || {};
  document.getElementById("host").textContent = state.host ? "· " + state.host : "";
  const error = document.getElementById("error");
  const lines = problems(state);
  error.hidden = !lines.length;
  error.replaceChildren(...lines.map((text) => el("span", { class: "problem" }, text)));
  const gpus = inv ? inv.gpus : [];
  const claims = holders(queue);
  const line = Array.isArray(queue.waiters) ? queue.waiters : null;
  const count = line ? line.length : "?";
  const when = new Date(state.taken_at * 1000).toLocaleTimeString();
  const waiters = count === 1 ? "1 waiter" : count + " waiters";
  document.getElementById("summary").textContent =
    gpus.length + (gpus.length === 1 ? " GPU" : " GPUs") +
    (inv ? " · driver " + (inv.driver_version ?? "n/a") + " · CUDA " + (inv.cuda_driver_version ?? "n/a") : "") +
    " · " + (claims ? claims.size + " claimed" : "claims unknown") + " · " + waiters +
    " in line · updated " + when;
  const list = document.getElementById("line");
  list.hidden = !(line && line.length);
  list.replaceChildren(...(line || []).map((w) => el("li", {},
    el("span", { class: "user" }, w.user ?? "?"),
    " waits for " + (w.n ?? "?") + (w.n === 1 ? " GPU" : " GPUs") +
    (w.criteria ? " (" + w.criteria + ")" : "") + (w.reason ? ": " + w.reason : ""),
    typeof w.command === "string" && w.command ? el("span", { class: "cmd" }, w.command) : null)));
  const history = state.history.gpus;
  document.getElementById("gpus").replaceChildren(
    ...gpus.map((g) => card(g, claims, history[g.uuid], state.taken_at)));
}

// GPU index -> who holds it, from gpukit queue's snapshot (gpukit.queue/1); null when the
// document is an error instead (the lock folder was refused, or could not be read): unknown.
function holders(queue) {
  if (!Array.isArray(queue.holders)) return null;
  const byIndex = new Map();
  for (const h of queue.holders) {
    for (const index of h.gpus || []) if (index !== null) byIndex.set(index, h);
  }
  return byIndex;
}

async function poll() {
  let state = null;
  try {
    const answer = await fetch("/api/state", { cache: "no-store" });
    if (!answer.ok) throw new Error("the server answered " + answer.status);
    state = await answer.json();
  } catch (err) {
    const error = document.getElementById("error");
    error.hidden = false;
    error.textContent = "Cannot reach gpukit serve (" + err.message + "); retrying.";
  }
  setTimeout(poll, state ? Math.max(500, state.interval_s * 1000) : 2000);
  if (state) render(state); // outside the try: a bug here shows in the console, not as "unreachable"
}

poll();
