// streamchat's web page: a Realtime-protocol chat client for the daemon that serves it.
//
// Speaks docs/protocol.md over ws(s)://<this host>/v1/realtime. The daemon
// shows a session's resume token once (session.created), so the page keeps
// it in localStorage and resumes the session after a reload
// (streamchat.session.resume). The daemon does not send a transcript on
// resume, so the page keeps the messages it has shown there too.
// Model text only ever reaches the page through text nodes, never as HTML.
"use strict";

const KEYS = {
  session: "streamchat.session",        // {id, resume_token}
  transcript: "streamchat.transcript",  // {session_id, messages: [{role, text, status, meta}]}
  settings: "streamchat.settings",      // the sampling fields and the API key
};
// Sent in response.create only when set; numbers are checked by the daemon.
const SAMPLING = ["temperature", "top_p", "max_output_tokens", "min_p",
                  "frequency_penalty", "presence_penalty", "repetition_penalty"];
const ENDED = {cancelled: "stopped", incomplete: "cut short: max_output_tokens", failed: "failed",
               interrupted: "connection lost"};

const $ = (id) => document.getElementById(id);
const state = {
  ws: null, session: null, fresh: null, resumeId: null, capacity: 0, messages: [], reply: null,
  statsPending: false, statsAgain: false, statsTimer: null, retries: 0, nextId: 0, closeNote: null,
};

// -- storage -----------------------------------------------------------------------

function load(key) {
  try { return JSON.parse(localStorage.getItem(key)); } catch { return null; }
}

function store(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch {  // over the quota: keep the recent half of the transcript
    if (key === KEYS.transcript && value.messages.length > 1) {
      store(key, {...value, messages: value.messages.slice(value.messages.length >> 1)});
    }
  }
}

function saveTranscript() {
  if (state.session) store(KEYS.transcript, {session_id: state.session.id, messages: state.messages});
}

function saveSettings() {
  const settings = {api_key: $("api-key").value};
  for (const name of SAMPLING) settings[name] = $(name).value;
  store(KEYS.settings, settings);
}

function loadSettings() {
  const settings = load(KEYS.settings) || {};
  $("api-key").value = settings.api_key || "";
  for (const name of SAMPLING) $(name).value = settings[name] || "";
}

// -- the connection ------------------------------------------------------------------

function connect() {
  if (state.ws) { state.ws.onclose = null; state.ws.close(1000); }
  state.ws = null;
  state.session = null;
  state.statsPending = false;
  setReady(false);
  setStatus("connecting…");
  const protocols = ["realtime"];
  const key = $("api-key").value.trim();
  if (key) protocols.push("openai-insecure-api-key." + key);
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  let ws;
  try {
    // A session to resume is named in the URL too, so a proxy in front of a fleet routes it home.
    const saved = load(KEYS.session);
    const query = saved && saved.id && saved.resume_token ? `?session_id=${encodeURIComponent(saved.id)}` : "";
    ws = new WebSocket(`${scheme}//${location.host}/v1/realtime${query}`, protocols);
  } catch (err) {
    setStatus(`cannot connect: ${err.message}`, "bad");
    return;
  }
  state.ws = ws;
  ws.onmessage = (m) => onEvent(JSON.parse(m.data));
  ws.onclose = (e) => onClose(e);
}

function onClose(event) {
  const hadSession = state.session !== null;
  state.ws = null;
  state.session = null;
  setReady(false);
  if (state.reply) endReply("interrupted", null);
  if (state.closeNote) {
    setStatus(state.closeNote, "bad");
    state.closeNote = null;
  } else if (!hadSession) {
    // The handshake failed: the daemon answered 401 or 403, or is down. The
    // browser does not say which; the daemon's log does.
    setStatus("could not connect: is the daemon running, and is the API key right?", "bad");
  } else {
    setStatus(`disconnected (${event.code}); reconnecting…`, "bad");
  }
  const delay = Math.min(1000 * 2 ** state.retries, 15000);
  state.retries += 1;
  setTimeout(() => { if (!state.ws) connect(); }, delay);
}

function send(event) {
  event.event_id = `web_${state.nextId++}`;
  state.ws.send(JSON.stringify(event));
  return event.event_id;
}

