// The fleet page of omni-router: polls the router's JSON routes every 2 s and draws what they report.
//
// Only what the router reported is shown; a field it did not report is a dash. Every text is set with
// textContent or a text node, never parsed as HTML. All URLs are relative to the page (/dashboard), so
// it works behind `kubectl port-forward` or a path prefix. The verdict (routable, fenced, out of
// rotation and why, the fleet's summary) is the router's own, from GET /fleet/status: the page judges
// nothing, so it cannot say otherwise than `omni-router status`, which prints the same answer.
"use strict";

(() => {
  const POLL_MS = 2000;
  const KEY_ITEM = "omni-router.dashboard.admin-key";
  const TIMELINE_ITEM = "omni-router.dashboard.timeline";
  // The longest stretch of time the timeline draws, and keeps.
  const SPAN_MS = 30 * 60 * 1000;
  const MIN_SPAN_MS = 10 * 1000;
  // Polls further apart than this (the tab slept, the router did not answer) start a new bar.
  const GAP_MS = 3 * POLL_MS + 4000;
  const MAX_EVENTS = 200;
  const SHOWN_VERSIONS = 10;
  const CHECKSUM_CHARS = 16;
  const COLORS = 8;
  const NONE = "-";
  // The routes read, relative to this page.
  const ROUTES = { status: "fleet/status", health: "health" };

  const $ = (id) => document.getElementById(id);

  /** An element with attributes (never `style`) and children (strings become text nodes). */
  function el(tag, attrs, ...children) {
    return build(document.createElement(tag), attrs, children);
  }

  // The SVG namespace, as the HTML parser gave it to the page's chart (no URL written here).
  function svg(tag, attrs, ...children) {
    return build(document.createElementNS($("timeline-chart").namespaceURI, tag), attrs, children);
  }

  function build(node, attrs, children) {
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value !== null && value !== undefined && value !== false) node.setAttribute(name, String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(typeof child === "string" ? document.createTextNode(child) : child);
    }
    return node;
  }

  // --- the admin key -----------------------------------------------------------------------------

  /** A key handed in the fragment (`#key=...`) is kept like a typed one and removed from the address bar. */
  function takeKeyFromFragment() {
    const params = new URLSearchParams(window.location.hash.slice(1));
    const key = params.get("key");
    if (key === null) return;
    if (key) sessionStorage.setItem(KEY_ITEM, key);
    history.replaceState(null, "", window.location.pathname + window.location.search);
  }

  const adminKey = () => sessionStorage.getItem(KEY_ITEM);

  function askForKey(message) {
    const form = $("key-form");
    if (form.hidden) {
      form.hidden = false;
      $("key-input").focus();
    }
    $("forget-key").hidden = adminKey() === null;
    showProblem(message);
  }

  // --- reading the router ------------------------------------------------------------------------

  class Refusal extends Error {
    constructor(path, status, message, role) {
      super(message);
      this.path = path;
      this.status = status;
      this.role = role;
    }
  }

  async function getJson(path) {
    const headers = { Accept: "application/json" };
    const key = adminKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    let response;
    try {
      response = await fetch(path, { headers, cache: "no-store" });
    } catch (err) {
      throw new Refusal(path, 0, `cannot reach the router (${err.message})`, null);
    }
    let body = null;
    try {
      body = await response.json();
    } catch {
      body = null;
    }
    if (!response.ok) {
      const message =
        body && body.error && typeof body.error.message === "string" ? body.error.message : `HTTP ${response.status}`;
      throw new Refusal(path, response.status, message, response.headers.get("X-Omni-Router-Role"));
    }
    return body;
  }

  /** The router's verdict with what it was judged from (GET /fleet/status), and its process (GET /health). */
  async function readRouter() {
    const [health, status] = await Promise.all([getJson(ROUTES.health), getJson(ROUTES.status)]);
    // The router's clock, as the journal's and the versions' times are: ages and the timeline agree with them.
    return { health, status, takenAt: status.read_at * 1000 };
  }

  // --- words ----------------------------------------------------------------------------------

  const pad = (n) => String(n).padStart(2, "0");

  function clock(ms) {
    const d = new Date(ms);
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${timeOfDay(ms)}`;
  }

  function timeOfDay(ms) {
    const d = new Date(ms);
    return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }

  function ago(seconds) {
    const s = Math.max(0, seconds);
    for (const [unit, size] of [["d", 86400], ["h", 3600], ["m", 60]]) {
      if (s >= size) return `${Math.floor(s / size)}${unit} ago`;
    }
    return `${Math.floor(s)}s ago`;
  }

  const when = (seconds, nowMs) => `${clock(seconds * 1000)} (${ago(nowMs / 1000 - seconds)})`;

  function versionLabel(s) {
    const label = s.weight_version || NONE;
    return s.staleness ? `${label} (${s.staleness} behind)` : label;
  }

  function catchUpLabel(c) {
    if (!c) return NONE;
    const source = c.source ? ` from ${c.source}` : "";
    if (c.state === "copying") return `copying${source}`;
    return `${c.state}${source} (${c.attempts} attempt(s))`; // failed, or retired: the routable cell says why
  }

  // --- the workers table -----------------------------------------------------------------------

  function renderWorkers(statuses) {
    const rows = statuses.map((s) => {
      const cells = [
        ["id", s.id],
        ["url", s.url],
        ["engine", s.engine || NONE],
        ["health", s.health],
        ["version", versionLabel(s)],
        ["paused", s.paused ? "yes" : s.reported_paused ? "own" : "no"],
        ["disabled", s.fenced ? "fenced" : s.disabled ? "yes" : "no"],
        ["pending", s.pending === null || s.pending === undefined ? "no" : s.pending],
        ["inflight", String(s.inflight)],
        ["catch-up", catchUpLabel(s.catch_up)],
        ["routable", s.routable ? "yes" : `no: ${s.out_of_rotation}`],
      ];
      const classes = [s.routable ? "routable" : "out", s.fenced ? "fenced" : s.disabled ? "disabled" : null];
      const row = el("tr", { "data-worker": s.id, class: classes.filter(Boolean).join(" ") });
      for (const [name, text] of cells) {
        const cell = el("td", { "data-col": name }, text);
        if (name === "health") cell.classList.add(`health-${s.health}`);
        if (name === "catch-up" && s.catch_up && s.catch_up.last_error) {
          cell.title = s.catch_up.detail || s.catch_up.last_error;
        }
        row.append(cell);
      }
      return row;
    });
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 11, class: "empty" }, "No worker registered")));
    $("worker-rows").replaceChildren(...rows);
  }

  function renderSummary(data) {
    const status = data.status;
    const summary = $("summary");
    summary.textContent = `${status.summary}. Read at ${clock(data.takenAt)} (router role: ${status.leader.role}).`;
    summary.dataset.exitCode = String(status.exit_code);
    const parts = [`The router reports ${data.health.routable_workers} routable worker(s).`];
    if (data.health.discovery) parts.push(`Discovery: ${JSON.stringify(data.health.discovery)}.`);
    $("router-health").textContent = parts.join(" ");
  }

  // --- the journal -------------------------------------------------------------------------------

  function storageWords(storage) {
    if (!storage) return "memory only (no --state-dir)";
    if (storage.healthy) return `stored in ${storage.location}`;
    const unsaved = storage.unsaved && storage.unsaved.length ? `; unsaved: ${storage.unsaved.join(", ")}` : "";
    return `the store ${storage.location} refuses writes (${storage.error})${unsaved}`;
  }

  function renderJournal(view, resolveHint, nowMs) {
    const host = $("journal");
    const kept = storageWords(view.storage);
    const entry = view.pending;
    if (!entry) {
      host.className = "";
      host.replaceChildren(el("p", { id: "journal-state" }, `No unresolved update (${kept}).`));
      return;
    }
    const targets = entry.targets.map((t) => t.id).join(", ") || NONE;
    const rows = [
      ["State", entry.state === "in_flight" ? "in flight (an update is running, or the router stopped during it)" : "failed"],
      ["Update", entry.path],
      ["Started", when(entry.started_at, nowMs)],
      ["Targets (fenced)", targets],
    ];
    if (entry.failed && entry.failed.length) rows.push(["Failed", entry.failed.join(", ")]);
    if (entry.reason) rows.push(["Reason", entry.reason]);
    rows.push(["Kept", kept]);
    const list = el("dl", {});
    for (const [term, text] of rows) list.append(el("dt", {}, term), el("dd", {}, text));
    host.className = "journal-pending";
    host.replaceChildren(
      el("p", { id: "journal-state" }, `Unresolved ${entry.state === "in_flight" ? "running" : "failed"} update ${entry.path}`),
      list,
      el("p", { class: "resolve-head" }, "To resolve (this page changes nothing): "),
      el("p", { id: "resolve-hint", class: "resolve" }, el("code", {}, resolveHint || NONE)),
      el(
        "p",
        { class: "note" },
        "Resolve only once the fenced workers hold the fleet's weights again (or were repaired): the router then " +
          "restores each one's previous flag and drops the entry.",
      ),
    );
  }

  // --- the fleet's versions ----------------------------------------------------------------------

  function renderVersions(versions, nowMs) {
    let head =
      `Sequence ${versions.sequence}, weight_version ${versions.weight_version || NONE}, ` +
      `policy ${versions.version_policy}`;
    const history = versions.history || [];
    const shown = history.slice(-SHOWN_VERSIONS).reverse();
    if (!history.length) head += ": none recorded yet (every worker's boot weights count as the fleet's)";
    else if (shown.length < history.length) head += ` (the last ${shown.length} of ${history.length} recorded)`;
    $("versions-head").textContent = head;
    const rows = shown.map((e) => {
      let checksum = e.checksum || NONE;
      if (checksum.length > CHECKSUM_CHARS) checksum = `${checksum.slice(0, CHECKSUM_CHARS)}…`;
      const cell = (text) => el("td", {}, text);
      return el(
        "tr",
        { "data-sequence": e.sequence },
        cell(String(e.sequence)),
        cell(e.weight_version || NONE),
        cell(e.changed_at ? when(e.changed_at, nowMs) : NONE),
        cell(checksum),
        cell(e.source_path || NONE),
      );
    });
    $("version-rows").replaceChildren(...rows);
  }

  // --- the timeline: kept in this tab from each poll -----------------------------------------

  function loadTimeline() {
    try {
      const kept = JSON.parse(sessionStorage.getItem(TIMELINE_ITEM) || "null");
      if (kept && kept.workers && kept.order && kept.colors && kept.events) return kept;
    } catch {
      // a damaged record starts afresh
    }
    return { workers: {}, order: [], colors: {}, events: [] };
  }

  const timeline = loadTimeline();

  function colorOf(version) {
    if (!(version in timeline.colors)) timeline.colors[version] = Object.keys(timeline.colors).length % COLORS;
    return timeline.colors[version];
  }

  function markOf(s) {
    if (s.fenced) return "fenced";
    if (s.disabled) return "disabled";
    if (s.health !== "healthy") return "down";
    if (s.pending !== null && s.pending !== undefined) return "pending";
    return "serving";
  }

  const MARK_WORDS = {
    fenced: "fenced",
    disabled: "disabled",
    down: "not healthy",
    pending: "pending",
    serving: "serving",
  };

  function record(statuses, t) {
    for (const s of statuses) {
      const version = s.weight_version || NONE;
      const mark = markOf(s);
      colorOf(version);
      let segments = timeline.workers[s.id];
      if (!segments) {
        segments = timeline.workers[s.id] = [];
        timeline.order.push(s.id);
      }
      const last = segments[segments.length - 1];
      if (last && last.version === version && last.mark === mark && t - last.to <= GAP_MS) {
        last.to = t;
        continue;
      }
      if (last) {
        if (last.version !== version) note(t, s.id, `version ${last.version} → ${version}`, "update");
        if (last.mark !== mark) note(t, s.id, `${MARK_WORDS[last.mark]} → ${MARK_WORDS[mark]}`, mark);
      } else {
        note(t, s.id, `first seen: version ${version}, ${MARK_WORDS[mark]}`, mark);
      }
      // A state holds until a poll sees another: the bar before a change ends where the next begins.
      if (last && t - last.to <= GAP_MS) last.to = t;
      segments.push({ from: t, to: t, version, mark });
    }
    const oldest = t - SPAN_MS;
    for (const id of [...timeline.order]) {
      const kept = timeline.workers[id].filter((seg) => seg.to >= oldest);
      if (kept.length) {
        timeline.workers[id] = kept;
      } else {
        delete timeline.workers[id];
        timeline.order = timeline.order.filter((other) => other !== id);
      }
    }
    try {
      sessionStorage.setItem(TIMELINE_ITEM, JSON.stringify(timeline));
    } catch {
      // storage full: the timeline lives on in memory
    }
  }

  function note(t, worker, text, kind) {
    timeline.events.push({ t, worker, text, kind });
    if (timeline.events.length > MAX_EVENTS) timeline.events.splice(0, timeline.events.length - MAX_EVENTS);
  }

  function renderTimeline(data) {
    const now = data.takenAt;
    const history = data.status.versions.history || [];
    let first = now;
    for (const id of timeline.order) first = Math.min(first, timeline.workers[id][0].from);
    for (const e of history) if (e.changed_at && now - e.changed_at * 1000 <= SPAN_MS) first = Math.min(first, e.changed_at * 1000);
    const span = Math.min(SPAN_MS, Math.max(MIN_SPAN_MS, (now - first) * 1.05));
    const start = now - span;

    const chart = $("timeline-chart");
    const width = Math.max(480, $("timeline").clientWidth || 960);
    const label = 150;
    const rowH = 24;
    const top = 40;
    const ids = timeline.order;
    const height = top + Math.max(1, ids.length) * rowH + 24;
    const x = (ms) => label + ((ms - start) / span) * (width - label - 10);
    for (const [name, value] of Object.entries({ width, height, viewBox: `0 0 ${width} ${height}` })) {
      chart.setAttribute(name, String(value));
    }
    chart.replaceChildren();

    // The time axis.
    for (let i = 0; i <= 4; i += 1) {
      const ms = start + (span * i) / 4;
      chart.append(
        svg("line", { class: "grid", x1: x(ms), x2: x(ms), y1: top - 4, y2: height - 20 }),
        svg("text", { class: "axis", x: x(ms), y: height - 6, "text-anchor": i === 4 ? "end" : i ? "middle" : "start" }, timeOfDay(ms)),
      );
    }

    // A marker across the rows, labelled above them (two label lines, taken in turn, so near ones do not overlap).
    let labels = 0;
    function marker(ms, kind, text, title, version) {
      const level = labels % 2 ? 28 : 14;
      labels += 1;
      const right = x(ms) + text.length * 6.5 + 6 > width; // about 6.5 pixels a character at 11 px
      chart.append(
        svg(
          "line",
          { class: kind, "data-version": version, x1: x(ms), x2: x(ms), y1: level + 3, y2: height - 20 },
          svg("title", {}, title),
        ),
        svg(
          "text",
          { class: `${kind}-label`, x: right ? x(ms) - 3 : x(ms) + 3, y: level, "text-anchor": right ? "end" : "start" },
          text,
        ),
      );
    }

    // The fleet's recorded updates.
    for (const e of history) {
      const ms = (e.changed_at || 0) * 1000;
      if (ms < start) continue;
      const name = `#${e.sequence} ${e.weight_version || NONE}`;
      marker(ms, "update", name, `fleet update ${name} at ${timeOfDay(ms)}`, e.weight_version || NONE);
    }

    // The journal's failed (or running) update, whose targets are fenced.
    const pending = data.status.journal.pending;
    if (pending && pending.started_at * 1000 >= start) {
      const ms = pending.started_at * 1000;
      const what = `${pending.state === "in_flight" ? "running" : "failed"} update ${pending.path}`;
      marker(ms, "fence-line", what, `${what} at ${timeOfDay(ms)}`, null);
    }

    // One row per worker: one bar per (version, state) it was seen in.
    const current = new Set(data.status.workers.map((s) => s.id));
    ids.forEach((id, i) => {
      const y = top + i * rowH;
      const name = current.has(id) ? id : `${id} (gone)`;
      chart.append(svg("text", { class: "row-label", x: 4, y: y + rowH / 2 + 4 }, name.length > 20 ? `${name.slice(0, 19)}…` : name));
      for (const seg of timeline.workers[id]) {
        if (seg.to < start) continue;
        const x0 = x(Math.max(seg.from, start));
        const w = Math.max(3, x(seg.to) - x0);
        const words = `${id}: version ${seg.version}, ${MARK_WORDS[seg.mark]}, ${timeOfDay(seg.from)}–${timeOfDay(seg.to)}`;
        chart.append(
          svg(
            "rect",
            {
              class: `seg v${colorOf(seg.version)} ${seg.mark}`,
              "data-worker": id,
              "data-version": seg.version,
              "data-mark": seg.mark,
              x: x0,
              y: y + 3,
              width: w,
              height: rowH - 6,
              rx: 2,
            },
            svg("title", {}, words),
          ),
        );
        if (seg.mark === "fenced") {
          chart.append(
            svg("path", { class: "fence-mark", d: `M${x0} ${y + 1} l5 -7 h-10 z` }, svg("title", {}, `${id} fenced at ${timeOfDay(seg.from)}`)),
          );
        }
      }
    });

    const legend = Object.entries(timeline.colors).map(([version, color]) =>
      el("li", { "data-version": version }, el("span", { class: `swatch v${color}` }), version),
    );
    $("legend").replaceChildren(...legend);

    const events = timeline.events
      .slice(-50)
      .reverse()
      .map((e) => el("li", { class: `event ${e.kind}` }, `${timeOfDay(e.t)}  ${e.worker}: ${e.text}`));
    $("events").replaceChildren(...events);
  }

  // --- the loop ----------------------------------------------------------------------------------

  function showProblem(message) {
    const problem = $("problem");
    problem.textContent = message || "";
    problem.hidden = !message;
  }

  async function poll() {
    let data;
    try {
      data = await readRouter();
    } catch (err) {
      if (err instanceof Refusal && err.status === 401) {
        askForKey(
          adminKey() === null
            ? "The router requires an admin key: type it below."
            : `The admin key was refused (GET /${err.path} answered 401: ${err.message}).`,
        );
      } else if (err instanceof Refusal && err.role === "standby") {
        showProblem(`${err.message} (GET /${err.path} answered ${err.status}; open the leader's page).`);
      } else if (err instanceof Refusal && err.status) {
        showProblem(`GET /${err.path} answered ${err.status}: ${err.message}. Showing the last answers read.`);
      } else {
        showProblem(`${err.message}. Showing the last answers read.`);
      }
      document.body.classList.add("stale");
      return;
    }
    document.body.classList.remove("stale");
    showProblem(null);
    $("key-form").hidden = true;
    $("forget-key").hidden = adminKey() === null;
    const status = data.status;
    record(status.workers, data.takenAt);
    renderSummary(data);
    renderWorkers(status.workers);
    renderJournal(status.journal, status.resolve_hint, data.takenAt);
    renderVersions(status.versions, data.takenAt);
    renderTimeline(data);
    document.body.dataset.polls = String(Number(document.body.dataset.polls || "0") + 1);
  }

  async function loop() {
    try {
      await poll();
    } finally {
      window.setTimeout(loop, POLL_MS);
    }
  }

  function start() {
    takeKeyFromFragment();
    // Anything the Content-Security-Policy blocks is said, and stays said (a page that needs it is broken).
    document.addEventListener("securitypolicyviolation", (e) => {
      const blocked = $("blocked");
      blocked.textContent = `The page's Content-Security-Policy blocked ${e.blockedURI || "inline content"} (${e.violatedDirective}).`;
      blocked.hidden = false;
    });
    $("key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const key = $("key-input").value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY_ITEM, key);
      $("key-input").value = "";
      $("key-form").hidden = true;
      poll();
    });
    $("forget-key").addEventListener("click", () => {
      sessionStorage.removeItem(KEY_ITEM);
      $("forget-key").hidden = true;
      poll();
    });
    loop();
  }

  start();
})();
