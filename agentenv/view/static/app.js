// agentenv view: the page. Plain JavaScript, no library; it reads the server's JSON endpoints
// (agentenv/view/server.py) and draws charts as inline SVG. Routes live in the URL's hash:
//   #/run/I              a run: its trajectories (rollout, eval) or its curves (training)
//   #/run/I/t/ID         one trajectory, token by token
//   #/run/I/g/GROUP      a group's samples side by side
//   #/compare/A/B        two runs task by task
// A run that is still writing is followed: the page polls for the lines added since it last asked.
"use strict";

const POLL_MS = 1000;
const state = { runs: [], data: {}, filters: {}, sort: { key: "index", dir: 1 }, heat: false, timer: null };
const $ = (sel, root = document) => root.querySelector(sel);

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "style") Object.assign(el.style, v);  // CSSOM: the page's CSP refuses style attributes
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) el.append(c instanceof Node ? c : String(c));
  return el;
}

async function api(path) {
  const r = await fetch(path, { cache: "no-store" });
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

const counted = (n, one, many) => `${n} ${n === 1 ? one : many}`;  // "1 tool call", "2 tool calls"
const fmt = (v, d = 3) => (v === null || v === undefined ? "–" : typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(d)) : String(v));
const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %");
const enc = encodeURIComponent;

// -- runs and their rows (followed) -------------------------------------------------------
async function runData(i) {
  let d = state.data[i];
  if (!d) {
    d = state.data[i] = { info: await api(`/api/run/${i}`), rows: [], generation: 0, progress: null, curves: null };
  }
  return d;
}

async function pollRows(i) {
  const d = await runData(i);
  const got = await api(`/api/run/${i}/rows?since=${d.rows.length}`);
  if (got.generation !== d.generation) { d.rows = []; d.generation = got.generation; return pollRows(i); }
  got.rows.forEach((r, k) => { r.index = d.rows.length + k; });
  d.rows.push(...got.rows);
  d.progress = got.progress;
  return got.rows.length;
}

function follow(fn) {
  clearTimeout(state.timer);
  const route = location.hash;
  const tick = async () => {
    if (location.hash !== route) return;
    try { await fn(); } catch (e) { setLive(`error: ${e.message}`); }
    if (location.hash === route) state.timer = setTimeout(tick, POLL_MS);
  };
  state.timer = setTimeout(tick, POLL_MS);
}

function show(...nodes) { $("#main").replaceChildren(...nodes.filter((n) => n !== null && n !== undefined)); }

function setLive(text) { $("#live").textContent = text; }

function progressText(p, rows) {
  if (!p || !p.log) return counted(rows, "line", "lines");
  const of = p.expected ? ` of ${p.expected}` : "";
  return `${rows} written${of} · ${p.in_flight_count} in flight · ${p.started} started`;
}

// -- the list of trajectories ------------------------------------------------------------
const COLUMNS = [
  ["index", "#"], ["task_id", "task"], ["sample_index", "sample"], ["reward", "reward"],
  ["finish_reason", "finish"], ["tool_calls", "tools"], ["tool_errors", "tool errors"],
  ["sampled", "sampled / tokens"], ["turns", "turns"], ["duration_s", "time (s)"], ["resumed", "resumed"],
  ["judge_failures", "judge"], ["branches", "branches"],
];

function filtered(rows) {
  const f = state.filters;
  const lo = f.rmin === "" || f.rmin === undefined ? -Infinity : Number(f.rmin);
  const hi = f.rmax === "" || f.rmax === undefined ? Infinity : Number(f.rmax);
  const out = rows.filter((r) =>
    (!f.env || r.env === f.env) &&
    (!f.task || r.task_id.includes(f.task)) &&
    (r.reward === null ? lo === -Infinity && hi === Infinity : r.reward >= lo && r.reward <= hi) &&
    (!f.finish || r.finish_reason === f.finish) &&
    (!f.toolerr || (f.toolerr === "with" ? r.tool_errors > 0 : r.tool_errors === 0)) &&
    (!f.resumed || (f.resumed === "yes") === r.resumed) &&
    (!f.judge || (f.judge === "failed" ? r.judge_failures.length > 0 : r.judged.length > 0 && !r.judge_failures.length)));
  const { key, dir } = state.sort;
  const val = (r) => (r[key] === null || r[key] === undefined ? -Infinity : Array.isArray(r[key]) ? r[key].length : r[key]);
  return out.sort((a, b) => (val(a) < val(b) ? -dir : val(a) > val(b) ? dir : a.index - b.index));
}

