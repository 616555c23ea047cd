// radixserve cache dashboard: polls /v1/cache/stats and /v1/cache/tree and draws them with SVG.
// No library, no build step, nothing loaded from elsewhere. Text that comes from the server
// (prompt text, with --expose-cache-tokens) is only ever set through textContent.
"use strict";
(() => {
  const SVG_NS = "http://www.w3.org/2000/svg";
  const KEY_STORAGE = "radixserve-api-key";
  const query = new URLSearchParams(location.search);
  const STATS_MS = Number(query.get("stats_ms")) || 1000;
  const TREE_MS = Number(query.get("tree_ms")) || 2000;
  const MAX_NODES = Number(query.get("max_nodes")) || 2000;
  const MAX_DEPTH = Number(query.get("max_depth")) || 32;
  // A request with no answer by then is given up (a stalled engine never answers a tree
  // request: it waits for the engine thread), and the next poll tries again.
  const TREE_TIMEOUT_MS = Number(query.get("tree_timeout_ms")) || Math.max(15000, 4 * TREE_MS);
  const STATS_TIMEOUT_MS = Math.max(10000, 4 * STATS_MS);
  const HEALTH_MS = Math.max(2000, STATS_MS);
  // A tree older than this is marked stale (its age is always shown).
  const STALE_MS = Math.max(10000, 3 * TREE_MS);
  const HISTORY = 120; // points kept in the time charts
  const COLOURS = { running: "#7b5cd6", locked: "#d9534f", evictable: "#4a7bd0", free: "#e6e8ee",
                    host: "#e39a2d", "device+host": "#2ca58d", namespace: "#8891a8", device: "#4a7bd0",
                    replica: "#5b6478" };
  const AGGREGATE_COLOUR = "#c9ccd6";

  // Everything the page knows, exposed for the browser tests and for curious operators.
  const state = {
    key: null, tree: null, stats: null, previous: null, history: [], selected: null,
    colour: "priority", drawnNodes: 0, renderMs: null, frameMs: null, treeFetchMs: null,
    treeUpdates: 0, statsUpdates: 0, errors: 0, lastError: null,
    treeAt: null, treeError: null, treeStarted: null, health: null, historyResets: 0,
    refreshTree: () => pollTree(true), refreshStats: () => pollStats(true),
    select: (id) => select(findNode(id)),
  };
  window.radixDashboard = state;
  const $ = (selector) => document.querySelector(selector);

  // ------------------------------------------------------------------ API key
  // The key comes from the form (the "API key" button, or shown after a 401), or from the URL
  // fragment (#key=..., never sent to the server nor logged, but the browser has written the
  // address into its history before this script runs: for throwaway profiles only). It is
  // kept in sessionStorage (this tab only, nothing persistent) and the fragment is removed
  // from the address bar at once, before anything that could fail. Its value is URL-encoded
  // (a key holding "&" or "%" is written %26, %25); one that does not decode (a stray "%") is
  // taken as it is, and a wrong key gets the form after its 401.
  function loadKey() {
    const match = /(?:^#|&)key=([^&]*)/.exec(location.hash);
    if (match) {
      history.replaceState(null, "", location.pathname + location.search);
      let key = match[1];
      try { key = decodeURIComponent(key); } catch (_) { /* not URL-encoded: as it is */ }
      if (key) sessionStorage.setItem(KEY_STORAGE, key);
    }
    state.key = sessionStorage.getItem(KEY_STORAGE);
  }

  function askForKey() {
    $("#keyform").hidden = false;
  }

  // fetch, given up after `timeoutMs` with an error that says so.
  async function fetchWithin(path, init, timeoutMs) {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), timeoutMs);
    try {
      return await fetch(path, { ...init, signal: abort.signal, cache: "no-store" });
    } catch (error) {
      if (abort.signal.aborted) throw new Error(`no answer in ${(timeoutMs / 1000).toFixed(1)} s`);
      throw error;
    } finally { clearTimeout(timer); }
  }

  // `path` is relative ("v1/cache/stats"): the app's own under a route prefix (dashboard.html).
  async function api(path, init = {}, timeoutMs = STATS_TIMEOUT_MS) {
    const headers = state.key ? { Authorization: "Bearer " + state.key } : {};
    const response = await fetchWithin(path, { ...init, headers }, timeoutMs);
    if (response.status === 401) {
      askForKey();
      throw new Error("this server needs its API key");
    }
    if (!response.ok) {
      let message = "HTTP " + response.status;
      try { message = (await response.json()).error.message; } catch (_) { /* not JSON */ }
      throw new Error(message);
    }
    return response.json();
  }

  // ------------------------------------------------------------------ polling
  let treeBusy = false, statsBusy = false, treeLoop = false;

  async function pollTree(once) {
    if (!treeBusy) {
      treeBusy = true;
      state.treeStarted = Date.now();
      try {
        const started = performance.now();
        // Token text is asked for only where the operator exposed it (the stats say so).
        const tokens = state.stats && state.stats.expose_tokens ? "&tokens=true" : "";
        const tree = await api(`v1/cache/tree?max_nodes=${MAX_NODES}&max_depth=${MAX_DEPTH}&hashes=true${tokens}`,
                               {}, TREE_TIMEOUT_MS);
        state.treeFetchMs = performance.now() - started;
        state.tree = tree;
        state.treeAt = Date.now();
        state.treeError = null;
        renderTree();
        renderTop();
        state.treeUpdates += 1;
        ok();
      } catch (error) {
        state.treeError = String(error.message || error);
        fail(error, "tree");
      } finally { treeBusy = false; state.treeStarted = null; renderTreeAge(); }
    }
    if (!once) setTimeout(pollTree, TREE_MS);
  }

  async function pollStats(once) {
    if (!statsBusy) {
      statsBusy = true;
      try {
        const stats = await api("v1/cache/stats");
        record(stats);
        renderStats();
        state.statsUpdates += 1;
        ok();
      } catch (error) {
        state.previous = null; // no rate across a gap (the server may have restarted meanwhile)
        fail(error, "stats");
      } finally { statsBusy = false; }
    }
    if (!once) setTimeout(pollStats, STATS_MS);
    // The tree loop starts once the stats have answered (or failed): its first request then
    // knows whether to ask for token text.
    if (!treeLoop) { treeLoop = true; pollTree(); }
  }

  // GET /health needs no key: 503 with the reason while the engine loop is stalled. The stats
  // come from what the engine published last, so they go on answering through a stall.
  async function pollHealth() {
    try {
      const response = await fetchWithin("health", {}, STATS_TIMEOUT_MS);
      let body = null;
      try { body = await response.json(); } catch (_) { /* not JSON */ }
      state.health = response.ok ? { ok: true, reason: null }
        : { ok: false, reason: (body && body.reason) || `HTTP ${response.status}` };
    } catch (error) {
      state.health = { ok: false, reason: "no answer: " + String(error.message || error) };
    }
    renderHealth();
    setTimeout(pollHealth, HEALTH_MS);
  }

  function renderHealth() {
    const el = $("#health");
    const unhealthy = state.health && !state.health.ok;
    el.hidden = !unhealthy;
    el.textContent = unhealthy ? "engine unhealthy: " + state.health.reason : "";
  }

  // The tree's own age, apart from the stats': a tree request waits for the engine thread.
  function renderTreeAge() {
    const el = $("#tree-age");
    const now = Date.now();
    const parts = [];
    if (state.treeAt !== null) parts.push(`tree from ${Math.round((now - state.treeAt) / 1000)} s ago`);
    if (state.treeStarted !== null && now - state.treeStarted > TREE_MS) {
      parts.push(`waiting ${Math.round((now - state.treeStarted) / 1000)} s for the engine`);
    }
    if (state.treeError) parts.push("error: " + state.treeError);
    el.textContent = parts.join(" · ");
    const stale = state.treeError !== null || (state.treeAt !== null && now - state.treeAt > STALE_MS);
    el.className = stale ? "stale" : "dim";
    el.dataset.stale = String(stale);
  }

  function ok() {
    const tree = state.tree;
    const parts = [`stats ${new Date().toLocaleTimeString()}`];
    if (tree) {
      parts.push(`${tree.nodes_shown.toLocaleString()} of ${tree.nodes_total.toLocaleString()} nodes drawn`);
      parts.push(`tree copy ${tree.took_ms.toFixed(1)} ms on the engine thread`);
      parts.push(`fetch ${state.treeFetchMs.toFixed(0)} ms, render ${state.renderMs.toFixed(1)} ms`);
    }
    $("#status").textContent = parts.join(" · ");
    $("#status").className = "dim";
  }

  function fail(error, what) {
    state.errors += 1;
    state.lastError = String(error.message || error);
    $("#status").textContent = `error (${what}): ${state.lastError}`;
    $("#status").className = "error";
  }

  // Rates over each polling interval come from differences of the cumulative counters, of one
  // server process: after a restart (another `started`), or a counter that went down (a reset),
  // the series starts again rather than plot the difference of two processes' counters.
  function record(stats) {
    const before = state.previous;
    state.stats = stats;
    state.previous = stats;
    // A tenant's key has no pool-wide counters (nor had the one before a switch of keys).
    if (!before || stats.requests === null || before.requests === null) return;
    const delta = (get) => get(stats) - get(before);
    const counters = [(s) => s.requests.prompt_tokens, (s) => s.requests.cached_tokens,
                      (s) => s.requests.requests_finished, (s) => s.lookups.tokens,
                      (s) => s.lookups.hit_tokens, (s) => s.ttft.count, (s) => s.ttft.sum];
    if (stats.started !== before.started || counters.some((get) => delta(get) < 0)) {
      state.history = [];
      state.historyResets += 1;
      return;
    }
    const prompt = delta((s) => s.requests.prompt_tokens);
    const lookups = delta((s) => s.lookups.tokens);
    const ttftCount = delta((s) => s.ttft.count);
    state.history.push({
      t: stats.time,
      hit: prompt > 0 ? delta((s) => s.requests.cached_tokens) / prompt : null,
      lookupHit: lookups > 0 ? delta((s) => s.lookups.hit_tokens) / lookups : null,
      ttft: ttftCount > 0 ? delta((s) => s.ttft.sum) / ttftCount : null,
    });
    if (state.history.length > HISTORY) state.history.shift();
  }

  // ------------------------------------------------------------------ the tree (an icicle)
  function svg(tag, attrs, parent) {
    const el = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attrs)) el.setAttribute(name, value);
    if (parent) parent.appendChild(el);
    return el;
  }

  function nodeColour(node, tree) {
    if (node.kind === "namespace") return COLOURS.namespace;
    if (node.kind === "replica") return COLOURS.replica; // a cluster's view: one per replica
    if (node.kind === "aggregate") return AGGREGATE_COLOUR;
    if (state.colour === "tier") return COLOURS[node.tier] || "#999";
    if (state.colour === "recency") {
      // Rank by the recency counter: dark = used most recently.
      const span = Math.max(1, tree.recency_tick - tree.minTick);
      const fresh = (node.tick - tree.minTick) / span;
      return `hsl(150, 45%, ${Math.round(88 - 55 * fresh)}%)`;
    }
    const priority = node.priority ?? 35; // 0 (blue, evicted first) .. 100 (red, kept longest)
    return `hsl(${Math.round(215 - 2.15 * priority)}, 62%, 56%)`;
  }

  function renderTree() {
    const started = performance.now();
    const tree = state.tree;
    const box = $("#tree");
    const width = box.clientWidth || 800, height = box.clientHeight || 560;
    const hot = new Set(tree.top_prefixes.map((p) => p.id));
    let levels = 1, minTick = Infinity;
    const stack = [[tree.root, 0]];
    while (stack.length) {
      const [node, level] = stack.pop();
      levels = Math.max(levels, level);
      if (node.kind === "node") minTick = Math.min(minTick, node.tick);
      for (const child of node.children || []) stack.push([child, level + 1]);
    }
    tree.minTick = Number.isFinite(minTick) ? minTick : 0;
    const rowHeight = height / levels;
    const fragment = document.createDocumentFragment();
    const total = tree.root.subtree_pages;
    const byId = new Map(), byKey = new Map();
    let drawn = 0;
    if (total === 0) {
      svg("text", { x: 12, y: 24 }, fragment).textContent = "the cache is empty";
    }
    // The cache root is not drawn: its children (namespaces) form the top row, laid out with a
    // running sum (linear in the namespaces, as every other row is in its siblings).
    const queue = [];
    let topX = 0;
    for (const child of total ? tree.root.children || [] : []) {
      queue.push([child, 0, topX, ""]);
      topX += (child.subtree_pages / total) * width;
    }
    const keys = new Map(); // id -> key
    while (queue.length) {
      const [node, level, x, parentKey] = queue.pop();
      const key = keyOf(node, parentKey);
      keys.set(node.id, key);
      // A key two nodes share names neither for certain: such a node is not selected again.
      byKey.set(key, byKey.has(key) ? null : node);
      const w = total ? (node.subtree_pages / total) * width : 0;
      const y = level * rowHeight;
      const classes = [node.kind];
      if (node.lock_count > 0 && node.kind !== "namespace") classes.push("locked");
      if (hot.has(node.id)) classes.push("hot");
      const rect = svg("rect", { x: x.toFixed(2), y: y.toFixed(2), width: Math.max(0, w - 0.5).toFixed(2),
                                 height: Math.max(1, rowHeight - 1).toFixed(2), class: classes.join(" "),
                                 fill: nodeColour(node, tree), "data-id": node.id, "data-kind": node.kind }, fragment);
      const title = svg("title", {}, rect);
      title.textContent = describe(node);
      byId.set(node.id, node);
      drawn += 1;
      if (w > 56 && rowHeight > 12) {
        const label = svg("text", { x: (x + 3).toFixed(1), y: (y + Math.min(rowHeight - 4, 13)).toFixed(1) }, fragment);
        label.textContent = node.kind === "aggregate" ? aggregateLabel(node)
          : node.kind === "namespace" ? `ns ${node.namespace.slice(0, 8)}` : `${node.pages}p ${node.hits}h`;
      }
      let childX = x;
      for (const child of node.children || []) {
        queue.push([child, level + 1, childX, key]);
        childX += total ? (child.subtree_pages / total) * width : 0;
      }
    }
    box.replaceChildren(fragment);
    box.setAttribute("viewBox", `0 0 ${width} ${height}`);
    box.dataset.nodes = String(drawn);
    state.byId = byId;
    state.keys = keys;
    state.drawnNodes = drawn;
    // Ids are positions in one snapshot; the key (keyOf) names the same node in the next one.
    if (state.selected !== null) select(byKey.get(state.selected) || null, true);
    const truncated = tree.truncated ? ` (small subtrees aggregated: grey)` : "";
    $("#tree-summary").textContent = `${tree.pages_total.toLocaleString()} pages cached, ` +
      `${tree.locked_pages.toLocaleString()} locked, ${tree.nodes_total.toLocaleString()} nodes${truncated}`;
    renderLegend();
    state.renderMs = performance.now() - started;
    requestAnimationFrame(() => { state.frameMs = performance.now() - started; });
  }

  // What names a node from one snapshot to the next (ids are positions in one snapshot: the
  // same id is another node once the tree changes). A node with a page hash: the hash. One
  // without (a partial leaf, a host-only node): its parent's key, its depth in tokens and its
  // text where the server sends it; two such siblings alike are told apart by none of these,
  // and renderTree drops such a key. A namespace: its id; an aggregate: its parent's.
  function keyOf(node, parentKey) {
    if (node.kind === "namespace") return `n${node.namespace}`;
    if (node.kind === "replica") return `r${node.replica}`;
    if (node.kind === "aggregate") return `${parentKey}/a`;
    if (node.hash != null) return `h${node.replica ?? ""}:${node.hash}`; // two replicas may hold one prefix
    return `${parentKey}/${node.partial ? "p" : "t"}${node.prefix_tokens}` + (node.text != null ? `:${node.text}` : "");
  }

  // An aggregate of nodes, or (below the top) of the namespaces left out.
  function aggregateLabel(node) {
    return node.namespaces != null ? `+${node.namespaces} namespaces` : `+${node.subtree_nodes} nodes`;
  }

  function renderLegend() {
    const legend = $("#legend");
    legend.replaceChildren();
    const item = (colour, text) => {
      const span = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.style.background = colour;
      span.append(swatch, text, "  ");
      legend.append(span);
    };
    if (state.colour === "priority") {
      for (const p of [0, 35, 60, 90, 100]) item(`hsl(${Math.round(215 - 2.15 * p)}, 62%, 56%)`, `priority ${p}`);
    } else if (state.colour === "recency") {
      item("hsl(150, 45%, 88%)", "least recent"); item("hsl(150, 45%, 33%)", "most recent");
    } else {
      item(COLOURS.device, "device"); item(COLOURS.host, "host");
      item(COLOURS["device+host"], "device+host (a copy on each)");
    }
    item(AGGREGATE_COLOUR, "aggregated small subtrees");
    legend.append("Width ∝ cached pages in the subtree; black outline: locked (in use); gold: top prefix.");
  }

  function findNode(id) {
    return state.byId ? state.byId.get(id) || null : null;
  }

  function describe(node) {
    if (node.kind === "aggregate" && node.namespaces != null) {
      return `${node.namespaces} smaller namespaces, ${node.subtree_nodes} nodes, ${node.pages} pages`;
    }
    if (node.kind === "aggregate") return `${node.subtree_nodes} smaller subtrees, ${node.pages} pages`;
    if (node.kind === "namespace") return `namespace ${node.namespace}: ${node.subtree_pages} pages`;
    return `${node.tier}: ${node.pages} pages (${node.tokens} tokens) at ${node.prefix_tokens} tokens deep, ` +
      `${node.hits} hits, priority ${node.priority}`;
  }

  function select(node, keep) {
    for (const el of document.querySelectorAll("#tree rect.selected")) el.classList.remove("selected");
    const details = $("#details");
    details.replaceChildren();
    if (!node) {
      if (!keep) state.selected = null;
      add(details, "click a node", "");
      return;
    }
    state.selected = state.keys.get(node.id);
    const rect = document.querySelector(`#tree rect[data-id="${node.id}"]`);
    if (rect) rect.classList.add("selected");
    const rows = [["kind", node.kind], ["pages", node.pages], ["tokens", node.tokens],
                  ["prefix tokens", node.prefix_tokens], ["subtree pages", node.subtree_pages],
                  ["subtree nodes", node.subtree_nodes], ["locks", node.lock_count], ["hits", node.hits]];
    if (node.kind === "node") {
      rows.push(["retention priority", `${node.priority} (max ${node.priority_max})`],
                ["age", `${node.age_s.toFixed(1)} s`], ["tier", node.tier]);
    }
    if (node.namespaces != null) rows.push(["namespaces", node.namespaces]);
    if (node.namespace) rows.push(["namespace", node.namespace]);
    if (node.text != null) rows.push(["text", node.text]);
    for (const [name, value] of rows) add(details, name, String(value));
  }

  function add(list, name, value) {
    const dt = document.createElement("dt");
    const dd = document.createElement("dd");
    dt.textContent = name;
    dd.textContent = value;
    list.append(dt, dd);
  }

  function renderTop() {
    const body = $("#top tbody");
    body.replaceChildren();
    state.tree.top_prefixes.forEach((prefix, rank) => {
      const row = document.createElement("tr");
      row.dataset.id = prefix.id;
      const cells = [rank + 1, prefix.hits, prefix.prefix_tokens, prefix.pages, prefix.namespace.slice(0, 8),
                     prefix.text ?? "— (start the server with --expose-cache-tokens to see text)"];
      cells.forEach((value, i) => {
        const cell = document.createElement("td");
        cell.textContent = String(value);
        if (i === 5) cell.className = "text";
        row.append(cell);
      });
      row.addEventListener("click", () => select(findNode(prefix.id)));
      body.append(row);
    });
  }

  // ------------------------------------------------------------------ stats panels
  // A tenant's key sees only its own namespaces' pages (docs/server.md): no pool, no rates.
  function renderTenantStats(s) {
    $("#flush").hidden = true; // a tenant may not flush (403)
    const d = s.tiers.device;
    const bar = $("#pool");
    bar.replaceChildren();
    const width = bar.clientWidth || 300;
    const locked = (d.pages_locked / Math.max(1, d.pages_cached)) * width;
    svg("rect", { x: 0, y: 0, width: locked, height: 26, fill: COLOURS.locked, "data-segment": "locked" }, bar);
    svg("rect", { x: locked, y: 0, width: width - locked, height: 26, fill: COLOURS.evictable, "data-segment": "evictable" }, bar);
    $("#pool-legend").textContent = `${d.pages_locked.toLocaleString()} locked of ${d.pages_cached.toLocaleString()} cached` +
      (s.tiers.host ? `; host: ${s.tiers.host.pages_cached}` : "");
    $("#pool-summary").textContent = `tenant ${s.tenant}: ${d.pages_cached.toLocaleString()} pages × ${s.page_size} tokens, ${s.nodes} nodes, ${s.hits} hits`;
    $("#hit-now").textContent = "pool-wide rates are an admin's view";
    $("#ttft-now").textContent = "";
  }

  function renderStats() {
    const s = state.stats;
    if (s.requests === null) return renderTenantStats(s);
    $("#flush").hidden = false;
    const d = s.tiers.device;
    const segments = [["running", d.pages_running, "held by running requests only"],
                      ["locked", d.pages_locked, "cached, locked"],
                      ["evictable", d.pages_evictable, "cached, evictable"],
                      ["free", d.pages_free, "free"]];
    const bar = $("#pool");
    bar.replaceChildren();
    const width = bar.clientWidth || 300;
    let x = 0;
    for (const [name, pages] of segments) {
      const w = (pages / d.pages_total) * width;
      const rect = svg("rect", { x, y: 0, width: Math.max(0, w), height: 26, fill: COLOURS[name], "data-segment": name }, bar);
      svg("title", {}, rect).textContent = `${name}: ${pages} pages`;
      x += w;
    }
    const legend = $("#pool-legend");
    legend.replaceChildren();
    for (const [name, pages, text] of segments) {
      const span = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.style.background = COLOURS[name];
      span.append(swatch, `${text}: ${pages.toLocaleString()}`);
      span.dataset.segment = name;
      legend.append(span);
    }
    const host = document.createElement("span");
    host.textContent = s.tiers.host ? `host: ${s.tiers.host.pages_cached}` : "host tier: none";
    legend.append(host);
    $("#pool-summary").textContent = `${d.pages_total.toLocaleString()} pages × ${s.page_size} tokens · ` +
      `${s.requests.running} running, ${s.requests.waiting} waiting`;
    $("#hit-now").textContent = `${(100 * s.hit_rate).toFixed(1)}% of prompt tokens cached overall`;
    $("#hit-now").dataset.value = String(s.hit_rate);
    const meanTtft = s.ttft.count ? s.ttft.sum / s.ttft.count : null;
    $("#ttft-now").textContent = meanTtft === null ? "no request yet" : `${(1000 * meanTtft).toFixed(0)} ms mean overall`;
    lineChart($("#hit-chart"), state.history.map((p) => p.hit), 1, (v) => `${Math.round(100 * v)}%`);
    const ttfts = state.history.map((p) => (p.ttft === null ? null : 1000 * p.ttft));
    lineChart($("#ttft-chart"), ttfts, Math.max(1, ...ttfts.filter((v) => v !== null)), (v) => `${Math.round(v)} ms`);
    evictionChart(s.histograms.evict_age_seconds);
  }

  function lineChart(box, values, max, format) {
    box.replaceChildren();
    const width = box.clientWidth || 300, height = box.clientHeight || 110, pad = 16;
    svg("line", { x1: 0, y1: height - pad, x2: width, y2: height - pad, stroke: "#ccd" }, box);
    svg("text", { x: 2, y: 10 }, box).textContent = format(max);
    svg("text", { x: 2, y: height - pad - 2 }, box).textContent = format(0);
    const step = width / Math.max(1, HISTORY - 1);
    const start = HISTORY - values.length;
    let path = "";
    values.forEach((v, i) => {
      if (v === null) return;
      const x = (start + i) * step, y = height - pad - (v / max) * (height - pad - 12);
      path += `${path ? "L" : "M"}${x.toFixed(1)},${y.toFixed(1)}`;
      svg("circle", { cx: x.toFixed(1), cy: y.toFixed(1), r: 1.8, fill: "#4a7bd0" }, box);
    });
    if (path) svg("path", { d: path, fill: "none", stroke: "#4a7bd0", "stroke-width": 1.5 }, box);
    svg("text", { x: 2, y: height - 3 }, box).textContent = `last ${values.length} polls, ${STATS_MS / 1000} s apart`;
  }

  function evictionChart(histogram) {
    const box = $("#evict-chart");
    box.replaceChildren();
    const width = box.clientWidth || 300, height = box.clientHeight || 110, pad = 16;
    // Cumulative (le, count) pairs -> count per bucket; JSON carries +inf as null.
    const counts = histogram.buckets.map(([, c], i, all) => c - (i ? all[i - 1][1] : 0));
    const labels = histogram.buckets.map(([le], i, all) => (le === null ? `>${all[i - 1][0]}` : `${le}`));
    const max = Math.max(1, ...counts);
    const w = width / counts.length;
    counts.forEach((count, i) => {
      const h = (count / max) * (height - pad - 12);
      const rect = svg("rect", { x: i * w + 1, y: height - pad - h, width: w - 2, height: h, fill: "#d9534f" }, box);
      svg("title", {}, rect).textContent = `${count} pages evicted at age <= ${labels[i]} s`;
      svg("text", { x: i * w + 2, y: height - 3 }, box).textContent = labels[i];
    });
    $("#evict-summary").textContent = histogram.count
      ? `${histogram.count.toLocaleString()} pages, mean ${(histogram.sum / histogram.count).toFixed(1)} s (seconds, young = thrashing)`
      : "no eviction yet";
  }

  // ------------------------------------------------------------------ controls
  function bind() {
    $("#colour").addEventListener("change", (event) => {
      state.colour = event.target.value;
      if (state.tree) renderTree();
    });
    $("#tree").addEventListener("click", (event) => {
      const id = event.target.dataset && event.target.dataset.id;
      if (id !== undefined) select(findNode(Number(id)));
    });
    $("#key-button").addEventListener("click", () => {
      askForKey();
      $("#key").focus();
    });
    $("#keyform").addEventListener("submit", (event) => {
      event.preventDefault();
      state.key = $("#key").value.trim() || null;
      if (state.key) sessionStorage.setItem(KEY_STORAGE, state.key);
      $("#keyform").hidden = true;
      pollTree(true); pollStats(true);
    });
    $("#flush").addEventListener("click", async () => {
      if (!confirm("Drop every unlocked cached page?")) return;
      try {
        const result = await api("v1/cache/flush", { method: "POST" });
        $("#status").textContent = `flushed ${result.pages_freed} pages`;
        pollTree(true);
      } catch (error) { fail(error, "flush"); }
    });
  }

  loadKey();
  bind();
  pollStats(); // and the tree loop, once the stats have answered
  pollHealth();
  setInterval(renderTreeAge, 1000);
})();
