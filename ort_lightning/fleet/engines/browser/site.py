"""The web side of a browser fleet: one page, its scripts, the device files and the page's WebSocket.

Routes of `web_app` (Starlette, served by uvicorn in `BrowserFleet`):

- ``GET /?token=T``: the page (``page.html`` of the devices' ``web/`` folder); a missing or wrong token is a 403.
- ``GET /fleet/devices/web/<script>`` and ``GET /web/<script>``: the page's scripts (`SCRIPTS`) at their paths in
  the package, so that their relative imports resolve alike in a page and in Node.
- ``GET /device/<role>?token=T``: the device files (``training``, ``eval``, ``optimizer``, ``checkpoint``).
- ``GET /data.js?token=T``: the user's data module, when the fleet has one (``page_data``).
- ``GET /ort/...``: onnxruntime-web's ``dist/`` folder, when `find_ort_web` found one on disk (a
  URL given instead is imported by the page from there).
- ``WS /join?token=T&name=N``: the device's connection (frames: `ort_lightning.fleet.devices.frames`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket, WebSocketDisconnect

from ort_lightning.fleet.engines.browser.hub import POLICY_VIOLATION, RUN_FINISHED, TOO_BIG, BrowserDevice, Hub
from ort_lightning.web import TRAINING_BUILD, asset, wire

__all__ = ["ROLES", "SCRIPTS", "web_app"]

#: The device files by the names runner.js's openDevice takes.
ROLES = ("training", "eval", "optimizer", "checkpoint")
#: The page's scripts by their folder in the package: the devices' room, and `ort_lightning.web` (runner and wire).
SCRIPTS = {"fleet/devices/web": ("page.js", "device.js", "frames.js", "secagg.js", "secagg_crypto.js",
                                 "secagg_shamir.js", "secagg_masks.js"),
           "web": ("runner.js", "wire.js", "wire.json")}
#: Where the device's scripts and page lie: the devices' room (`ort_lightning.fleet.devices`), beside their frames.
_SCRIPTS = Path(__file__).resolve().parents[2] / "devices" / "web"
#: WebSocket close code of a page that leaves on purpose (its leave button; wire.json's ``left``).
NORMAL_CLOSURE: int = wire()["closes"]["left"]
#: Why a page that closed with NORMAL_CLOSURE is gone: it left on purpose, which fails nothing.
_LEAVING = "pressed its leave button"
_WRONG_TOKEN = ("This fleet's join token is missing or wrong (a page of another fleet, or of a run started with "
                "another token, has another): open the URL the fleet printed (http://HOST:PORT/?token=...), with its "
                "token.")
_LOG = logging.getLogger("ort_lightning.fleet.engines.browser")


def _refuse_token(what: str, address: str) -> None:
    # NOTE: the log names the address, never the token that was sent: a wrong token may be a near miss of the right one.
    _LOG.warning("%s from %s came with a missing or wrong join token (another fleet's page, or one of a run with "
                 "another token); refused", what, address)


def _address(connection: Request | WebSocket) -> str:
    client = connection.client
    return f"{client.host}:{client.port}" if client else "unknown"


def _close_reason(code: int | None, frame_limit: int) -> str:
    if code == TOO_BIG:
        return f"sent a frame over the size limit of {frame_limit} bytes, so its connection was closed"
    if code == NORMAL_CLOSURE:
        return _LEAVING
    return f"closed its page or lost its connection (WebSocket close code {code})"


class _Site:
    """The handlers of `web_app`, over one `Hub`."""

    def __init__(
        self, hub: Hub, *, token: str, files: dict[str, Path], ort: str, frame_limit: int, page_data: Path | None,
        fleet: str, exchange: dict[str, Any] | None, served: dict[str, int] | None,
    ) -> None:
        self.hub, self.token, self.files, self.frame_limit, self.fleet = hub, token, files, frame_limit, fleet
        self.page_data = page_data
        self.exchange = exchange or {"mode": "all", "size": hub.parameters, "spans": [[0, hub.parameters]]}
        # NOTE: a page keeps the files it downloaded under their digests, and takes them from there on a later join.
        self.digests = {role: _sha256(path) for role, path in files.items()}
        self.served = served if served is not None else {}
        self.ort_module = f"{ort}/{TRAINING_BUILD}" if ort.startswith(("http://", "https://")) else \
            f"/ort/{TRAINING_BUILD}"

    def admitted(self, token: str | None) -> bool:
        return token is not None and secrets.compare_digest(token.encode(), self.token.encode())

    async def page(self, request: Request) -> Response:
        if not self.admitted(request.query_params.get("token")):
            _refuse_token("a page", _address(request))
            return PlainTextResponse(_WRONG_TOKEN, status_code=403)
        return FileResponse(_SCRIPTS / "page.html", media_type="text/html")

    async def script(self, request: Request) -> Response:
        folder, _, name = request.url.path.strip("/").rpartition("/")
        path = asset(name) if folder == "web" else _SCRIPTS / name
        return FileResponse(path, media_type="application/json" if name.endswith(".json") else "text/javascript")

    async def device_file(self, request: Request) -> Response:
        if not self.admitted(request.query_params.get("token")):
            return PlainTextResponse(_WRONG_TOKEN, status_code=403)
        role = request.path_params["role"]
        if role not in self.files:
            return PlainTextResponse(f"No device file {role!r}; the roles are {list(ROLES)}.", status_code=404)
        self.served[role] = self.served.get(role, 0) + self.files[role].stat().st_size
        return FileResponse(self.files[role], media_type="application/octet-stream")

    async def data_module(self, request: Request) -> Response:
        if not self.admitted(request.query_params.get("token")):
            return PlainTextResponse(_WRONG_TOKEN, status_code=403)
        if self.page_data is None:
            return PlainTextResponse("This fleet ships its batches to the pages; it has no data module.",
                                     status_code=404)
        return FileResponse(self.page_data, media_type="text/javascript")

    async def join(self, socket: WebSocket) -> None:
        await socket.accept()
        address = _address(socket)
        if not self.admitted(socket.query_params.get("token")):
            # NOTE: accepted first, so that the page can show why: a refused handshake reaches it as a bare 403.
            _refuse_token("a device's connection", address)
            await socket.close(code=POLICY_VIOLATION, reason="wrong join token (another fleet's, or an earlier run's); "
                                                             "open the URL the fleet printed")
            return
        if self.hub.finished:
            await socket.close(code=RUN_FINISHED, reason="the fleet's run finished")
            return
        device = BrowserDevice(socket.query_params.get("name", ""), address, send=lambda frame: _send(socket, frame),
                               close=lambda code, why: _close(socket, code, why))
        self.hub.join(device)
        files = {role: f"/device/{role}?token={self.token}" for role in self.files}
        data = None if self.page_data is None else f"/data.js?token={self.token}"
        await socket.send_text(json.dumps({"type": "welcome", "fleet": self.fleet, "device": device.name,
                                           "ort": self.ort_module,
                                           "files": files, "digests": self.digests, "exchange": self.exchange,
                                           "parameters": self.hub.parameters, "data": data,
                                           "order": self.hub.weight_order.names}))
        reason = await self._listen(socket, device)
        self.hub.lost(device, f"{device.name} {reason}", left=reason == _LEAVING)

    async def _listen(self, socket: WebSocket, device: BrowserDevice) -> str:
        """Hand the device's frames to the hub until its socket closes; why it closed."""
        while True:
            try:
                event = await socket.receive()
            except (WebSocketDisconnect, RuntimeError):
                return _close_reason(None, self.frame_limit)
            if event["type"] == "websocket.disconnect":
                return _close_reason(event.get("code"), self.frame_limit)
            if event.get("bytes") is not None:
                self.hub.receive(device, event["bytes"])
                continue
            message = _json(event.get("text"))
            if message.get("type") not in _TEXT:
                reason = f"{device.name} sent a text frame that is not the fleet's wire format: {message['problem']}"
                self.hub.refuse(device, reason)
                # NOTE: closed here, before the handler returns: a handler that returns first drops the socket unsaid.
                await _close(socket, POLICY_VIOLATION, reason[:120])
                return f"was refused: {reason}"
            if message.get("type") == "ready":
                refused = self.hub.ready(device, message.get("parameters"), message.get("identity"))
                if refused is not None:
                    await _close(socket, POLICY_VIOLATION, refused[:120])
                    return f"was refused: {refused}"
                await _send(socket, json.dumps({"type": "admitted", "device": device.name,
                                                "partition": device.partition, "partitions": self.hub.partitions}))
            else:
                self.hub.receive(device, message)


