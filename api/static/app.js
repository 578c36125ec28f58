// The vsrq web app: a client of the public API, nothing more. The key is sent only as `Authorization: Bearer`;
// videos are shown from blob: URLs (the output fetched with that header, the input kept from the dropped file), so no
// key or signed URL ever lands in a page address, a log or the browser history.
"use strict";

const KEY = "vsrq.key";
const ACTIVE = new Set(["queued", "in_progress"]);
const STATUS_LABEL = {queued: "Queued", in_progress: "Running", completed: "Completed", failed: "Failed", cancelled: "Cancelled"};
const STAGE_LABEL = {probing: "Reading input", upscaling: "Upscaling", encoding: "Encoding", uploading: "Saving result"};
const POLL_ACTIVE_MS = 1000;
const POLL_IDLE_MS = 5000;
const KEEP_INPUT_BYTES = 2 ** 30; // originals up to 1 GiB are kept in this browser for the comparison
const LIST_PAGE = 50; // the newest jobs listed, and how many more "Show older jobs" adds
const ACTIVE_MOST = 100; // queued (the next to run first) and running jobs listed beside them however old: a page each

const $ = (id) => document.getElementById(id);
// `open`: the workspace is shown, with `key`, or with none where the service asks for none (auth off)
// `session` counts sign-ins and -outs: a list fetched for an earlier one is dropped; one `poll` runs at a time
const state = {
  key: null, open: false, session: 0, polling: false, pollAgain: false, listed: LIST_PAGE, picked: null,
  pickedMedia: null, jobs: new Map(), outputs: new Map(), comparing: null, compareFrom: null, timer: null, upload: null,
  qualities: new Map(),  // model -> the quality tiers its workers run (`loadQualities`)
};
const REDUCED_MOTION = window.matchMedia("(prefers-reduced-motion: reduce)");

// -- small helpers -------------------------------------------------------------------------------------------------

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  node.append(...children.filter((child) => child !== null && child !== undefined));
  return node;
}

function bytes(n) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return `${n.toFixed(n < 10 && i ? 1 : 0)} ${units[i]}`;
}

function clock(seconds) {
  const s = Math.max(0, Math.floor(seconds || 0));
  return `${Math.floor(s / 60)}:${String(s % 60).padStart(2, "0")}`;
}

// The worker's estimate of its engine's end (the job's `eta`), as a person reads a wait.
function timeLeft(eta) {
  const minutes = (eta - Date.now() / 1000) / 60;
  if (minutes < 1) return "under a minute left";
  return minutes < 90 ? `about ${Math.round(minutes)} min left` : `about ${(minutes / 60).toFixed(1)} h left`;
}

const relative = new Intl.RelativeTimeFormat(undefined, {numeric: "auto"});
function ago(unixSeconds) {
  const seconds = Math.round(unixSeconds - Date.now() / 1000);
  const [value, unit] = Math.abs(seconds) < 60 ? [seconds, "second"] : Math.abs(seconds) < 3600
    ? [Math.round(seconds / 60), "minute"] : Math.abs(seconds) < 86400 ? [Math.round(seconds / 3600), "hour"]
    : [Math.round(seconds / 86400), "day"];
  return relative.format(value, unit);
}

let toastTimer;
function toast(message, kind = "info") {
  const box = $("toast");
  box.textContent = message;
  box.dataset.kind = kind;
  box.classList.add("show");
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => box.classList.remove("show"), 5000);
}

function fail(error) {
  // fetch's own TypeError ("Failed to fetch", Firefox's "NetworkError…") is the network's, not the service's answer
  const unreachable = error instanceof TypeError && /fetch|network/i.test(error.message);
  toast(unreachable ? "Cannot reach the service: check the connection and try again." : error.message || String(error),
    "error");
}

// Said to screen readers: what changed where a person is not looking (a job that ended).
function announce(message) {
  $("announce").textContent = message;
}

// -- the API -------------------------------------------------------------------------------------------------------

