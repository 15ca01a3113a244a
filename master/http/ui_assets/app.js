"use strict";
// The job status page: fetches /ui/status (the same JSON as /v1/status) every REFRESH_MS and rebuilds
// the view. Every value is data sent by nodes and workers: it goes through textContent, never innerHTML.

const REFRESH_MS = 1000;

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "-" : String(text);
  if (className) td.className = className;
  return td;
}

function seconds(value, digits) {
  return value === null || value === undefined ? "-" : value.toFixed(digits) + "s";
}

function show(id, text) {
  document.getElementById(id).textContent = text;
}

function byRank(a, b) {
  const ra = a.rank === null ? Infinity : a.rank;
  const rb = b.rank === null ? Infinity : b.rank;
  return ra - rb || (a.node_id < b.node_id ? -1 : a.node_id > b.node_id ? 1 : 0);
}

function nodeRow(node) {
  const tr = document.createElement("tr");
  tr.dataset.node = node.node_id;
  const flags = [];
  if (node.straggler) flags.push("straggler");
  if (node.persist_error) flags.push("persist failing: " + node.persist_error);
  if (node.node_check_verdict && !node.node_check_verdict.startsWith("ok")) {
    flags.push("node check: " + node.node_check_verdict);
  }
  tr.append(
    cell(node.node_id),
    cell(node.rank),
    cell(node.state, "state-" + node.state),
    cell(seconds(node.heartbeat_age_s, 1), "num"),
    cell(node.step, "num"),
    cell(seconds(node.step_time_s, 3), "num"),
    cell(node.restarts, "num"),
    cell(node.persisted_step, "num"),
    cell(flags.join("; "), "flag"),
  );
  return tr;
}

function eventRow(event) {
  const tr = document.createElement("tr");
  tr.append(cell(seconds(event.age_s, 0), "num"), cell(event.kind), cell(event.message));
  return tr;
}

function render(job) {
  document.title = "elastic-run job " + job.job_id;
  show(
    "job",
    `job ${job.job_id}: ${job.phase}, round ${job.round}, ${job.nnodes} node(s), ` +
      `world size ${job.world_size}, restarts ${job.restart_count}/${job.max_restarts}`,
  );
  show("reason", job.waiting_reason ? `round ${job.round}: ${job.waiting_reason}` : "");
  show("outcome", job.outcome ? `outcome: ${job.outcome.summary} (exit ${job.outcome.exit_code})` : "");
  const goodput = job.goodput_ratio;
  show("goodput", goodput === null || goodput === undefined ? "-" : (100 * goodput).toFixed(1) + "%");
  const dash = (v) => (v === null || v === undefined ? "-" : "step " + v);
  show("checkpoint", `committed ${dash(job.committed_step)}, on disk ${dash(job.persisted_step)}`);
  document.getElementById("nodes").replaceChildren(...[...job.nodes].sort(byRank).map(nodeRow));
  document.getElementById("events").replaceChildren(...[...(job.events || [])].reverse().map(eventRow));
}

async function refresh() {
  try {
    const reply = await fetch("/ui/status", { credentials: "same-origin", cache: "no-store" });
    if (reply.status === 401) {
      window.location.assign("/ui/login");
      return;
    }
    if (!reply.ok) {
      show("error", `the master answered ${reply.status}; retrying`);
    } else {
      render(await reply.json());
      show("error", "");
      show("updated", "updated " + new Date().toLocaleTimeString());
    }
  } catch (error) {
    show("error", "cannot reach the master (" + error + "); retrying");
  }
  setTimeout(refresh, REFRESH_MS);
}

refresh();
