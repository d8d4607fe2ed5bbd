// FedLookahead dashboard: renders the run page's plots from the JSON API and keeps them live by polling.
// Only GET requests; the ?token= of the page (if any) goes with every API call as a Bearer header.
(function () {
  "use strict";

  const token = new URLSearchParams(window.location.search).get("token");
  const POLL_RUNNING_MS = 3000;
  const POLL_IDLE_MS = 15000;
  const HEAD_COLORS = ["#2f6fdb", "#d9480f", "#2b8a3e", "#862e9c", "#c92a2a", "#0b7285", "#e67700", "#5c940d"];

  function withToken(url) {
    if (!token) return url;
    return url + (url.indexOf("?") >= 0 ? "&" : "?") + "token=" + encodeURIComponent(token);
  }

  async function api(path) {
    const headers = { Accept: "application/json" };
    if (token) headers.Authorization = "Bearer " + token;
    const response = await fetch(path, { headers: headers, cache: "no-store" });
    if (!response.ok) throw new Error(path + ": HTTP " + response.status);
    return response.json();
  }

  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }

  function fmt(value, digits) {
    return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
  }

  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return n.toFixed(i ? 1 : 0) + " " + units[i];
  }

  function utc(iso) {
    return iso ? iso.slice(0, 19).replace("T", " ") : "–";
  }

  const charts = {};
  window.fedla = { charts: charts, api: api, withToken: withToken, polls: 0, pollErrors: 0 };

  function baseOptions(yTitle, extra) {
    const options = {
      animation: false,
      responsive: true,
      maintainAspectRatio: false,
      interaction: { mode: "index", intersect: false },
      plugins: { legend: { position: "bottom", labels: { boxWidth: 12 } } },
      scales: {
        x: { title: { display: true, text: "round" } },
        y: { title: { display: true, text: yTitle } },
      },
    };
    return Object.assign(options, extra || {});
  }

  function draw(id, type, labels, datasets, options) {
    const canvas = document.getElementById(id);
    if (!canvas) return;
    if (charts[id]) {
      charts[id].data.labels = labels;
      charts[id].data.datasets = datasets;
      charts[id].update("none");
    } else {
      charts[id] = new window.Chart(canvas, { type: type, data: { labels: labels, datasets: datasets }, options: options });
    }
    canvas.dataset.rounds = String(labels.length);
  }

  function line(label, data, color, dashed) {
    return { label: label, data: data, borderColor: color, backgroundColor: color, borderWidth: 2, pointRadius: 2,
             borderDash: dashed ? [5, 4] : [], spanGaps: false, tension: 0.15 };
  }

  function renderCharts(rounds) {
    const labels = rounds.map(function (r) { return r.round; });
    draw("chart-loss", "line", labels, [line("train loss", rounds.map(function (r) { return r.metrics.train_loss; }), "#2f6fdb")],
         baseOptions("loss"));

    const numHeads = rounds.reduce(function (m, r) { return Math.max(m, r.metrics.head_accuracy.length); }, 0);
    const acc = [];
    for (let k = 0; k < numHeads; k++) {
      const color = HEAD_COLORS[k % HEAD_COLORS.length];
      acc.push(line("head " + (k + 1), rounds.map(function (r) { return r.metrics.head_accuracy[k] ?? null; }), color, false));
      if (rounds.some(function (r) { return r.metrics.client_head_accuracy && r.metrics.client_head_accuracy[k] != null; })) {
        const ds = line("head " + (k + 1) + " (clients)",
                        rounds.map(function (r) { return (r.metrics.client_head_accuracy || [])[k] ?? null; }), color, true);
        ds.pointRadius = 0;
        acc.push(ds);
      }
    }
    draw("chart-accuracy", "line", labels, acc, baseOptions("top-1 accuracy", {}));

    const tau = [line("τ (server eval)", rounds.map(function (r) { return r.metrics.tau; }), "#2b8a3e", false)];
    if (rounds.some(function (r) { return r.metrics.client_tau != null; })) {
      tau.push(line("τ (client eval)", rounds.map(function (r) { return r.metrics.client_tau; }), "#2b8a3e", true));
    }
    draw("chart-tau", "line", labels, tau, baseOptions("accepted tokens / step"));

    draw("chart-epsilon", "line", labels, [
      line("ε max over clients", rounds.map(function (r) { return r.privacy.epsilon_max; }), "#c92a2a", false),
      line("ε mean", rounds.map(function (r) { return r.privacy.epsilon_mean; }), "#e67700", true),
    ], baseOptions("ε"));
    const last = rounds.length ? rounds[rounds.length - 1] : null;
    const delta = document.getElementById("delta");
    if (delta) delta.textContent = last && last.privacy.delta != null ? String(last.privacy.delta) : "–";

    const bar = function (label, data, color) {
      return { type: "bar", label: label, data: data, backgroundColor: color, stack: "outcome" };
    };
    const sampled = line("sampled", rounds.map(function (r) { return r.participation.sampled; }), "#1d2330", true);
    sampled.type = "line";
    sampled.stack = "sampled";
    draw("chart-participation", "bar", labels, [
      sampled,
      bar("succeeded", rounds.map(function (r) { return r.participation.succeeded; }), "#2b8a3e"),
      bar("dropped", rounds.map(function (r) { return r.participation.dropped; }), "#f08c00"),
      bar("rejected", rounds.map(function (r) { return r.participation.rejected.length; }), "#c92a2a"),
    ], baseOptions("clients", {
      scales: { x: { stacked: true, title: { display: true, text: "round" } },
                y: { stacked: true, beginAtZero: true, ticks: { precision: 0 }, title: { display: true, text: "clients" } } },
    }));
  }

  function renderTable(rounds) {
    const body = document.querySelector("#rounds-table tbody");
    if (!body) return;
    body.replaceChildren();
    rounds.slice().reverse().forEach(function (r) {
      const tr = el("tr");
      const reasons = r.participation.rejected.map(function (x) { return x.reason; });
      [r.round, fmt(r.metrics.train_loss, 4),
       r.metrics.head_accuracy.map(function (a) { return fmt(a, 3); }).join(" · "),
       fmt(r.metrics.tau, 3), fmt(r.metrics.client_tau, 3), fmt(r.tau_heads_only, 3),
       (r.privacy.epsilon_max === null ? "∞" : fmt(r.privacy.epsilon_max, 3)) + " / " +
         (r.privacy.epsilon_mean === null ? "∞" : fmt(r.privacy.epsilon_mean, 3)),
       r.participation.sampled, r.participation.succeeded, r.participation.dropped].forEach(function (v) {
        tr.appendChild(el("td", v));
      });
      tr.appendChild(el("td", reasons.length ? reasons.length + " (" + reasons.join("; ") + ")" : "0", reasons.length ? "reasons" : ""));
      const s = r.seconds;
      tr.appendChild(el("td", fmt(r.wall_seconds, 1) +
        (s ? " (" + [s.fit, s.server_eval, s.client_eval].map(function (v) { return fmt(v, 1); }).join(" / ") + ")" : "")));
      const b = r.bytes;
      tr.appendChild(el("td", b ? [b.down_per_client, b.up_per_client, b.eval_push_per_client].map(bytes).join(" / ")
                                : bytes(r.bytes_per_client)));
      body.appendChild(tr);
    });
  }

  function renderCheckpoint(runId, ck) {
    const box = document.getElementById("checkpoint");
    if (!box) return;
    box.replaceChildren();
    if (!ck) {
      box.appendChild(el("p", "No checkpoint recorded yet.", "muted"));
      return;
    }
    const dl = el("dl", null, "kv");
    [["Round", ck.round], ["Head version", ck.head_version], ["Size", bytes(ck.size_bytes)],
     ["Recorded", utc(ck.created_at) + " UTC"]].forEach(function (kv) {
      dl.appendChild(el("dt", kv[0]));
      dl.appendChild(el("dd", kv[1]));
    });
    dl.appendChild(el("dt", "SHA-256"));
    const dd = el("dd");
    dd.appendChild(el("code", ck.sha256, "hash"));
    dl.appendChild(dd);
    box.appendChild(dl);
    const p = el("p");
    const a = el("a", "Download checkpoint (round " + ck.round + ")", "button");
    a.id = "checkpoint-download";
    a.href = withToken("/runs/" + encodeURIComponent(runId) + "/checkpoint");
    p.appendChild(a);
    box.appendChild(p);
  }

  function renderRun(run, rounds) {
    const status = document.getElementById("run-status");
    status.textContent = run.status;
    status.className = "status status-" + run.status;
    document.body.dataset.status = run.status;
    document.getElementById("num-rounds").textContent = String(rounds.length);
    document.getElementById("updated-at").textContent = utc(run.updated_at);
    document.getElementById("no-rounds").classList.toggle("hidden", rounds.length > 0);
    document.getElementById("live").classList.toggle("on", run.status === "running");
    document.getElementById("live").textContent = run.status === "running" ? "live" : "";
    renderCharts(rounds);
    renderTable(rounds);
    renderCheckpoint(run.run_id, run.latest_checkpoint);
    document.body.dataset.rounds = String(rounds.length);
    document.body.dataset.ready = "1";
  }

  async function runPage() {
    const runId = document.body.dataset.runId;
    const base = "/api/runs/" + encodeURIComponent(runId);
    let lastUpdated = null;
    async function tick() {
      let running = document.body.dataset.status === "running";
      try {
        const run = await api(base);
        running = run.status === "running";
        if (run.updated_at !== lastUpdated) {
          const rounds = await api(base + "/rounds");
          renderRun(run, rounds);
          lastUpdated = run.updated_at;
        }
        window.fedla.polls += 1;
        document.body.dataset.poll = "ok";
      } catch (err) {
        window.fedla.pollErrors += 1;
        document.body.dataset.poll = "error";
        console.error(err);
      }
      window.setTimeout(tick, running ? POLL_RUNNING_MS : POLL_IDLE_MS);
    }
    await tick();
  }

  async function indexPage() {
    let last = null;
    async function tick() {
      try {
        const runs = await api("/api/runs");
        const text = JSON.stringify(runs);
        if (last !== null && text !== last) renderRuns(runs);
        last = text;
        document.body.dataset.poll = "ok";
      } catch (err) {
        document.body.dataset.poll = "error";
      }
      window.setTimeout(tick, 5000);
    }
    await tick();
  }

  function renderRuns(runs) {
    const table = document.getElementById("runs-table");
    const empty = document.getElementById("empty-state");
    if (empty) empty.classList.toggle("hidden", runs.length > 0);
    table.classList.toggle("hidden", runs.length === 0);
    const body = table.querySelector("tbody");
    body.replaceChildren();
    runs.forEach(function (run) {
      const tr = el("tr");
      tr.dataset.runId = run.run_id;
      const td = el("td");
      const a = el("a", run.run_id);
      a.href = withToken("/runs/" + encodeURIComponent(run.run_id));
      td.appendChild(a);
      tr.appendChild(td);
      const st = el("td");
      st.appendChild(el("span", run.status, "status status-" + run.status));
      tr.appendChild(st);
      [run.num_rounds, fmt(run.last_train_loss, 4), fmt(run.last_tau, 3),
       run.last_epsilon_max === null ? (run.num_rounds ? "∞" : "–") : fmt(run.last_epsilon_max, 3),
       utc(run.started_at), utc(run.updated_at)].forEach(function (v) { tr.appendChild(el("td", v)); });
      body.appendChild(tr);
    });
  }

  // The privacy-utility benchmark this run belonged to (embedded by the page): DP tau against epsilon, with
  // public-only, federated non-private and central non-private as reference lines and this run starred.
  function renderPrivacyUtility() {
    const data = document.getElementById("privacy-utility-data");
    if (!data) return;
    const curve = JSON.parse(data.textContent);
    const xs = curve.epsilon;
    const points = function (ys) { return xs.map(function (x, i) { return { x: x, y: ys[i] }; }); };
    const flat = function (y) { return points(xs.map(function () { return y; })); };
    const datasets = [Object.assign(line("federated DP", points(curve.dp), "#c92a2a", false), { pointRadius: 4 })];
    const refs = { public_only: "#1d2330", federated_nodp: "#2f6fdb", central_nodp: "#2b8a3e" };
    Object.keys(refs).forEach(function (name) {
      if (curve.references[name] != null) {
        const ds = line(name, flat(curve.references[name]), refs[name], true);
        ds.pointRadius = 0;
        datasets.push(ds);
      }
    });
    const mine = curve.this_run;
    if (mine) {
      const x = mine.epsilon === null ? xs[xs.length - 1] : mine.epsilon;
      datasets.push({ label: "this run", data: [{ x: x, y: mine.tau }], type: "scatter", pointStyle: "star",
                      pointRadius: 10, borderColor: "#e67700", backgroundColor: "#e67700" });
    }
    const options = baseOptions("heads-only τ", {});
    options.scales.x = { type: "logarithmic", title: { display: true, text: "ε (δ = 1e-5, all rounds)" },
                         ticks: { callback: function (v) { return xs.indexOf(v) >= 0 ? String(v) : ""; } } };
    options.interaction = { mode: "nearest", intersect: false };
    draw("chart-privacy-utility", "line", [], datasets, options);
  }

  document.addEventListener("DOMContentLoaded", function () {
    const page = document.body.dataset.page;
    if (page === "run") renderPrivacyUtility();
    if (page === "run") runPage();
    else if (page === "index") indexPage();
  });
})();