function select(id, label, values, current) {
  return h("label", {}, label, h("select", { id, onchange: (e) => setFilter(id.slice(2), e.target.value) },
    h("option", { value: "" }, "any"),
    values.map(([v, text]) => h("option", { value: v, selected: v === current }, text))));
}

function setFilter(key, value) { state.filters[key] = value; drawTable(); }

function filterBar(rows) {
  const f = state.filters;
  const uniq = (k) => [...new Set(rows.map((r) => r[k]))].sort().map((v) => [v, v]);
  return h("div", { class: "filters", id: "filters" },
    select("f-env", "env ", uniq("env"), f.env),
    h("label", {}, "task ", h("input", { id: "f-task", type: "search", placeholder: "contains", value: f.task || "",
      oninput: (e) => setFilter("task", e.target.value) })),
    h("label", {}, "reward ", h("input", { id: "f-rmin", type: "number", step: "any", placeholder: "min", value: f.rmin || "",
      oninput: (e) => setFilter("rmin", e.target.value) }), " – ",
      h("input", { id: "f-rmax", type: "number", step: "any", placeholder: "max", value: f.rmax || "",
        oninput: (e) => setFilter("rmax", e.target.value) })),
    select("f-finish", "finish ", uniq("finish_reason"), f.finish),
    select("f-toolerr", "tool errors ", [["with", "with errors"], ["without", "none"]], f.toolerr),
    select("f-resumed", "resumed ", [["yes", "resumed"], ["no", "not resumed"]], f.resumed),
    rows.some((r) => r.judged.length) ? select("f-judge", "judge ", [["failed", "failed"], ["ok", "scored"]], f.judge) : null);
}

function rowCells(run, r) {
  const comps = Object.entries(r.components).map(([k, v]) => `${k} ${fmt(v, 2)}`).join(", ");
  return [
    h("td", {}, r.index), h("td", {}, r.task_id),
    h("td", {}, h("a", { href: `#/run/${run}/g/${enc(r.group_id)}`, title: "the group side by side",
      onclick: (e) => e.stopPropagation() }, `${r.sample_index}`)),
    h("td", { class: "num reward", title: comps }, fmt(r.reward)),
    h("td", { class: r.finish_reason.startsWith("error") ? "bad" : "" }, r.finish_reason),
    h("td", { class: "num" }, r.tool_calls), h("td", { class: "num" + (r.tool_errors ? " bad" : "") }, r.tool_errors),
    h("td", { class: "num" }, `${r.sampled} / ${r.tokens}`), h("td", { class: "num" }, r.turns),
    h("td", { class: "num" }, fmt(r.duration_s, 2)), h("td", {}, r.resumed ? "yes" : ""),
    h("td", { class: r.judge_failures.length ? "bad" : "" }, r.judge_failures.length ? `failed: ${r.judge_failures.join(", ")}` : r.judged.length ? "ok" : ""),
    // an agent program's further sequences (rewritten histories, roles' own contexts) and their roles
    h("td", { class: "branches", title: r.branches ? "sequences besides the main one, and their roles" : null },
      r.branches ? `${r.branches} · ${r.roles.join(", ")}` : ""),
  ];
}

function drawTable() {
  const run = state.current, d = state.data[run], box = $("#table");
  if (!box || !d) return;
  const rows = filtered(d.rows);
  const head = h("tr", {}, COLUMNS.map(([k, label]) => h("th", {
    class: state.sort.key === k ? (state.sort.dir > 0 ? "asc" : "desc") : "",
    onclick: () => { state.sort = { key: k, dir: state.sort.key === k ? -state.sort.dir : 1 }; drawTable(); },
  }, label)));
  const body = rows.slice(0, 2000).map((r) => h("tr", { class: "row", "data-id": r.id,
    onclick: () => { location.hash = `#/run/${run}/t/${enc(r.id)}`; } }, rowCells(run, r)));
  box.replaceChildren(h("table", { id: "rows" }, h("thead", {}, head), h("tbody", {}, body)));
  const scored = rows.filter((r) => r.reward !== null);
  const mean = scored.length ? scored.reduce((s, r) => s + r.reward, 0) / scored.length : null;
  const drawn = rows.length > 2000 ? ` (the first 2000 drawn: filter or sort to see others)` : "";
  $("#count").textContent = `${rows.length} of ${d.rows.length} shown · mean reward ${fmt(mean)}${drawn}`;
}