// The API's words mark names as code, in backticks (`clip.mp4` is a text file): shown here as the names themselves
const readable = (text) => String(text).replace(/`([^`]*)`/g, "$1");

class ApiError extends Error {
  constructor(status, body) {
    super(readable((body && (body.detail || body.title)) || `The service answered ${status}.`));
    this.status = status;
    this.body = body;
  }
}

function authorization() {
  return state.key ? {Authorization: `Bearer ${state.key}`} : {};
}

function refused() {
  signOut(state.key ? "The service did not accept this key; enter it again." : "");
}

async function api(path, options = {}) {
  const response = await fetch(path, {...options, headers: {...options.headers, ...authorization()}});
  if (response.ok) return response;
  let body = null;
  try { body = await response.json(); } catch { /* not problem+json: the status says enough */ }
  if (response.status === 401) refused();
  throw new ApiError(response.status, body);
}

// Originals are kept in IndexedDB, so the comparison survives a reload.
const originals = (() => {
  let opened = null;
  const open = () => opened ??= new Promise((resolve, reject) => {
    const request = indexedDB.open("vsrq", 1);
    request.onupgradeneeded = () => request.result.createObjectStore("inputs");
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
  const run = async (mode, action) => {
    const db = await open();
    return new Promise((resolve, reject) => {
      const transaction = db.transaction("inputs", mode);
      const request = action(transaction.objectStore("inputs"));
      transaction.oncomplete = () => resolve(request.result);
      transaction.onerror = () => reject(transaction.error);
    });
  };
  const memory = new Map();
  return {
    async put(id, file) {
      memory.set(id, file);
      if (file.size <= KEEP_INPUT_BYTES) await run("readwrite", (store) => store.put(file, id)).catch(() => {});
    },
    async get(id) {
      return memory.get(id) || await run("readonly", (store) => store.get(id)).catch(() => undefined);
    },
    async delete(id) {
      memory.delete(id);
      await run("readwrite", (store) => store.delete(id)).catch(() => {});
    },
  };
})();

// Originals of this key's jobs the service no longer has (deleted elsewhere, expired while listed) go: up to 1 GiB
// each stayed in the browser. Only jobs this key listed: another key's are another owner's, 404 to this one.
async function forgetGone(ids) {
  for (const id of ids) {
    try {
      await api(`/v1/videos/${encodeURIComponent(id)}`);
    } catch (error) {
      if (error.status === 404) await originals.delete(id);
    }
  }
}

// -- the key -------------------------------------------------------------------------------------------------------

function storedKey() {
  return sessionStorage.getItem(KEY) || localStorage.getItem(KEY);
}

async function connect(event) {
  event.preventDefault();
  const key = $("api-key").value.trim();
  $("key-error").textContent = "";
  if (!key) {
    $("key-error").textContent = "Enter your API key.";
    return;
  }
  state.key = key;
  try {
    await fetchJobs();
  } catch (error) {
    state.key = null;
    $("key-error").textContent = error.status === 401 ? "This key was not accepted." : error.message;
    return;
  }
  (($("remember").checked) ? localStorage : sessionStorage).setItem(KEY, key);
  $("api-key").value = "";
  showWorkspace();
}

function signOut(message) {
  if (state.upload) state.upload.abort();
  sessionStorage.removeItem(KEY);
  localStorage.removeItem(KEY);
  keptUploads.clear();  // the next person on this browser sees no file names
  state.key = null;
  state.open = false;
  state.session += 1;
  clearTimeout(state.timer);
  state.jobs.clear();
  $("jobs").replaceChildren();
  closeCompare();
  $("workspace").hidden = true;
  $("sign-out").hidden = true;
  $("connect").hidden = false;
  $("key-error").textContent = typeof message === "string" ? message : "";
  $("api-key").focus();
}

function showWorkspace() {
  state.open = true;
  state.session += 1;
  $("connect").hidden = true;
  $("workspace").hidden = false;
  $("sign-out").hidden = !state.key;  // no key to forget where the service asks for none
  loadModels().then(loadQualities);  // at each sign-in: workers come and go
  poll();
}

async function loadModels() {
  const select = $("model");
  if (select.options.length) return;
  try {
    const document_ = await (await fetch("/openapi.json")).json();
    const model = document_.components.schemas.VideoCreateForm.properties.model;
    for (const name of model.enum) select.append(el("option", {value: name}, name));
    select.value = model.default;
  } catch {
    select.append(el("option", {value: ""}, "Default model"));
  }
}

// The tiers each model's workers run (GET /v1/models): where none of them has a faster path (lanczos, GPUs without
// FP8), `high` would run the exact engine all the same, so it is not offered. Unknown (an older API, no answer): all.
async function loadQualities() {
  try {
    const models = await (await api("/v1/models")).json();
    state.qualities = new Map(models.data.map((model) => [model.id, model.qualities]));
  } catch {
    state.qualities = new Map();
  }
  offerQualities();
}

function offerQualities() {
  const select = $("quality");
  const hint = $("quality-hint");
  hint.dataset.faster ??= hint.textContent;  // the tier's own description, shown where it is offered
  const model = $("model").value;
  const tiers = state.qualities.get(model);
  const none = Boolean(tiers) && !tiers.includes("high");
  select.querySelector('option[value="high"]').disabled = none;
  if (none && select.value === "high") select.value = "lossless";
  hint.textContent = none
    ? `Faster is not available for ${model}: its workers have no faster path (a classical upscaler, or GPUs without `
      + "8-bit float arithmetic)."
    : hint.dataset.faster;
}

// -- picking a file ------------------------------------------------------------------------------------------------

// What a picked file certainly is when it is no video, by the type the browser gives it (the service checks too).
// Not `audio/*` nor `text/*` whole: an Ogg file with Theora is `audio/ogg`, and Linux calls `.ts` a text type.
const NOT_VIDEO = {
  "audio/mpeg": "an audio file", "audio/flac": "an audio file", "audio/x-flac": "an audio file",
  "audio/wav": "an audio file", "audio/x-wav": "an audio file", "audio/aac": "an audio file",
  "audio/x-m4a": "an audio file", "audio/opus": "an audio file", "application/pdf": "a document",
  "application/zip": "a document", "text/plain": "a document", "image/jpeg": "a still picture",
  "image/bmp": "a still picture", "image/tiff": "a still picture", "image/heic": "a still picture",
  "image/svg+xml": "a still picture",
};

function notVideo(file) {
  return NOT_VIDEO[file.type] || null;
}

function pick(file) {
  if (!file) return;
  if (state.upload) {
    toast("A video is uploading: cancel it first to pick another.", "error");
    return;
  }
  state.picked = file;
  state.pickedMedia = null;
  $("picked-name").textContent = file.name;
  $("picked-info").textContent = bytes(file.size);
  $("picked").hidden = false;
  $("dropzone").hidden = true;
  const wrong = file.size === 0 ? "empty (0 bytes)" : notVideo(file);
  $("submit").disabled = Boolean(wrong);
  $("form-error").textContent = wrong ? `${file.name} is ${wrong}, not a video: pick a video file.` : "";
  if (wrong) return;
  // Read its size where the browser can decode it (not every container can be played here; the service reads more).
  const probe = document.createElement("video");
  probe.preload = "metadata";
  probe.muted = true;
  const url = URL.createObjectURL(file);
  probe.onloadedmetadata = () => {
    if (state.picked === file && probe.videoWidth) {
      state.pickedMedia = {width: probe.videoWidth, height: probe.videoHeight};
      $("picked-info").textContent =
        `${probe.videoWidth}×${probe.videoHeight} · ${clock(probe.duration)} · ${bytes(file.size)}`;
      outputSize();
    }
    URL.revokeObjectURL(url);
  };
  probe.onerror = () => {
    URL.revokeObjectURL(url);
    // An animated picture (GIF, APNG, WebP, AVIF) is no video to the browser: its first frame gives its size
    createImageBitmap(file).then((picture) => {
      if (state.picked === file) {
        state.pickedMedia = {width: picture.width, height: picture.height};
        $("picked-info").textContent = `${picture.width}×${picture.height} · ${bytes(file.size)}`;
        outputSize();
      }
      picture.close();
    }, () => {});
  };
  probe.src = url;
  outputSize();
}

function unpick() {
  const focused = $("picked").contains(document.activeElement);
  state.picked = null;
  state.pickedMedia = null;
  $("picked").hidden = true;
  $("dropzone").hidden = false;
  $("submit").disabled = true;
  $("file").value = "";
  $("form-error").textContent = "";
  outputSize();
  if (focused) $("dropzone").focus();
}

function chosenScale() {
  return document.querySelector('input[name="sr_resolution_scale"]:checked').value;
}

const TARGETS = {hd: [1280, 720], fullhd: [1920, 1080], "2k": [2560, 1440]};

function outputSize() {
  const media = state.pickedMedia;
  const scale = Number(chosenScale());
  if (!media) {
    $("out-size").textContent = "";
    return;
  }
  const [width, height] = [Math.round(media.width * scale), Math.round(media.height * scale)];
  const custom = /^(\d+)x(\d+)$/.exec($("custom-target").value.trim());
  const target = $("target").value === "custom" ? custom && [Number(custom[1]), Number(custom[2])]
    : TARGETS[$("target").value];
  // the service never upscales to a target: one larger than the output leaves it as it is
  const smaller = target && (width > target[0] || height > target[1]);
  const box = target && `${target[0]}×${target[1]}`;
  $("out-size").textContent = `Output ${width}×${height}` +
    (smaller ? `, then downscaled to fit ${box}` : target ? `, already within ${box}` : "");
}

// -- creating a job ------------------------------------------------------------------------------------------------

function formFields() {
  const target = $("target").value === "custom" ? $("custom-target").value.trim() : $("target").value;
  const fields = {
    model: $("model").value,
    sr_resolution_scale: chosenScale(),
    seed: $("seed").value,
    sr_tile_min_overlap: $("overlap").value,
    sr_target_resolution: target,
    sr_target_resize_mode: $("resize").value,
    output_codec: $("codec").value,
    output_crf: $("crf").value,
    quality: $("quality").value,
    deinterlace: $("deinterlace").value,
    background: $("background").value,
  };
  return Object.fromEntries(Object.entries(fields).filter(([, value]) => value !== ""));
}

function submit(event) {
  event.preventDefault();
  const file = state.picked;
  if (!file) return;
  const bar = document.querySelector("#upload .bar");
  const setProgress = (loaded, total) => {
    const percent = total ? Math.round((100 * loaded) / total) : 0;
    bar.firstElementChild.style.width = `${percent}%`;
    bar.setAttribute("aria-valuenow", String(percent));
    $("upload-text").textContent = `Uploading ${percent} % · ${bytes(loaded)} of ${bytes(total)}`;
  };
  const done = () => {
    state.upload = null;
    $("upload").hidden = true;
    $("submit").disabled = !state.picked;
    $("submit").textContent = "Upscale";
    $("unpick").textContent = "Change";
    $("unpick").disabled = false;
  };
  const ui = {
    progress: setProgress,
    // all of it sent: the service is making the job, which a cancel here would not stop (the page said "cancelled")
    sent: () => { $("unpick").disabled = true; },
    created: async (job) => {
      done();
      await originals.put(job.id, file);
      unpick();
      toast(`Uploaded ${file.name}.`);
      upsertJob(job);
      poll();
    },
    refused: (error) => {
      done();
      if (error.status === 401) refused();
      showFormError(error);
    },
    failed: (message) => {
      done();
      $("form-error").textContent = message;
    },
  };
  state.upload = file.size > PART_BYTES ? sendInParts(file, ui) : sendWhole(file, ui);
  $("form-error").textContent = "";
  $("upload").hidden = false;
  $("submit").disabled = true;
  $("submit").textContent = "Uploading…";
  $("unpick").textContent = "Cancel upload";
  setProgress(0, file.size);
}

function jobHeaders() {
  return crypto.randomUUID ? {"Idempotency-Key": crypto.randomUUID()} : {};
}

// A file of one part goes in one request, the job's form with it; what `abort()` stops.
function sendWhole(file, ui) {
  const form = new FormData();
  for (const [name, value] of Object.entries(formFields())) form.append(name, value);
  form.append("video_reference", file, file.name);
  const xhr = new XMLHttpRequest(); // fetch() reports no upload progress
  xhr.open("POST", "/v1/videos");
  for (const [name, value] of Object.entries({...authorization(), ...jobHeaders()})) xhr.setRequestHeader(name, value);
  xhr.responseType = "json";
  let sent = 0;  // nothing sent when the request fails: the service never answered
  xhr.upload.onprogress = (progress) => {
    sent = progress.loaded;
    ui.progress(progress.loaded, progress.total);
  };
  xhr.upload.onload = ui.sent;
  xhr.onload = () => {
    if (xhr.status === 200) ui.created(xhr.response);
    else ui.refused(new ApiError(xhr.status, xhr.response));
  };
  xhr.onerror = () => ui.failed(sent ? "The upload was interrupted: check the connection and try again."
    : "Cannot reach the service: check the connection and try again.");
  xhr.onabort = () => ui.failed("Upload cancelled.");
  xhr.send(form);
  return xhr;
}

// A larger file goes in parts (POST /v1/uploads as JSON, its /parts, /complete, then the job naming it): a connection
// that drops costs the part in flight, sent again once the network is back, not the file.
const PART_BYTES = 8 * 1024 * 1024;
const TRANSIENT = [408, 429, 500, 502, 503, 504];

function sendInParts(file, ui) {
  const upload = {id: null, xhr: null, aborted: false};
  const kept = keptUploads.of(file);
  upload.abort = () => {
    upload.aborted = true;
    if (upload.xhr) upload.xhr.abort();
    if (upload.id) cancelUpload(upload.id);  // else once its declaration answers, below
    kept.forget();
    ui.failed("Upload cancelled.");
  };
  const post = (path, body, headers = {}) => api(path, {
    method: "POST", headers: {"Content-Type": "application/json", ...headers}, body: JSON.stringify(body),
  }).then((response) => response.json());
  const count = Math.ceil(file.size / PART_BYTES);
  (async () => {
    // The same file picked again after a reload, a crash or a lost connection: its parts already up are not sent
    // (or, completed before the job was made, none is)
    const earlier = kept.read();
    const found = earlier && await api(`/v1/uploads/${earlier.id}`).then((r) => r.json()).catch(() => null);
    const usable = found && ["pending", "completed"].includes(found.status);
    const parts = usable ? earlier.parts.map((id) => found.part_ids.includes(id) && id) : [];
    const completed = usable && found.status === "completed" && parts.length === count && parts.every(Boolean);
    let id = found && found.id;
    if (parts.some(Boolean) && (found.status === "pending" || completed)) {
      toast(`Resuming ${file.name}: ${parts.filter(Boolean).length} of ${count} parts were sent before.`);
    } else {
      const declared = {bytes: file.size, filename: file.name, mime_type: file.type || "video/mp4",
        purpose: "user_data"};
      id = (await again(upload, "the upload", () => post("/v1/uploads", declared))).id;
      parts.length = 0;
    }
    if (upload.aborted) return cancelUpload(id);  // cancelled while it was being looked up or declared
    upload.id = id;
    for (let index = 0, at = 0; at < file.size; index += 1, at += PART_BYTES) {
      if (parts[index]) continue;
      const part = file.slice(at, at + PART_BYTES);
      const progress = (loaded) => ui.progress(at + Math.min(loaded, part.size), file.size);
      parts[index] = await again(upload, `part ${index + 1} of ${count}`, () => sendPart(upload, part, progress));
      if (upload.aborted) return;  // cancelled as the part landed: nothing is kept to resume
      kept.write(upload.id, parts);
    }
    if (!completed) {
      await again(upload, "the last step", () => post(`/v1/uploads/${upload.id}/complete`, {part_ids: parts}));
    }
    if (upload.aborted) return;
    ui.sent();
    const job = {...formFields(), upload_id: upload.id};
    const headers = jobHeaders();  // one key for every try: a retry whose first answer was lost makes no second job
    const made = await again(upload, "the job", () => post("/v1/videos", job, headers));
    kept.forget();
    ui.created(made);
  })().catch((error) => {
    if (upload.aborted) return;
    if (error instanceof ApiError) ui.refused(error);
    else ui.failed("Cannot reach the service: check the connection and try again.");
  });
  return upload;
}

// Uploads in parts not yet completed, by file (name, size, last change) in localStorage: which parts are up, so the
// same file picked again resumes where it stopped. Kept as long as the service keeps a pending upload (a day).
const keptUploads = (() => {
  const NAME = "vsrq-uploads";
  const DAY_MS = 24 * 3600 * 1000;
  const all = () => {
    try { return JSON.parse(localStorage.getItem(NAME)) || {}; } catch { return {}; }
  };
  const save = (uploads) => {
    try {
      localStorage.setItem(NAME, JSON.stringify(uploads));
    } catch { /* full or forbidden: no resume, that is all */ }
  };
  return {
    of(file) {
      const key = `${file.name}\n${file.size}\n${file.lastModified}`;
      return {
        read() {
          const kept = all()[key];
          return kept && Date.now() - kept.at < DAY_MS && kept.part_bytes === PART_BYTES ? kept : null;
        },
        write(id, parts) {
          const uploads = Object.fromEntries(Object.entries(all()).filter(([, kept]) => Date.now() - kept.at < DAY_MS));
          save({...uploads, [key]: {id, parts, part_bytes: PART_BYTES, at: Date.now()}});
        },
        forget() {
          const {[key]: _, ...others} = all();
          save(others);
        },
      };
    },
    clear() {
      localStorage.removeItem(NAME);
    },
  };
})();

