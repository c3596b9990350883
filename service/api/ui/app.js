// modelprep's operator page: hash routes (#/jobs, #/jobs/<id>, #/submit, #/offload) over the
// /v1 API. The DOM is built with h() (textContent, never innerHTML): job sources, errors and
// model reports are caller-supplied strings and must not become markup.
import { ApiProblem, api, download, followJob, getKey, isTerminal, setKey } from "./api.js";

const STATUSES = ["queued", "running", "succeeded", "failed", "cancelled"];
const MAX_STREAMS = 4; // a browser opens ~6 HTTP/1.1 connections per host: leave room for calls
const LIST_REFRESH_MS = 15_000; // one list request to notice new jobs; progress comes by SSE

const main = document.getElementById("main");
const session = { admin: false, tenant: null };
let viewAbort = new AbortController();

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(el.dataset, value);
    else el.setAttribute(name, value === true ? "" : value);
  }
  fill(el, ...children);
  return el;
}

/** Append children (nodes, text, nested arrays); null/undefined/false are left out. */
function fill(el, ...children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function refill(el, ...children) {
  el.replaceChildren();
  return fill(el, ...children);
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

function when(iso) {
  return iso ? new Date(iso).toLocaleString() : "–";
}

function percent(progress) {
  if (!progress || !progress.total) return null;
  return Math.min(100, Math.round((100 * progress.done) / progress.total));
}

function progressBar(job) {
  const pct = isTerminal(job.status) && job.status === "succeeded" ? 100 : percent(job.progress);
  return h("progress", { max: 100, value: pct ?? null, title: pct === null ? "" : `${pct}%` });
}

function problemBox(error) {
  const text = error instanceof ApiProblem ? `${error.problem.title}: ${error.message}` : String(error);
  return h("p", { class: "problem", role: "alert" }, text);
}

function table(head, rows) {
  return h("table", {}, h("thead", {}, h("tr", {}, head.map((c) => h("th", {}, c)))), h("tbody", {}, rows));
}

function keyValues(object) {
  return h("dl", { class: "kv" }, Object.entries(object ?? {}).map(([k, v]) => [
    h("dt", {}, k),
    h("dd", {}, typeof v === "object" && v !== null ? JSON.stringify(v) : /bytes/.test(k) ? bytes(v) : String(v)),
  ]));
}

// ---- sign-in -------------------------------------------------------------------------------

async function whoAmI() {
  await api("/v1/jobs?limit=1"); // 401 without a valid key
  try {
    await api("/v1/offload");
    session.admin = true;
  } catch (error) {
    if (!(error instanceof ApiProblem) || error.status !== 403) throw error;
    session.admin = false;
  }
  document.getElementById("nav").hidden = false;
  document.getElementById("nav-offload").hidden = !session.admin;
  document.getElementById("signout").hidden = !getKey();
  document.getElementById("who").textContent = getKey() ? (session.admin ? "admin key" : "tenant key") : "open service";
}

function signInView(error) {
  document.getElementById("nav").hidden = true;
  const input = h("input", { id: "api-key", type: "password", autocomplete: "off", required: true, size: 50 });
  const form = h("form", { id: "signin" },
    h("h1", {}, "API key"),
    h("p", {}, "Kept in this tab's session storage only, sent as a bearer header."),
    h("label", { for: "api-key" }, "Key "), input, " ", h("button", { type: "submit" }, "Use key"),
    error ? problemBox(error) : null);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    setKey(input.value.trim());
    start();
  });
  refill(main, form);
  input.focus();
}

// ---- jobs list -----------------------------------------------------------------------------

function jobRow(job) {
  const source = job.source?.uri ?? job.request?.source ?? "";
  return h("tr", { dataset: { jobId: job.id, status: job.status } },
    h("td", {}, h("a", { href: `#/jobs/${job.id}` }, job.id.slice(0, 12))),
    h("td", { class: `status ${job.status}` }, job.status),
    h("td", {}, job.phase),
    h("td", {}, progressBar(job)),
    h("td", {}, when(job.created_at)),
    h("td", {}, when(job.started_at)),
    h("td", {}, when(job.finished_at)),
    h("td", { class: "source", title: source }, source),
    session.admin ? h("td", {}, job.tenant ?? "–") : null);
}