#: The device's messages this site handles (wire.json's device messages): text frames here, the binary result in
#: `Hub.receive` (a SecAgg+ stage's answer too).
HANDLED = {"ready": "text", "error": "text", "result": "binary", "secagg": "binary"}
_TEXT = tuple(kind for kind, frame in HANDLED.items() if frame == "text")
#: What a device's text frame must be: a JSON object of these types (results travel as binary frames).
_EXPECTED = "a JSON object of type 'ready' or 'error' (results travel as binary frames); use the fleet's page"


def _json(text: str | None) -> dict[str, Any]:
    """The text frame's JSON object; else ``{"problem": ...}`` saying what it is instead."""
    try:
        value = json.loads(text or "")
    except json.JSONDecodeError:
        return {"problem": f"{(text or '')[:40]!r} is not JSON, but {_EXPECTED}"}
    if not isinstance(value, dict) or value.get("type") not in _TEXT:
        what = f"type {value.get('type')!r}" if isinstance(value, dict) else f"a JSON {type(value).__name__}"
        return {"problem": f"it is {what}, but {_EXPECTED}"}
    return value


async def _send(socket: WebSocket, frame: bytes | str) -> None:
    # NOTE: a socket that closed meanwhile is the hub's business (its receive loop reports it), not an error here.
    with contextlib.suppress(RuntimeError, WebSocketDisconnect, ConnectionError):
        await (socket.send_text(frame) if isinstance(frame, str) else socket.send_bytes(frame))


