// The run console: fills the server-rendered page shells from the JSON API.
//
// Rules this file keeps:
// - The token lives in sessionStorage and goes out only as the Authorization header: never in
//   a URL, never in a cookie (so no request another site makes can carry it: CSRF-safe).
// - Everything the API returns is data: it reaches the page through textContent and
//   setAttribute on attributes we choose, never through innerHTML.
// - Live updates go through watch() (polling) and, on a run's page, follow() (the run's event
//   stream read with fetch: EventSource cannot send the Authorization header). Either only
//   says "something changed"; the renderers stay the same.

const TOKEN_KEY = "dar.token";
const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED", "TIMED_OUT"]);
const STATUSES = ["QUEUED", "RUNNING", "WAITING", "NEEDS_ATTENTION", "SUCCEEDED", "FAILED",
  "CANCELLED", "TIMED_OUT"];
const PAGE_SIZE = 20;
const body = document.body;
const $ = (sel) => document.querySelector(sel);

// -- DOM without markup ---------------------------------------------------------------------

/** h("a", {href: "/x", class: "y"}, "text", child): attributes set one by one, children as
 *  text nodes (strings) or elements. Never parses markup. */
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) throw new Error("no inline handlers");
    el.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

function json(value) {
  if (typeof value === "string") return value;
  return JSON.stringify(value, null, 2);
}

function shortId(id) {
  return id.slice(0, 8);
}

function runLink(id, text) {
  return h("a", { href: `/runs/${encodeURIComponent(id)}` }, text || shortId(id));
}

function badge(status) {
  return h("span", { class: `badge s-${status}` }, status);
}

function age(iso) {
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 60) return `${Math.floor(s)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h`;
  return `${Math.floor(s / 86400)}d`;
}

function usd(x) {
  return `$${Number(x || 0).toFixed(4)}`;
}

function flash(message, isError) {
  const el = $("#flash");
  el.textContent = message;
  el.className = isError ? "error" : "";
}

// -- the API --------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message, code, field) {
    super(message);
    this.status = status;
    this.code = code || null;
    this.field = field || null;
  }
}

async function api(method, path, payload, extraHeaders) {
  const headers = { Accept: "application/json", ...(extraHeaders || {}) };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  const init = { method, headers, credentials: "omit", cache: "no-store" };
  if (payload !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(payload);
  }
  const response = await fetch(path, init);
  const text = await response.text();
  const data = text ? JSON.parse(text) : null;
  if (!response.ok) {
    const error = (data && data.error) || {};
    const message = error.message || `HTTP ${response.status}`;
    if (response.status === 401) showLogin(message);
    throw new ApiError(response.status, message, error.code, error.field);
  }
  return data;
}

/** Call load() now and again every `ms` until stop() or until it returns false. The seam for
 *  a server-sent event stream: the callers only need "call me when something changed". */
function watch(load, ms) {
  let timer = null;
  let stopped = false;
  const tick = async () => {
    let more = true;
    try {
      more = (await load()) !== false;
    } catch (e) {
      if (e instanceof ApiError && e.status === 401) return;
      flash(e.message, true);
    }
    if (more && !stopped) timer = setTimeout(tick, ms);
  };
  tick();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}

/** Read /api/runs/{id}/events with fetch streaming, resuming after the last event id when the
 *  connection drops. onEvent(name, data) for each event; resolves at run.finished. Rejects
 *  when the stream cannot be opened (the caller falls back to polling). */
async function follow(runId, onEvent, signal) {
  let last = null;
  for (;;) {
    const headers = { Accept: "text/event-stream" };
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = `Bearer ${token}`;
    if (last) headers["Last-Event-ID"] = last;
    const response = await fetch(`/api/runs/${encodeURIComponent(runId)}/events`,
      { headers, signal });
    if (!response.ok || !response.body) throw new ApiError(response.status, "no event stream");
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let id = null, name = "message", data = "";
        for (const line of block.split("\n")) {
          if (line.startsWith("id: ")) id = line.slice(4);
          else if (line.startsWith("event: ")) name = line.slice(7);
          else if (line.startsWith("data: ")) data += line.slice(6);
        }
        if (!data) continue;
        if (id) last = id;
        onEvent(name, JSON.parse(data));
        if (name === "run.finished") return;
      }
    }
    await new Promise((resolve) => setTimeout(resolve, 1000));  // dropped: resume after `last`
  }
}

// -- the session ----------------------------------------------------------------------------

let me = null;

function showLogin(message) {
  $("#main").hidden = true;
  $("#login").hidden = false;
  $("#login-error").textContent = sessionStorage.getItem(TOKEN_KEY) ? message || "" : "";
  $("#token").focus();
}

async function signIn() {
  try {
    me = await api("GET", "/api/whoami");
  } catch (e) {
    if (!(e instanceof ApiError && e.status === 401)) flash(e.message, true);
    return false;
  }
  $("#login").hidden = true;
  $("#main").hidden = false;
  if (me.auth) {
    $("#whoami").textContent = `${me.name} (${me.roles.join(", ")}) · tenant ${me.tenant}`;
    $("#signout").hidden = false;
  } else {
    $("#whoami").textContent = "open access (development)";
  }
  return true;
}

function setupSession() {
  $("#login-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const input = $("#token");
    sessionStorage.setItem(TOKEN_KEY, input.value.trim());
    input.value = "";
    if (await signIn()) start();
  });
  $("#signout").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    window.location.assign("/");
  });
}

// -- runs list ------------------------------------------------------------------------------