async function jobsView(params) {
  const status = params.get("status") ?? "";
  const signal = viewAbort.signal;
  const filter = h("select", { id: "status-filter", onchange: (e) => {
    location.hash = e.target.value ? `#/jobs?status=${e.target.value}` : "#/jobs";
  } }, h("option", { value: "" }, "all"), STATUSES.map((s) => h("option", { value: s, selected: s === status }, s)));
  const body = h("tbody");
  const head = ["job", "status", "phase", "progress", "created", "started", "finished", "source"];
  if (session.admin) head.push("tenant");
  const message = h("div");
  refill(main, h("h1", {}, "Jobs"), h("label", {}, "Status ", filter), message,
    h("table", { id: "jobs" }, h("thead", {}, h("tr", {}, head.map((c) => h("th", {}, c)))), body));

  const jobs = new Map();
  const followed = new Map(); // job id -> AbortController of its stream
  const render = () => {
    const rows = [...jobs.values()]
      .filter((job) => !status || job.status === status)
      .sort((a, b) => b.created_at.localeCompare(a.created_at))
      .map(jobRow);
    refill(body, rows);
    if (!rows.length) body.append(h("tr", {}, h("td", { colspan: head.length }, "No jobs.")));
  };
  const follow = (job) => {
    if (followed.has(job.id) || isTerminal(job.status) || followed.size >= MAX_STREAMS) return;
    const abort = new AbortController();
    signal.addEventListener("abort", () => abort.abort());
    followed.set(job.id, abort);
    followJob(job.id, (state) => {
      const known = jobs.get(job.id);
      const merged = { ...known, ...state };
      if (isTerminal(state.status) && !merged.finished_at) merged.finished_at = new Date().toISOString();
      if (state.status === "running" && !merged.started_at) merged.started_at = new Date().toISOString();
      jobs.set(job.id, merged);
      render();
    }, abort.signal).catch(() => {}).finally(() => {
      followed.delete(job.id);
      if (!signal.aborted) refresh(); // pick up finished_at and the next job to follow
    });
  };
  const refresh = async () => {
    try {
      const page = await api(`/v1/jobs?limit=100${status ? `&status=${status}` : ""}`, { signal });
      if (status) for (const [id, job] of jobs) if (job.status !== status) jobs.delete(id);
      for (const job of page.items) jobs.set(job.id, job);
      message.replaceChildren();
      render();
      for (const job of page.items) follow(job);
    } catch (error) {
      if (!signal.aborted) message.replaceChildren(problemBox(error));
    }
  };
  await refresh();
  const timer = setInterval(refresh, LIST_REFRESH_MS);
  signal.addEventListener("abort", () => clearInterval(timer));
}

// ---- one job -------------------------------------------------------------------------------

function timeline(phases) {
  if (!phases?.length) return h("p", {}, "No phase recorded yet.");
  const total = phases.reduce((sum, p) => sum + (p.seconds ?? 0), 0) || 1;
  return h("ol", { class: "timeline" }, phases.map((p) => h("li", {},
    h("span", { class: "phase-name" }, p.phase),
    h("span", { class: "bar", style: null, dataset: { width: Math.max(1, Math.round((100 * (p.seconds ?? 0)) / total)) } }),
    h("span", {}, p.seconds === null || p.seconds === undefined ? "running" : `${p.seconds.toFixed(3)} s`))));
}

function sizeBars(root) {
  // Inline style attributes are refused by the page's CSP; CSSOM properties are not.
  for (const bar of root.querySelectorAll(".bar[data-width]")) bar.style.width = `${bar.dataset.width}%`;
}