function sendPart(upload, part, progress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest(); // fetch() reports no upload progress
    upload.xhr = xhr;
    xhr.open("POST", `/v1/uploads/${upload.id}/parts`);
    for (const [name, value] of Object.entries(authorization())) xhr.setRequestHeader(name, value);
    xhr.responseType = "json";
    xhr.upload.onprogress = (event) => progress(event.loaded);
    xhr.onload = () => (xhr.status === 201 ? resolve(xhr.response.id) : reject(new ApiError(xhr.status, xhr.response)));
    xhr.onerror = () => reject(new TypeError("the connection dropped"));
    xhr.onabort = () => reject(new DOMException("cancelled", "AbortError"));
    const form = new FormData();
    form.append("data", part, "part");
    xhr.send(form);
  });
}

// `attempt()` until it answers, through dropped connections and a few of the service's passing refusals (waiting 1,
// 2, 4 … 30 s, or until the browser is back online); what the caller must mend, or a cancel, ends it: nothing more
// is sent.
async function again(upload, what, attempt) {
  for (let tries = 0, refusals = 0; ; tries += 1) {
    if (upload.aborted) throw new DOMException("cancelled", "AbortError");
    try {
      return await attempt();
    } catch (error) {
      const refused = error instanceof ApiError;
      refusals += refused;  // a service that keeps failing is said after ~2 min; a lost network is waited for
      if (upload.aborted || (refused && (!passing(error) || refusals > 6))) throw error;
      const wait = Math.min(30, 2 ** tries);
      $("upload-text").textContent = navigator.onLine ? `Connection lost sending ${what}: trying again in ${wait} s…`
        : `Offline: ${what} is sent again once the connection is back.`;
      await online(wait);
    }
  }
}