function reportBox(rep) {
  const passes = Object.entries(rep["pass@k"]).map(([k, v]) => h("span", { class: "stat" }, `pass@${k} `, h("b", {}, fmt(v))));
  const comps = Object.entries(rep.components).map(([k, v]) => h("span", { class: "stat" }, `${k} `, h("b", {}, fmt(v))));
  return h("div", { class: "card", id: "report" },
    h("div", {}, h("b", {}, `eval: ${rep.tasks} tasks × ${rep.samples_per_task || "varying"} samples`),
      ` · env ${rep.env || "?"} · threshold ${rep.threshold}`),
    h("div", {}, passes, h("span", { class: "stat" }, "mean reward ", h("b", {}, fmt(rep.mean_reward))), comps));
}

async function showList(run) {
  const d = await runData(run);
  await pollRows(run);
  state.current = run;
  show(
    h("h2", {}, d.info.label, h("span", { class: "muted" }, ` ${d.info.kind} · ${d.info.path}`)),
    d.info.report ? reportBox(d.info.report) : null,
    h("div", { id: "flight", class: "muted small-text" }),
    filterBar(d.rows), h("div", { id: "count", class: "muted" }), h("div", { id: "table" }));
  drawTable();
  const live = () => {
    setLive(progressText(d.progress, d.rows.length));
    const p = d.progress, box = $("#flight");
    if (box) box.textContent = p && p.in_flight_count ? `in flight: ` + p.in_flight.map((f) => `${f.task_id} #${f.sample} (${f.turns} turns)`).join(", ") + (p.in_flight_count > p.in_flight.length ? ", …" : "") : "";
  };
  live();
  follow(async () => {
    const before = d.rows.length;
    if (await pollRows(run) || d.rows.length !== before) drawTable();
    live();
  });
}

// -- one trajectory ----------------------------------------------------------------------
function heatColor(lp) {  // probability of the sampled token: low is red, high is pale
  const p = Math.exp(lp);
  return `hsl(${Math.round(120 * p)}, 85%, ${Math.round(55 + 35 * p)}%)`;
}

function tokenSpans(t) {
  const frag = [];
  for (const s of t.spans) {
    const seg = h("div", { class: `seg seg-${s.kind}`, "data-kind": s.kind, "data-continued": s.continued ? "1" : null });
    // A model segment right after another: the turn before stopped at its token cap
    // (--max-tokens-per-turn) without a tool call, and the model went on in a new turn.
    seg.append(h("span", { class: "seg-label" }, s.kind === "model" ? (s.continued
      ? "model, continued (loss mask 1): the turn before stopped at its token cap (--max-tokens-per-turn) without a tool call, so the model goes on in a new turn"
      : "model (loss mask 1)") : s.kind === "env" ? "inserted (loss mask 0)" : "prompt"));
    for (let i = s.start; i < s.end; i++) {
      const m = t.loss_mask[i];
      const span = h("span", { class: `tok m${m}${s.kind === "prompt" ? " prompt" : ""}`, "data-i": i }, t.pieces[i]);
      if (m) span.style.setProperty("--heat", heatColor(t.logprobs[i]));
      seg.append(span);
    }
    frag.push(seg);
  }
  return frag;
}

function showTip(e, t, name) {  // t: one token sequence; name: which, when the trajectory has several
  const el = e.target.closest(".tok"), tip = $("#tip");
  if (!el) { tip.hidden = true; return; }
  const i = Number(el.dataset.i), m = t.loss_mask[i];
  const lines = [`${name ? name + " · " : ""}position ${i} · id ${t.ids[i]} · ${JSON.stringify(t.pieces[i])}`];
  if (m) lines.push(`logprob ${t.logprobs[i].toFixed(4)} (p ${Math.exp(t.logprobs[i]).toFixed(3)})`, `weight version ${t.weight_versions[i]}`);
  else lines.push("not sampled (loss mask 0)");
  tip.textContent = lines.join("\n");
  tip.hidden = false;
  tip.style.left = `${Math.min(e.clientX + 12, window.innerWidth - 320)}px`;
  tip.style.top = `${e.clientY + 14}px`;
}

function toolCalls(t) {
  if (!t.tool_calls.length) return h("p", { class: "muted" }, "no tool calls");
  return t.tool_calls.map((c, k) => h("div", { class: `call status-${c.status}` },
    h("div", { class: "call-head" }, h("b", {}, `call ${k + 1}`), ` · turn ${c.turn} · ${c.name || "(no tool named)"} · `,
      h("span", { class: "status" }, c.status), ` · ${fmt(c.duration_s, 3)} s`),
    h("div", { class: "label" }, "code"),
    h("pre", { class: "code" }, c.arguments.code !== undefined ? c.arguments.code : JSON.stringify(c.arguments, null, 1)),
    h("div", { class: "label" }, "output"), h("pre", { class: "output" }, c.output),
    c.error ? h("pre", { class: "error" }, c.error) : null));
}