async function verificationSection(job, signal) {
  const manifest = job.artifacts.find((a) => a.path === "manifest.json");
  if (!manifest) return h("p", {}, "No manifest yet.");
  const response = await fetch(manifest.url, { headers: { Authorization: `Bearer ${getKey() ?? ""}` }, signal });
  if (!response.ok) return h("p", {}, `manifest.json: HTTP ${response.status}`);
  const data = await response.json();
  return table(["format", "verification"], (data.exports ?? []).map((e) => {
    const verify = e.verify ?? {};
    const verdict = verify.skipped ? `skipped: ${verify.skipped}` : verify.ok === false || verify.passed === false ? "FAILED" : Object.keys(verify).length ? "passed" : "not run";
    return h("tr", { class: "verify" }, h("td", {}, e.format), h("td", {}, h("strong", {}, verdict), " ",
      h("code", {}, JSON.stringify(verify))));
  }));
}

async function jobView(jobId) {
  const signal = viewAbort.signal;
  let job;
  try {
    job = await api(`/v1/jobs/${encodeURIComponent(jobId)}`, { signal });
  } catch (error) {
    main.replaceChildren(h("h1", {}, "Job"), problemBox(error));
    return;
  }
  const status = h("span", { id: "job-status", class: `status ${job.status}` }, job.status);
  const phase = h("span", { id: "job-phase" }, job.phase);
  const bar = h("span", {}, progressBar(job));
  const actions = h("div", { class: "actions" });
  const notice = h("div");
  const details = h("div");
  const times = h("p", { id: "job-times" });
  const renderDetails = async () => {
    refill(times, `created ${when(job.created_at)} · started ${when(job.started_at)} · finished ${when(job.finished_at)}`,
      session.admin ? ` · tenant ${job.tenant ?? "–"}` : "");
    // DELETE /v1/jobs/{id} cancels a live job and removes a finished job's files (the job stays).
    refill(actions,
      isTerminal(job.status) ? null : h("button", { id: "cancel", type: "button", onclick: () => act("cancel") }, "Cancel job"),
      isTerminal(job.status) && !job.deleted_at ? h("button", { id: "delete", type: "button", onclick: () => act("delete") }, "Delete files") : null,
      job.deleted_at ? h("span", { id: "deleted" }, `files deleted ${when(job.deleted_at)}`) : null);
    const artifacts = table(["artifact", "size", "sha256"], job.artifacts.map((a) => h("tr", {},
      h("td", {}, h("a", { href: "#", class: "download", dataset: { path: a.path }, onclick: (e) => {
        e.preventDefault();
        download(a.url, a.path.split("/").pop()).catch((error) => notice.replaceChildren(problemBox(error)));
      } }, a.path)),
      h("td", {}, bytes(a.size)), h("td", {}, h("code", {}, a.sha256.slice(0, 16))))));
    refill(details,
      job.error ? h("p", { class: "problem", id: "job-error" }, `${job.error.type}: ${job.error.message}`) : null,
      h("h2", {}, "Phases"), timeline(job.phases),
      h("h2", {}, "Metrics"), keyValues(job.metrics),
      job.offload ? [h("h2", {}, "Offload"), keyValues(job.offload)] : null,
      h("h2", {}, "Model"), job.model ? keyValues(job.model) : h("p", {}, "Not read yet."),
      h("h2", {}, "Verification"), isTerminal(job.status) ? await verificationSection(job, signal).catch(problemBox) : h("p", {}, "When the job ends."),
      h("h2", {}, "Artifacts"), job.artifacts.length ? artifacts : h("p", {}, "None yet."),
      h("h2", {}, "Request"), h("pre", {}, JSON.stringify(job.request, null, 2)));
    sizeBars(details);
  };
  const act = async (what) => {
    if (what === "delete" && !confirm("Delete this job's artifacts? The job record stays.")) return;
    try {
      job = await api(`/v1/jobs/${encodeURIComponent(jobId)}`, { method: "DELETE" });
      notice.replaceChildren(h("p", { class: "ok" }, what === "delete" ? "files deleted" : "cancel requested"));
      if (what === "delete") await renderDetails();
    } catch (error) {
      notice.replaceChildren(problemBox(error));
    }
  };
  refill(main, h("h1", {}, `Job ${job.id}`),
    h("p", {}, "Status ", status, " · phase ", phase, " ", bar, " · source ", h("code", {}, job.source?.uri ?? job.request.source)),
    times, actions, notice, details);
  await renderDetails();
  if (isTerminal(job.status)) return;
  followJob(job.id, async (state) => {
    status.textContent = state.status;
    status.className = `status ${state.status}`;
    phase.textContent = state.phase;
    bar.replaceChildren(progressBar(state));
    if (isTerminal(state.status)) {
      job = await api(`/v1/jobs/${encodeURIComponent(jobId)}`, { signal });
      await renderDetails();
    } else {
      job = { ...job, ...state };
    }
  }, signal).catch((error) => notice.replaceChildren(problemBox(error)));
}