// A refusal that a later try may not meet: the service busy, or completing the same upload for a request it lost.
function passing(error) {
  const completing = error.status === 409 && error.body && error.body.code === "upload_completing";
  return TRANSIENT.includes(error.status) || completing;
}

function online(wait) {
  return new Promise((resolve) => {
    if (navigator.onLine) setTimeout(resolve, wait * 1000);
    window.addEventListener("online", resolve, {once: true});
  });
}

// A cancelled upload's parts go on the service; a cancel sent offline is sent again once the browser is back online.
async function cancelUpload(id) {
  for (let tries = 0; tries < 8; tries += 1) {
    try {
      return await api(`/v1/uploads/${id}/cancel`, {method: "POST"});
    } catch (error) {
      if (error instanceof ApiError && !passing(error)) return null;  // gone, or completed meanwhile
      await online(Math.min(30, 2 ** tries));
    }
  }
  return null;
}

// The form's control for each field the API names in `errors`.
const FIELD_INPUT = {
  model: "model", seed: "seed", sr_tile_min_overlap: "overlap", sr_target_resolution: "custom-target",
  sr_target_resize_mode: "resize", output_codec: "codec", output_crf: "crf", quality: "quality",
  deinterlace: "deinterlace", background: "background", video_reference: "dropzone",
};