function onEvent(e) {
  switch (e.type) {
    case "session.created": return onCreated(e.session);
    case "streamchat.session.resumed":
      return adopt(e.session, load(KEYS.session).resume_token, `resumed (from ${e.restored_from})`);
    case "session.updated":
      $("instructions").value = e.session.instructions || "";
      return setStatus("system prompt set");
    case "response.created":
      if (state.reply) state.reply.responseId = e.response.id;
      return;
    case "response.output_text.delta":
      if (state.reply) appendText(state.reply, e.delta);
      return;
    case "response.done": return onResponseDone(e.response);
    case "streamchat.session.stats": return showStats(e);
    case "error": return onError(e.error);
  }
}

function onCreated(session) {
  state.fresh = session;
  const saved = load(KEYS.session);
  if (saved && saved.id && saved.resume_token) {
    setStatus("resuming…");
    state.resumeId = send({type: "streamchat.session.resume", session_id: saved.id,
                           resume_token: saved.resume_token});
  } else {
    adopt(session, session.resume_token, "new session");
  }
}

function adopt(session, token, note) {
  state.session = session;
  state.retries = 0;
  store(KEYS.session, {id: session.id, resume_token: token});
  const transcript = load(KEYS.transcript);
  state.messages = transcript && transcript.session_id === session.id ? transcript.messages : [];
  for (const msg of state.messages) if (msg.status === "in_progress") msg.status = "interrupted";
  saveTranscript();
  $("log").replaceChildren(...state.messages.map(messageNode));
  $("session-id").textContent = session.id;
  $("model").textContent = session.model;
  const t = session.truncation || {};
  state.capacity = (t.sink_tokens || 0) + (t.window_tokens || 0);
  setReady(true);
  setStatus(note, "good");
  const typed = $("instructions").value.trim();
  if (note === "new session" && typed) setInstructions();
  else $("instructions").value = session.instructions || "";
  requestStats();
  scrollDown();
}

function onError(error) {
  if (error.event_id && error.event_id === state.resumeId) {
    state.resumeId = null;
    if (error.code === "session_not_found") {
      return adopt(state.fresh, state.fresh.resume_token, "the last session is gone; new session");
    }
    state.closeNote = `could not resume: ${error.message}; retrying`;
    return state.ws.close(1000);  // onClose retries later; the saved session is kept
  }
  if (state.reply && error.event_id === state.reply.requestId) endReply("failed", null, error.message);
  setStatus(`${error.code}: ${error.message}`, "bad");
}

// -- messages ----------------------------------------------------------------------

function messageNode(msg) {
  const li = document.createElement("li");
  li.className = `msg ${msg.role}`;
  const text = document.createElement("div");
  text.className = "text";
  text.append(document.createTextNode(msg.text));
  const meta = document.createElement("div");
  meta.className = "meta";
  li.append(text, meta);
  showMeta(li, msg);
  return li;
}

function showMeta(li, msg) {
  const parts = [];
  if (ENDED[msg.status]) parts.push(ENDED[msg.status] + (msg.error ? `: ${msg.error}` : ""));
  if (msg.meta) parts.push(msg.meta);
  li.lastChild.textContent = parts.join(" · ");
  li.dataset.status = msg.status;
}

function addMessage(msg) {
  state.messages.push(msg);
  const node = messageNode(msg);
  $("log").append(node);
  scrollDown();
  return {msg, node, textNode: node.firstChild.firstChild};
}

function appendText(reply, delta) {
  reply.msg.text += delta;
  reply.textNode.appendData(delta);
  scrollDown();
}

function scrollDown() {
  const log = $("log");
  log.scrollTop = log.scrollHeight;
}

// -- a turn ------------------------------------------------------------------------

function sendMessage() {
  const text = $("input").value;
  if (!text.trim() || state.reply || !state.session) return;
  let options;
  try {
    options = responseOptions();
  } catch (err) {
    return setStatus(err.message, "bad");
  }
  $("input").value = "";
  addMessage({role: "user", text, status: "completed"});
  saveTranscript();
  send({type: "conversation.item.create",
        item: {type: "message", role: "user", content: [{type: "input_text", text}]}});
  state.reply = addMessage({role: "assistant", text: "", status: "in_progress"});
  state.reply.requestId = send({type: "response.create", response: options});
  setBusy(true);
  state.statsTimer = setInterval(requestStats, 1000);
}