function runsPage() {
  const filters = $("#filters");
  const params = new URLSearchParams(window.location.search);
  for (const name of ["status", "agent", "idPrefix"]) {
    if (params.get(name)) filters.elements[name].value = params.get(name);
  }
  let cursors = [null]; // the cursor of each page seen, for "Newer"
  let next = null;

  const query = (cursor) => {
    const q = new URLSearchParams({ limit: String(PAGE_SIZE) });
    for (const name of ["status", "agent", "idPrefix"]) {
      const v = filters.elements[name].value.trim();
      if (v) q.set(name, v);
    }
    if (cursor) q.set("cursor", cursor);
    return q;
  };

  const renderCounts = (counts) => {
    const list = clear($("#counts"));
    for (const st of STATUSES) {
      const button = h("button", {
        type: "button", class: `count s-${st}`, "data-status": st,
        "aria-pressed": filters.elements.status.value === st ? "true" : "false",
      }, h("span", { class: "n" }, counts[st] ?? 0), " ", st);
      button.addEventListener("click", () => {
        filters.elements.status.value = filters.elements.status.value === st ? "" : st;
        reset();
      });
      list.append(h("li", {}, button));
    }
  };

  const renderRuns = (page) => {
    const tbody = clear($("#runs tbody"));
    for (const r of page.items) {
      tbody.append(h("tr", { "data-run-id": r.id, "data-status": r.status },
        h("td", {}, runLink(r.id)),
        h("td", {}, badge(r.status)),
        h("td", {}, r.agent),
        h("td", { title: r.createdAt }, age(r.createdAt)),
        h("td", { class: "num" }, r.stepCount),
        h("td", { class: "num" }, r.tokensUsed.toLocaleString("en")),
        h("td", { class: "num" }, usd(r.costUsd)),
        h("td", {}, r.submittedBy || "-"),
      ));
    }
    $("#runs-empty").hidden = page.items.length > 0;
    next = page.nextCursor;
    $("#older").disabled = !next;
    $("#newer").disabled = cursors.length <= 1;
  };

  const load = async () => {
    const q = query(cursors[cursors.length - 1]);
    const countQuery = new URLSearchParams();
    if (q.get("agent")) countQuery.set("agent", q.get("agent"));
    const [page, counts] = await Promise.all([
      api("GET", `/api/runs?${q}`),
      api("GET", `/api/runs/counts?${countQuery}`),
    ]);
    renderCounts(counts.counts);
    renderRuns(page);
  };

  let stop = watch(load, 2000);
  const reset = () => {
    stop();
    cursors = [null];
    const shown = query(null);
    shown.delete("limit");
    window.history.replaceState(null, "", shown.toString() ? `/?${shown}` : "/");
    stop = watch(load, 2000);
  };
  filters.addEventListener("submit", (event) => {
    event.preventDefault();
    reset();
  });
  for (const name of ["status", "agent"]) filters.elements[name].addEventListener("change", reset);
  $("#older").addEventListener("click", () => {
    if (!next) return;
    cursors.push(next);
    stop();
    stop = watch(load, 2000);
  });
  $("#newer").addEventListener("click", () => {
    if (cursors.length <= 1) return;
    cursors.pop();
    stop();
    stop = watch(load, 2000);
  });

  if (me.can.submit) {
    $("#submit-section").hidden = false;
    $("#submit-form").addEventListener("submit", async (event) => {
      event.preventDefault();
      const form = event.target;
      const option = form.elements.agent.selectedOptions[0];
      let input = form.elements.input.value;
      if (option && option.dataset.durable === "1") {
        try {
          input = JSON.parse(input);
        } catch {
          flash(`input: ${option.value} is a durable function and takes JSON`, true);
          return;
        }
      }
      const payload = { input, agent: form.elements.agent.value };
      const budget = form.elements.tokenBudget.value;
      if (budget) payload.tokenBudget = Number(budget);
      try {
        const accepted = await api("POST", "/api/runs", payload);
        form.elements.input.value = "";
        clear($("#flash")).append("Submitted run ", runLink(accepted.id, accepted.id), ".");
        $("#flash").className = "";
        await load();
      } catch (e) {
        flash(e.message, true);
      }
    });
  }
}

// -- one run --------------------------------------------------------------------------------

function fact(dl, term, ...value) {
  dl.append(h("dt", {}, term), h("dd", {}, ...value));
}

function meter(label, used, budget, text) {
  const id = `m-${label.replace(/\W+/g, "-")}`;
  return h("div", { class: "meter" },
    h("label", { for: id }, label),
    h("progress", { id, max: budget || 1, value: Math.min(used, budget || 1) }),
    h("span", {}, text));
}

function actionButton(label, onClick, attrs) {
  const b = h("button", { type: "button", ...(attrs || {}) }, label);
  b.addEventListener("click", async () => {
    b.disabled = true;
    try {
      await onClick();
    } catch (e) {
      flash(e.message, true);
    } finally {
      b.disabled = false;
    }
  });
  return b;
}

function renderHeader(run, steps, refresh) {
  const dl = clear($("#facts"));
  fact(dl, "Status", badge(run.status), run.cancelRequested && !TERMINAL.has(run.status)
    ? " (cancel requested)" : "");
  fact(dl, "Agent", run.agent);
  fact(dl, "Model", run.model);
  if (run.deployment) fact(dl, "Version", run.deployment);
  if (run.waitReason) fact(dl, "Waiting for", run.waitReason);
  fact(dl, "Lease holder", run.lockedBy ? `${run.lockedBy} until ${run.leaseExpiresAt}` : "none");
  fact(dl, "Deadline", run.deadlineAt);
  fact(dl, "Submitted", `${run.createdAt} by ${run.submittedBy || "anonymous"}`);
  if (run.finishedAt) fact(dl, "Finished", run.finishedAt);
  if (run.forkedFrom && run.forkedFrom.runId) {
    const original = run.forkedFrom.runId;
    fact(dl, "Forked from", runLink(original), ` at step ${run.forkedFrom.seq}`,
      run.forkedFrom.replayModel ? " (replaying the model)" : "", " · ",
      h("a", { id: "diff-original", href: diffPath(original, run.id) }, "diff with original"));
  }
  if (run.error) fact(dl, "Error", h("span", { class: "error" }, run.error));

  const stepCount = steps.filter((s) => s.kind !== "AUDIT").length;
  const budgets = clear($("#budgets"));
  budgets.append(
    meter("Tokens", run.tokensUsed, run.tokenBudget,
      `${run.tokensUsed.toLocaleString("en")} of ${run.tokenBudget.toLocaleString("en")}`),
    meter("Steps", stepCount, run.maxSteps, `${stepCount} of ${run.maxSteps}`));
  if (run.costBudgetUsd) {
    budgets.append(meter("Cost", run.costUsd, run.costBudgetUsd,
      `${usd(run.costUsd)} of ${usd(run.costBudgetUsd)}`));
  } else {
    budgets.append(h("p", {}, `Cost ${usd(run.costUsd)} (no cost budget)`));
  }
  const deadlineLeft = (Date.parse(run.deadlineAt) - Date.parse(run.createdAt)) / 1000;
  const elapsed = ((run.finishedAt ? Date.parse(run.finishedAt) : Date.now())
    - Date.parse(run.createdAt)) / 1000;
  budgets.append(meter("Time", elapsed, deadlineLeft,
    `${Math.round(elapsed)} s of ${Math.round(deadlineLeft)} s`));

  const actions = clear($("#actions"));
  const path = `/api/runs/${encodeURIComponent(run.id)}`;
  if (me.can.cancel && !TERMINAL.has(run.status)) {
    actions.append(actionButton("Cancel run", async () => {
      await api("POST", `${path}/cancel`);
      flash("Cancellation requested.");
      await refresh();
    }, { id: "cancel", class: "danger" }));
  }
  if (me.can.resume && (run.status === "FAILED" || run.status === "TIMED_OUT")) {
    actions.append(actionButton("Resume run", async () => {
      await api("POST", `${path}/resume`);
      flash("Resumed.");
      await refresh();
    }, { id: "resume" }));
  }
}

/** The waterfall: one row per step, its bar placed by start and length on the run's axis.
 *  With `onFork`, each step a fork can start from has a "Fork from here" button. */