function showFormError(error) {
  const fields = (error.body && error.body.errors) || [];
  for (const input of document.querySelectorAll("#job-form [aria-invalid]")) input.removeAttribute("aria-invalid");
  const inputs = fields.map((item) => $(FIELD_INPUT[item.field])).filter(Boolean);
  const label = (item) => {
    const input = $(FIELD_INPUT[item.field]);
    const text = input && document.querySelector(`label[for="${input.id}"]`);
    return text ? text.textContent : item.field || "request";
  };
  $("form-error").replaceChildren(
    fields.length ? "Check these fields:" : error.message,  // the API's detail points at `errors`, listed here
    ...fields.map((item) => el("span", {class: "field-error"}, `${label(item)}: ${item.message}`)),
  );
  for (const input of inputs) input.setAttribute("aria-invalid", "true");
  if (inputs.length) {
    const details = inputs[0].closest("details");
    if (details) details.open = true;
    inputs[0].focus();
  }
}

// -- the job list --------------------------------------------------------------------------------------------------

// Up to `most` jobs of the list `query` selects, page by page: the jobs, and whether there are more.
async function listed(query, most) {
  const jobs = [];
  let after = null;
  let more = true;
  while (more && jobs.length < most) {
    const limit = Math.min(100, most - jobs.length);
    const page = await (await api(`/v1/videos?${query}&limit=${limit}${after ? `&after=${after}` : ""}`)).json();
    jobs.push(...page.data);
    // a page emptied by deletions meanwhile has no cursor to go on from
    [after, more] = [page.last_id, page.has_more && page.last_id !== null];
  }
  return {jobs, more};
}

// The newest `state.listed` jobs, then the queued and running ones older than them (the next to run first, up to
// ACTIVE_MOST of each). Newest first: the list's own order (jobs of one second included), then the older ones by
// creation (a job that started between the two lists is in both: listed once).
async function fetchJobs() {
  const newest = await listed("order=desc", state.listed);
  $("jobs-older").hidden = !newest.more;
  const ids = new Set(newest.jobs.map((job) => job.id));
  const older = [];
  let unlisted = false;
  for (const status of ACTIVE) {
    const going = await listed(`status=${status}&order=asc`, ACTIVE_MOST);
    unlisted ||= going.more;
    for (const job of going.jobs.filter((job) => !ids.has(job.id))) {
      older.push(job);
      ids.add(job.id);
    }
  }
  $("jobs-unlisted").hidden = !unlisted;
  return [...newest.jobs, ...older.sort((a, b) => b.created_at - a.created_at || (a.id < b.id ? 1 : -1))];
}

// The rows in the order of `jobs`, each moved only where it is out of place: a moved row's video would stop.
function placeRows(jobs) {
  const list = $("jobs");
  jobs.forEach((job, index) => {
    const row = state.jobs.get(job.id).row;
    if (list.children[index] !== row) list.insertBefore(row, list.children[index] || null);
  });
}

async function poll() {
  clearTimeout(state.timer);
  if (!state.open) return;
  if (state.polling) {  // asked again while a list is on its way (a job made, older jobs asked for): once it is in
    state.pollAgain = true;
    return;
  }
  const session = state.session;
  state.polling = true;
  let jobs = null;
  try {
    jobs = await fetchJobs();
  } catch (error) {
    if (session === state.session) $("jobs-updated").textContent = "Cannot reach the service; retrying…";
  } finally {
    state.polling = false;
  }
  if (session !== state.session) {  // signed out, or in with another key, meanwhile: the list is not this session's
    if (state.pollAgain) {  // the new session's first poll, held back by this one
      state.pollAgain = false;
      return poll();
    }
    return;
  }
  if (jobs) {
    const ids = new Set(jobs.map((job) => job.id));
    const gone = [...state.jobs.keys()].filter((id) => !ids.has(id));
    gone.forEach(removeJob);
    forgetGone(gone);  // deleted or expired, or only off the list's newest: the service says which
    jobs.forEach(upsertJob);
    placeRows(jobs);
    $("jobs-updated").textContent = `Updated ${new Date().toLocaleTimeString()}`;
  }
  if (state.pollAgain) {
    state.pollAgain = false;
    return poll();
  }
  const active = [...state.jobs.values()].some((entry) => ACTIVE.has(entry.job.status));
  state.timer = setTimeout(poll, active ? POLL_ACTIVE_MS : POLL_IDLE_MS);
}

