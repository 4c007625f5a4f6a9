"""``python -m benchmarks.secagg``: what SecAgg+ costs a JavaScript device, in Node and in a Chromium page.

``benchmarks/secagg_cost.mjs`` runs a SecAgg+ round of N JavaScript clients (every device a neighbour
of every other) in one thread and times one device's stages for updates of 10 k, 100 k and 1 M
float32 values: setup, share keys, collect masked vectors (weight, quantize, mask, mod, ``.npy``)
and unmask, median of the rounds; and counts the bytes that device sends. It runs under Node, then
in headless Chromium, served from this repository on loopback, which posts its numbers back.

Usage::

    python -m benchmarks.secagg                               # 10k, 100k, 1M values, 5 devices, 3 rounds
    python -m benchmarks.secagg --sizes 10000 --devices 3 --repeats 1
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import tempfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = """<!doctype html><meta charset="utf-8"><script type="module">
const { measure } = await import('/benchmarks/secagg_cost.mjs');
const rows = await measure(%s);
await fetch('/result', { method: 'POST', body: JSON.stringify(rows) });
</script>"""


def in_node(options: dict[str, Any]) -> list[dict[str, Any]]:
    """The cost rows measured by Node."""
    args = [",".join(map(str, options["sizes"])), str(options["devices"]), str(options["repeats"])]
    out = subprocess.run([str(shutil.which("node")), "benchmarks/secagg_cost.mjs", *args], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout)


class _Handler(SimpleHTTPRequestHandler):
    """The repository's files, the benchmark's page, and a POST of its numbers."""

    def __init__(self, *args: Any, page: str, results: list[str], done: threading.Event, **kwargs: Any) -> None:
        self._page, self._results, self._done = page, results, done
        super().__init__(*args, directory=str(ROOT), **kwargs)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path != "/secagg.html":
            super().do_GET()
            return
        body = self._page.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        self._results.append(self.rfile.read(int(self.headers["Content-Length"])).decode())
        self.send_response(204)
        self.end_headers()
        self._done.set()

    def log_message(self, *_: Any) -> None:
        pass


def in_chromium(options: dict[str, Any], chromium: str) -> list[dict[str, Any]]:
    """The cost rows measured in a headless Chromium page (WebCrypto on loopback is a secure context)."""
    results: list[str] = []
    done = threading.Event()
    handler = functools.partial(_Handler, page=PAGE % json.dumps(options), results=results, done=done)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with tempfile.TemporaryDirectory() as profile:
        browser = subprocess.Popen([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                    f"--user-data-dir={profile}", f"http://127.0.0.1:{server.server_port}/secagg.html"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            if not done.wait(timeout=600):
                raise TimeoutError("the Chromium page did not post its numbers within 600 s")
        finally:
            browser.kill()
            browser.wait()
            server.shutdown()
    return json.loads(results[0])


def table(rows: dict[str, list[dict[str, Any]]]) -> str:
    """Markdown: per place and size, the median milliseconds of each stage and the bytes sent."""
    lines = ["| where | values | setup (ms) | share keys (ms) | collect masked vectors (ms) | unmask (ms) | "
             "masked update (bytes) | plain float32 (bytes) | added: update + keys + shares (bytes) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for place, measured in rows.items():
        for row in measured:
            sent = row["sent"]
            added = sent["masked"] - sent["plain"] + sent["keys"] + sent["shares"] + sent["unmask"]
            lines.append(f"| {place} | {row['size']:,} | {row['setup']:.1f} | {row['share_keys']:.1f} | "
                         f"{row['collect']:.1f} | {row['unmask']:.2f} | {sent['masked']:,} | {sent['plain']:,} | "
                         f"{added:,} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000", help="update sizes, comma-separated")
    parser.add_argument("--devices", type=int, default=5, help="devices in the round, all neighbours")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per size (the median is reported)")
    args = parser.parse_args()
    options = {"sizes": [int(s) for s in args.sizes.split(",")], "devices": args.devices, "repeats": args.repeats}
    rows = {"Node " + subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip():
            in_node(options)}
    chromium = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
    if chromium is not None:
        rows["Chromium (headless)"] = in_chromium(options, chromium)
    print(f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}; {args.devices} devices, "
          f"median of {args.repeats} rounds")
    print(table(rows))


if __name__ == "__main__":
    main()