function responseOptions() {
  const options = {};
  for (const name of SAMPLING) {
    const raw = $(name).value.trim();
    if (raw === "") continue;
    const value = Number(raw);
    if (!Number.isFinite(value)) throw new Error(`${name} must be a number`);
    if (name === "max_output_tokens" && !Number.isInteger(value)) {
      throw new Error("max_output_tokens must be a whole number");
    }
    options[name] = value;
  }
  return options;
}

function onResponseDone(response) {
  if (!state.reply) return;
  const u = response.usage;
  let meta = null;
  if (u) {
    const timing = u.timing || {};
    meta = `${u.output_tokens} tokens`;
    if (timing.ttft_ms != null) meta += ` · first token ${Math.round(timing.ttft_ms)} ms`;
    if (timing.output_tokens_per_s != null) meta += ` · ${timing.output_tokens_per_s.toFixed(1)} tokens/s`;
    meta += ` · ${u.input_token_details.cached_tokens} of ${u.input_tokens} input tokens cached`;
    $("stat-reply").textContent = meta;
  }
  const details = response.status_details || {};
  endReply(response.status, meta, details.error ? details.error.message : null);
}

function endReply(status, meta, error) {
  const reply = state.reply;
  state.reply = null;
  clearInterval(state.statsTimer);
  reply.msg.status = status;
  reply.msg.meta = meta;
  if (error) reply.msg.error = error;
  showMeta(reply.node, reply.msg);
  saveTranscript();
  setBusy(false);
  if (state.session) requestStats();
}

function stopReply() {
  if (state.reply && state.session) send({type: "response.cancel"});
}

function setInstructions() {
  if (!state.session || state.reply) return;
  send({type: "session.update", session: {type: "realtime", instructions: $("instructions").value}});
}

function newSession() {
  if (state.reply) return;
  localStorage.removeItem(KEYS.session);
  localStorage.removeItem(KEYS.transcript);
  connect();
}

// -- figures -----------------------------------------------------------------------

function requestStats() {
  if (!state.session) return;
  if (state.statsPending) {  // one at a time; ask again once it is answered
    state.statsAgain = true;
    return;
  }
  state.statsPending = true;
  state.statsAgain = false;
  send({type: "streamchat.session.stats"});
}

function showStats(s) {
  state.statsPending = false;
  if (state.statsAgain) requestStats();
  $("stat-context").textContent = s.context_tokens;
  $("stat-capacity").textContent = state.capacity || "–";
  $("context-fill").max = state.capacity || 1;
  $("context-fill").value = Math.min(s.context_tokens, state.capacity || 0);
  $("stat-total").textContent = s.total_tokens;
  $("stat-evicted").textContent = s.evicted_tokens;
  $("stat-cached").textContent = s.cached_tokens;
  const prefix = s.prefix || {};
  $("stat-prefix").textContent = `${prefix.hit_tokens} of ${prefix.queried_tokens} tokens`;
  $("stat-tier").textContent = s.tier + (s.on_disk ? " (saved on disk)" : "");
  $("stat-blocks").textContent = `${s.blocks.owned} owned, ${s.blocks.shared} shared`;
  $("stat-kv").textContent = formatBytes(s.kv_bytes);
}

function formatBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  for (; n >= 1024 && i < units.length - 1; i++) n /= 1024;
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

// -- the page ----------------------------------------------------------------------

function setStatus(text, kind) {
  $("status").textContent = text;
  $("status").dataset.kind = kind || "";
}

function setReady(ready) {
  for (const id of ["send", "new-session", "set-instructions"]) $(id).disabled = !ready;
  if (!ready) $("stop").disabled = true;
}

function setBusy(busy) {
  const idle = !busy && state.session !== null;
  for (const id of ["send", "new-session", "set-instructions"]) $(id).disabled = !idle;
  $("stop").disabled = !busy;
}

function start() {
  loadSettings();
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); sendMessage(); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); sendMessage(); }
  });
  $("stop").addEventListener("click", stopReply);
  $("new-session").addEventListener("click", newSession);
  $("set-instructions").addEventListener("click", setInstructions);
  $("reconnect").addEventListener("click", () => { state.retries = 0; connect(); });
  for (const name of [...SAMPLING, "api-key"]) $(name).addEventListener("change", saveSettings);
  window.addEventListener("pagehide", saveTranscript);  // keeps a reply cut by the reload
  connect();
}

start();