function judgeCard(t) {  // what stands behind a model-graded component: the judge's verdict
  const details = Object.entries(t.reward_details || {});
  if (!details.length) return null;
  return h("div", { id: "judge" }, h("h3", {}, "judge"), details.map(([name, d]) => h("div", { class: `call ${d.failure ? "status-failed" : "status-ok"}`, "data-name": name },
    h("div", { class: "call-head" }, h("b", {}, name), ` · score ${fmt(d.score)} · `,
      h("span", { class: "status" }, d.failure ? `failed: ${d.failure}` : "ok"),
      d.latency_s !== undefined ? ` · ${fmt(d.latency_s, 3)} s` : "", d.cached ? " · cached" : "", d.rank !== undefined ? ` · rank ${d.rank}` : ""),
    d.error ? h("pre", { class: "error" }, d.error) : null,
    d.reply !== undefined ? [h("div", { class: "label" }, "reply"), h("pre", { class: "output" }, d.reply)] : null)));
}

function turnsTable(t) {
  const cols = ["prompt_tokens", "cached_tokens", "new_tokens", "finish_reason", "latency_s", "weight_version"];
  return h("table", { class: "small" }, h("tr", {}, h("th", {}, "turn"), cols.map((c) => h("th", {}, c.replace("_", " ")))),
    t.turns.map((r, k) => h("tr", {}, h("td", {}, k), cols.map((c) => h("td", { class: "num" }, fmt(r[c], 3))))));
}

function tokenView(seq, id, name) {  // one token sequence, each token in its own box; hover for its numbers
  const box = h("div", { id, class: "tokens" + (state.heat ? " heat" : "") }, tokenSpans(seq));
  box.addEventListener("mousemove", (e) => showTip(e, seq, name));
  box.addEventListener("mouseleave", () => { $("#tip").hidden = true; });
  return box;
}

const sampledOf = (seq) => seq.loss_mask.reduce((n, m) => n + m, 0);

function versionRange(seqs) {  // the weight versions that sampled the sequences' tokens, lowest–highest
  let lo = Infinity, hi = -Infinity;
  for (const s of seqs) for (const v of s.weight_versions) if (v >= 0) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  return lo === Infinity ? "–" : `${lo}–${hi}`;
}

// An agent program's sequences, stacked: the main one, then each branch (a rewritten history,
// or a role's own context: a sub-agent, a critic), each a training row of its own, with its role.
// A trajectory without branches shows its one sequence as it always did.
function sequenceViews(t) {
  if (!t.branches.length) return tokenView(t, "tokens", "");
  return h("div", { id: "sequences" },
    h("p", { class: "muted" }, `${t.branches.length + 1} token sequences: the main one and `,
      counted(t.branches.length, "branch", "branches"),
      " (a rewritten history, or a role's own context); each is a training row of its own"),
    [t, ...t.branches].map((seq, k) => {
      const name = (k ? `branch ${k}` : "main") + (seq.role ? ` · role ${seq.role}` : "");
      return h("section", { class: "sequence", "data-index": k, "data-role": seq.role || "" },
        h("h3", { class: "seq-head" }, name, h("span", { class: "muted" },
          ` · ${sampledOf(seq)} sampled of ${seq.ids.length} tokens · weight versions ${versionRange([seq])}`)),
        tokenView(seq, k ? `tokens-${k}` : "tokens", name));
    }));
}