// ---- submit --------------------------------------------------------------------------------

async function exportFormats() {
  // The formats the server accepts, from its own OpenAPI document: a new exporter shows up here.
  try {
    const doc = await (await fetch("/openapi.json")).json();
    const items = doc.components.schemas.JobCreate.properties.exports.items;
    if (items.discriminator) return Object.keys(items.discriminator.mapping);
  } catch { /* fall through */ }
  return ["safetensors", "gguf", "nnef", "onnx"];
}

function fieldError(name) {
  return h("span", { class: "field-error", id: `error-${name}`, role: "alert" });
}

async function submitView() {
  const formats = await exportFormats();
  const field = (name, label, input, hint) => h("div", { class: "field" },
    h("label", { for: `f-${name}` }, label), input, hint ? h("small", {}, hint) : null, fieldError(name));
  const exportRows = formats.map((format) => h("div", { class: "export", dataset: { format } },
    h("label", {}, h("input", { type: "checkbox", name: "format", value: format, checked: format === "safetensors" }), ` ${format}`),
    h("input", { type: "text", name: `options-${format}`, placeholder: "options as JSON, e.g. {}", size: 40 }),
    h("span", { class: "field-error", id: `error-exports-${format}` })));
  const form = h("form", { id: "submit-form", novalidate: true },
    h("h1", {}, "Submit a job"),
    field("source", "Source", h("input", { id: "f-source", name: "source", size: 60, placeholder: "file:///models/x, hf://org/repo, https://…" })),
    field("revision", "Revision", h("input", { id: "f-revision", name: "revision" }), "hf:// branch, tag or commit"),
    h("fieldset", { id: "f-exports" }, h("legend", {}, "Exports"), exportRows, fieldError("exports")),
    field("max_memory", "Max memory", h("input", { id: "f-max_memory", name: "max_memory", placeholder: "1GiB" })),
    field("verify", "Verify", h("input", { id: "f-verify", name: "verify", type: "checkbox", checked: true })),
    h("button", { type: "submit" }, "Submit"), h("div", { id: "form-problem" }));
  const clearErrors = () => form.querySelectorAll(".field-error").forEach((el) => { el.textContent = ""; });
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors();
    form.querySelector("#form-problem").replaceChildren();
    const chosen = [...form.querySelectorAll("input[name=format]:checked")].map((el) => el.value);
    const exports = [];
    for (const format of chosen) {
      const raw = form.querySelector(`input[name=options-${format}]`).value.trim();
      try {
        exports.push({ ...(raw ? JSON.parse(raw) : {}), format });
      } catch {
        form.querySelector(`#error-exports-${format}`).textContent = "not valid JSON";
        return;
      }
    }
    const body = { source: form.elements.source.value.trim(), exports, verify: form.elements.verify.checked };
    if (form.elements.revision.value.trim()) body.revision = form.elements.revision.value.trim();
    if (form.elements.max_memory.value.trim()) body.max_memory = form.elements.max_memory.value.trim();
    try {
      const job = await api("/v1/jobs", { method: "POST", body });
      location.hash = `#/jobs/${job.id}`;
    } catch (error) {
      showProblem(form, error, chosen);
    }
  });
  main.replaceChildren(form);
}