function sizeLabel(size) {
  return size ? size.replace("x", "×") : null;
}

function scaleLabel(job) {
  return `${Number(job.params.sr_resolution_scale)}×`;
}

// The tier that ran once the job is done (a model without a faster path runs `lossless`: its notes say so), else
// the one asked for; the default, `lossless`, goes unsaid.
function qualityLabel(job) {
  const quality = (job.output && job.output.quality) || job.params.quality;
  return quality && quality !== "lossless" ? quality : null;
}

function stageText(job) {
  switch (job.status) {
    case "queued":
      if (job.cancel_requested) return "Cancelling…";
      if (job.queue_position == null && job.retry_at) {  // out of line until its wait ends
        return `Queued · attempt ${job.attempt + 1} at ${new Date(job.retry_at * 1000).toLocaleTimeString()}`;
      }
      return job.queue_position === 0 ? "Queued · next up"
        : job.queue_position == null ? "Queued" : `Queued · ${job.queue_position} ahead`;
    case "in_progress": {
      const stage = STAGE_LABEL[job.stage] || "Starting";
      const attempt = job.attempt > 1 ? ` · attempt ${job.attempt}` : "";
      const left = job.eta ? ` · ${timeLeft(job.eta)}` : "";
      return job.cancel_requested ? "Cancelling…" : `${stage} · ${job.progress} %${left}${attempt}`;
    }
    case "completed":
      return job.started_at && job.completed_at ? `Done in ${clock(job.completed_at - job.started_at)}` : "Done";
    case "failed":
      return "";  // the badge says it, the error line why
    default:
      return "Cancelled";
  }
}

function upsertJob(job) {
  let entry = state.jobs.get(job.id);
  if (!entry) {
    entry = {job, row: buildRow(job)};
    state.jobs.set(job.id, entry);
    $("jobs").prepend(entry.row);  // a job just made; `poll` puts the list in order
  }
  if (entry.job.status !== job.status && !ACTIVE.has(job.status)) {
    announce(`${job.input.filename || job.id}: ${STATUS_LABEL[job.status] || job.status}`);
  }
  entry.job = job;
  fillRow(entry.row, job);
  $("jobs-empty").hidden = state.jobs.size > 0;
  if (state.comparing === job.id && job.status !== "completed") closeCompare();
}

function removeJob(id) {
  const entry = state.jobs.get(id);
  if (!entry) return;
  entry.row.remove();
  state.jobs.delete(id);
  const url = state.outputs.get(id);
  if (url) URL.revokeObjectURL(url);
  state.outputs.delete(id);
  if (state.comparing === id) closeCompare();
  $("jobs-empty").hidden = state.jobs.size > 0;
}

// A row's button, named for a screen reader with the job's file ("Delete clip.mp4", not twenty "Delete"s).
function action(kind, text, name, onclick, attributes = {}) {
  return el("button", {type: "button", class: "ghost", "data-action": kind, "aria-label": `${text} ${name}`, onclick,
    ...attributes}, text);
}

function buildRow(job) {
  const name = job.input.filename || job.id;
  const row = el("li", {class: "job", "data-id": job.id},
    el("div", {class: "job-head"},
      el("span", {class: "job-name", title: name}, name),
      el("span", {class: "badge"})),
    el("div", {class: "job-meta muted small"}),
    el("div", {class: "bar", role: "progressbar", "aria-label": `Progress of ${name}`, "aria-valuemin": "0",
      "aria-valuemax": "100"}, el("span")),
    el("div", {class: "job-foot"},
      el("span", {class: "job-stage small"}),
      el("div", {class: "actions"},
        action("compare", "Compare", name, () => compare(job.id)),
        action("download", "Download", name, () => download(job.id)),
        action("cancel", "Cancel", name, () => cancel(job.id)),
        action("history", "History", name, () => history(job.id), {"aria-expanded": "false"}),
        action("delete", "Delete", name, () => remove(job.id), {class: "ghost danger"}))),
    el("p", {class: "job-error error small"}),
    el("ul", {class: "job-notes small", "aria-label": `Notes on ${name}`, hidden: ""}),
    el("ol", {class: "job-history small muted", hidden: ""}));
  return row;
}

// One line per event of GET /v1/videos/{id}/events: what happened, seconds after the job was created.
function eventText(event) {
  switch (event.type) {
    case "created": return "Created";
    case "leased": return `Attempt ${event.attempt} started`;
    case "stage": return STAGE_LABEL[event.stage] || event.stage;
    case "requeued": {
      const left = event.attempts_left == null ? "" : ` (${event.attempts_left} more may end so before it fails)`;
      return `Attempt ${event.attempt} ended: ${event.reason.message} (${event.reason.code}); it will run again${left}`;
    }
    case "cancel_requested": return "Cancel asked";
    case "completed": return "Completed";
    case "failed": return `Failed: ${readable(event.error.message)} (${event.error.code})`;
    case "cancelled": return "Cancelled";
    case "webhook": {
      const hook = event.webhook;
      const answer = hook.status_code ? ` (${hook.status_code})` : hook.code ? ` (${hook.code})` : "";
      return `Webhook ${hook.event}, try ${hook.attempt}: ${hook.outcome}${answer}`;
    }
    default: return event.type;
  }
}

