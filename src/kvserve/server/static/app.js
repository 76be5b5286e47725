// kvserve's web view: the KV calculator, the live block pool and a chat box, in plain JS.
//
// Everything it shows comes from this server: GET /v1/kv_state (server/kv_state.py) every
// POLL_MS (BUSY_POLL_MS while this page's chat turn runs, to show its blocks filling), and
// POST /v1/chat/completions. Both need the API key when the server has one: on a
// 401 the page asks for it, keeps it in sessionStorage and sends it as "Authorization: Bearer".
"use strict";

const KEY_STORAGE = "kvserve.apiKey";
const POLL_MS = 500;
const BUSY_POLL_MS = 100;
const BLOCK = { FREE: 0, USED: 1, CACHED: 2 }; // kv_state.BlockState
const COLOURS = { free: "#e6e8eb", cached: "#7d8fa3" };

const $ = (id) => document.getElementById(id);

class AuthNeeded extends Error {}

// -- the API ----------------------------------------------------------------------------------

async function api(path, init = {}) {
  const headers = new Headers(init.headers || {});
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const response = await fetch(path, { ...init, headers });
  if (response.status === 401) {
    askForKey(key !== null);
    throw new AuthNeeded();
  }
  return response;
}

async function errorText(response) {
  try {
    return (await response.json()).error.message;
  } catch {
    return `HTTP ${response.status}`;
  }
}

function askForKey(wrong) {
  setStatus(wrong ? "that API key was refused: enter another" : "this server needs an API key");
  const form = $("key-form");
  if (form.hidden) {
    form.hidden = false;
    $("key-input").focus();
  }
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("key-input").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORAGE, key);
  $("key-input").value = "";
  $("key-form").hidden = true;
  refreshNow();
});

function setStatus(text) {
  $("status").textContent = text;
}

// -- formatting -------------------------------------------------------------------------------

const int = (n) => n.toLocaleString("en-US");

function scaled(n, base, units) {
  let i = 0;
  while (n >= base && i < units.length - 1) {
    n /= base;
    i += 1;
  }
  return `${n.toFixed(2)} ${units[i]}`;
}

// "1,073,741,824 B (1.07 GB, 1.00 GiB)": exact, then as decimal and binary units
function bytes(n) {
  if (n < 1000) return `${int(n)} B`;
  const si = scaled(n, 1000, ["B", "kB", "MB", "GB", "TB", "PB"]);
  const bin = scaled(n, 1024, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]);
  return `${int(n)} B (${si}, ${bin})`;
}

const ms = (s) => (s === null || s === undefined ? "–" : `${(s * 1000).toFixed(1)} ms`);
const percent = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);

// -- the calculator ---------------------------------------------------------------------------

const calc = { table: null, headDims: [], blockSize: 16 };

// a slider and its number box, kept equal; returns a getter
function pair(name) {
  const range = $(`calc-${name}`);
  const box = $(`calc-${name}-n`);
  range.addEventListener("input", () => {
    box.value = range.value;
    recompute();
  });
  box.addEventListener("input", () => {
    if (box.value === "") return;
    if (Number(box.value) > Number(range.max)) range.max = box.value;
    range.value = box.value;
    recompute();
  });
  return {
    get: () => Number(box.value),
    set: (v) => {
      if (v > Number(range.max)) range.max = String(v);
      range.value = String(v);
      box.value = String(v);
    },
  };
}

const layers = pair("layers");
const kvHeads = pair("kv-heads");
const context = pair("context");
const users = pair("users");
const memory = pair("memory");

$("calc-head-dim").addEventListener("input", recompute);
$("calc-k-dtype").addEventListener("change", recompute);
$("calc-v-dtype").addEventListener("change", recompute);

function headDim() {
  return calc.headDims[Number($("calc-head-dim").value)];
}