function renderTimeline(run, steps, onFork) {
  const points = onFork ? forkPoints(steps) : new Set();
  const t0 = Date.parse(run.createdAt);
  const ends = steps.map((s) => Date.parse(s.finishedAt || s.startedAt));
  const tEnd = Math.max(t0 + 1, run.finishedAt ? Date.parse(run.finishedAt) : Date.now(), ...ends);
  const span = tEnd - t0;
  $("#axis").textContent = `(0 to ${(span / 1000).toFixed(1)} s)`;
  const tbody = clear($("#timeline tbody"));
  for (const s of steps) {
    const start = Date.parse(s.startedAt) - t0;
    const end = (s.finishedAt ? Date.parse(s.finishedAt) : Date.now()) - t0;
    const duration = Math.max(0, end - start);
    const bar = h("span", {
      class: `bar k-${s.kind} st-${s.status}${s.kind === "AUDIT" ? " marker" : ""}`,
      title: `${s.stepKey}: starts at ${(start / 1000).toFixed(2)} s, `
        + `${s.finishedAt ? "" : "running for "}${duration} ms`,
    });
    bar.style.left = `${(100 * start) / span}%`;
    bar.style.width = s.kind === "AUDIT" ? "" : `${Math.max(0.4, (100 * duration) / span)}%`;
    const notes = [];
    // Attempts count from 1: a second one is a retry. Resumes, resolutions and decisions are
    // the operator actions (AUDIT rows) placed on the same axis.
    if (s.attempt > 1) notes.push(h("span", { class: "note retry" }, `attempt ${s.attempt}`));
    if (s.status === "RETRYING") notes.push(h("span", { class: "note retry" }, "retrying"));
    if (s.resolution) notes.push(h("span", { class: "note" }, `resolution: ${s.resolution}`));
    if (s.origin) {
      notes.push(h("span", {
        class: "note origin",
        title: `${s.origin} from the original run, which paid ${s.originalTokens ?? 0} tokens, `
          + `${usd(s.originalCostUsd)}; this run paid nothing for it`,
      }, s.origin));
    }
    if (s.kind === "AUDIT" && (s.action === "resume" || s.action === "resolve")) {
      notes.push(h("span", { class: "note resumed" }, "resumed here"));
    }
    let label = s.kind === "AUDIT"
      ? `${s.action} by ${s.actor}`
      : s.toolName ? `${s.stepKey} (${s.toolName})` : s.stepKey;
    if (s.childRunId) {  // a child run (steps.child, a sub-agent): a link to it
      label = h("span", {}, label, " ", h("a", {
        class: "child-run", href: `/runs/${encodeURIComponent(s.childRunId)}`,
        "aria-label": `child run ${s.childRunId}`,
      }, `child run ${shortId(s.childRunId)}`));
    }
    let fork = "";
    if (points.has(s.seq)) {
      fork = h("button", { type: "button", class: "secondary fork", "data-seq": s.seq,
        "aria-label": `Fork from step ${s.seq}` }, "Fork from here");
      fork.addEventListener("click", () => onFork(s.seq));
    }
    tbody.append(h("tr", {
      class: `row k-${s.kind}`, "data-kind": s.kind, "data-status": s.status,
      "data-seq": s.seq ?? "", "data-origin": s.origin || "",
    },
      h("td", { class: "num" }, s.seq ?? ""),
      h("td", {}, h("span", { class: `kind k-${s.kind}` }, s.kind)),
      h("td", {}, label, " ", notes),
      h("td", {}, s.status, s.error ? h("span", { class: "error block" }, s.error) : ""),
      h("td", { class: "num" }, s.kind === "AUDIT" ? "" : `${s.inputTokens} / ${s.outputTokens}`),
      h("td", { class: "num" }, s.kind === "AUDIT" ? "" : usd(s.costUsd)),
      h("td", {}, s.worker || ""),
      h("td", { class: "track" }, bar, h("span", { class: "sr-only" },
        `starts at ${(start / 1000).toFixed(2)} s, lasts ${duration} ms`)),
      h("td", { class: "fork-cell" }, fork),
    ));
  }
}

function renderConversation(conversation) {
  const list = clear($("#conversation"));
  for (const e of conversation.entries) {
    let who;
    let content;
    switch (e.type) {
      case "input": who = "User"; content = h("pre", {}, json(e.content)); break;
      case "text": who = "Assistant"; content = h("p", { class: "text" }, e.text); break;
      case "tool_call":
        who = `Tool call ${e.name}`;
        content = h("pre", {}, json(e.input));
        break;
      case "tool_result":
        who = `Result of ${e.name || "tool"}${e.isError ? " (error)" : ""}`
          + `${e.inDoubt ? " (in doubt: started, never finished)" : ""}`;
        content = h("pre", {}, e.output === null || e.output === undefined ? "" : json(e.output));
        break;
      case "step":
        who = `${e.kind} ${e.stepKey} ${e.status}`;
        content = h("pre", {}, e.result === null || e.result === undefined ? "" : json(e.result));
        break;
      case "result": who = "Result"; content = h("pre", {}, json(e.content)); break;
      case "error": who = "Error"; content = h("p", { class: "error" }, e.text); break;
      default: who = e.type; content = h("pre", {}, json(e.block ?? e));
    }
    list.append(h("li", { class: `msg m-${e.type}` },
      h("div", { class: "who" }, who, e.seq ? h("span", { class: "seq" }, ` step ${e.seq}`) : ""),
      content));
  }
}

function decisionForm(approval, onDone) {
  const wrap = h("div", { class: "decision" });
  const mayDecide = me.can.approve && me.approvalRoles.includes(approval.role);
  wrap.append(
    h("p", {}, "Step ", h("code", {}, approval.stepKey), ", role ", h("strong", {}, approval.role),
      `, requested ${approval.requestedAt}, expires ${approval.expiresAt}.`),
    h("h3", {}, "Payload"),
    h("pre", { class: "payload" }, json(approval.payload)),
    h("p", {}, "Payload hash ", h("code", { class: "hash" }, approval.payloadHash)),
  );
  if (!mayDecide) {
    wrap.append(h("p", { class: "muted" }, `Deciding needs a token with the role ${approval.role}.`));
    return wrap;
  }
  const id = `comment-${approval.id}`;
  const comment = h("textarea", { id, rows: 2 });
  wrap.append(h("label", { for: id }, "Comment (optional)"), comment);
  const decide = (verb) => async () => {
    const payload = { payloadHash: approval.payloadHash };
    if (comment.value.trim()) payload.comment = comment.value.trim();
    const decided = await api("POST",
      `/api/approvals/${encodeURIComponent(approval.id)}/${verb}`, payload);
    flash(`Approval ${decided.status.toLowerCase()} by ${decided.decidedBy}.`);
    await onDone();
  };
  wrap.append(h("div", { class: "actions" },
    actionButton("Approve", decide("approve"), { class: "approve" }),
    actionButton("Reject", decide("reject"), { class: "danger reject" })));
  return wrap;
}

/** The in-doubt step: the latest one left STARTED. */
function inDoubt(steps) {
  const started = steps.filter((s) => s.status === "STARTED" && s.kind !== "AUDIT");
  return started.length ? started[started.length - 1] : null;
}

