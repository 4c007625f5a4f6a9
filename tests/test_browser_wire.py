"""The browser fleet's wire, defined once (``ort_lightning/web/wire.json``), against both of its sides.

A side names a message type or a WebSocket close code only from that file: the shipped JavaScript through
``wire.js`` (no literal type or code at all), the server's Python by the types it lists (its close codes are read
from it). Each message type it lists is handled by the side that receives it: ``device.js``'s ``HANDLERS`` for the
server's messages, ``site.HANDLED`` for the device's. A type or code that one side adds and the file lacks, or one
the file gains and its receiver does not handle, fails here.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import tokenize
from pathlib import Path

import pytest

from ort_lightning.web import wire

from ._web import ROOT
from .helpers import RunIf

pytest.importorskip("starlette", reason='the browser fleet is not installed: pip install -e ".[fleet]"')

from ort_lightning.fleet.engines.browser import site  # noqa: E402

PACKAGE = ROOT / "ort_lightning"
DEVICES = PACKAGE / "fleet" / "devices"
SCRIPTS = sorted([*(PACKAGE / "web").glob("*.js"), *(DEVICES / "web").glob("*.js"), *(DEVICES / "web").glob("*.mjs")])
SERVER = sorted([*(PACKAGE / "fleet" / "engines" / "browser").glob("*.py"), DEVICES / "frames.py"])
#: A literal message type or close code in JavaScript: `type: 'x'`, `.type === 'x'`, `close(1000`, `code === 4000`.
JS_TYPE = re.compile(r"""\btype\s*(?::|[!=]==?)\s*['"`](\w+)['"`]""")
JS_CODE = re.compile(r"(?:\bclose\(|\bcode\s*[!=]==?|\bincludes\()\s*(\d+)")
#: `type` literals that are no message: tensor types (wire.js's ARRAYS) and an import attribute (`type: 'json'`).
NOT_MESSAGES = {"float32", "int64", "int32", "bool", "json"}


def _types() -> set[str]:
    messages = wire()["messages"]
    return {*messages["server"], *messages["device"]}


def _js_code(path: Path) -> str:
    """The script without its comments."""
    return re.sub(r"/\*.*?\*/|(?<![:'\"`])//[^\n]*", "", path.read_text(encoding="utf-8"), flags=re.S)


def _python_literals(path: Path) -> tuple[list[str], list[int]]:
    """The message types a module writes or compares as literals, and the close codes it writes as numbers."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
              if t.type in (tokenize.NAME, tokenize.OP, tokenize.STRING, tokenize.NUMBER)]
    types: list[str] = []
    codes: list[int] = []
    for index, token in enumerate(tokens):
        if token.type == tokenize.STRING and token.string.strip("'\"") == "type" and index + 2 < len(tokens):
            after = tokens[index + 1: index + 12]
            # `"type": "x"`; or `.get("type") == "x"`, `not in ("x", "y")`, `["type"] == "x"`
            if after[0].string == ":":
                types += [after[1].string.strip("'\"")] if after[1].type == tokenize.STRING else []
            elif after[0].string in ")]" and after[1].string in ("==", "!=", "in", "not"):
                for other in after[2:]:
                    if other.type == tokenize.STRING:
                        types.append(other.string.strip("'\""))
                    elif other.string not in ("in", "(", ","):
                        break
        if token.type == tokenize.NUMBER and index >= 2 and token.string.isdigit():
            before = (tokens[index - 2].string, tokens[index - 1].string)
            if before in (("code", "="), ("close", "(")) or before[1] in ("==", "!="):
                codes.append(int(token.string))
    # NOTE: an ASGI event's type (websocket.receive, websocket.disconnect) is Starlette's, not the wire's.
    return [t for t in types if "." not in t], [c for c in codes if 1000 <= c <= 4999]


def test_each_side_names_message_types_and_close_codes_only_from_the_wire() -> None:
    javascript = {path.name: ([t for t in JS_TYPE.findall(_js_code(path)) if t not in NOT_MESSAGES],
                              JS_CODE.findall(_js_code(path))) for path in SCRIPTS}
    assert {"wire.js", "runner.js", "device.js", "page.js", "frames.js", "node_device.mjs"} <= set(javascript)
    assert {name: found for name, found in javascript.items() if found != ([], [])} == {}, (
        "the shipped JavaScript names message types and close codes through wire.js (MESSAGE.x, CLOSE.x): add a new "
        "one to ort_lightning/web/wire.json")
    python = {path.name: _python_literals(path) for path in SERVER}
    named = {t for types, _ in python.values() for t in types}
    assert {"welcome", "admitted", "notice", "ready", "train"} <= named  # the scan sees them
    assert named - _types() == set(), f"the server names message types that ort_lightning/web/wire.json lacks: {named}"
    assert {name: codes for name, (_, codes) in python.items() if codes} == {}, (
        "the server reads its close codes from ort_lightning/web/wire.json (ort_lightning.web.wire())")


@RunIf(node=True)
def test_each_message_type_of_the_wire_is_handled_by_the_side_it_goes_to() -> None:
    messages = wire()["messages"]
    assert messages["device"] == site.HANDLED
    node = shutil.which("node")
    assert node is not None
    script = ("const {HANDLERS} = await import(process.argv[1]); const w = await import(process.argv[2]);"
              "console.log(JSON.stringify({handled: Object.keys(HANDLERS), close: w.CLOSE, server: w.SERVER_MESSAGES,"
              " device: w.DEVICE_MESSAGES}));")
    run = subprocess.run([node, "--input-type=module", "-e", script,
                          (DEVICES / "web" / "device.js").as_uri(),
                          (PACKAGE / "web" / "wire.js").as_uri()], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    javascript = json.loads(run.stdout)
    assert sorted(javascript["handled"]) == sorted(messages["server"])
    assert (javascript["server"], javascript["device"]) == (list(messages["server"]), list(messages["device"]))
    assert javascript["close"] == wire()["closes"]