function prefillCalculator(state) {
  calc.spec = state.spec;
  calc.maxModelLen = state.max_model_len;
  calc.table = state.cache_dtypes;
  calc.blockSize = state.spec.block_size;
  const names = Object.keys(calc.table);
  calc.headDims = Object.keys(calc.table[names[0]]).map(Number).sort((a, b) => a - b);
  const slider = $("calc-head-dim");
  slider.max = String(calc.headDims.length - 1);
  slider.value = String(Math.max(0, calc.headDims.indexOf(state.spec.head_dim)));
  for (const [id, chosen] of [
    ["calc-k-dtype", state.spec.k_cache_dtype],
    ["calc-v-dtype", state.spec.v_cache_dtype],
  ]) {
    const select = $(id);
    select.replaceChildren(...names.map((n) => new Option(n, n, false, n === chosen)));
  }
  layers.set(state.spec.num_layers);
  kvHeads.set(state.spec.num_kv_heads);
  context.set(state.max_model_len);
  recompute();
}

function recompute() {
  $("calc-head-dim-n").textContent = calc.headDims.length ? String(headDim()) : "–";
  if (!calc.table) return;
  const outputs = ["calc-per-token", "calc-per-request", "calc-total", "calc-fit"];
  if ([layers, kvHeads, context, users, memory].some((p) => !(p.get() >= 1))) {
    for (const id of outputs) $(id).textContent = "– (every figure must be at least 1)";
    return;
  }
  const d = headDim();
  const k = $("calc-k-dtype").value;
  const v = $("calc-v-dtype").value;
  const kb = calc.table[k][d];
  const vb = calc.table[v][d];
  if (kb === undefined || vb === undefined) {
    $("calc-per-token").textContent = `${kb === undefined ? k : v} cannot hold head dim ${d}`;
    for (const id of outputs.slice(1)) $(id).textContent = "–";
    return;
  }
  const perToken = layers.get() * kvHeads.get() * (kb + vb);
  const perRequest = perToken * context.get();
  // the pool hands out whole blocks: a request holds ceil(context / block size) of them
  const allocated = Math.ceil(context.get() / calc.blockSize) * calc.blockSize * perToken;
  const device = memory.get() * 2 ** 30;
  const fit = Math.floor(device / allocated);
  $("calc-per-token").textContent =
    `${bytes(perToken)} = ${layers.get()} × ${kvHeads.get()} × (${kb} + ${vb})`;
  $("calc-per-request").textContent = bytes(perRequest);
  $("calc-total").textContent = bytes(perRequest * users.get());
  const fitText = $("calc-fit");
  fitText.textContent =
    `${int(fit)} in ${memory.get()} GiB (${bytes(allocated)} each, in whole blocks of ` +
    `${calc.blockSize} tokens)`;
  fitText.classList.toggle("over", users.get() > fit);
}

// -- what a text costs: its tokens under the served tokenizer, at the served cache layout ---

async function costText() {
  const text = $("cost-text").value;
  const out = $("cost-out");
  if (!calc.spec || !text.trim()) return;
  const response = await api("/tokenize", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ prompt: text, add_special_tokens: false }),
  });
  if (!response.ok) {
    out.textContent = await errorText(response);
    return;
  }
  const tokens = (await response.json()).count;
  const words = text.trim().split(/\s+/).length;
  const exact = tokens * calc.spec.bytes_per_token;
  const blocks = Math.ceil(tokens / calc.blockSize);
  const share = (100 * tokens) / calc.maxModelLen;
  out.dataset.tokens = String(tokens);
  out.textContent =
    `${int(tokens)} tokens, ${int(words)} words (${(tokens / words).toFixed(2)} tokens per ` +
    `word); it holds ${bytes(exact)} of KV (${bytes(blocks * calc.spec.bytes_per_block)} in ` +
    `${int(blocks)} blocks), ${share.toFixed(2)}% of the ${int(calc.maxModelLen)}-token context`;
}
$("cost-go").addEventListener("click", costText);

// -- the block pool ---------------------------------------------------------------------------

const pool = { state: null, cell: 0, cols: 0 };

// a stable colour per request id (FNV-1a -> hue)
function requestColour(id) {
  let h = 0x811c9dc5;
  for (let i = 0; i < id.length; i += 1) {
    h ^= id.charCodeAt(i);
    h = Math.imul(h, 0x01000193) >>> 0;
  }
  return `hsl(${h % 360}, 70%, 48%)`;
}