async def _close(socket: WebSocket, code: int, reason: str) -> None:
    with contextlib.suppress(RuntimeError, WebSocketDisconnect, ConnectionError):
        await socket.close(code=code, reason=reason)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def web_app(
    hub: Hub, *, token: str, files: dict[str, Path], ort: str, frame_limit: int, page_data: Path | None = None,
    fleet: str = "ort-lightning fleet", exchange: dict[str, Any] | None = None, served: dict[str, int] | None = None,
) -> Starlette:
    """The fleet's Starlette application.

    Args:
        hub: the devices and replies the WebSocket feeds.
        token: the fleet's join token.
        files: the device files by role (`ROLES`).
        ort: onnxruntime-web's ``dist/`` folder, or a URL that serves it (from `find_ort_web`).
        frame_limit: the largest frame a page may send, in bytes (uvicorn's ``ws_max_size`` enforces it).
        page_data: the user's data module (an ES module the page imports), or None.
        fleet: the fleet's name, which the page shows and keys its device identity by.
        exchange: `Exchange.describe` of the device folder (None: every value travels).
        served: counts the bytes of each device file served, by role, as they go out.
    """
    site = _Site(hub, token=token, files=files, ort=ort, frame_limit=frame_limit, page_data=page_data, fleet=fleet,
                 exchange=exchange, served=served)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()

        def schedule(coroutine: Coroutine[Any, Any, None]) -> concurrent.futures.Future[None]:
            return asyncio.run_coroutine_threadsafe(coroutine, loop)

        hub.bind(schedule)
        yield

    routes: list[Any] = [
        Route("/", site.page),
        *(Route(f"/{folder}/{name}", site.script) for folder, names in SCRIPTS.items() for name in names),
        Route("/device/{role}", site.device_file), Route("/data.js", site.data_module),
        WebSocketRoute("/join", site.join),
    ]
    if not ort.startswith(("http://", "https://")):
        routes.append(Mount("/ort", StaticFiles(directory=ort), name="ort"))
    return Starlette(routes=routes, lifespan=lifespan)