function resolutionForm(run, steps, onDone) {
  const wrap = h("div", { class: "resolution" });
  const step = inDoubt(steps);
  wrap.append(h("p", {}, run.error || run.waitReason || "This run stopped for an operator."));
  if (step) {
    wrap.append(h("p", {}, "In doubt: step ", h("code", {}, step.stepKey),
      ` (${step.kind}${step.toolName ? ` ${step.toolName}` : ""}), started ${step.startedAt}`
      + `${step.worker ? ` on ${step.worker}` : ""}: it may or may not have taken effect.`));
  }
  if (!me.can.resolve) {
    wrap.append(h("p", { class: "muted" }, "Resolving needs a token with the admin role."));
    return wrap;
  }
  const path = `/api/runs/${encodeURIComponent(run.id)}/resolve`;
  const sid = `supply-${run.id}`;
  const eid = `iserror-${run.id}`;
  const rid = `reason-${run.id}`;
  const output = h("textarea", { id: sid, rows: 2 });
  const isError = h("input", { id: eid, type: "checkbox" });
  const reason = h("input", { id: rid, type: "text" });
  const done = async (body, what) => {
    const result = await api("POST", path, body);
    flash(`Resolved (${what}): run is ${result.status}.`);
    await onDone();
  };
  wrap.append(
    h("fieldset", {}, h("legend", {}, "It happened: supply its result"),
      h("label", { for: sid }, "Result (JSON, or plain text)"), output,
      h("label", { for: eid }, isError, " the result is an error"),
      actionButton("Supply result", () => {
        let value = output.value;
        try { value = JSON.parse(value); } catch { /* plain text */ }
        return done({ action: "supply_result", output: value, isError: isError.checked },
          "result supplied");
      }, { class: "supply" })),
    h("fieldset", {}, h("legend", {}, "It did not happen: run it once more"),
      actionButton("Retry step", () => done({ action: "retry" }, "retry"), { class: "retry" })),
    h("fieldset", {}, h("legend", {}, "Give up: fail the run"),
      h("label", { for: rid }, "Reason"), reason,
      actionButton("Fail run", () => done(
        reason.value.trim() ? { action: "fail", reason: reason.value.trim() } : { action: "fail" },
        "failed"), { class: "danger fail" })),
  );
  return wrap;
}

/** The run tree panel: the whole tree the run belongs to (GET /api/runs/{id}/tree), from its
 *  root down, each run linked with its agent, status, tokens and cost, this run marked. Only
 *  asked for a run with a parent or children. */
async function renderFamily(run) {
  const panel = $("#family-panel");
  const children = run.children || [];
  panel.hidden = !run.parentRunId && children.length === 0;
  const parent = clear($("#family-parent"));
  if (panel.hidden) return;
  if (run.parentRunId) parent.append("Started by run ", runLink(run.parentRunId), ".");
  const tree = await api("GET", `/api/runs/${encodeURIComponent(run.id)}/tree`);
  const above = $("#tree-above");
  const root = tree.nodes[0];
  above.hidden = !root.parentRunId;
  clear(above);
  if (root.parentRunId) {
    above.append(`The tree goes further up than ${tree.maxDepth} levels: `,
      runLink(root.parentRunId), " is the parent of the topmost run shown.");
  }
  // nodes come depth first (a run, then its children's subtrees): nest them by depth
  const scrolled = $("#run-tree").scrollTop;  // kept across the rebuild
  const list = clear($("#run-tree"));
  const shown = new Map();  // run id -> children listed under it
  const items = new Map();  // run id -> its list item
  const lists = [list];
  let last = null;
  for (const n of tree.nodes) {
    if (n.depth > 0 && n.depth >= lists.length) {
      const sub = h("ul", {});
      last.append(sub);
      lists.push(sub);
    }
    lists.length = n.depth + 1;
    const current = n.id === run.id;
    const link = h("a", {
      href: `/runs/${encodeURIComponent(n.id)}`,
      "aria-current": current ? "page" : null,
    }, shortId(n.id));
    last = h("li", { "data-run-id": n.id, "data-depth": n.depth, class: current ? "current" : null },
      h("span", { class: "node" }, link, " ", h("span", { class: "agent" }, n.agent), " ",
        badge(n.status), ` ${n.tokensUsed} tokens, ${usd(n.costUsd)}`,
        current ? h("span", { class: "here" }, " (this run)") : null));
    lists[n.depth].append(last);
    items.set(n.id, last);
    if (n.parentRunId) shown.set(n.parentRunId, (shown.get(n.parentRunId) || 0) + 1);
  }
  // a run whose children are not all listed says how many are left out
  for (const n of tree.nodes) {
    const missing = n.childCount - (shown.get(n.id) || 0);
    if (missing <= 0) continue;
    const li = items.get(n.id);
    let sub = li.querySelector(":scope > ul");
    if (!sub) { sub = h("ul", {}); li.append(sub); }
    // childCount is counted up to maxNodes + 1: past that, the number left out is unknown
    const more = n.childCount > tree.maxNodes
      ? `More child runs not shown (more than ${tree.maxNodes} in all)`
      : `${missing} more child run${missing === 1 ? "" : "s"} not shown`;
    sub.append(h("li", { class: "more muted" }, `${more}: the timeline of `, runLink(n.id),
      " links each of its child runs"));
  }
  // a tall tree scrolls in its panel: bring this run into view once, then leave the scroll be
  list.scrollTop = scrolled;
  if (list.dataset.scrolled !== run.id && items.has(run.id)) {
    list.dataset.scrolled = run.id;
    const top = items.get(run.id).offsetTop;
    if (top > list.clientHeight - 32) list.scrollTop = top - list.clientHeight / 2;
  }
  const note = $("#tree-note");
  note.hidden = !tree.truncated;
  note.textContent = tree.truncated
    ? `A large tree: shown are the first ${tree.maxNodes} runs breadth-first from the top `
      + `(each run's children oldest first, at most ${tree.maxDepth} levels) and this run's `
      + "own line from the top."
    : "";
}

function setupMessages(id, refresh) {
  $("#message-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const form = event.target;
    try {
      const interrupt = form.elements.interrupt.checked;
      const sent = await api("POST", `/api/runs/${encodeURIComponent(id)}/messages`,
        { text: form.elements.text.value, policy: interrupt ? "interrupt" : "enqueue" });
      form.elements.text.value = "";
      form.elements.interrupt.checked = false;
      flash(interrupt
        ? `Message ${sent.messageId} sent: the model call in flight is interrupted for it.`
        : `Message ${sent.messageId} sent: delivered at the next step boundary.`);
      await refresh();
    } catch (e) {
      flash(e.message, true);
    }
  });
}