function holders(state, block) {
  return (state.block_requests[String(block)] || []).map((i) => state.requests[i]);
}

function drawPool(state) {
  const canvas = $("pool-canvas");
  const width = canvas.parentElement.clientWidth;
  const n = state.num_blocks;
  // cells as large as fit in ~320 px of height, between 3 and 18 px
  const cell = Math.max(3, Math.min(18, Math.floor(Math.sqrt((width * 320) / n))));
  const cols = Math.max(1, Math.floor(width / cell));
  const rows = Math.ceil(n / cols);
  const dpr = window.devicePixelRatio || 1;
  canvas.style.width = `${cols * cell}px`;
  canvas.style.height = `${rows * cell}px`;
  canvas.width = cols * cell * dpr;
  canvas.height = rows * cell * dpr;
  const ctx = canvas.getContext("2d");
  ctx.scale(dpr, dpr);
  const gap = cell >= 6 ? 1 : 0;
  const colours = state.requests.map(requestColour);
  for (let b = 0; b < n; b += 1) {
    const s = state.blocks[b];
    if (s === BLOCK.USED) ctx.fillStyle = colours[state.block_requests[String(b)][0]];
    else ctx.fillStyle = s === BLOCK.CACHED ? COLOURS.cached : COLOURS.free;
    ctx.fillRect((b % cols) * cell, Math.floor(b / cols) * cell, cell - gap, cell - gap);
  }
  pool.cell = cell;
  pool.cols = cols;
}

$("pool-canvas").addEventListener("mousemove", (event) => {
  const state = pool.state;
  if (!state || !pool.cell) return;
  const rect = event.target.getBoundingClientRect();
  const col = Math.floor((event.clientX - rect.left) / pool.cell);
  const row = Math.floor((event.clientY - rect.top) / pool.cell);
  const b = row * pool.cols + col;
  if (col >= pool.cols || b >= state.num_blocks) return;
  const s = state.blocks[b];
  const what =
    s === BLOCK.USED
      ? `in use by ${holders(state, b).join(", ")}`
      : s === BLOCK.CACHED
        ? "cached: a prefix-cache hit until evicted"
        : "free";
  $("pool-hover").textContent = `block ${b}: ${what}`;
});

function renderPool(state) {
  const spec = state.spec;
  $("pool-shape").textContent =
    `${int(state.num_blocks)} blocks × ${spec.block_size} tokens, ${bytes(spec.bytes_per_block)} ` +
    `each (${spec.num_layers} layers × ${spec.num_kv_heads} KV heads × ${spec.head_dim}, ` +
    `${spec.cache_dtype}; ${int(spec.bytes_per_token)} B per token)`;
  const st = state.stats;
  $("pool-free").textContent = int(st.num_free_blocks);
  $("pool-used").textContent = int(st.num_used_blocks);
  $("pool-cached").textContent = int(st.num_cached_blocks);
  drawPool(state);
  const counts = new Map(state.requests.map((id) => [id, 0]));
  for (const holding of Object.values(state.block_requests)) {
    for (const i of holding) counts.set(state.requests[i], counts.get(state.requests[i]) + 1);
  }
  $("pool-requests").replaceChildren(
    ...state.requests.map((id) => {
      const item = document.createElement("li");
      const swatch = document.createElement("i");
      swatch.className = "swatch";
      swatch.style.background = requestColour(id);
      item.append(swatch, `${id}: ${counts.get(id)} blocks`);
      return item;
    }),
  );
  $("stat-usage").textContent =
    `${percent(st.kv_cache_usage)} (${int(st.num_used_blocks)} / ${int(state.num_blocks)})`;
  $("stat-hit-rate").textContent =
    st.prefix_cache_hit_rate === null
      ? "– (no lookups yet)"
      : `${percent(st.prefix_cache_hit_rate)} (${int(st.prefix_cache_hits)} / ` +
        `${int(st.prefix_cache_queries)} tokens)`;
  $("stat-running").textContent = `${st.num_running} / ${st.num_waiting}`;
  $("stat-preemptions").textContent = int(st.num_preemptions);
  const lat = state.latency;
  if (lat) {
    // medians over the last (up to lat.window) finished requests, and the latest one
    const summary = (median, last, n) =>
      n === 0 ? "– (none finished yet)"
        : `${ms(median)}, ${ms(last)} (last ${n} request${n === 1 ? "" : "s"})`;
    $("stat-ttft").textContent = summary(lat.ttft_median_s, lat.ttft_last_s, lat.num_ttft);
    $("stat-tpot").textContent = summary(lat.tpot_median_s, lat.tpot_last_s, lat.num_tpot);
  }
}

