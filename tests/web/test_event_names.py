"""The clients read the catalogue's names: every event type the browser
client (web/static/client.js) and the headless client (client/call.py) handle,
every field they read of it, and every message they send, is declared in
turn/event_catalogue.py. A rename on either side fails here, not silently
in a browser."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from turn import client_messages
from turn import event_catalogue as cat
from web.webrtc_transport import PTT_ERRORS

ROOT = Path(__file__).resolve().parents[2]
CLIENT_JS = ROOT / "web" / "static" / "client.js"
#: the headless client (moving to a top-level client/ package)
CALL_PY = ROOT / "client" / "call.py"

#: (type, field) a client reads that no emitter sends, known and reported:
#: client.js skips an agent.delta with ``withheld``, but withheld deltas are
#: logged fenced and never delivered, and the field is never in the payload
KNOWN_DEAD_READS = {("agent.delta", "withheld")}


def fields_of(type: str) -> set[str]:
    return set(cat.MODEL_OF[type].model_fields)


def js_functions(src: str) -> dict[str, tuple[list[str], str]]:
    """name -> (parameter names, body) of every ``function name(...) {...}``."""
    out: dict[str, tuple[list[str], str]] = {}
    for m in re.finditer(r"function\s+(\w+)\s*\(([^)]*)\)\s*\{", src):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            i += 1
        out[m.group(1)] = ([p.strip() for p in m.group(2).split(",") if p.strip()], src[m.end() : i - 1])
    return out


def js_args(src: str, start: int) -> list[str]:
    """The top-level arguments of the call whose "(" is at ``start``."""
    args, depth, cur = [], 0, ""
    for ch in src[start + 1 :]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return args + [cur.strip()]


def js_reads(body: str, var: str, functions: dict[str, tuple[list[str], str]], seen: set[str]) -> set[str]:
    """Fields of ``var`` read in ``body``, and in the functions it is passed to."""
    reads = set(re.findall(rf"\b{var}\.(\w+)", body))
    for call in re.finditer(r"\b(\w+)\(", body):
        name = call.group(1)
        if name not in functions or name in seen:
            continue
        args = js_args(body, call.end() - 1)
        if var in args:
            params, inner = functions[name]
            seen.add(name)
            reads |= js_reads(inner, params[args.index(var)], functions, seen)
    return reads


def test_client_js_handles_only_catalogue_events_and_reads_their_fields() -> None:
    src = CLIENT_JS.read_text()
    functions = js_functions(src)
    params, body = functions["handleEvent"]
    assert params == ["c", "msg"] and "switch (msg.type)" in body
    cases = list(re.finditer(r'case "([^"]+)":', body))
    handled = [m.group(1) for m in cases]
    assert {"turn", "agent.delta", "barge_in", "error", "pong"} <= set(handled)  # the parse found the switch
    assert set(handled) <= set(cat.MODEL_OF), set(handled) - set(cat.MODEL_OF)
    assert not set(re.findall(r'(?<!typeof )msg\.type\s*[!=]==?\s*"([^"]+)"', src)) - set(cat.MODEL_OF)
    problems = []
    for m, nxt in zip(cases, [*cases[1:], None], strict=True):
        block = body[m.end() : nxt.start() if nxt else len(body)]
        read = js_reads(block, "msg", functions, set())
        for field in sorted(read - fields_of(m.group(1))):
            if (m.group(1), field) not in KNOWN_DEAD_READS:
                problems.append(f"{m.group(1)}.{field}")
    assert not problems, f"client.js reads fields the catalogue does not declare: {problems}"
    # the reads were found (the parse follows handleEvent into its helpers)
    assert js_reads(body[body.index('case "turn":') :], "msg", functions, set()) >= {"status", "label", "stop_reason"}


def test_client_js_sends_only_catalogue_messages() -> None:
    src = CLIENT_JS.read_text()
    sent = set(re.findall(r'sendPtt\(\w+, "([^"]+)"\)', src)) | set(re.findall(r'JSON\.stringify\(\{\s*type:\s*"([^"]+)"', src))
    assert sent == {"ptt.start", "ptt.end", "ping"}
    assert sent <= set(client_messages.CLIENT_MODEL_OF)
    refusals = re.search(r"const PTT_ERRORS = new Set\(\[([^\]]*)\]\)", src)
    assert refusals is not None
    codes = set(re.findall(r'"([^"]+)"', refusals.group(1)))
    assert codes == set(PTT_ERRORS) and codes <= set(cat.ErrorCode.__args__)


def _type_test(node: ast.expr) -> set[str] | None:
    """The event types an ``if`` test compares the event's type with
    (``kind == "x"``, ``ev.get("type") in ("x", "y")``, also as a term of
    an ``and``), or None."""
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
        found = [t for v in node.values if (t := _type_test(v)) is not None]
        return set().union(*found) if found else None
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1):
        return None
    left, right = node.left, node.comparators[0]
    is_type = (isinstance(left, ast.Name) and left.id == "kind") or (
        isinstance(left, ast.Call) and isinstance(left.func, ast.Attribute) and left.func.attr == "get"
        and isinstance(left.func.value, ast.Name) and left.func.value.id == "ev"
        and [a.value for a in left.args if isinstance(a, ast.Constant)] == ["type"]
    )
    if not is_type:
        return None
    if isinstance(node.ops[0], ast.Eq) and isinstance(right, ast.Constant):
        return {right.value}
    if isinstance(node.ops[0], ast.In) and isinstance(right, ast.Tuple):
        return {e.value for e in right.elts if isinstance(e, ast.Constant)}
    return None


def _ev_reads(nodes: list[ast.stmt]) -> set[str]:
    """Fields of ``ev`` read in ``nodes``: ``ev["x"]`` and ``ev.get("x")``."""
    out: set[str] = set()
    for node in (n for stmt in nodes for n in ast.walk(stmt)):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "ev":
            if isinstance(node.slice, ast.Constant):
                out.add(node.slice.value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "ev" and node.args
              and isinstance(node.args[0], ast.Constant)):
            out.add(node.args[0].value)
    return out


#: server -> device message types of the xiaozhi-esp32 protocol (web/devices/messages.py)
DEVICE_PROTOCOL_TYPES = {"hello", "stt", "llm", "tts", "alert", "mcp", "system", "custom"}


def test_headless_client_reads_catalogue_names() -> None:
    assert CALL_PY.exists(), "the headless client (client/call.py) is gone"
    tree = ast.parse(CALL_PY.read_text())
    compared: set[str] = set()
    problems = []
    # every module of the headless clients that reads events (WebRTC, phone, their shared turn view)
    for path in sorted((ROOT / "client").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.If) and (types := _type_test(node.test)) is not None:
                if path.name.startswith("device"):
                    # the device simulator also reads the firmware protocol's
                    # own messages (xiaozhi-esp32 docs/websocket.md 4.2), which
                    # are not catalogue events
                    types = types - DEVICE_PROTOCOL_TYPES
                compared |= types
                for type in types:
                    if type in cat.MODEL_OF:
                        problems += [f"{path.name}: {type}.{f}" for f in sorted(_ev_reads(node.body) - fields_of(type))]
    assert {"turn", "transcript", "agent.delta", "barge_in", "backchannel", "agent.interrupted"} <= compared  # the parse found them
    assert compared <= set(cat.MODEL_OF), compared - set(cat.MODEL_OF)
    assert not problems, f"the headless clients read fields the catalogue does not declare: {problems}"
    sent = {  # self._send({"type": ...}) on the data channel
        msg.values[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_send"
        and node.args and isinstance(msg := node.args[0], ast.Dict) and msg.keys
        and isinstance(msg.keys[0], ast.Constant) and msg.keys[0].value == "type" and isinstance(msg.values[0], ast.Constant)
    }
    assert {"ptt.start", "ptt.end"} <= sent
    assert sent <= set(client_messages.CLIENT_MODEL_OF), sent - set(client_messages.CLIENT_MODEL_OF)