function showProblem(form, error, chosen) {
  // The API's own validation errors, each next to the field its loc names:
  // ["body", "source"], ["body", "exports", "0", "gguf", "quant"], ...
  const unplaced = [];
  for (const err of error.problem?.errors ?? []) {
    const [, name, index, , ...rest] = err.loc;
    let target = null;
    if (name === "exports" && index !== undefined && chosen[Number(index)]) {
      target = form.querySelector(`#error-exports-${chosen[Number(index)]}`);
    } else if (name) {
      target = form.querySelector(`#error-${name}`);
    }
    const text = rest.length ? `${rest.join(".")}: ${err.msg}` : err.msg;
    if (target) target.textContent = target.textContent ? `${target.textContent}; ${text}` : text;
    else unplaced.push(`${err.loc.join(".")}: ${err.msg}`);
  }
  if (!error.problem?.errors?.length || unplaced.length) {
    refill(form.querySelector("#form-problem"), problemBox(error), ...unplaced.map((u) => h("p", {}, u)));
  }
}

// ---- offload (admins) ----------------------------------------------------------------------

async function offloadView() {
  let usage;
  try {
    usage = await api("/v1/offload", { signal: viewAbort.signal });
  } catch (error) {
    main.replaceChildren(h("h1", {}, "Offload directory"), problemBox(error));
    return;
  }
  const rows = Object.entries(usage.jobs).map(([id, store]) => h("tr", {},
    h("td", {}, h("a", { href: `#/jobs/${id}` }, id.slice(0, 12))),
    h("td", {}, bytes(store.bytes_on_disk)), h("td", {}, store.files), h("td", {}, store.reloads ?? 0),
    h("td", {}, bytes(store.bytes_read ?? 0))));
  refill(main, h("h1", {}, "Offload directory"),
    h("p", {}, `free disk ${bytes(usage.free_disk_bytes)} of ${bytes(usage.disk_total_bytes)}`,
      usage.quota_bytes_per_job ? ` · quota per job ${bytes(usage.quota_bytes_per_job)}` : ""),
    h("h2", {}, "Total"), keyValues(usage.total),
    h("h2", {}, "Per job"),
    rows.length ? table(["job", "bytes on disk", "files", "reloads", "bytes read"], rows) : h("p", {}, "No offload directory on disk."));
}

// ---- routing -------------------------------------------------------------------------------

async function route() {
  viewAbort.abort();
  viewAbort = new AbortController();
  const [path, query] = (location.hash.slice(1) || "/jobs").split("?");
  const params = new URLSearchParams(query ?? "");
  const parts = path.split("/").filter(Boolean);
  for (const link of document.querySelectorAll("[data-nav]")) {
    link.classList.toggle("active", link.dataset.nav === parts[0]);
  }
  try {
    if (parts[0] === "jobs" && parts[1]) await jobView(decodeURIComponent(parts[1]));
    else if (parts[0] === "submit") await submitView();
    else if (parts[0] === "offload") await offloadView();
    else await jobsView(params);
  } catch (error) {
    if (error instanceof ApiProblem && error.status === 401) signInView(error);
    else if (!viewAbort.signal.aborted) main.replaceChildren(problemBox(error));
  }
}

async function start() {
  try {
    await whoAmI();
  } catch (error) {
    if (error instanceof ApiProblem && error.status === 401) {
      if (getKey()) setKey(null);
      signInView(getKey() === null && error.problem.detail?.includes("not valid") ? error : null);
      return;
    }
    main.replaceChildren(problemBox(error));
    return;
  }
  await route();
}

document.getElementById("signout").addEventListener("click", () => {
  setKey(null);
  location.hash = "#/jobs";
  location.reload();
});
window.addEventListener("hashchange", route);
start();