function runPage() {
  const id = body.dataset.runId;
  const path = `/api/runs/${encodeURIComponent(id)}`;
  let stop = null;
  const forkPanel = me.can.fork ? setupFork(id) : null;
  setupCompare(id);
  const load = async () => {
    const [run, steps, conversation] = await Promise.all([
      api("GET", path), api("GET", `${path}/timeline`), api("GET", `${path}/conversation`)]);
    renderHeader(run, steps, refresh);
    if (forkPanel) forkPanel.update(run, steps);
    renderTimeline(run, steps, forkPanel ? forkPanel.open : null);
    renderConversation(conversation);
    await renderFamily(run);
    // messages go to agent-loop runs: none for a durable function's (the API answers 409)
    const noMessages = JSON.parse(body.dataset.noMessages || "[]");
    $("#message-panel").hidden = !me.can.submit || noMessages.includes(run.agent)
      || ["FAILED", "CANCELLED", "TIMED_OUT"].includes(run.status);
    const approvalPanel = $("#approval-panel");
    if (run.status === "WAITING") {
      const pending = await api("GET", `/api/approvals?runId=${encodeURIComponent(id)}`);
      approvalPanel.hidden = pending.items.length === 0;
      const target = $("#approval-body");
      const key = pending.items.map((a) => a.id).join(",");
      // Rebuilt only when the approvals change, so a comment being typed survives the poll.
      if (target.dataset.key !== key) {
        target.dataset.key = key;
        clear(target);
        for (const a of pending.items) target.append(decisionForm(a, refresh));
      }
    } else {
      approvalPanel.hidden = true;
      delete $("#approval-body").dataset.key;
    }
    const attention = $("#attention-panel");
    attention.hidden = run.status !== "NEEDS_ATTENTION";
    if (!attention.hidden && !attention.dataset.shown) {
      attention.dataset.shown = "1";
      clear($("#attention-body")).append(resolutionForm(run, steps, refresh));
    } else if (attention.hidden) {
      delete attention.dataset.shown;
    }
    body.dataset.status = run.status;
    return run;
  };
  // Follow the run's event stream while it can change: reload on each durable event, show the
  // model's text as it streams. Without the stream (an old server, a proxy) poll instead; an
  // action on a finished run (resume) follows again.
  let typing = {};
  const showText = () => {
    const live = $("#live-text");
    const text = Object.values(typing).join("");
    live.hidden = !text;
    live.textContent = text;
  };
  let pending = null;
  const reloadSoon = () => {
    if (pending) return;
    pending = setTimeout(async () => {
      pending = null;
      try { await load(); } catch (e) { if (!(e instanceof ApiError)) flash(e.message, true); }
    }, 150);
  };
  const onEvent = (name, data) => {
    if (name === "text.delta") {
      const k = `${data.key}#${data.attempt}`;
      typing[k] = (typing[k] || "") + data.text;
      showText();
    } else if (name === "text.retract") {
      delete typing[`${data.key}#${data.attempt}`];
      showText();
    } else {
      if (name === "step.finished") typing = {};
      showText();
      reloadSoon();
    }
  };
  const poll = () => {
    if (stop) return;
    const controller = new AbortController();
    stop = () => controller.abort();
    follow(id, onEvent, controller.signal).then(() => {
      stop = null;
      typing = {};
      showText();
      reloadSoon();
    }, (e) => {
      if (controller.signal.aborted) return;
      stop = null;
      if (e instanceof ApiError && e.status === 401) return;
      pollOnly();
    });
  };
  const pollOnly = () => {
    if (stop) return;
    stop = watch(async () => {
      const run = await load();
      if (TERMINAL.has(run.status)) {
        stop = null;
        return false;
      }
      return true;
    }, 1000);
  };
  const refresh = async () => {
    await load();
    poll();
  };
  if (me.can.submit) setupMessages(id, refresh);
  load().then(poll, (e) => { if (!(e instanceof ApiError)) flash(e.message, true); poll(); });
}

// -- forks ----------------------------------------------------------------------------------

const COMPLETED = new Set(["DONE", "ERROR", "REJECTED"]);
const EDITABLE = new Set(["TOOL", "STEP", "SIDE_EFFECT"]);
const UUID_RE = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;
const REFUSALS = {
  400: "Invalid request", 403: "Not allowed", 404: "Not found", 409: "Conflict",
  422: "Idempotency key reused", 429: "Rate limited",
};

function diffPath(a, b) {
  return `/runs/${encodeURIComponent(a)}/diff/${encodeURIComponent(b)}`;
}

/** The seqs a fork may start from (as the API decides, checked again there): every step
 *  before it completed, and not inside a durable step (between it and its nested steps). */
function forkPoints(steps) {
  const rows = steps.filter((s) => s.kind !== "AUDIT" && s.seq !== null)
    .sort((x, y) => x.seq - y.seq);
  const nestedEnd = new Map(); // step key -> the last seq nested in it
  for (const s of rows) {
    const parts = s.stepKey.split("/");
    for (let i = 1; i < parts.length; i++) {
      const parent = parts.slice(0, i).join("/");
      nestedEnd.set(parent, Math.max(nestedEnd.get(parent) || 0, s.seq));
    }
  }
  const points = new Set();
  for (const [i, s] of rows.entries()) {
    if (rows.slice(0, i).some((c) => !COMPLETED.has(c.status))) break;
    const inside = rows.slice(0, i).some((c) => s.seq <= (nestedEnd.get(c.stepKey) || 0));
    if (!inside) points.add(s.seq);
  }
  return points;
}

/** A fresh Idempotency-Key (crypto.randomUUID needs a secure context; this does not). */
function newKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return `console-fork-${[...bytes].map((b) => b.toString(16).padStart(2, "0")).join("")}`;
}

/** JSON when it parses, else the text as it is. */
function jsonOrText(text) {
  try { return JSON.parse(text); } catch { return text; }
}

function refusal(e) {
  if (!(e instanceof ApiError)) return e.message;
  return `${REFUSALS[e.status] || "Refused"} (HTTP ${e.status}): ${e.message}`;
}

/** The "fork from here" form: open(seq) shows it for a fork point; update(run, steps) keeps
 *  what it offers in step with the page. It posts to the fork API with an Idempotency-Key
 *  made when it opens (a double click or a retried post makes one fork), then goes to the
 *  new run. Refusals stay on the form, the field named by the API marked invalid. */
function setupFork(runId) {
  const panel = $("#fork-panel");
  const form = $("#fork-form");
  const f = form.elements;
  const error = $("#fork-error");
  let run = null;
  let steps = [];
  let key = null;

  const describe = () => {
    const n = Number(f.fromSeq.value);
    const step = steps.find((s) => s.seq === n);
    $("#fork-explain").textContent = n > 1
      ? `The fork copies steps 1 to ${n - 1} of this run (they do not run again and bill `
        + `nothing) and runs again from step ${n}${step ? ` (${step.kind} ${step.stepKey})` : ""}.`
      : "The fork starts over from the first step.";
    const chosen = f.editSeq.value;
    const select = clear(f.editSeq);
    select.append(h("option", { value: "" }, "no step (no edit)"));
    for (const s of steps) {
      if (s.seq === null || s.seq >= n || !EDITABLE.has(s.kind) || !COMPLETED.has(s.status)) {
        continue;
      }
      select.append(h("option", { value: s.seq },
        `step ${s.seq}: ${s.kind} ${s.toolName || s.stepKey}`));
    }
    f.editSeq.value = [...select.options].some((o) => o.value === chosen) ? chosen : "";
    f.editOutput.disabled = !f.editSeq.value;
  };
  const reset = () => {
    error.textContent = "";
    for (const el of form.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
  };
  const open = (seq) => {
    reset();
    key = newKey();
    f.fromSeq.value = String(seq);
    f.fromSeq.max = String(Math.max(1, ...steps.map((s) => s.seq || 0)) + 1);
    describe();
    panel.hidden = false;
    $("#fork-title").textContent = `Fork from step ${seq}`;
    $("#fork-title").focus();
    panel.scrollIntoView({ block: "nearest" });
  };
  f.fromSeq.addEventListener("input", describe);
  f.editSeq.addEventListener("change", () => { f.editOutput.disabled = !f.editSeq.value; });
  $("#fork-close").addEventListener("click", () => { panel.hidden = true; });
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    reset();
    const payload = { fromSeq: Number(f.fromSeq.value) };
    const input = f.input.value;
    if (input.trim()) {
      if (typeof run.input === "string") {
        payload.input = input;
      } else {
        try {
          payload.input = JSON.parse(input);
        } catch {
          f.input.setAttribute("aria-invalid", "true");
          error.textContent = "input: this run is a durable function: its input is JSON";
          return;
        }
      }
    }
    if (f.model.value.trim()) payload.model = f.model.value.trim();
    if (f.tokenBudget.value) payload.tokenBudget = Number(f.tokenBudget.value);
    if (f.editSeq.value) {
      payload.toolResult = { seq: Number(f.editSeq.value), output: jsonOrText(f.editOutput.value) };
    }
    if (f.replayModel.checked) payload.replayModel = true;
    const button = $("#fork-submit");
    button.disabled = true;
    try {
      const created = await api("POST", `/api/runs/${encodeURIComponent(runId)}/fork`, payload,
        { "Idempotency-Key": key });
      window.location.assign(`/runs/${encodeURIComponent(created.id)}`);
    } catch (e) {
      if (e instanceof ApiError && e.status === 401) return;
      const fields = { fromSeq: "fromSeq", input: "input", model: "model",
        tokenBudget: "tokenBudget", toolResult: "editOutput", replayModel: "replayModel" };
      if (e.field && fields[e.field]) f[fields[e.field]].setAttribute("aria-invalid", "true");
      error.textContent = refusal(e);
    } finally {
      button.disabled = false;
    }
  });
  return {
    open,
    update(latest, latestSteps) {
      run = latest;
      steps = latestSteps;
      if (!panel.hidden && document.activeElement !== f.editSeq) describe();
    },
  };
}