async function showTrajectory(run, id) {
  const t = await api(`/api/run/${run}/traj?id=${enc(id)}`);
  const info = (await runData(run)).info;
  const all = [t, ...t.branches];
  const comps = Object.entries(t.reward_components || {});
  const total = (f) => all.reduce((n, s) => n + f(s), 0);
  const sampled = t.branches.length
    ? `${total(sampledOf)} sampled of ${total((s) => s.ids.length)} tokens in ${all.length} sequences`
    : `${t.summary.sampled} sampled of ${t.summary.tokens} tokens`;
  show(
    h("p", {}, h("a", { href: `#/run/${run}` }, "← all trajectories"), " · ",
      h("a", { href: `#/run/${run}/g/${enc(t.group_id)}` }, `group ${t.group_id}`)),
    h("h2", {}, `${t.task_id} · sample ${t.sample_index}`, h("span", { class: "muted" }, ` ${t.id}`)),
    h("div", { class: "card", id: "reward" },
      h("span", { class: "stat" }, "reward ", h("b", { id: "reward-value" }, fmt(t.reward))),
      comps.map(([k, v]) => h("span", { class: "stat component" }, `${k} `, h("b", {}, fmt(v)))),
      h("span", { class: "stat" }, "finish ", h("b", {}, t.finish_reason)),
      h("span", { class: "stat" }, sampled),
      h("span", { class: "stat" }, `weight versions ${versionRange(all)}`),
      h("span", { class: "stat" }, `${fmt(t.duration_s, 2)} s`), t.summary.resumed ? h("span", { class: "stat" }, "resumed") : null,
      t.error ? h("pre", { class: "error" }, t.error) : null),
    h("div", { class: "controls" },
      h("label", {}, h("input", { type: "checkbox", id: "heat", checked: state.heat, onchange: (e) => {
        state.heat = e.target.checked;
        document.querySelectorAll(".tokens").forEach((el) => el.classList.toggle("heat", state.heat)); } }),
        " heat view (sampled tokens by probability: red unlikely, pale likely)"),
      h("span", { class: "legend" }, h("span", { class: "tok m1" }, "sampled"), " ", h("span", { class: "tok m0" }, "inserted"),
        " ", h("span", { class: "tok m0 prompt" }, "prompt"))),
    info.tokenizer_is_runs ? null : h("p", { class: "warn", id: "tokenizer-note" },
      `token text from ${info.tokenizer}: the run's model directory (${info.settings.model || "not named"}) has no tokenizer.json here`),
    sequenceViews(t),
    judgeCard(t),
    h("h3", {}, "tool calls"), h("div", { id: "calls" }, toolCalls(t)),
    h("h3", {}, "turns"), turnsTable(t),
    h("h3", {}, "metadata"), h("pre", { class: "meta" }, JSON.stringify(t.metadata, null, 1)));
}

// -- a group side by side ------------------------------------------------------------------
async function showGroup(run, gid) {
  const g = await api(`/api/run/${run}/group?id=${enc(gid)}`);
  const rewards = g.samples.map((s) => s.reward).filter((r) => r !== null);
  const flat = rewards.length > 1 && rewards.every((r) => r === rewards[0]);
  show(
    h("p", {}, h("a", { href: `#/run/${run}` }, "← all trajectories")),
    h("h2", {}, `group ${gid}`, h("span", { class: "muted" }, ` ${counted(g.samples.length, "sample", "samples")}`)),
    flat ? h("p", { class: "warn", id: "flat" }, "every sample has the same reward: no learning signal from this group") : null,
    h("div", { class: "group", id: "group" }, g.samples.map((s) => h("div", { class: "sample", "data-id": s.id },
      h("div", {}, h("a", { href: `#/run/${run}/t/${enc(s.id)}` }, `sample ${s.sample_index}`)),
      h("div", {}, "reward ", h("b", { class: "reward" }, fmt(s.reward))),
      h("div", {}, "advantage ", h("b", { class: `advantage ${s.advantage > 0 ? "pos" : s.advantage < 0 ? "neg" : ""}` }, fmt(s.advantage))),
      h("div", { class: "muted" }, `${s.finish_reason} · ${counted(s.tool_calls, "tool call", "tool calls")} (${counted(s.tool_errors, "error", "errors")}) · ${s.sampled} sampled`),
      h("pre", { class: "text" }, s.text)))));
}

// -- two runs task by task ---------------------------------------------------------------
function bar(rate) {
  return h("span", { class: "bar" }, h("span", { style: { width: `${rate === null ? 0 : 100 * rate}%` } }), h("i", {}, pct(rate)));
}

