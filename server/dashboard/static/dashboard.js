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

  function bytes(n) {  // decimal units, as traffic is usually quoted (23.9 MB, not 22.8 MiB)
    if (n === null || n === undefined) return "–";
    const units = ["B", "kB", "MB", "GB"];
    let i = 0;
    while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
    return n.toFixed(i ? 1 : 0) + " " + units[i];
  }

  // Epsilon spent and left against the run's budget; null epsilon is unbounded (no DP guarantee).
  function epsilonSpent(spent, budget, rounds) {
    if (!rounds) return "–";
    if (spent === null || spent === undefined) return "∞ (no DP)";
    return budget === null || budget === undefined ? fmt(spent, 3) + " (no budget)" : fmt(spent, 3) + " of " + fmt(budget, 2);
  }

  function epsilonLeft(spent, budget) {
    if (spent === null || spent === undefined || budget === null || budget === undefined) return "–";
    return fmt(Math.max(0, budget - spent), 3);
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

  // Accuracy, tau and epsilon get a round-0 point: the starting heads (epsilon 0: nothing spent yet), so that a
  // round's gain or loss is visible; loss, participation and traffic have no round 0.
  function renderCharts(rounds, run) {
    const labels = rounds.map(function (r) { return r.round; });
    const start = run.starting_heads;
    const withStart = start ? [0].concat(labels) : labels;
    const from0 = function (first, values) { return start ? [first].concat(values) : values; };
    draw("chart-loss", "line", labels, [line("train loss", rounds.map(function (r) { return r.metrics.train_loss; }), "#2f6fdb")],
         baseOptions("loss"));

    const numHeads = rounds.reduce(function (m, r) { return Math.max(m, r.metrics.head_accuracy.length); },
                                   start ? start.head_accuracy.length : 0);
    const acc = [];
    for (let k = 0; k < numHeads; k++) {
      const color = HEAD_COLORS[k % HEAD_COLORS.length];
      acc.push(line("head " + (k + 1), from0(start ? start.head_accuracy[k] ?? null : null,
                                             rounds.map(function (r) { return r.metrics.head_accuracy[k] ?? null; })), color, false));
      if (rounds.some(function (r) { return r.metrics.client_head_accuracy && r.metrics.client_head_accuracy[k] != null; })) {
        const ds = line("head " + (k + 1) + " (clients)",
                        from0(null, rounds.map(function (r) { return (r.metrics.client_head_accuracy || [])[k] ?? null; })), color, true);
        ds.pointRadius = 0;
        acc.push(ds);
      }
    }
    draw("chart-accuracy", "line", withStart, acc, baseOptions("top-1 accuracy", {}));

    const tau = [line("τ (server eval)", from0(start ? start.tau : null, rounds.map(function (r) { return r.metrics.tau; })), "#2b8a3e", false)];
    if (rounds.some(function (r) { return r.metrics.client_tau != null; })) {
      tau.push(line("τ (client eval)", from0(null, rounds.map(function (r) { return r.metrics.client_tau; })), "#2b8a3e", true));
    }
    const headsOnly = from0(start ? start.tau_heads_only ?? null : null, rounds.map(function (r) { return r.tau_heads_only ?? null; }));
    if (headsOnly.some(function (v) { return v !== null; })) {
      const ds = line("τ heads only (first and last)", headsOnly, "#862e9c", false);
      ds.spanGaps = true;
      ds.pointRadius = 4;
      tau.push(ds);
    }
    draw("chart-tau", "line", withStart, tau, baseOptions("accepted tokens / step"));

    const budget = run.plan && run.plan.privacy ? run.plan.privacy.epsilon_budget : null;
    const dp = run.plan && run.plan.privacy ? run.plan.privacy.dp : rounds.some(function (r) { return r.privacy.epsilon_max !== null; });
    const zero = dp ? 0 : null;
    const eps = [
      line("ε max over clients", from0(zero, rounds.map(function (r) { return r.privacy.epsilon_max; })), "#c92a2a", false),
      line("ε mean", from0(zero, rounds.map(function (r) { return r.privacy.epsilon_mean; })), "#e67700", true),
    ];
    if (budget !== null && budget !== undefined) {
      const ds = line("budget ε = " + fmt(budget, 2), withStart.map(function () { return budget; }), "#1d2330", true);
      ds.pointRadius = 0;
      ds.borderWidth = 1.5;
      eps.push(ds);
    }
    draw("chart-epsilon", "line", withStart, eps, baseOptions("ε", {}));
    const last = rounds.length ? rounds[rounds.length - 1] : null;
    const note = document.getElementById("epsilon-note");
    if (note) {
      const delta = last && last.privacy.delta != null ? last.privacy.delta : run.plan && run.plan.privacy ? run.plan.privacy.delta : null;
      note.textContent = !dp ? "(no DP in this run: ε is unbounded)"
        : "(δ = " + (delta === null ? "–" : Number(delta).toExponential()) + (budget != null ? ", budget " + fmt(budget, 2) : "") +
          (last ? ", spent " + epsilonSpent(last.privacy.epsilon_max, null, 1).replace(" (no budget)", "") +
                  (budget != null ? ", left " + epsilonLeft(last.privacy.epsilon_max, budget) : "") : "") + ")";
    }
    const left = document.getElementById("epsilon-left");
    if (left) {
      left.textContent = epsilonSpent(last ? last.privacy.epsilon_max : null, budget, rounds.length) +
        (last && budget != null ? " · left " + epsilonLeft(last.privacy.epsilon_max, budget) : "");
    }

    const bar = function (label, data, color, stack) {
      return { type: "bar", label: label, data: data, backgroundColor: color, stack: stack || "outcome" };
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

    const mb = function (pick) { return rounds.map(function (r) { const v = pick(r); return v === null || v === undefined ? null : v / 1e6; }); };
    draw("chart-bytes", "bar", labels, [
      bar("heads down", mb(function (r) { return r.bytes ? r.bytes.down_per_client : r.bytes_per_client; }), "#2f6fdb", "bytes"),
      bar("update up", mb(function (r) { return r.bytes ? r.bytes.up_per_client : null; }), "#d9480f", "bytes"),
      bar("evaluation push", mb(function (r) { return r.bytes ? r.bytes.eval_push_per_client : null; }), "#868e96", "bytes"),
    ], baseOptions("MB per client", {
      scales: { x: { stacked: true, title: { display: true, text: "round" } },
                y: { stacked: true, beginAtZero: true, title: { display: true, text: "MB per client" } } },
    }));
  }

  // One sentence at the top: is the federation improving on its starting heads, and what has it cost?
  function renderGlance(rounds, run) {
    const box = document.getElementById("glance");
    if (!box) return;
    box.replaceChildren();
    const start = run.starting_heads;
    const last = rounds.length ? rounds[rounds.length - 1] : null;
    if (!last) return;
    const change = function (name, before, after, digits) {
      const span = el("span");
      span.appendChild(document.createTextNode(name + " " + (before === null || before === undefined ? "" : fmt(before, digits) + " → ")));
      const diff = before === null || before === undefined ? null : after - before;
      const value = el("span", fmt(after, digits) + (diff === null ? "" : " (" + (diff >= 0 ? "+" : "") + fmt(diff, digits) + ")"),
                       diff === null || Math.abs(diff) < Math.pow(10, -digits) ? "" : diff > 0 ? "up" : "down");
      span.appendChild(value);
      return span;
    };
    const parts = [change("head-1 accuracy", start ? start.head_accuracy[0] : null, last.metrics.head_accuracy[0], 3)];
    if (last.metrics.tau !== null && last.metrics.tau !== undefined) parts.push(change("τ", start ? start.tau : null, last.metrics.tau, 2));
    const budget = run.plan && run.plan.privacy ? run.plan.privacy.epsilon_budget : null;
    parts.push(el("span", "ε " + epsilonSpent(last.privacy.epsilon_max, budget, rounds.length)));
    box.appendChild(el("strong", (start ? "Since the starting heads, after round " : "After round ") + last.round + ": "));
    parts.forEach(function (part, i) {
      if (i) box.appendChild(document.createTextNode(" · "));
      box.appendChild(part);
    });
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
    renderCharts(rounds, run);
    renderGlance(rounds, run);
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
        if (text !== last) renderRuns(runs);
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
       epsilonSpent(run.last_epsilon_max, run.epsilon_budget, run.num_rounds), epsilonLeft(run.last_epsilon_max, run.epsilon_budget),
       utc(run.started_at), utc(run.updated_at)].forEach(function (v) { tr.appendChild(el("td", v)); });
      body.appendChild(tr);
    });
    document.body.dataset.ready = "1";
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