/** "Compare with run": a full id, or the start of one that names exactly one run. */
function setupCompare(runId) {
  const form = $("#compare-form");
  const error = $("#compare-error");
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.textContent = "";
    const other = form.elements.other.value.trim().toLowerCase();
    try {
      let target = other;
      if (!UUID_RE.test(other)) {
        const q = new URLSearchParams({ idPrefix: other, limit: "2" });
        const found = (await api("GET", `/api/runs?${q}`)).items;
        if (found.length !== 1) {
          error.textContent = found.length
            ? `more than one run starts with ${other}: give more of the id`
            : `no run starts with ${other}`;
          return;
        }
        target = found[0].id;
      }
      window.location.assign(diffPath(runId, target));
    } catch (e) {
      if (!(e instanceof ApiError && e.status === 401)) error.textContent = refusal(e);
    }
  });
}

// -- comparing two runs ---------------------------------------------------------------------

const DIFF_CELLS = ["kind", "stepKey", "toolName", "status", "input", "output", "tokens",
  "costUsd"];

function runSummary(label, r) {
  const dl = h("dl", { class: "facts" });
  fact(dl, "Run", runLink(r.id, r.id));
  fact(dl, "Status", badge(r.status));
  fact(dl, "Agent", r.agent);
  fact(dl, "Model", r.model);
  fact(dl, "Tokens", r.tokensUsed.toLocaleString("en"));
  fact(dl, "Cost", usd(r.costUsd));
  if (r.forkedFrom && r.forkedFrom.runId) {
    fact(dl, "Forked from", runLink(r.forkedFrom.runId), ` at step ${r.forkedFrom.seq}`);
  }
  fact(dl, "Input", h("pre", {}, json(r.input)));
  if (r.result !== null && r.result !== undefined) fact(dl, "Result", h("pre", {}, json(r.result)));
  if (r.error) fact(dl, "Error", h("span", { class: "error" }, r.error));
  return h("section", { class: "card side", "aria-label": `Run ${label}` }, h("h2", {}, label), dl);
}

function sideCells(side, differences) {
  if (!side) return [h("td", { colspan: DIFF_CELLS.length, class: "missing" }, "no step")];
  const changed = (...fields) => (fields.some((x) => differences.includes(x)) ? "changed" : null);
  const small = (value) => {
    if (value === null || value === undefined) return "";
    const hash = value.promptHash || value.inputHash;  // what a model call or a step is keyed on
    if (hash && Object.keys(value).length === 1) {
      return h("code", { class: "hash", title: hash },
        `${value.promptHash ? "prompt" : "input"} ${hash.slice(0, 10)}…`);
    }
    return h("pre", { class: "small" }, json(value));
  };
  const billed = side.billedTokens !== side.tokens
    ? h("span", { class: "muted block" }, `billed ${side.billedTokens}`) : "";
  return [
    h("td", { class: changed("kind") }, h("span", { class: `kind k-${side.kind}` }, side.kind)),
    h("td", { class: changed("stepKey") }, h("code", {}, side.stepKey)),
    h("td", { class: changed("toolName") }, side.toolName || ""),
    h("td", { class: changed("status", "error") }, side.status,
      side.origin ? h("span", { class: "note origin" }, side.origin) : "",
      side.error ? h("span", { class: "error block" }, side.error) : ""),
    h("td", { class: changed("input") }, small(side.input)),
    h("td", { class: changed("output") }, small(side.output)),
    h("td", { class: `num ${changed("tokens") || ""}` }, side.tokens.toLocaleString("en"), billed),
    h("td", { class: `num ${changed("costUsd") || ""}` }, usd(side.costUsd)),
  ];
}

function renderDiff(d) {
  clear($("#diff-runs")).append(runSummary("A", d.a), runSummary("B", d.b));
  const summary = clear($("#diff-summary"));
  summary.append(h("p", {}, d.runDifferences.length
    ? `The runs differ in: ${d.runDifferences.join(", ")}.`
    : "Same agent, input, model, status and result."));
  const first = d.steps.find((r) => r.seq === d.firstDifferentSeq);
  summary.append(first
    ? h("p", { id: "first-diff" }, "First difference at ",
      h("a", { href: `#seq-${first.seq}` }, `step ${first.seq}`),
      `: ${first.differences.join(", ")}.`)
    : h("p", { id: "first-diff" }, "The steps are the same."));
  const table = $("#diff-steps");
  for (const old of [...table.tBodies]) old.remove();
  for (const r of d.steps) {
    const cls = r.same ? "same" : r.seq === d.firstDifferentSeq ? "differs first" : "differs";
    const tbody = h("tbody", { id: `seq-${r.seq}`, class: cls, "data-seq": r.seq });
    tbody.append(
      h("tr", { class: "side-a" },
        h("th", { scope: "rowgroup", rowspan: 2, class: "num" }, r.seq),
        h("th", { scope: "row" }, "A"),
        sideCells(r.a, r.differences),
        h("td", { rowspan: 2, class: "differences" },
          r.same ? "same" : r.differences.join(", "))),
      h("tr", { class: "side-b" }, h("th", { scope: "row" }, "B"), sideCells(r.b, r.differences)),
    );
    table.append(tbody);
  }
  $("#diff-empty").hidden = d.steps.length > 0;
}

function diffPage() {
  const a = body.dataset.runA;
  const b = body.dataset.runB;
  let scrolled = false;
  watch(async () => {
    const d = await api("GET", `/api/runs/${encodeURIComponent(a)}/diff/${encodeURIComponent(b)}`);
    renderDiff(d);
    body.dataset.firstDifferentSeq = d.firstDifferentSeq ?? "none";
    if (!scrolled && d.firstDifferentSeq !== null) {
      scrolled = true;
      $(`#seq-${d.firstDifferentSeq}`).scrollIntoView({ block: "center" });
    }
    return !(TERMINAL.has(d.a.status) && TERMINAL.has(d.b.status));
  }, 2000);
}

// -- approvals inbox ------------------------------------------------------------------------