async function showCompare(a, b) {
  const c = await api(`/api/compare?a=${a}&b=${b}`);
  const choices = state.runs.filter((r) => r.kind !== "train");
  const pick = (id, cur, other) => h("select", { id, onchange: (e) => {
    location.hash = id === "cmp-a" ? `#/compare/${e.target.value}/${other}` : `#/compare/${other}/${e.target.value}`; } },
  choices.map((r) => h("option", { value: r.index, selected: r.index === cur }, r.label)));
  const rows = c.tasks.map((t) => {
    const ra = t.a ? t.a.rate : null, rb = t.b ? t.b.rate : null;
    const delta = ra !== null && rb !== null ? rb - ra : null;
    return h("tr", { class: "task", "data-task": t.task_id }, h("td", {}, t.task_id),
      h("td", {}, bar(ra), t.a ? h("span", { class: "muted" }, ` ${t.a.passed}/${t.a.samples}`) : null),
      h("td", {}, bar(rb), t.b ? h("span", { class: "muted" }, ` ${t.b.passed}/${t.b.samples}`) : null),
      h("td", { class: `num delta ${delta > 0 ? "pos" : delta < 0 ? "neg" : ""}` }, delta === null ? "–" : (delta > 0 ? "+" : "") + (100 * delta).toFixed(1)));
  });
  show(
    h("h2", {}, "compare: pass rate per task"),
    h("div", { class: "controls" }, "A ", pick("cmp-a", c.a.index, b), " B ", pick("cmp-b", c.b.index, a)),
    h("div", { class: "card", id: "cmp-summary" },
      h("span", { class: "stat" }, `A ${c.a.label} `, h("b", {}, pct(c.rate_a))),
      h("span", { class: "stat" }, `B ${c.b.label} `, h("b", {}, pct(c.rate_b))),
      h("span", { class: "stat" }, `${c.common} tasks in both · B better on ${c.better}, worse on ${c.worse}`)),
    h("table", { id: "compare" }, h("tr", {}, ["task", `A: ${c.a.label}`, `B: ${c.b.label}`, "B − A (points)"].map((x) => h("th", {}, x))), rows));
}

// -- a training run's curves -------------------------------------------------------------
// The panels `agentenv plot` draws (agentenv/train/plot.py), with its axes: each series is
// drawn on the axis it names (0: left, 1: right), each axis labelled, a right axis only where a
// quantity of another unit shares the panel. The derived series (the reward's moving mean,
// the measured generation rate and the run's mean rate) come from the server, which computes
// them with plot.py's own functions: a step in which the generator was busy but no program
// finished measured no rate and has no point, rather than a point at 0 tok/s.
const PANELS = [
  { id: "reward", title: "reward", axes: ["reward"],
    series: [["reward_mean", "batch mean", 0, "dots"], ["reward_moving", "moving mean (5 steps)", 0], ["eval_pass1", "held-out pass@1", 0, "eval"]] },
  { id: "loss", title: "loss", axes: ["loss"], series: [["loss", "loss", 0]] },
  { id: "clipping", title: "clipping", axes: ["fraction of tokens", "KL(policy || reference), nats/token"],
    series: [["clip_frac", "clipped token fraction", 0], ["is_truncated_frac", "IS-truncated token fraction", 0], ["kl_ref", "KL(policy || reference)", 1]] },
  { id: "throughput", title: "throughput", axes: ["tokens/s", "idle fraction"], fixed: [null, [0, 1]],
    series: [["gen_tokens_per_s_measured", "generated tok/s (programs finished in the step)", 0, "line"],
      ["gen_tokens_per_s_run_mean", "generated tok/s (run mean)", 0], ["gen_idle_frac", "generator idle", 1], ["trainer_idle_frac", "trainer idle", 1]] },
  { id: "offpolicy", title: "off-policyness", axes: ["staleness (weight versions behind)", "KL(behaviour || trainer), nats/token"],
    series: [["staleness_mean", "mean token staleness", 0, "line"], ["kl_behaviour", "KL(behaviour || trainer)", 1, "line"]] },
  { id: "signal", title: "learning signal", axes: ["groups"],
    series: [["zero_variance_groups", "groups with no reward variance", 0], ["groups", "groups per step", 0]] },
];
const COLORS = ["#1f77b4", "#ff7f0e", "#d62728", "#2ca02c", "#9467bd", "#8c564b"];
// Series that agentenv plot draws in a colour of their own (matplotlib's tab: palette), so a
// curve has one colour in the PNG and on this page.
const SERIES_COLORS = { gen_tokens_per_s_measured: "#1f77b4", gen_tokens_per_s_run_mean: "#9467bd",
  gen_idle_frac: "#2ca02c", trainer_idle_frac: "#d62728" };

function points(key, rows, evals) {
  if (key === "eval_pass1") return evals.map((e) => [e.step, e["pass@1"]]);
  return rows.map((r) => [r.step, r[key] === undefined ? null : r[key]]);
}

function yRange(values, fixed) {  // an axis's extent: what it shows, and 0
  if (fixed) return fixed;
  let lo = Math.min(...values, 0), hi = Math.max(...values, 0);
  if (hi === lo) hi = lo + 1;
  return [lo, hi];
}

