// The page's only way to reach the service: every call carries the key from sessionStorage
// as a bearer header, never in a URL (URLs end up in logs, history and Referer headers).

const KEY = "modelprep.key";

export function getKey() {
  return sessionStorage.getItem(KEY);
}

export function setKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

/** An error answer of the API: its RFC 9457 problem document, kept whole. */
export class ApiProblem extends Error {
  constructor(status, problem) {
    super(problem.detail || problem.title || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
  }
}

function headers(extra = {}) {
  const key = getKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function raiseFor(response) {
  if (response.ok) return response;
  let problem;
  try {
    problem = await response.json();
  } catch {
    problem = { title: response.statusText, detail: `HTTP ${response.status}` };
  }
  throw new ApiProblem(response.status, problem);
}

/** A JSON call to the API; throws ApiProblem for an error answer. */
export async function api(path, { method = "GET", body, signal } = {}) {
  const init = { method, signal, headers: headers({ Accept: "application/json" }) };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await raiseFor(await fetch(path, init));
  return response.status === 204 ? null : response.json();
}

/** Fetch a file with the key and hand it to the browser as a download (a blob: URL). */
export async function download(path, filename) {
  const response = await raiseFor(await fetch(path, { headers: headers() }));
  const url = URL.createObjectURL(await response.blob());
  const link = document.createElement("a");
  link.href = url;
  link.download = filename;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
}

/** Parse Server-Sent Events from a fetch() body (EventSource cannot send a header). */
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const event = { event: "message", data: [], id: null };
      for (const line of block.split("\n")) {
        if (!line || line.startsWith(":")) continue; // a comment: the server's keep-alive ping
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "data") event.data.push(value);
        else if (field === "event") event.event = value;
        else if (field === "id") event.id = value;
      }
      if (event.data.length) yield { ...event, data: event.data.join("\n") };
    }
  }
}

const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

/**
 * Follow a job's /events stream, calling onState(jobEvent) for each state, until the job ends
 * or signal aborts. Reconnects after a dropped connection with Last-Event-ID (each event is the
 * whole state, so nothing is lost), backing off up to 30 s so a down service is not hammered.
 */
export async function followJob(jobId, onState, signal) {
  let lastId = null;
  let delay = 1000;
  while (!signal.aborted) {
    try {
      const extra = { Accept: "text/event-stream" };
      if (lastId) extra["Last-Event-ID"] = lastId;
      const response = await raiseFor(
        await fetch(`/v1/jobs/${encodeURIComponent(jobId)}/events`, { headers: headers(extra), signal }),
      );
      for await (const event of sseEvents(response.body)) {
        lastId = event.id ?? lastId;
        delay = 1000;
        const state = JSON.parse(event.data);
        onState(state);
        if (TERMINAL.has(state.status)) return;
      }
    } catch (error) {
      if (signal.aborted) return;
      if (error instanceof ApiProblem && error.status < 500 && error.status !== 429) throw error;
    }
    await new Promise((resolve) => setTimeout(resolve, delay));
    delay = Math.min(delay * 2, 30_000);
  }
}

export function isTerminal(status) {
  return TERMINAL.has(status);
}
