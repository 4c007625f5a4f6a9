"""The JavaScript SecAgg+ client in a Chromium page matches Flower 1.42.0's vectors, as it does in Node.

A page's WebCrypto is BoringSSL's, not Node's OpenSSL: PKCS#8 and SPKI import and export, ECDH,
HKDF, AES-CBC and HMAC must agree with Flower there too. ``tests/web/secagg_page.mjs`` runs the
vectors' checks (``tests/web/secagg_vectors.json``) in headless Chromium, served from the
repository on loopback (a secure context), and posts each check's verdict back.
"""

from __future__ import annotations

import functools
import json
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests._web import ROOT, chromium_program
from tests.fleet.devices.secagg_vectors import PATH
from tests.fleet.engines.browser.chromium import chromium

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(chromium_program() is None, reason="Chromium is not installed (.ci/run installs it)")]

PAGE = b"""<!doctype html><meta charset="utf-8"><script type="module">
let verdicts;
try {
  const { check } = await import('/tests/web/secagg_page.mjs');
  verdicts = await check(await (await fetch('/tests/web/secagg_vectors.json')).json());
} catch (error) {
  verdicts = { [`the page failed: ${error.stack}`]: false };
}
await fetch('/verdicts', { method: 'POST', body: JSON.stringify(verdicts) });
</script>"""


class _Handler(SimpleHTTPRequestHandler):
    def __init__(self, *args: Any, posted: list[bytes], done: threading.Event, **kwargs: Any) -> None:
        self._posted, self._done = posted, done
        super().__init__(*args, directory=str(ROOT), **kwargs)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path != "/secagg.html":
            super().do_GET()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def do_POST(self) -> None:  # noqa: N802
        self._posted.append(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(204)
        self.end_headers()
        self._done.set()

    def log_message(self, *_: Any) -> None:
        pass


def test_the_page_matches_flowers_vectors() -> None:
    posted: list[bytes] = []
    done = threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, posted=posted, done=done))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with chromium({"secagg": f"http://127.0.0.1:{server.server_port}/secagg.html"}):
            assert done.wait(timeout=120), "the Chromium page posted no verdicts within 120 s"
    finally:
        server.shutdown()
    verdicts = json.loads(posted[0])
    stored = json.loads(PATH.read_text(encoding="utf-8"))
    expected = len(stored["fernet"]) + len(stored["masks"]) + len(stored["shamir"]) + len(stored["quantization"]) \
        + len(stored["stages"]) + 3
    assert len(verdicts) == expected, verdicts
    assert [name for name, passed in verdicts.items() if not passed] == []