function approvalsPage() {
  const mine = $("#a-mine");
  if (!me.auth) {
    $("#approvals-note").textContent = "Authentication is off: every approval can be decided here.";
  } else if (!me.approvalRoles.length) {
    $("#approvals-note").textContent = "This token holds no approval role: it can look, not decide.";
    mine.checked = false;
  }
  const shownIds = new Set();
  const load = async () => {
    const data = await api("GET", "/api/approvals?status=PENDING");
    const items = data.items.filter((a) => !mine.checked || !me.auth
      || me.approvalRoles.includes(a.role));
    const list = $("#approvals");
    const ids = new Set(items.map((a) => a.id));
    // Keep cards already shown (a comment being typed survives the poll); add and drop others.
    for (const li of [...list.children]) {
      if (!ids.has(li.dataset.approvalId)) {
        shownIds.delete(li.dataset.approvalId);
        li.remove();
      }
    }
    for (const a of items) {
      if (shownIds.has(a.id)) continue;
      shownIds.add(a.id);
      list.append(h("li", { class: "card approval", "data-approval-id": a.id },
        h("h2", {}, "Run ", runLink(a.runId), ": ", a.stepKey),
        decisionForm(a, load)));
    }
    $("#approvals-empty").hidden = items.length > 0;
  };
  mine.addEventListener("change", () => {
    clear($("#approvals"));
    shownIds.clear();
    load();
  });
  watch(load, 3000);
}

// -- needs attention ------------------------------------------------------------------------

function attentionPage() {
  const shown = new Set();
  const load = async () => {
    const page = await api("GET", `/api/runs?status=NEEDS_ATTENTION&limit=${PAGE_SIZE}`);
    const list = $("#attention");
    const ids = new Set(page.items.map((r) => r.id));
    for (const li of [...list.children]) {
      if (!ids.has(li.dataset.runId)) {
        shown.delete(li.dataset.runId);
        li.remove();
      }
    }
    for (const run of page.items) {
      if (shown.has(run.id)) continue;
      shown.add(run.id);
      const steps = await api("GET", `/api/runs/${encodeURIComponent(run.id)}/timeline`);
      list.append(h("li", { class: "card", "data-run-id": run.id },
        h("h2", {}, "Run ", runLink(run.id), ` (${run.agent})`),
        resolutionForm(run, steps, load)));
    }
    $("#attention-empty").hidden = page.items.length > 0;
  };
  watch(load, 3000);
}

// -- overview -------------------------------------------------------------------------------

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777",
  "#4b5563"];
const STATUS_COLOURS = { SUCCEEDED: "#16a34a", FAILED: "#dc2626", CANCELLED: "#6b7280",
  TIMED_OUT: "#d97706" };

/** Series keyed by `key` on an hourly axis from `since` to `until`, zeros where no row. */
function hourly(stats, rows, key, value) {
  const step = stats.bucketSeconds;
  const first = Math.floor(Date.parse(stats.since) / 1000 / step) * step;
  const last = Math.floor(Date.parse(stats.until) / 1000 / step) * step;
  const xs = [];
  for (let t = first; t <= last; t += step) xs.push(t);
  const index = new Map(xs.map((t, i) => [t, i]));
  const series = new Map();
  for (const row of rows) {
    const k = key(row);
    if (!series.has(k)) series.set(k, xs.map(() => null));
    const i = index.get(Math.floor(Date.parse(row.at) / 1000));
    if (i !== undefined) series.get(k)[i] = value(row);
  }
  return { xs, series };
}

const charts = {};

function chart(id, title, xs, series, colours, unit) {
  const el = $(`#${id}`);
  if (charts[id]) charts[id].destroy();
  clear(el);
  const names = [...series.keys()];
  const opts = {
    width: Math.min(900, el.clientWidth || 900),
    height: 220,
    series: [{}, ...names.map((name, i) => ({
      label: name,
      stroke: colours[name] || PALETTE[i % PALETTE.length],
      width: 2,
      spanGaps: false,
      points: { show: true, size: 5 },
    }))],
    scales: { y: { range: (u, min, max) => [0, max > 0 ? max * 1.15 : 1] } },
    axes: [{}, { label: unit }],
  };
  const data = [xs, ...names.map((n) => series.get(n))];
  charts[id] = new window.uPlot(opts, data, el);
  el.setAttribute("aria-label", `${title}: ${names.length ? names.join(", ") : "no data"}`);
}

function overviewPage() {
  const load = async () => {
    const window_ = document.querySelector("input[name=window]:checked").value;
    const stats = await api("GET", `/api/stats?window=${encodeURIComponent(window_)}`);
    const f = hourly(stats, stats.finished, (r) => r.status, (r) => r.count);
    chart("c-finished", "Runs finished per hour", f.xs, f.series, STATUS_COLOURS, "runs");
    const total = stats.finished.reduce((n, r) => n + r.count, 0);
    $("#c-finished-sum").textContent = `${total} runs finished in the last ${stats.window}: `
      + (STATUSES.filter((st) => TERMINAL.has(st)).map((st) => `${st} ${stats.finished
        .filter((r) => r.status === st).reduce((n, r) => n + r.count, 0)}`).join(", "));
    const c = hourly(stats, stats.cost, (r) => r.model, (r) => r.usd);
    chart("c-cost", "Cost per hour by model", c.xs, c.series, {}, "USD");
    const spent = stats.cost.reduce((n, r) => n + r.usd, 0);
    $("#c-cost-sum").textContent = `${usd(spent)} recorded in the last ${stats.window}`;
    const l50 = hourly(stats, stats.latency, (r) => `${r.kind} p50`, (r) => r.p50Ms);
    const l95 = hourly(stats, stats.latency, (r) => `${r.kind} p95`, (r) => r.p95Ms);
    const latency = new Map([...l50.series, ...l95.series].sort((a, b) => a[0].localeCompare(b[0])));
    chart("c-latency", "Step latency per hour", l50.xs, latency, {}, "ms");
    const kinds = [...new Set(stats.latency.map((r) => r.kind))];
    $("#c-latency-sum").textContent = kinds.length
      ? `Kinds seen: ${kinds.join(", ")}` : "No steps finished in this window.";
  };
  for (const radio of document.querySelectorAll("input[name=window]")) {
    radio.addEventListener("change", () => load().catch((e) => flash(e.message, true)));
  }
  watch(load, 30000);
}

// -- schedules ------------------------------------------------------------------------------