// -- polling ----------------------------------------------------------------------------------

const poller = { timer: null, busy: false, again: false, chatting: false };
const pollInterval = () => (poller.chatting ? BUSY_POLL_MS : POLL_MS);

async function poll() {
  if (poller.busy) {
    poller.again = true; // a refresh asked for while one is in flight runs right after it
    return;
  }
  poller.busy = true;
  clearTimeout(poller.timer);
  let schedule = true;
  try {
    const response = await api("/v1/kv_state");
    if (!response.ok) {
      setStatus(`/v1/kv_state: ${await errorText(response)}`);
    } else {
      const state = await response.json();
      const first = pool.state === null;
      pool.state = state;
      if (first) prefillCalculator(state);
      $("model-name").textContent = state.model;
      renderPool(state);
      setStatus(`live: refreshed every ${pollInterval()} ms`);
    }
  } catch (err) {
    if (err instanceof AuthNeeded) schedule = false; // resumes when a key is given
    else setStatus(`the server did not answer: ${err.message}`);
  } finally {
    poller.busy = false;
  }
  if (poller.again) {
    poller.again = false;
    poll();
  } else if (schedule) {
    poller.timer = setTimeout(poll, pollInterval());
  }
}

function refreshNow() {
  poll();
}

window.addEventListener("resize", () => pool.state && drawPool(pool.state));

// -- chat -------------------------------------------------------------------------------------

const conversation = []; // {role, content}, kept here: the server keeps no sessions

function addTurn(role, text) {
  const turn = document.createElement("div");
  turn.className = `turn ${role}`;
  const body = document.createElement("p");
  body.textContent = text;
  turn.append(body);
  $("chat-log").append(turn);
  turn.scrollIntoView({ block: "nearest" });
  return turn;
}

function usageLine(usage) {
  const cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
  const line = document.createElement("p");
  line.className = "usage";
  line.dataset.promptTokens = String(usage.prompt_tokens);
  line.dataset.cachedTokens = String(cached);
  line.dataset.computedTokens = String(usage.prompt_tokens - cached);
  line.textContent =
    `prompt ${int(usage.prompt_tokens)} tokens: ${int(cached)} from the cache, ` +
    `${int(usage.prompt_tokens - cached)} computed · ${int(usage.completion_tokens)} generated`;
  return line;
}

$("chat-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text) return;
  const send = $("chat-send");
  send.disabled = true;
  poller.chatting = true;
  conversation.push({ role: "user", content: text });
  const userTurn = addTurn("user", text);
  const body = { messages: conversation, max_tokens: Number($("chat-max-tokens").value) || 128 };
  if (pool.state) body.model = pool.state.model;
  if ($("chat-ignore-eos").checked) body.ignore_eos = true;
  try {
    const request = api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    refreshNow(); // show the blocks this turn takes while it runs
    const response = await request;
    if (!response.ok) throw new Error(await errorText(response));
    const reply = await response.json();
    const content = reply.choices[0].message.content || "";
    conversation.push({ role: "assistant", content });
    const turn = addTurn("assistant", content);
    turn.append(usageLine(reply.usage));
    $("chat-input").value = "";
  } catch (err) {
    conversation.pop(); // the turn did not happen: send it again later
    userTurn.remove();
    if (!(err instanceof AuthNeeded)) addTurn("error", err.message);
  } finally {
    send.disabled = false;
    poller.chatting = false;
    refreshNow();
  }
});

$("chat-reset").addEventListener("click", () => {
  conversation.length = 0;
  $("chat-log").replaceChildren();
});

recompute();
poll();
