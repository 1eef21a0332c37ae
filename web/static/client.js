// turnkeeper browser client: plain JavaScript, no build step, no dependencies.
//
// Connect: microphone -> RTCPeerConnection (+ "events" data channel) -> offer,
// gathered completely (the server does not trickle ICE) -> POST
// /v1/webrtc/offer -> answer. The agent's voice comes back on the same audio
// transceiver; its events (turn states, transcript, reply tokens, barge-ins)
// arrive as JSON on the data channel and are rendered below.
//
// Push-to-talk: holding the "Hold to talk" button (or Space, outside text
// fields) sends {"type":"ptt.start"} on the data channel, releasing it sends
// {"type":"ptt.end"}. At most one start is outstanding; key repeat sends
// nothing more; losing the connection while held resets the button.
//
// A deploy: a draining server sends {"type":"session.draining","left_s"}.
// Once no turn is running and the agent is idle, the client opens a new
// session (the load balancer sends the offer to a serving instance) while
// the old one still plays, and switches over when the new one's media is
// connected: make before break. An offer refused meanwhile (503) is tried
// again after a second while time is left; a session that ends first is
// replaced by a fresh connection.
"use strict";

(() => {
  const ICE_GATHER_TIMEOUT_MS = 2000; // offer with what we have after this
  const PING_INTERVAL_MS = 5000;      // data channel round-trip probe
  const MOVE_RETRY_MS = 1000;         // a refused offer while moving is tried again after this

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
  // What the voice activity detector's events mean, for the panel.
  const VAD_LABELS = {
    speech_started: "speech?",        // maybe speech: the agent pauses
    speech_confirmed: "speech",
    speech_rejected: "noise (ignored)",
    speech_stopped: "silence",
    end_of_turn: "end of turn",
  };
  // Who started a barge-in.
  const INITIATORS = { vad: "voice", ptt: "push-to-talk" };
  // Refusals of push-to-talk messages (the server's error codes).
  const PTT_ERRORS = new Set(["ptt_already_active", "ptt_not_active", "session_not_ready"]);

  const $ = (id) => document.getElementById(id);
  const ui = {
    connect: $("connect"),
    disconnect: $("disconnect"),
    ptt: $("ptt"),
    pttState: $("ptt-state"),
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
  // Per-turn transcript entries, by turn id, and the first of each generation.
  const entries = new Map();
  const byGeneration = new Map();

  // ---- status line -----------------------------------------------------------

  function setStatus(text, state) {
    ui.status.textContent = text;
    ui.status.dataset.state = state;
  }

  function setButtons(connected) {
    ui.connect.disabled = connected;
    ui.disconnect.disabled = !connected;
    renderPtt();
  }

  // ---- connect / disconnect --------------------------------------------------

  function newConn() {
    return {
      pc: null, dc: null, stream: null, pinger: null, closedByUs: false, pings: new Map(),
      ready: false,  // the server's agent runs (session.ready): push-to-talk is accepted
      ptt: null,     // push-to-talk held, and by what: "pointer" | "key" | null
      remote: null,  // the agent's audio stream, attached once this connection is the current one
      busy: new Set(),   // turns not yet terminal
      phase: "idle",     // the agent's phase (agent.state)
      drainUntil: null,  // the server drains: it ends this session at this time (performance.now() ms)
      successor: null,   // the connection opened to replace this one (a drain)
      retry: null,       // timer of the next attempt to open a successor
    };
  }

  // A connection still wanted: the current one, or the one replacing it.
  const wanted = (c) => conn === c || (conn !== null && conn.successor === c);

  async function connect() {
    if (conn) return;
    const c = newConn();
    conn = c;
    setButtons(true);
    resetPanel();
    try {
      await open(c);
    } catch (err) {
      if (conn !== c) return teardown(c);
      fail(c, err.message || String(err));
    }
  }

  // Microphone, peer connection, offer, answer for `c`. Throws on failure;
  // returns early (tearing `c` down) once `c` is no longer wanted.
  async function open(c) {
    if (conn === c) setStatus("Requesting microphone…", "connecting");
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
    if (!wanted(c)) return teardown(c);
    // a successor listens only once it takes over (the old session still runs)
    if (conn !== c) stream.getAudioTracks().forEach((t) => { t.enabled = false; });

    const pc = new RTCPeerConnection();
    c.pc = pc;
    // The data channel must exist before the offer so it is negotiated in it.
    const dc = pc.createDataChannel("events");
    c.dc = dc;
    wireDataChannel(c, dc);
    for (const track of stream.getAudioTracks()) pc.addTrack(track, stream);

    pc.ontrack = (ev) => {
      c.remote = ev.streams[0] || new MediaStream([ev.track]);
      if (conn === c) playRemote(c);
    };
    pc.onconnectionstatechange = () => onConnectionState(c);

    if (conn === c) setStatus("Preparing offer…", "connecting");
    await pc.setLocalDescription(await pc.createOffer());
    await iceGatheringComplete(pc, ICE_GATHER_TIMEOUT_MS);
    if (!wanted(c)) return teardown(c);

    if (conn === c) setStatus("Sending offer…", "connecting");
    const answer = await postOffer(pc.localDescription, echoCancellation(stream));
    if (!wanted(c)) return teardown(c);
    c.sessionId = answer.session_id || "";
    if (conn === c) ui.sessionId.textContent = c.sessionId;
    await pc.setRemoteDescription({ type: "answer", sdp: answer.sdp });
    if (conn === c) setStatus("Connecting media…", "connecting");
  }

  function playRemote(c) {
    ui.audio.srcObject = c.remote;
    ui.audio.play().catch(() => { /* autoplay policy: the Connect click normally allows it */ });
  }

  // ---- moving to another server (a drain) -----------------------------------

  function onDraining(c, msg) {
    if (c.drainUntil !== null) return;
    c.drainUntil = performance.now() + 1000 * (Number(msg.left_s) || 0);
    setStatus(`The server is restarting (${msg.reason || "drain"}); moving to another one between turns…`, "connecting");
    maybeMove(c);
  }

  // Open the successor of a draining connection once it is between turns.
  function maybeMove(c) {
    if (conn !== c || c.drainUntil === null || c.successor || c.retry) return;
    if (c.busy.size > 0 || c.phase !== "idle" || c.ptt) return; // after this turn
    const s = newConn();
    c.successor = s;
    open(s).catch((err) => {
      if (c.successor !== s) return;
      c.successor = null;
      teardown(s);
      // refused (the balancer still sent us to a draining server): again while time is left
      if (conn === c && performance.now() + MOVE_RETRY_MS < c.drainUntil) {
        c.retry = setTimeout(() => { c.retry = null; maybeMove(c); }, MOVE_RETRY_MS);
      } else if (conn === c) {
        addError({ code: "move_failed", message: `could not move to another server: ${err.message || err}` });
      }
    });
  }

  // The successor `s` of the current connection `old` is connected: switch.
  function takeOver(old, s) {
    old.successor = null;
    old.closedByUs = true;
    conn = s;
    teardown(old);
    resetPanel();
    ui.sessionId.textContent = s.sessionId || "";
    if (s.stream) s.stream.getAudioTracks().forEach((t) => { t.enabled = true; });
    if (s.remote) playRemote(s);
    renderPtt();
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
    if (c.retry) clearTimeout(c.retry);
    c.retry = null;
    if (c.successor) { const s = c.successor; c.successor = null; if (conn !== s) teardown(s); }
    // Released with the connection: tell the server if it can still hear us
    // (a Disconnect while held), and never leave the button pressed.
    if (c.ptt && c.dc && c.dc.readyState === "open") sendPtt(c, "ptt.end");
    c.ptt = null;
    c.ready = false;
    if (c.pinger) clearInterval(c.pinger);
    c.pinger = null;
    if (c.dc) { try { c.dc.close(); } catch (_) { /* already closed */ } }
    if (c.pc) { try { c.pc.close(); } catch (_) { /* already closed */ } }
    if (c.stream) c.stream.getTracks().forEach((t) => t.stop());
    c.dc = c.pc = c.stream = null;
    renderPtt();
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
    if (!c.pc) return;
    if (conn !== null && conn.successor === c) {
      if (c.pc.connectionState === "connected") {
        takeOver(conn, c);
        setStatus("Moved to another server (the last one is restarting). Speak, or hold to talk.", "connected");
      } else if (["failed", "closed"].includes(c.pc.connectionState)) {
        const old = conn;
        old.successor = null;
        teardown(c);
        maybeMove(old);
      }
      return;
    }
    if (conn !== c) return;
    const state = c.pc.connectionState;
    if (state === "connected") {
      setStatus("Connected. Speak, or hold to talk; talk over the agent to interrupt it.", "connected");
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

  // The client token this offer presents (single use: one per session),
  // or null (a development server needs none). Where it comes from, first
  // found wins:
  //  1. window.turnkeeperClientToken: an async function of the embedding
  //     page that asks the app's backend (which calls POST /v1/sessions);
  //  2. <meta name="turnkeeper-token-url" content="/path">: a same-origin
  //     URL of the app's backend, POSTed to; it answers {"client_token"};
  //  3. #client_token=ck_... in the page's URL (a fragment never reaches a
  //     server or its logs); used once, then removed from the address.
  async function clientToken() {
    if (typeof window.turnkeeperClientToken === "function") {
      const t = await window.turnkeeperClientToken();
      return t || null;
    }
    const meta = document.querySelector('meta[name="turnkeeper-token-url"]');
    if (meta && meta.content) {
      const url = new URL(meta.content, location.href);
      if (url.origin !== location.origin) throw new Error("turnkeeper-token-url must be on this page's origin");
      const resp = await fetch(url, { method: "POST", credentials: "same-origin" });
      const body = await resp.json().catch(() => null);
      if (!resp.ok || !body || typeof body.client_token !== "string") {
        throw new Error(`Cannot get a client token from ${url.pathname} (HTTP ${resp.status})`);
      }
      return body.client_token;
    }
    const hash = new URLSearchParams(location.hash.slice(1));
    const token = hash.get("client_token");
    if (token) {
      hash.delete("client_token");
      const rest = hash.toString();
      history.replaceState(null, "", location.pathname + location.search + (rest ? `#${rest}` : ""));
      return token;
    }
    return null;
  }

  // Whether the microphone runs the browser's echo canceller, as the track
  // reports it (MediaTrackSettings.echoCancellation), or undefined when the
  // browser does not say: the server's echo guard then assumes less of it.
  function echoCancellation(stream) {
    const track = stream.getAudioTracks()[0];
    const value = track && track.getSettings ? track.getSettings().echoCancellation : undefined;
    return typeof value === "boolean" ? value : undefined;
  }

  // POST the offer (with what the microphone's echo canceller is, if
  // known); returns {type, sdp, session_id} or throws with the server's
  // error code and message.
  async function postOffer(desc, echo) {
    let resp;
    const headers = { "Content-Type": "application/json" };
    const token = await clientToken();
    if (token) headers.Authorization = `Bearer ${token}`;
    try {
      resp = await fetch("/v1/webrtc/offer", {
        method: "POST",
        headers,
        body: JSON.stringify({ type: desc.type, sdp: desc.sdp, echo_cancellation: echo }),
      });
    } catch (err) {
      throw new Error(`Cannot reach the server: ${err.message || err}`);
    }
    let body = null;
    try { body = await resp.json(); } catch (_) { /* not JSON */ }
    if (!resp.ok) {
      const e = body && body.error;
      const detail = e ? `${e.code}: ${e.message}` : `HTTP ${resp.status}`;
      if (resp.status === 401) {
        throw new Error(`Not allowed to talk to this agent (${detail}). Open this page with a client token from the app's backend.`);
      }
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
      renderPtt();
    };
    dc.onclose = () => {
      if (c.ptt) c.ptt = null;
      renderPtt();
      // The server ends a session by closing the peer connection; the event
      // channel closing is the first sign of it.
      if (conn === c && !c.closedByUs && c.drainUntil !== null) {
        // a draining server ended it before we moved: the successor, or a fresh connection
        const s = c.successor;
        c.successor = null;
        c.closedByUs = true;
        teardown(c);
        conn = null;
        if (s) {
          conn = s;
          resetPanel();
          if (s.stream) s.stream.getAudioTracks().forEach((t) => { t.enabled = true; });
          if (s.remote) playRemote(s);
          setStatus("Reconnecting to another server…", "connecting");
        } else {
          connect();
        }
        return;
      }
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
    if (conn !== c) {  // a successor before it takes over: nothing of it is shown yet
      if (msg.type === "session.ready") c.ready = true;
      return;
    }
    switch (msg.type) {
      case "session.draining":
        onDraining(c, msg);
        break;
      case "session.ready":
        ui.sessionId.textContent = msg.session_id || ui.sessionId.textContent;
        c.ready = true;
        renderPtt();
        break;
      case "vad":
        ui.vad.textContent = VAD_LABELS[msg.event] || String(msg.event || "-");
        ui.vad.dataset.event = String(msg.event || "");
        break;
      case "turn":
        if (TERMINAL.has(msg.status)) c.busy.delete(msg.turn_id); else c.busy.add(msg.turn_id);
        onTurn(msg);
        maybeMove(c);
        break;
      case "transcript":
        if (msg.role === "user") setUserText(entryFor(msg.turn_id, msg.generation), msg.text);
        break;
      case "agent.delta": {
        if (msg.withheld) break; // never meant for us (the server fences these anyway)
        const e = entryFor(msg.turn_id, msg.generation);
        e.li.setAttribute("aria-busy", "true");
        e.delivered += msg.text || "";
        renderAgent(e);
        break;
      }
      case "agent.restart": {
        // the turn runs on at another server: its reply streams again from the start
        const e = entryFor(msg.turn_id, msg.generation);
        e.delivered = "";
        renderAgent(e);
        break;
      }
      case "agent.done": {
        const e = entryFor(msg.turn_id, msg.generation);
        e.delivered = msg.text || "";
        renderAgent(e);
        e.li.removeAttribute("aria-busy");
        break;
      }
      case "agent.interrupted":
        onInterrupted(msg);
        break;
      case "end_of_turn":
        // the reply that started at the pause is taken back: the user went on
        if (msg.outcome === "withdrawn" && msg.turn_id) withdraw(msg.turn_id, msg.generation);
        break;
      case "false_interruption":
        addNote(msg, "false-interruption", `paused ${fmtMs(msg.paused_ms)} for a noise, resumed`);
        break;
      case "backchannel": {
        const paused = msg.paused_ms > 0 ? ` (paused ${fmtMs(msg.paused_ms)})` : "";
        addNote(msg, "backchannel", `backchannel “${msg.text || ""}”, kept talking${paused}`);
        break;
      }
      case "stop_deferred":
        onStopDeferred(msg);
        break;
      case "stt.failover": {
        const then = { reconnect: "reconnecting", fallback: `now heard by ${msg.fallback}`, failed: "no recogniser left" }[msg.action];
        addNote(msg, "stt-failover", `speech recogniser ${msg.provider} failed (${msg.error}): ${then || msg.action}`);
        break;
      }
      case "tts.failover": {
        const then = { reconnect: "reconnecting", fallback: `now spoken by ${msg.fallback}`, failed: "the reply ends here" }[msg.action];
        addNote(msg, "tts-failover", `speech synthesiser ${msg.provider} failed (${msg.error}): ${then || msg.action}`);
        break;
      }
      case "agent.state":
        if (msg.generation >= shown.generation) {
          ui.agentPhase.textContent = msg.phase;
          c.phase = msg.phase;
        }
        maybeMove(c);
        break;
      case "barge_in":
        addBargeIn(msg);
        break;
      case "error":
        addError(msg);
        if (PTT_ERRORS.has(msg.code)) onPttRefused(c, msg);
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

  // A reply started at the user's pause and taken back when they went on
  // (stop reason speculation_withdrawn): nothing of it was heard or done, and
  // the next turn answers the whole request. It is no turn of the user's:
  // its transcript entry goes, and it is shown as "withdrawn", never as
  // stopped, cancelled or interrupted.
  const WITHDRAWN = "speculation_withdrawn";

  function withdraw(turnId, generation) {
    const e = entryFor(turnId, generation);
    e.withdrawn = true;
    e.li.remove();
    if (byGeneration.get(generation) === e) byGeneration.delete(generation);
    return e;
  }

  function onTurn(msg) {
    const taken = msg.stop_reason && msg.stop_reason.kind === WITHDRAWN;
    const label = taken ? "withdrawn" : msg.label || STATUS_LABELS[msg.status] || String(msg.status).toLowerCase();
    const e = taken ? withdraw(msg.turn_id, msg.generation) : entryFor(msg.turn_id, msg.generation);
    e.li.dataset.state = label;
    e.badge.textContent = label;
    e.badge.dataset.state = label;
    if (e.withdrawn) {
      showTurn(msg, label);
      logTurn(msg, label);
      return;
    }
    if (msg.transcript && !e.userText.textContent) setUserText(e, msg.transcript);

    if (msg.reply) e.reply = msg.reply;
    if (msg.status === "COMPLETED" && msg.reply && !e.delivered) {
      e.delivered = msg.reply;
      renderAgent(e);
    }
    if (msg.status === "CANCELLED" || msg.status === "RECONCILE_REQUIRED") markInterrupted(e);
    if (msg.status === "FAILED" && !e.userText.textContent && msg.error === "no_speech_recognized") {
      setUserText(e, "");
    }
    if (TERMINAL.has(msg.status)) e.li.removeAttribute("aria-busy");

    showTurn(msg, label);
    logTurn(msg, label);
  }

  // The panel follows the newest turn; an older turn's later states still
  // go to the state-change log and its transcript entry.
  function showTurn(msg, label) {
    if (msg.generation < shown.generation) return;
    shown = { turnId: msg.turn_id, generation: msg.generation };
    ui.turnId.textContent = msg.turn_id;
    ui.turnGeneration.textContent = String(msg.generation);
    ui.turnState.textContent = label;
    ui.turnState.dataset.state = label;
    ui.turnStopReason.textContent = describeStopReason(msg.stop_reason, msg.error);
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

  // An interrupted reply: tag it "(interrupted)". What the user heard
  // (agent.interrupted) stays plain; the rest of the reply, spoken too late or
  // never delivered (fenced by the barge-in), is struck through and dimmed.
  function markInterrupted(e) {
    e.interrupted = true;
    e.li.classList.add("interrupted");
    e.tag.hidden = false;
    renderAgent(e);
  }

  // agent.interrupted: how much of the reply reached the user's ears.
  function onInterrupted(msg) {
    const e = entryFor(msg.turn_id, msg.generation);
    e.heard = typeof msg.heard === "string" ? msg.heard : "";
    if (typeof msg.played_ms === "number") e.playedMs = msg.played_ms;
    e.li.dataset.heard = e.heard;
    markInterrupted(e);
  }

  // The agent line of entry `e`: the text received, split into heard and
  // unheard once the reply was interrupted.
  function renderAgent(e) {
    if (!e.interrupted) {
      e.agentText.textContent = e.delivered;
      return;
    }
    for (const old of e.agent.querySelectorAll(".unheard, .fenced")) old.remove();
    const delivered = e.delivered.trim();
    const reply = (e.reply || "").trim();
    // The whole reply as far as we know it: the store's record may hold more
    // than reached us (the barge-in fenced the rest).
    const full = reply.length > delivered.length && reply.startsWith(delivered) ? reply : delivered;
    const split = e.heard === null ? null : splitHeard(full, e.heard);
    if (split) {
      e.agentText.textContent = split[0];
      if (split[1].trim()) {
        e.agent.insertBefore(struck("unheard", "not heard (interrupted before it was played)", split[1]), e.tag);
      }
    } else if (e.heard !== null) {
      // Heard text that is not a prefix of what we have: show what was heard.
      e.agentText.textContent = e.heard;
    } else {
      e.agentText.textContent = e.delivered;
      if (full.length > delivered.length) {
        e.agent.insertBefore(struck("fenced", "generated but never delivered (fenced by the barge-in)",
          full.slice(delivered.length)), e.tag);
      }
    }
    updateTag(e);
  }

  // <s class=cls> with `text`, announced as "not heard" to screen readers.
  function struck(cls, title, text) {
    const s = document.createElement("s");
    s.className = cls;
    s.title = title;
    const sr = document.createElement("span");
    sr.className = "visually-hidden";
    sr.textContent = " (not heard:) ";
    s.append(sr, text);
    return s;
  }

  // ["heard part of full", "rest"] if `heard` is `full`'s beginning (ignoring
  // differences in white space); null if it is not.
  function splitHeard(full, heard) {
    let i = 0;
    let j = 0;
    const ws = /\s/;
    while (j < heard.length) {
      if (ws.test(heard[j])) { j++; continue; }
      while (i < full.length && ws.test(full[i])) i++;
      if (i >= full.length || full[i] !== heard[j]) return null;
      i++;
      j++;
    }
    return [full.slice(0, i), full.slice(i)];
  }

  // The text streams faster than it is spoken, so the reply may be complete
  // on screen though most of it was never heard: say how much was played,
  // how much queued speech the barge-in dropped, and who interrupted.
  function updateTag(e) {
    const parts = [];
    if (e.heard !== null) parts.push(e.heard ? `heard ${fmtS(e.playedMs)}` : "none of it heard");
    if (e.clearedMs > 0) parts.push(`${fmtS(e.clearedMs)} of speech not played`);
    if (e.initiator) parts.push(`by ${INITIATORS[e.initiator] || e.initiator}`);
    e.tag.textContent = parts.length ? `(interrupted; ${parts.join(", ")})` : "(interrupted)";
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
    e = {
      li, badge, user, userText, agent, agentText, tag,
      delivered: "",      // the reply text received (deltas, agent.done)
      reply: null,        // the reply as recorded (turn events)
      interrupted: false,
      heard: null,        // what of it the user heard (agent.interrupted)
      playedMs: 0,
      clearedMs: 0,
      initiator: null,    // who barged in on it
    };
    entries.set(turnId, e);
    const newest = byGeneration.get(generation);
    if (!newest) byGeneration.set(generation, e);
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
    const by = msg.initiator ? ` by ${INITIATORS[msg.initiator] || msg.initiator}` : "";
    if (msg.initiator) li.dataset.initiator = msg.initiator;
    const paused = msg.paused_ms > 0 ? `, paused ${fmtMs(msg.paused_ms)} before` : "";
    li.textContent =
      `gen ${msg.old_generation} → ${msg.generation}${by}: fenced ${fmtMs(msg.onset_to_fence_ms)} after onset${paused},` +
      ` ${fmtMs(msg.cleared_ms)} of audio cleared (turn ${shortId(msg.old_turn_id)})`;
    prependCapped(ui.bargeIns, li, 20);
    const old = entries.get(msg.old_turn_id);
    if (old) {
      if (typeof msg.cleared_ms === "number") old.clearedMs = msg.cleared_ms;
      if (msg.initiator) old.initiator = msg.initiator;
      updateTag(old);
    }
  }

  // A barge-in while a must-complete step commits: silent now, stopped later.
  function onStopDeferred(msg) {
    const text = msg.why === "must_complete"
      ? "stop deferred: a must-complete action is committing; the audio is silenced and the turn stops when it ends"
      : `stop deferred (${msg.why || "?"})`;
    addNote(msg, "stop-deferred", text);
    const li = document.createElement("li");
    li.dataset.oldTurnId = msg.turn_id || "";
    li.className = "deferred";
    li.textContent = `turn ${shortId(msg.turn_id)}: ${text}`;
    prependCapped(ui.bargeIns, li, 20);
  }

  // A small note in the transcript (false interruption, backchannel, ...):
  // inside the entry of the turn it concerns (by id, else by generation, the
  // turn the agent was speaking for), or on its own line.
  function addNote(msg, kind, text) {
    const e = (msg.turn_id && entries.get(msg.turn_id)) || byGeneration.get(msg.generation);
    const note = document.createElement(e ? "p" : "li");
    note.className = "note";
    note.dataset.kind = kind;
    note.textContent = text;
    if (e) e.li.append(note);
    else ui.transcript.append(note);
    note.scrollIntoView({ block: "nearest" });
  }

  function addError(msg) {
    const li = document.createElement("li");
    if (msg.code) li.dataset.code = msg.code;
    const where = msg.turn_id ? ` (turn ${shortId(msg.turn_id)})` : "";
    li.textContent = `${msg.code ? msg.code + ": " : ""}${msg.message || "error"}${where}`;
    prependCapped(ui.errors, li, 20);
  }

  // ---- helpers ---------------------------------------------------------------

  function resetPanel() {
    shown = { turnId: null, generation: -1 };
    byGeneration.clear(); // generations count from 1 again in a new session
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
  const fmtS = (ms) => `${((ms || 0) / 1000).toFixed(1)} s`;

  // ---- push-to-talk ----------------------------------------------------------

  // Push-to-talk can be used: connected, the events channel open, the agent running.
  function pttUsable(c) {
    return !!(c && conn === c && c.ready && c.dc && c.dc.readyState === "open");
  }

  function sendPtt(c, type) {
    try {
      c.dc.send(JSON.stringify({ type }));
      return true;
    } catch (err) {
      addError({ code: "send_failed", message: `could not send ${type}: ${err.message || err}` });
      return false;
    }
  }

  // Pressed (by "pointer" or "key"): one ptt.start, never two in a row.
  function pttPress(source) {
    const c = conn;
    if (!pttUsable(c) || c.ptt) return;
    if (!sendPtt(c, "ptt.start")) return;
    c.ptt = source;
    ui.pttState.dataset.state = "";
    renderPtt();
  }

  // Released by `source` (null: whatever holds it): ptt.end, if a start was sent.
  function pttRelease(source) {
    const c = conn;
    if (!c || !c.ptt || (source && c.ptt !== source)) return;
    c.ptt = null;
    if (c.dc && c.dc.readyState === "open") sendPtt(c, "ptt.end");
    renderPtt();
  }

  // The server refused a push-to-talk message.
  function onPttRefused(c, msg) {
    if (msg.code === "session_not_ready" && c.ptt) {
      c.ptt = null; // it never started: the release must not send ptt.end
      c.ready = false;
    }
    renderPtt();
    ui.pttState.textContent = `push-to-talk refused: ${msg.message || msg.code}`;
    ui.pttState.dataset.state = "error";
  }

  // The button and its state line follow the current connection.
  function renderPtt() {
    const c = conn;
    const held = !!(c && c.ptt);
    ui.ptt.disabled = !pttUsable(c) && !held;
    ui.ptt.setAttribute("aria-pressed", held ? "true" : "false");
    ui.ptt.dataset.state = held ? "held" : "";
    document.body.classList.toggle("ptt-held", held);
    if (held) {
      ui.pttState.textContent = "talking (push-to-talk)";
      ui.pttState.dataset.state = "talking";
    } else if (ui.pttState.dataset.state !== "error" || !c) {
      ui.pttState.textContent = "";
      ui.pttState.dataset.state = "";
    }
  }

  const isSpace = (ev) => ev.code === "Space" || ev.key === " ";

  // Space is push-to-talk except where it types (text fields).
  function typesText(el) {
    if (!el || !(el instanceof Element)) return false;
    if (el.isContentEditable) return true;
    if (el.tagName === "TEXTAREA" || el.tagName === "SELECT") return true;
    if (el.tagName !== "INPUT") return false;
    const NOT_TEXT = ["button", "checkbox", "radio", "range", "color", "file", "image", "reset", "submit"];
    return !NOT_TEXT.includes((el.type || "text").toLowerCase());
  }

  ui.ptt.addEventListener("pointerdown", (ev) => {
    if (ev.button !== 0) return; // primary button, touch or pen contact only
    ev.preventDefault();          // no focus change, no text selection
    pttPress("pointer");
  });
  for (const type of ["pointerup", "pointerleave", "pointercancel"]) {
    ui.ptt.addEventListener(type, () => pttRelease("pointer"));
  }
  ui.ptt.addEventListener("contextmenu", (ev) => ev.preventDefault()); // long press on touch screens

  document.addEventListener("keydown", (ev) => {
    if (!isSpace(ev) || ev.ctrlKey || ev.metaKey || ev.altKey || typesText(ev.target)) return;
    const c = conn;
    if (!pttUsable(c) && !(c && c.ptt)) return; // Space keeps its usual meaning (e.g. presses Connect)
    ev.preventDefault(); // no scrolling, no click of a focused button
    if (ev.repeat || c.ptt) return; // key repeat: still the same press
    pttPress("key");
  });
  document.addEventListener("keyup", (ev) => {
    if (!isSpace(ev)) return;
    const c = conn;
    if (c && c.ptt === "key") {
      ev.preventDefault();
      pttRelease("key");
    } else if (pttUsable(c) && !typesText(ev.target)) {
      ev.preventDefault();
    }
  });
  // A release we cannot see (focus left the window) ends the press.
  window.addEventListener("blur", () => pttRelease(null));
  document.addEventListener("visibilitychange", () => { if (document.hidden) pttRelease(null); });

  ui.connect.addEventListener("click", () => { connect(); });
  ui.disconnect.addEventListener("click", disconnect);
  window.addEventListener("pagehide", disconnect);
})();