async function history(id) {
  const row = state.jobs.get(id).row;
  const list = row.querySelector(".job-history");
  const button = row.querySelector("[data-action='history']");
  if (!list.hidden) {
    list.hidden = true;
    button.setAttribute("aria-expanded", "false");
    return;
  }
  try {
    const events = (await (await api(`/v1/videos/${encodeURIComponent(id)}/events`)).json()).data;
    const start = events.length ? events[0].at : 0;
    list.replaceChildren(...events.map((event) =>
      el("li", {"data-type": event.type}, el("span", {class: "at"}, `+${(event.at - start).toFixed(1)} s`), " ", eventText(event))));
    list.hidden = false;
    button.setAttribute("aria-expanded", "true");
  } catch (error) {
    fail(error);
  }
}

function fillRow(row, job) {
  row.dataset.status = job.status;
  const badge = row.querySelector(".badge");
  badge.textContent = STATUS_LABEL[job.status] || job.status;
  badge.className = `badge ${job.status}`;
  const media = job.input.media;
  const out = sizeLabel(job.size);
  const sizes = media ? `${media.width}×${media.height} → ${out || "…"}` : out ? `→ ${out}` : null;
  row.querySelector(".job-meta").textContent =
    [scaleLabel(job), job.model, qualityLabel(job), sizes, ago(job.created_at)].filter(Boolean).join(" · ");
  const bar = row.querySelector(".bar");
  bar.firstElementChild.style.width = `${job.progress}%`;
  bar.setAttribute("aria-valuenow", String(job.progress));
  bar.hidden = !ACTIVE.has(job.status) && job.status !== "completed";
  row.querySelector(".job-stage").textContent = stageText(job);
  row.querySelector(".job-error").textContent = job.error ? `${readable(job.error.message)} (${job.error.code})` : "";
  // what the worker says a person should know of the run: deinterlaced, streams left out, a tier it could not run
  const notes = row.querySelector(".job-notes");
  const said = (job.output && job.output.notes) || [];
  if (notes.childElementCount !== said.length) notes.replaceChildren(...said.map((note) => el("li", {}, note)));
  notes.hidden = said.length === 0;
  const show = {
    compare: job.status === "completed",
    download: job.status === "completed",
    cancel: ACTIVE.has(job.status) && !job.cancel_requested,
    history: true,
    delete: !ACTIVE.has(job.status),
  };
  for (const button of row.querySelectorAll("[data-action]")) button.hidden = !show[button.dataset.action];
}

// The result as a blob: URL (fetched with the key's header: a plain link would carry none), `progress` told of each
// chunk as a fraction of the whole.
async function outputUrl(id, progress = () => {}) {
  if (!state.outputs.has(id)) {
    const response = await api(`/v1/videos/${encodeURIComponent(id)}/content`);
    const total = Number(response.headers.get("Content-Length")) || 0;
    const chunks = [];
    let received = 0;
    for (const reader = response.body.getReader(); ;) {
      const {done, value} = await reader.read();
      if (done) break;
      chunks.push(value);
      received += value.length;
      if (total) progress(received / total);
    }
    state.outputs.set(id, URL.createObjectURL(new Blob(chunks, {type: "video/mp4"})));
  }
  return state.outputs.get(id);
}

// Runs `work` with `button` saying how far it got, and not pressed again meanwhile.
async function busy(button, work) {
  const text = button.textContent;
  button.disabled = true;
  try {
    return await work((fraction) => { button.textContent = `${Math.round(100 * fraction)} %`; });
  } finally {
    button.disabled = false;
    button.textContent = text;
  }
}

async function download(id) {
  const job = state.jobs.get(id).job;
  const button = state.jobs.get(id).row.querySelector("[data-action='download']");
  try {
    const link = el("a", {href: await busy(button, (progress) => outputUrl(id, progress))});
    const stem = (job.input.filename || job.id).replace(/\.[^.]+$/, "");
    link.download = `${stem}-x${Number(job.params.sr_resolution_scale)}.mp4`;
    document.body.append(link);
    link.click();
    link.remove();
  } catch (error) {
    fail(error);
  }
}

async function cancel(id) {
  try {
    upsertJob(await (await api(`/v1/videos/${encodeURIComponent(id)}/cancel`, {method: "POST"})).json());
    poll();
  } catch (error) {
    fail(error);
  }
}

async function remove(id) {
  const job = state.jobs.get(id).job;
  if (!window.confirm(`Delete “${job.input.filename || job.id}” and its files?`)) return;
  try {
    await api(`/v1/videos/${encodeURIComponent(id)}`, {method: "DELETE"});
    await originals.delete(id);
    removeJob(id);
    toast("Deleted.");
  } catch (error) {
    fail(error);
  }
}

// -- before / after ------------------------------------------------------------------------------------------------

const NOT_HERE = "The original is not in this browser (it was uploaded from elsewhere): only the result is shown.";
const NOT_PLAYABLE = "This browser cannot play the original's format: only the result is shown.";

function withoutOriginal(message) {
  $("no-before").textContent = message;
  $("no-before").hidden = false;
  $("stage").classList.add("no-original");
}

async function compare(id) {
  const job = state.jobs.get(id).job;
  const before = $("before");
  const after = $("after");
  const button = state.jobs.get(id).row.querySelector("[data-action='compare']");
  try {
    after.src = await busy(button, (progress) => outputUrl(id, progress));
  } catch (error) {
    fail(error);
    return;
  }
  state.compareFrom = button;
  const original = await originals.get(id);
  if (before.src.startsWith("blob:")) URL.revokeObjectURL(before.src);
  before.removeAttribute("src");
  if (original) before.src = URL.createObjectURL(original);
  before.load();
  $("no-before").hidden = true;
  $("stage").classList.remove("no-original");
  if (!original) withoutOriginal(NOT_HERE);
  state.comparing = id;
  const media = job.input.media;
  $("before-size").textContent = media ? `${media.width}×${media.height}` : "";
  $("after-size").textContent = sizeLabel(job.size) || "";
  $("compare-name").textContent = `${job.input.filename || job.id} · ${scaleLabel(job)} · ${job.model}`;
  const [width, height] = (job.size || "16x9").split("x").map(Number);
  $("stage").style.setProperty("--ratio", `${width} / ${height}`);
  $("compare").hidden = false;
  $("play").textContent = "Play";
  $("compare").scrollIntoView({behavior: REDUCED_MOTION.matches ? "auto" : "smooth", block: "start"});
  $("play").focus({preventScroll: true});
}