function schedulesPage() {
  const load = async () => {
    const data = await api("GET", "/api/schedules");
    const tbody = clear($("#schedules tbody"));
    for (const sc of data.items) {
      const detail = await api("GET", `/api/schedules/${encodeURIComponent(sc.id)}`);
      const last = detail.recentTicks.find((t) => t.runId);
      const remove = me.can.submit
        ? h("button", { type: "button", class: "danger" }, "Delete") : "";
      if (remove) {
        remove.addEventListener("click", async () => {
          try {
            await api("DELETE", `/api/schedules/${encodeURIComponent(sc.id)}`);
            flash(`Deleted schedule ${shortId(sc.id)}.`);
            await load();
          } catch (e) {
            flash(e.message, true);
          }
        });
      }
      tbody.append(h("tr", { "data-schedule-id": sc.id },
        h("td", {}, h("code", {}, shortId(sc.id))), h("td", {}, sc.agent),
        h("td", {}, h("code", {}, sc.cron)), h("td", {}, sc.timezone), h("td", {}, sc.overlap),
        h("td", {}, sc.catchUp), h("td", {}, sc.nextTickAt),
        h("td", {}, last ? runLink(last.runId) : "none yet"), h("td", {}, remove)));
    }
    $("#schedules-empty").hidden = data.items.length > 0;
  };
  if (me.can.submit) {
    $("#schedule-section").hidden = false;
    $("#schedule-form").addEventListener("submit", async (event) => {
      event.preventDefault();
      const form = event.target;
      const option = form.elements.agent.selectedOptions[0];
      let input = form.elements.input.value;
      if (option && option.dataset.durable === "1") {
        try {
          input = JSON.parse(input);
        } catch {
          flash(`input: ${option.value} is a durable function and takes JSON`, true);
          return;
        }
      }
      const payload = {
        input, agent: form.elements.agent.value, cron: form.elements.cron.value,
        timezone: form.elements.timezone.value || "UTC", overlap: form.elements.overlap.value,
        catchUp: form.elements.catchUp.value,
      };
      try {
        const made = await api("POST", "/api/schedules", payload);
        flash(`Created schedule ${shortId(made.id)}; next tick ${made.nextTickAt}.`);
        await load();
      } catch (e) {
        flash(e.message, true);
      }
    });
  }
  watch(load, 5000);
}

// -- versions -------------------------------------------------------------------------------

const REPORT_KEY = "dar.lastCheck";

function divergenceText(d) {
  if (!d) return "";
  return `${d.seq === null ? "the run" : `seq ${d.seq}`}: recorded ${d.recorded}; the new code: ${d.asked}`;
}

/** The report of an upgrade (or of a check: dryRun) as POST /api/versions/{v}/upgrade
 *  returned it: each run checked, whether it moved, and the first divergence of those that
 *  stay. */
function renderReport(report) {
  const section = $("#report");
  if (!report) {
    section.hidden = true;
    return;
  }
  section.hidden = false;
  const what = report.dryRun ? "Check (nothing moved)" : "Upgrade";
  $("#report-summary").textContent = `${what} of version ${report.from} to ${report.to}: `
    + `${report.checked} run(s) checked, ${report.moved.length} moved, `
    + `${report.stayed.length} stay (their history does not replay), `
    + `${report.busy.length} busy (held by a worker: try again).`;
  const tbody = clear($("#report-runs tbody"));
  for (const r of report.runs) {
    let outcome = "stays";
    if (r.moved) outcome = "moved";
    else if (r.busy) outcome = "busy";
    else if (r.clean) outcome = report.dryRun ? "would move" : "clean";
    tbody.append(h("tr", { "data-run-id": r.runId, class: r.clean ? null : "diverged" },
      h("td", {}, runLink(r.runId)), h("td", {}, r.agent), h("td", { class: "num" }, r.steps),
      h("td", { class: "outcome" }, outcome), h("td", { class: "divergence" }, divergenceText(r.divergence)),
      h("td", {}, (r.configurationChanges || []).join("; "))));
  }
  if (!report.runs.length) {
    tbody.append(h("tr", {}, h("td", { colspan: 6 }, "No run of this version to move.")));
  }
}

function versionsPage() {
  const note = $("#versions-note");
  if (!me.can.versions) {
    note.hidden = false;
    note.textContent = "This token cannot read the versions: that takes the metrics role.";
    return;
  }
  let stored = null;
  try {
    stored = JSON.parse(sessionStorage.getItem(REPORT_KEY) || "null");
  } catch {
    stored = null;
  }
  renderReport(stored);
  let shown = null;
  const upgrade = async (deployment, dryRun, button) => {
    button.disabled = true;
    try {
      const path = `/api/versions/${encodeURIComponent(deployment)}/upgrade`;
      const report = await api("POST", path, { dryRun });
      sessionStorage.setItem(REPORT_KEY, JSON.stringify(report));
      renderReport(report);
      flash(dryRun
        ? `Checked ${report.checked} run(s) of ${deployment}: ${report.stayed.length} would stay.`
        : `Moved ${report.moved.length} run(s) of ${deployment} to ${report.to}; `
          + `${report.stayed.length} stay.`);
      shown = null;
      await load();
    } catch (e) {
      flash(e.message, true);
    } finally {
      button.disabled = false;
    }
  };
  const load = async () => {
    const data = await api("GET", "/api/versions");
    // Workers' heartbeats change lastSeen every few seconds: redraw only what a person sees
    // (so a button is not replaced under the pointer).
    const key = JSON.stringify([data.current, data.unservedRuns, data.upgradePolicies,
      data.versions.map((v) => [v.deployment, v.served, v.runs,
        v.workers.map((w) => [w.worker, w.live])])]);
    if (key === shown) return;
    shown = key;
    const summary = $("#versions-summary");
    summary.textContent = data.unservedRuns
      ? `${data.unservedRuns} run(s) in flight wait for a version no live worker serves.`
      : "Every run in flight is of a version a live worker serves.";
    summary.className = data.unservedRuns ? "error" : "";
    const tbody = clear($("#versions tbody"));
    for (const v of data.versions) {
      const name = v.deployment === null ? "(none)" : v.deployment;
      const current = v.deployment === data.current;
      const unserved = !v.served && v.inFlight > 0;
      const live = v.workers.filter((w) => w.live).map((w) => w.worker);
      const actions = h("div", { class: "actions" });
      if (me.can.upgrade && data.current && !current && v.deployment !== null) {
        const check = h("button", { type: "button", class: "secondary",
          "aria-label": `Check the runs of ${name}` }, "Check");
        check.addEventListener("click", () => upgrade(v.deployment, true, check));
        const move = h("button", { type: "button",
          "aria-label": `Upgrade the runs of ${name} to ${data.current}` },
          `Upgrade to ${data.current}`);
        move.addEventListener("click", () => upgrade(v.deployment, false, move));
        actions.append(check, move);
      }
      const statuses = Object.entries(v.runs).map(([st, n]) => h("span", {},
        badge(st), ` ${n} `));
      tbody.append(h("tr", { "data-deployment": name, class: unserved ? "unserved" : null },
        h("td", {}, h("code", {}, name), current ? h("span", { class: "note" }, "this web's") : ""),
        h("td", { class: "served" }, v.served ? "yes" : (unserved ? "no: its runs wait" : "no")),
        h("td", {}, live.length ? `${live.length} live: ${live.join(", ")}` : "none live"),
        h("td", { class: "num in-flight" }, v.inFlight),
        h("td", {}, statuses.length ? statuses : "none"),
        h("td", {}, actions)));
    }
    $("#versions-empty").hidden = data.versions.length > 0;
    const policies = clear($("#policies"));
    for (const [agent, policy] of Object.entries(data.upgradePolicies || {})) {
      policies.append(h("li", { "data-agent": agent }, `${agent}: `, h("code", {}, policy)));
    }
  };
  watch(load, 3000);
}

// -- start ----------------------------------------------------------------------------------

const PAGES = {
  runs: runsPage, run: runPage, approvals: approvalsPage, attention: attentionPage,
  overview: overviewPage, diff: diffPage, schedules: schedulesPage, versions: versionsPage,
};
let started = false;

function start() {
  if (started) return;
  started = true;
  PAGES[body.dataset.page]();
  body.dataset.ready = "1";
}

setupSession();
signIn().then((ok) => {
  if (ok) start();
  else if ($("#main").hidden && $("#login").hidden) showLogin("");
});