function chart(panel, rows, evals, hidden) {
  const series = panel.series.map(([key, label, axis, style], k) => ({ key, label, axis, style, color: SERIES_COLORS[key] || COLORS[k], pts: points(key, rows, evals).filter((p) => p[1] !== null) }))
    .filter((s) => s.pts.length);
  const twin = series.some((s) => s.axis === 1);
  const W = 420, H = 210, L = 58, R = twin ? 58 : 10, T = 10, B = 26;
  const NS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(NS, "svg");
  const el = (tag, attrs, text) => {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  };
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("id", `chart-${panel.id}`);
  const shown = series.filter((s) => !hidden.has(`${panel.id}:${s.key}`));
  const xs = series.flatMap((s) => s.pts.map((p) => p[0]));
  const x0 = Math.min(...xs, 0), x1 = Math.max(...xs, 1);
  const X = (x) => L + ((x - x0) / (x1 - x0 || 1)) * (W - L - R);
  svg.append(el("rect", { x: L, y: T, width: W - L - R, height: H - T - B, class: "plot" }));
  const ranges = [0, 1].map((axis) => yRange(shown.filter((s) => s.axis === axis).flatMap((s) => s.pts.map((p) => p[1])), (panel.fixed || [])[axis]));
  const Ys = ranges.map(([y0, y1]) => (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B));
  for (const axis of twin ? [0, 1] : [0]) {  // ticks and the axis's label, on its side
    const onAxis = series.filter((s) => s.axis === axis), [y0, y1] = ranges[axis];
    const side = axis === 0 ? "left" : "right", tx = axis === 0 ? L - 4 : W - R + 4;
    for (const f of [0, 0.5, 1]) {
      const y = y0 + f * (y1 - y0);
      if (axis === 0) svg.append(el("line", { x1: L, x2: W - R, y1: Ys[0](y), y2: Ys[0](y), class: "grid" }));
      svg.append(el("text", { x: tx, y: Ys[axis](y) + 4, class: `ylab ${side}` }, fmt(y, Math.abs(y) >= 100 ? 0 : 3)));
    }
    const lx = axis === 0 ? 11 : W - 4, ly = T + (H - T - B) / 2;
    svg.append(el("text", { x: lx, y: ly, transform: `rotate(-90 ${lx} ${ly})`, class: "axis-label", "data-axis": side,
      fill: twin ? onAxis[0].color : "currentColor" }, panel.axes[axis]));
  }
  svg.append(el("text", { x: W - R, y: H - 6, class: "xlab" }, `step (${x0}–${x1})`));
  for (const s of shown) {
    const Y = Ys[s.axis];
    if (s.style !== "dots") svg.append(el("path", { d: s.pts.map((p, i) => `${i ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(""),
      class: "series", stroke: s.color, "data-key": s.key }));
    if (s.style) for (const p of s.pts) svg.append(el("circle", { cx: X(p[0]), cy: Y(p[1]), r: s.style === "eval" ? 3.5 : 2.5, fill: s.color, class: "dot",
      "data-key": s.key, "data-step": p[0], "data-value": p[1] }));
  }
  const cursor = el("line", { y1: T, y2: H - B, class: "cursor", visibility: "hidden" });
  svg.append(cursor);
  return { svg, series, X, x0, x1, cursor, W, L, R };
}

function drawCurves(run) {
  const d = state.data[run], c = d.curves, box = $("#charts");
  if (!box) return;
  box.replaceChildren(...PANELS.map((panel) => {
    const g = chart(panel, c.rows, c.evals, state.hiddenSeries);
    if (!g.series.length) return null;
    const readout = h("div", { class: "readout" }, "\u00a0");
    g.svg.addEventListener("mousemove", (e) => {  // the nearest step's values under the pointer
      const r = g.svg.getBoundingClientRect(), x = ((e.clientX - r.left) / r.width) * g.W;
      const step = Math.round(g.x0 + ((x - g.L) / (g.W - g.L - g.R)) * (g.x1 - g.x0));
      g.cursor.setAttribute("x1", g.X(step)); g.cursor.setAttribute("x2", g.X(step)); g.cursor.setAttribute("visibility", "visible");
      readout.textContent = `step ${step}: ` + g.series.map((s) => {
        const p = s.pts.reduce((best, q) => (Math.abs(q[0] - step) < Math.abs(best[0] - step) ? q : best), s.pts[0]);
        return `${s.label} ${fmt(p[1], 4)}${p[0] !== step ? ` (step ${p[0]})` : ""}`;
      }).join(" · ");
    });
    g.svg.addEventListener("mouseleave", () => g.cursor.setAttribute("visibility", "hidden"));
    const legend = h("div", { class: "legend" }, g.series.map((s) => {
      const id = `${panel.id}:${s.key}`;
      return h("span", { class: "key" + (state.hiddenSeries.has(id) ? " off" : ""), title: "click: show or hide",
        onclick: () => { state.hiddenSeries.has(id) ? state.hiddenSeries.delete(id) : state.hiddenSeries.add(id); drawCurves(run); } },
      h("i", { style: { background: s.color } }), s.label);
    }));
    return h("div", { class: "panel" }, h("h4", {}, panel.title), g.svg, legend, readout);
  }).filter(Boolean));
  const last = c.rows[c.rows.length - 1];
  $("#train-status").textContent = last ? `${counted(c.rows.length, "step", "steps")} · last step ${last.step} at ${fmt(last.time_s, 1)} s · reward ${fmt(last.reward_mean)}` : "no step yet";
}

async function pollCurves(run) {
  const d = state.data[run];
  const c = d.curves || { rows: [], evals: [] };
  const got = await api(`/api/run/${run}/curves?since=${c.rows.length}&evals_since=${c.evals.length}`);
  d.curves = { rows: c.rows.concat(got.rows), evals: c.evals.concat(got.evals), summary: got.summary };
  return got.rows.length + got.evals.length;
}

async function showTraining(run) {
  const d = await runData(run);
  state.hiddenSeries = state.hiddenSeries || new Set();
  await pollCurves(run);
  const cfg = d.info.config || {};
  const s = d.curves.summary;
  show(
    h("h2", {}, d.info.label, h("span", { class: "muted" }, ` training run · ${d.info.path}`)),
    h("div", { class: "card", id: "train-summary" },
      h("span", { class: "stat" }, `env ${cfg.env || "?"} · ${cfg.mode || "?"} · ${cfg.steps || "?"} steps · ${cfg.groups_per_step || "?"} groups × ${cfg.group_size || "?"}`),
      s ? h("span", { class: "stat" }, `reward ${fmt(s.first_reward)} → ${fmt(s.last_reward)} · ${fmt(s.wall_s, 1)} s`) : h("span", { class: "stat" }, "running (no summary yet)"),
      s && s.eval ? h("span", { class: "stat" }, `held-out pass@1 ${fmt(s.eval["first_pass@1"])} → ${fmt(s.eval["last_pass@1"])}`) : null),
    h("div", { id: "train-status", class: "muted" }),
    h("div", { id: "charts", class: "charts" }),
    d.curves.evals.length ? h("h3", {}, "held-out evaluations") : null,
    d.curves.evals.length ? h("table", { class: "small", id: "evals" }, h("tr", {}, ["step", "tasks", "samples", "pass@1", "mean reward"].map((x) => h("th", {}, x))),
      d.curves.evals.map((e) => h("tr", {}, [e.step, e.tasks, e.samples, fmt(e["pass@1"]), fmt(e.mean_reward)].map((x) => h("td", { class: "num" }, x))))) : null);
  drawCurves(run);
  setLive(counted(d.curves.rows.length, "step", "steps"));
  follow(async () => {
    if (await pollCurves(run)) drawCurves(run);
    setLive(counted(d.curves.rows.length, "step", "steps"));
  });
}

// -- routing -------------------------------------------------------------------------------
function nav() {
  const links = state.runs.map((r) => h("a", { href: `#/run/${r.index}`, class: "run", "data-kind": r.kind, title: r.path }, `${r.label} (${r.kind})`));
  const comparable = state.runs.filter((r) => r.kind !== "train");
  if (comparable.length >= 2) links.push(h("a", { href: `#/compare/${comparable[0].index}/${comparable[1].index}`, id: "compare-link" }, "compare"));
  $("#runs").replaceChildren(...links);
}

async function route() {
  clearTimeout(state.timer);
  setLive("");
  $("#tip").hidden = true;
  const parts = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  try {
    if (parts[0] === "compare") return await showCompare(Number(parts[1]), Number(parts[2]));
    const run = parts[0] === "run" ? Number(parts[1]) : 0;
    document.querySelectorAll("#runs a.run").forEach((a, k) => a.classList.toggle("current", k === run));
    if (parts[2] === "t") return await showTrajectory(run, parts.slice(3).join("/"));
    if (parts[2] === "g") return await showGroup(run, parts.slice(3).join("/"));
    const d = await runData(run);
    return d.info.kind === "train" ? await showTraining(run) : await showList(run);
  } catch (e) {
    show(h("p", { class: "bad" }, `error: ${e.message}`));
  } finally {
    document.body.dataset.ready = location.hash || "#/";
  }
}

async function start() {
  state.runs = await api("/api/runs");
  nav();
  window.addEventListener("hashchange", route);
  await route();
}

start();