function closeCompare() {
  const before = $("before");
  const after = $("after");
  after.pause();
  before.pause();
  if (before.src.startsWith("blob:")) URL.revokeObjectURL(before.src);
  before.removeAttribute("src");
  after.removeAttribute("src");
  state.comparing = null;
  const wasOpen = !$("compare").hidden;
  $("compare").hidden = true;
  // back where the comparison was asked for, not on <body>
  if (wasOpen && state.compareFrom && state.compareFrom.isConnected) state.compareFrom.focus();
  state.compareFrom = null;
}

// The result leads; the original follows it (play, pause, seek), nudged back whenever it drifts.
function followAfter() {
  const before = $("before");
  const after = $("after");
  if (before.src && Math.abs(before.currentTime - after.currentTime) > 0.08) before.currentTime = after.currentTime;
  const duration = after.duration || 0;
  $("seek").value = duration ? String(Math.round((1000 * after.currentTime) / duration)) : "0";
  $("clock").textContent = `${clock(after.currentTime)} / ${clock(duration)}`;
  if (!after.paused) requestAnimationFrame(followAfter);
}

function wirePlayer() {
  const before = $("before");
  const after = $("after");
  before.loop = after.loop = true;
  $("play").addEventListener("click", () => (after.paused ? after.play().catch(fail) : after.pause()));
  after.addEventListener("play", () => {
    $("play").textContent = "Pause";
    $("play").setAttribute("aria-label", "Pause");
    if (before.src) before.play().catch(() => {});
    requestAnimationFrame(followAfter);
  });
  after.addEventListener("pause", () => {
    $("play").textContent = "Play";
    $("play").setAttribute("aria-label", "Play");
    before.pause();
    followAfter();
  });
  after.addEventListener("loadedmetadata", followAfter);
  after.addEventListener("seeked", followAfter);
  $("seek").addEventListener("input", () => {
    if (after.duration) after.currentTime = (Number($("seek").value) / 1000) * after.duration;
  });
  const sound = () => { after.muted = !$("sound").checked; };
  $("sound").addEventListener("change", sound);
  sound();
  const split = () => $("stage").style.setProperty("--split", `${$("split").value}%`);
  $("split").addEventListener("input", split);
  split();
  for (const radio of document.querySelectorAll('input[name="layout"]')) {
    radio.addEventListener("change", () => {
      $("stage").classList.toggle("slider", radio.value === "slider" && radio.checked);
      $("stage").classList.toggle("side", radio.value === "side" && radio.checked);
    });
  }
  $("compare-close").addEventListener("click", closeCompare);
  $("compare").addEventListener("keydown", (event) => {
    if (event.key === "Escape") closeCompare();
  });
  // AVI, MPEG-4 Part 2, WMV...: kept for the comparison but no <video> plays them
  const unplayable = () => {
    if (before.getAttribute("src")) withoutOriginal(NOT_PLAYABLE);
  };
  before.addEventListener("error", unplayable);
  before.addEventListener("loadedmetadata", () => { if (!before.videoWidth) unplayable(); });
}

// -- start ---------------------------------------------------------------------------------------------------------

function wireForm() {
  const zone = $("dropzone");
  zone.addEventListener("click", () => $("file").click());
  zone.addEventListener("keydown", (event) => {
    if (event.key === "Enter" || event.key === " ") {
      event.preventDefault();
      $("file").click();
    }
  });
  for (const kind of ["dragenter", "dragover"]) {
    zone.addEventListener(kind, (event) => { event.preventDefault(); zone.classList.add("over"); });
  }
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (event) => {
    event.preventDefault();
    zone.classList.remove("over");
    const files = event.dataTransfer.files;
    if (files.length > 1) toast(`One video at a time: ${files[0].name} is picked.`);
    pick(files[0]);
  });
  // A file dropped anywhere else would make the browser navigate away from the page.
  window.addEventListener("dragover", (event) => event.preventDefault());
  window.addEventListener("drop", (event) => event.preventDefault());
  $("file").addEventListener("change", () => pick($("file").files[0]));
  $("unpick").addEventListener("click", () => (state.upload ? state.upload.abort() : unpick()));
  window.addEventListener("beforeunload", (event) => {
    if (state.upload) {  // the browser asks before an upload in flight is lost
      event.preventDefault();
      event.returnValue = "";
    }
  });
  $("custom-target").addEventListener("input", outputSize);
  for (const radio of document.querySelectorAll('input[name="sr_resolution_scale"]')) {
    radio.addEventListener("change", outputSize);
  }
  $("target").addEventListener("change", () => {
    $("custom-field").hidden = $("target").value !== "custom";
    outputSize();
  });
  $("model").addEventListener("change", offerQualities);
  $("job-form").addEventListener("submit", submit);
  $("key-form").addEventListener("submit", connect);
  $("sign-out").addEventListener("click", () => signOut());
  $("jobs-older").addEventListener("click", () => {
    state.listed += LIST_PAGE;
    poll();
  });
}

document.addEventListener("DOMContentLoaded", async () => {
  wireForm();
  wirePlayer();
  state.key = storedKey();
  if (state.key) return showWorkspace();
  // A service with auth off (`vsrq dev`, VSRQ_AUTH=none) lists jobs for a request without a key: none to ask for
  try {
    await fetchJobs();
    showWorkspace();
  } catch {
    signOut();
  }
});
