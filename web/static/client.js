// turnkeeper browser client: plain JavaScript, no build step, no dependencies.
//
// Connect: microphone -> RTCPeerConnection (+ "events" data channel) -> offer,
// gathered completely (the server does not trickle ICE) -> POST
// /v1/webrtc/offer -> answer. The agent's voice comes back on the same audio
// transceiver; its events (turn states, transcript, reply tokens, barge-ins)
// arrive as JSON on the data channel and are rendered below.
"use strict";

(() => {
  const ICE_GATHER_TIMEOUT_MS = 2000; // offer with what we have after this
  const PING_INTERVAL_MS = 5000;      // data channel round-trip probe

  // Labels the server sends; CANCEL_REQUESTED is "stopping", never "cancelled".
  const STATUS_LABELS = {
    QUEUED: "queued",
    RUNNING: "running",
    CANCEL_REQUESTED: "stopping",
    CANCELLED: "cancelled",
    COMPLETED: "completed",
    FAILED: "failed",
    RECONCILE_REQUIRED: "reconcile_required",
  };
  const TERMINAL = new Set(["CANCELLED", "COMPLETED", "FAILED", "RECONCILE_REQUIRED"]);

  const $ = (id) => document.getElementById(id);
  const ui = {
    connect: $("connect"),
    disconnect: $("disconnect"),
    status: $("status"),
    audio: $("remote-audio"),
    transcript: $("transcript"),
    turnId: $("turn-id"),
    turnGeneration: $("turn-generation"),
    turnState: $("turn-state"),
    turnStopReason: $("turn-stop-reason"),
    agentPhase: $("agent-phase"),
    vad: $("vad"),
    turnLog: $("turn-log"),
    bargeIns: $("barge-ins"),
    sessionId: $("session-id"),
    rtt: $("rtt"),
    errors: $("errors"),
  };

  // ?raw=1 turns off the browser's audio processing (tests feed synthetic
  // speech, which echo cancellation and noise suppression would mangle).
  const RAW = new URLSearchParams(location.search).get("raw") === "1";

  // One connection attempt at a time. `conn` is the current one; every await
  // in connect() checks it is still current, so Disconnect during a pending
  // getUserMedia or offer cleans up whatever that attempt already created.
  let conn = null;
  // Which turn the panel shows: the newest by generation.
  let shown = { turnId: null, generation: -1 };
  // Per-turn transcript entries, by turn id.
  const entries = new Map();

  // ---- status line -----------------------------------------------------------

  function setStatus(text, state) {
    ui.status.textContent = text;
    ui.status.dataset.state = state;
  }

  function setButtons(connected) {
    ui.connect.disabled = connected;
    ui.disconnect.disabled = !connected;
  }

  // ---- connect / disconnect --------------------------------------------------

  async function connect() {
    if (conn) return;
    const c = { pc: null, dc: null, stream: null, pinger: null, closedByUs: false, pings: new Map() };
    conn = c;
    setButtons(true);
    resetPanel();
    try {
      setStatus("Requesting microphone…", "connecting");
      const audio = RAW
        ? { echoCancellation: false, noiseSuppression: false, autoGainControl: false }
        : { echoCancellation: true, noiseSuppression: true, autoGainControl: true };
      let stream;
      try {
        stream = await navigator.mediaDevices.getUserMedia({ audio });
      } catch (err) {
        throw new Error(`Microphone unavailable: ${err.name || "Error"}: ${err.message || err}`);
      }
      c.stream = stream;
      if (conn !== c) return teardown(c);

      const pc = new RTCPeerConnection();
      c.pc = pc;
      // The data channel must exist before the offer so it is negotiated in it.
      const dc = pc.createDataChannel("events");
      c.dc = dc;
      wireDataChannel(c, dc);
      for (const track of stream.getAudioTracks()) pc.addTrack(track, stream);

      pc.ontrack = (ev) => {
        ui.audio.srcObject = ev.streams[0] || new MediaStream([ev.track]);
        ui.audio.play().catch(() => { /* autoplay policy: the Connect click normally allows it */ });
      };
      pc.onconnectionstatechange = () => onConnectionState(c);

      setStatus("Preparing offer…", "connecting");
      await pc.setLocalDescription(await pc.createOffer());
      await iceGatheringComplete(pc, ICE_GATHER_TIMEOUT_MS);
      if (conn !== c) return teardown(c);

      setStatus("Sending offer…", "connecting");
      const answer = await postOffer(pc.localDescription);
      if (conn !== c) return teardown(c);
      ui.sessionId.textContent = answer.session_id || "";
      await pc.setRemoteDescription({ type: "answer", sdp: answer.sdp });
      setStatus("Connecting media…", "connecting");
    } catch (err) {
      if (conn !== c) return teardown(c);
      fail(c, err.message || String(err));
    }
  }

  // The user pressed Disconnect.
  function disconnect() {
    const c = conn;
    if (!c) return;
    c.closedByUs = true;
    conn = null;
    teardown(c);
    setButtons(false);
    setStatus("Disconnected.", "idle");
  }

  // Something went wrong with the current attempt: free it and say why.
  function fail(c, message) {
    teardown(c);
    if (conn === c) conn = null;
    setButtons(false);
    setStatus(message, "error");
  }

  // Free everything an attempt holds: ping timer, data channel, peer
  // connection, microphone. Safe to call more than once. (A Disconnect while
  // the offer is in flight leaves the server's half-made session to its
  // connect watchdog.)
  function teardown(c) {
    if (c.pinger) clearInterval(c.pinger);
    c.pinger = null;
    if (c.dc) { try { c.dc.close(); } catch (_) { /* already closed */ } }
    if (c.pc) { try { c.pc.close(); } catch (_) { /* already closed */ } }
    if (c.stream) c.stream.getTracks().forEach((t) => t.stop());
    c.dc = c.pc = c.stream = null;
    // A stale attempt (Disconnect, then Connect again while it was pending)
    // must not clear the page of the attempt that replaced it.
    if (conn !== c && conn !== null) return;
    if (ui.audio.srcObject) ui.audio.srcObject = null;
    ui.vad.textContent = "-";
    ui.agentPhase.textContent = "";
    ui.rtt.textContent = "";
    for (const entry of entries.values()) entry.li.removeAttribute("aria-busy");
  }

  function onConnectionState(c) {
    if (conn !== c || !c.pc) return;
    const state = c.pc.connectionState;
    if (state === "connected") {
      setStatus("Connected. Speak; talk over the agent to interrupt it.", "connected");
    } else if (state === "failed") {
      fail(c, "Connection failed (no route to the server's media).");
    } else if (state === "disconnected") {
      setStatus("Connection interrupted; waiting for it to recover…", "connecting");
    } else if (state === "closed") {
      fail(c, "The server closed the connection.");
    }
  }

  // Resolves when ICE gathering is complete, or after `timeoutMs` anyway
  // (the offer then carries the candidates gathered so far).
  function iceGatheringComplete(pc, timeoutMs) {
    if (pc.iceGatheringState === "complete") return Promise.resolve();
    return new Promise((resolve) => {
      const done = () => {
        clearTimeout(timer);
        pc.removeEventListener("icegatheringstatechange", check);
        resolve();
      };
      const check = () => { if (pc.iceGatheringState === "complete") done(); };
      const timer = setTimeout(done, timeoutMs);
      pc.addEventListener("icegatheringstatechange", check);
    });
  }

  // POST the offer; returns {type, sdp, session_id} or throws with the
  // server's error code and message.
  async function postOffer(desc) {
    let resp;
    try {
      resp = await fetch("/v1/webrtc/offer", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ type: desc.type, sdp: desc.sdp }),
      });
    } catch (err) {
      throw new Error(`Cannot reach the server: ${err.message || err}`);
    }
    let body = null;
    try { body = await resp.json(); } catch (_) { /* not JSON */ }
    if (!resp.ok) {
      const e = body && body.error;
      const detail = e ? `${e.code}: ${e.message}` : `HTTP ${resp.status}`;
      throw new Error(`Offer rejected (${detail})`);
    }
    if (!body || body.type !== "answer" || typeof body.sdp !== "string") {
      throw new Error("Offer failed: the server's answer is malformed.");
    }
    return body;
  }

  // ---- data channel ----------------------------------------------------------

  function wireDataChannel(c, dc) {
    let nextPing = 1;
    dc.onopen = () => {
      const ping = () => {
        if (dc.readyState !== "open") return;
        const id = nextPing++;
        c.pings.set(id, performance.now());
        dc.send(JSON.stringify({ type: "ping", id }));
      };
      ping();
      c.pinger = setInterval(ping, PING_INTERVAL_MS);
    };
    dc.onclose = () => {
      // The server ends a session by closing the peer connection; the event
      // channel closing is the first sign of it.
      if (conn === c && !c.closedByUs) fail(c, "The server ended the session.");
    };
    dc.onmessage = (ev) => {
      let msg;
      try { msg = JSON.parse(ev.data); } catch (_) { return; }
      if (!msg || typeof msg.type !== "string") return;
      try {
        handleEvent(c, msg);
      } catch (err) {
        console.error("turnkeeper: cannot render event", msg, err);
      }
    };
  }

  function handleEvent(c, msg) {
    switch (msg.type) {
      case "session.ready":
        ui.sessionId.textContent = msg.session_id || ui.sessionId.textContent;
        break;
      case "vad":
        ui.vad.textContent = msg.event === "speech_started" ? "speech" : "silence";
        break;
      case "turn":
        onTurn(msg);
        break;
      case "transcript":
        if (msg.role === "user") setUserText(entryFor(msg.turn_id, msg.generation), msg.text);
        break;
      case "agent.delta": {
        const e = entryFor(msg.turn_id, msg.generation);
        e.li.setAttribute("aria-busy", "true");
        e.agentText.textContent += msg.text;
        break;
      }
      case "agent.done": {
        const e = entryFor(msg.turn_id, msg.generation);
        e.agentText.textContent = msg.text;
        e.li.removeAttribute("aria-busy");
        break;
      }
      case "agent.state":
        if (msg.generation >= shown.generation) ui.agentPhase.textContent = msg.phase;
        break;
      case "barge_in":
        addBargeIn(msg);
        break;
      case "error":
        addError(msg);
        break;
      case "pong": {
        const sent = c.pings.get(msg.id);
        if (sent !== undefined) {
          c.pings.delete(msg.id);
          ui.rtt.textContent = `${Math.round(performance.now() - sent)} ms`;
        }
        break;
      }
      default:
        break; // unknown event types are ignored (forward compatible)
    }
  }

  // ---- turns -----------------------------------------------------------------

  function onTurn(msg) {
    const label = msg.label || STATUS_LABELS[msg.status] || String(msg.status).toLowerCase();
    const e = entryFor(msg.turn_id, msg.generation);
    e.li.dataset.state = label;
    e.badge.textContent = label;
    e.badge.dataset.state = label;
    if (msg.transcript && !e.userText.textContent) setUserText(e, msg.transcript);

    if (msg.status === "COMPLETED" && msg.reply && !e.agentText.textContent) {
      e.agentText.textContent = msg.reply;
    }
    if (msg.status === "CANCELLED" || msg.status === "RECONCILE_REQUIRED") markInterrupted(e, msg.reply);
    if (msg.status === "FAILED" && !e.userText.textContent && msg.error === "no_speech_recognized") {
      setUserText(e, "");
    }
    if (TERMINAL.has(msg.status)) e.li.removeAttribute("aria-busy");

    // The panel follows the newest turn; an older turn's later states still
    // go to the state-change log and its transcript entry.
    if (msg.generation >= shown.generation) {
      shown = { turnId: msg.turn_id, generation: msg.generation };
      ui.turnId.textContent = msg.turn_id;
      ui.turnGeneration.textContent = String(msg.generation);
      ui.turnState.textContent = label;
      ui.turnState.dataset.state = label;
      ui.turnStopReason.textContent = describeStopReason(msg.stop_reason, msg.error);
    }
    logTurn(msg, label);
  }

  function describeStopReason(reason, error) {
    if (reason) return `${reason.kind} (by ${reason.initiator})`;
    return error ? `error: ${error}` : "";
  }

  function logTurn(msg, label) {
    const li = document.createElement("li");
    li.dataset.turnId = msg.turn_id;
    li.dataset.state = label;
    const id = document.createElement("code");
    id.textContent = shortId(msg.turn_id);
    id.title = msg.turn_id;
    li.append(id, ` gen ${msg.generation} → `);
    const state = document.createElement("span");
    state.className = "state";
    state.dataset.state = label;
    state.textContent = label;
    li.append(state);
    if (msg.stop_reason) li.append(` (${msg.stop_reason.kind})`);
    prependCapped(ui.turnLog, li, 30);
  }

  // An interrupted reply: tag it "(interrupted)", and strike through what the
  // model had produced but never reached us (fenced by the barge-in).
  function markInterrupted(e, reply) {
    if (e.li.classList.contains("interrupted")) return;
    e.li.classList.add("interrupted");
    const full = (reply || "").trim();
    const shownText = e.agentText.textContent.trim();
    if (full.length > shownText.length && full.startsWith(shownText)) {
      const tail = document.createElement("s");
      tail.className = "fenced";
      tail.title = "generated but never delivered (fenced by the barge-in)";
      tail.textContent = full.slice(shownText.length);
      e.agent.insertBefore(tail, e.tag);
    }
    e.tag.hidden = false;
    updateTag(e);
  }

  // The text streams faster than it is spoken, so the reply may be complete
  // on screen though most of it was never heard: the barge-in says how much
  // queued speech was dropped.
  function updateTag(e) {
    e.tag.textContent = e.clearedMs > 0
      ? `(interrupted; ${(e.clearedMs / 1000).toFixed(1)} s of speech not played)`
      : "(interrupted)";
  }

  // The transcript entry of a turn, created on its first event.
  function entryFor(turnId, generation) {
    let e = entries.get(turnId);
    if (e) return e;
    const li = document.createElement("li");
    li.className = "turn";
    li.dataset.turnId = turnId;
    li.dataset.generation = String(generation);

    const head = document.createElement("div");
    head.className = "turn-head";
    const gen = document.createElement("span");
    gen.className = "gen";
    gen.textContent = `gen ${generation}`;
    const badge = document.createElement("span");
    badge.className = "state";
    head.append(gen, badge);

    const user = document.createElement("p");
    user.className = "user";
    user.dataset.turnId = turnId;
    const userWho = who("You");
    const userText = document.createElement("span");
    userText.className = "text";
    user.append(userWho, userText);

    const agent = document.createElement("p");
    agent.className = "agent";
    agent.dataset.turnId = turnId;
    const agentText = document.createElement("span");
    agentText.className = "text";
    const tag = document.createElement("span");
    tag.className = "tag";
    tag.textContent = "(interrupted)";
    tag.hidden = true;
    agent.append(who("Agent"), agentText, tag);

    li.append(head, user, agent);
    ui.transcript.append(li);
    li.scrollIntoView({ block: "nearest" });
    e = { li, badge, user, userText, agent, agentText, tag, clearedMs: 0 };
    entries.set(turnId, e);
    return e;
  }

  function who(name) {
    const s = document.createElement("span");
    s.className = "who";
    s.textContent = `${name}: `;
    return s;
  }

  function setUserText(e, text) {
    e.userText.textContent = text || "(no speech recognized)";
    if (!text) e.li.classList.add("empty");
  }

  // ---- barge-ins and errors --------------------------------------------------

  function addBargeIn(msg) {
    const li = document.createElement("li");
    li.dataset.oldTurnId = msg.old_turn_id;
    li.textContent =
      `gen ${msg.old_generation} → ${msg.generation}: fenced ${fmtMs(msg.onset_to_fence_ms)} after onset,` +
      ` ${fmtMs(msg.cleared_ms)} of audio cleared (turn ${shortId(msg.old_turn_id)})`;
    prependCapped(ui.bargeIns, li, 20);
    const old = entries.get(msg.old_turn_id);
    if (old && typeof msg.cleared_ms === "number") {
      old.clearedMs = msg.cleared_ms;
      updateTag(old);
    }
  }

  function addError(msg) {
    const li = document.createElement("li");
    const where = msg.turn_id ? ` (turn ${shortId(msg.turn_id)})` : "";
    li.textContent = `${msg.code ? msg.code + ": " : ""}${msg.message || "error"}${where}`;
    prependCapped(ui.errors, li, 20);
  }

  // ---- helpers ---------------------------------------------------------------

  function resetPanel() {
    shown = { turnId: null, generation: -1 };
    ui.turnId.textContent = "";
    ui.turnGeneration.textContent = "";
    ui.turnState.textContent = "";
    delete ui.turnState.dataset.state;
    ui.turnStopReason.textContent = "";
    ui.sessionId.textContent = "";
    // Keep the transcript of earlier sessions, separated by a divider.
    if (ui.transcript.lastElementChild && !ui.transcript.lastElementChild.classList.contains("divider")) {
      const hr = document.createElement("li");
      hr.className = "divider";
      hr.setAttribute("role", "separator");
      hr.textContent = "new session";
      ui.transcript.append(hr);
    }
  }

  function prependCapped(list, li, max) {
    list.prepend(li);
    while (list.children.length > max) list.lastElementChild.remove();
  }

  const shortId = (id) => (id ? String(id).slice(0, 8) : "?");
  const fmtMs = (ms) => (typeof ms === "number" ? `${ms.toFixed(ms < 10 ? 1 : 0)} ms` : "?");

  ui.connect.addEventListener("click", () => { connect(); });
  ui.disconnect.addEventListener("click", disconnect);
  window.addEventListener("pagehide", disconnect);
})();
