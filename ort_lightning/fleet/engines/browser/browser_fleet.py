"""`BrowserFleet`: a web server whose visitors are the devices of a Flower fleet (docs/browsers.md)."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import uvicorn
from flwr.app import Context, RecordDict

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.errors import ConfigurationError
from ort_lightning.fleet.devices.device_files import device_files, ordered
from ort_lightning.fleet.devices.exchange import Exchange
from ort_lightning.fleet.devices.frames import HEADER_LIMIT
from ort_lightning.fleet.devices.protocol import DataFn
from ort_lightning.fleet.devices.weight_order import WeightOrder
from ort_lightning.fleet.engines.browser.grid import BrowserGrid, Epochs, PageData, strategy_floor
from ort_lightning.fleet.engines.browser.hub import BrowserDevice, Hub, OnEvent, Refusal
from ort_lightning.fleet.engines.browser.site import web_app
from ort_lightning.fleet.engines.browser.tls import is_loopback, tls_files
from ort_lightning.fleet.engines.joined import JoinedGrid
from ort_lightning.fleet.engines.local import _RUN_ID, LocalGrid
from ort_lightning.fleet.server.secure import SecureFleetServer
from ort_lightning.fleet.server.server_app import FleetServer
from ort_lightning.web import find_ort_web

__all__ = ["BrowserFleet"]

#: A fleet's server: plain rounds (`FleetServer`) or rounds through Flower's SecAgg+ (`SecureFleetServer`).
Server = TypeVar("Server", bound=FleetServer | SecureFleetServer)

_LOG = logging.getLogger("ort_lightning.fleet.engines.browser")

def _page_data(
    data: DataFn | None, page_data: str | os.PathLike[str] | None, max_examples: int | None
) -> Path | None:
    """The data module's path, once `data`, `page_data` and `max_examples` are known to fit together."""
    if (data is None) == (page_data is None):
        given = "both" if data is not None else "neither"
        raise ConfigurationError("Expected exactly one of `data` (the server ships each device's batches) and "
                                 f"`page_data` (the pages make their own), but got {given}; pass one of them.")
    if page_data is None:
        return None
    path = Path(page_data).expanduser().resolve()
    if path.suffix not in (".js", ".mjs") or not path.is_file():
        raise ConfigurationError(f"Expected `page_data` to be an ES module file (.js or .mjs) that exports "
                                 f"`batches`, but got {os.fspath(page_data)!r}, which is not such a file; pass the "
                                 "path of your data module (see examples/browser_data.js).")
    if max_examples is None or max_examples < 1:
        raise ConfigurationError(f"Expected `max_examples` >= 1 with `page_data`, but got {max_examples}: the server "
                                 "cannot count what a page makes, so it checks each device's claim against your bound; "
                                 "pass the most examples per epoch one device's data module makes.")
    return path


class BrowserFleet:
    """A fleet whose devices are the browsers that open its URL; Flower's strategy runs the rounds.

    Args:
        artifacts: the device folder the pages load (graphs, ``nominal_checkpoint``; a folder from
            ``prepare_for_web`` trains at its own learning rate, a plain one at ORT's default 1e-3).
        data: ``(partition, partitions) -> ClientData``, as `DeviceClient` takes it: each round, a
            device gets the batches of ``data(its partition, devices).train``, iterated once per epoch.
            None with `page_data`.
        page_data: an ES module (``.js`` or ``.mjs`` file) that the pages import to make their own
            batches, instead of `data` (the contract is in docs/browsers.md): only the
            weights travel, the data never leaves the device.
        max_examples: with `page_data`, the most examples per epoch a device may claim (the server
            cannot count them); a device that claims more, or none, is refused.
        host: the address to listen on (loopback by default; ``"0.0.0.0"`` for other machines).
        port: the port; 0 picks a free one (`url` tells which).
        devices: the most devices connected at once, and the data's partition count (each device
            holds one partition; a page beyond them is refused and told so).
        epochs: local epochs per round.
        device_timeout: seconds a browser may take to answer a round before it is dropped.
        ort_web: onnxruntime-web's ``dist/`` folder or a URL that serves it (see `find_ort_web`).
        token: the join token (a random one by default).
        min_devices: how many devices `run` waits for before the first round (None: `devices`).
            Later rounds sample among the devices connected then, with the strategy's own rules.
        wait_timeout: seconds the fleet waits, between rounds, for the strategy's minimum of devices
            (its ``min_available_nodes`` and ``min_train_nodes``) once too few are connected; then
            `run` stops with a `FleetError` (the finished rounds' checkpoints stay). None: no limit.
        name: the fleet's name, which the page shows; a page keeps its device identity under it.
        on_event: told of each device that joins, comes back, leaves or is refused (a `PopulationEvent`).
        certfile: a PEM certificate (chain) to serve HTTPS and WSS with; with `keyfile`.
        keyfile: the certificate's PEM private key.

    Raises:
        ConfigurationError: for non-positive counts, a folder a browser cannot train, no onnxruntime-web,
            both or neither of `data` and `page_data`, `page_data` that is no ES module file or lacks `max_examples`.
    """

    def __init__(
        self,
        artifacts: TrainingArtifacts | str | os.PathLike[str],
        data: DataFn | None = None,
        *,
        page_data: str | os.PathLike[str] | None = None,
        max_examples: int | None = None,
        host: str = "127.0.0.1",
        port: int = 8000,
        devices: int = 3,
        epochs: int = 1,
        device_timeout: float = 600.0,
        ort_web: str | None = None,
        token: str | None = None,
        min_devices: int | None = None,
        wait_timeout: float | None = 600.0,
        name: str = "ort-lightning fleet",
        on_event: OnEvent | None = None,
        certfile: str | os.PathLike[str] | None = None,
        keyfile: str | os.PathLike[str] | None = None,
    ) -> None:
        if devices < 1 or epochs < 1 or device_timeout <= 0:
            raise ConfigurationError(f"Expected devices >= 1, epochs >= 1 and device_timeout > 0, but got {devices}, "
                                     f"{epochs} and {device_timeout}; pass the browsers to wait for, the local epochs "
                                     "per round and the seconds a browser may take for a round.")
        self.min_devices = devices if min_devices is None else min_devices
        if not 1 <= self.min_devices <= devices or (wait_timeout is not None and wait_timeout <= 0):
            raise ConfigurationError(f"Expected min_devices from 1 to devices ({devices}) and wait_timeout > 0 or "
                                     f"None, but got {min_devices} and {wait_timeout}; pass how many pages the first "
                                     "round needs, at most the fleet's devices, and the seconds to wait for too few.")
        self.wait_timeout = wait_timeout
        self.tls = tls_files(certfile, keyfile)
        self.page_data = _page_data(data, page_data, max_examples)
        self.max_examples = max_examples
        self.artifacts = artifacts if isinstance(artifacts, TrainingArtifacts) else TrainingArtifacts.load(artifacts)
        self.data, self.devices, self.epochs = data, devices, epochs
        self.host = host
        self.token = token or secrets.token_urlsafe(16)
        # NOTE: frozen parameters never travel: a page reads them from the complete checkpoint, downloaded once.
        files = device_files(self.artifacts, complete=bool(self.artifacts.manifest.frozen))
        #: What a round carries: the sent tensors, in ONNX Runtime's buffer order over the files the pages open.
        self.exchange = Exchange.of(self.artifacts, WeightOrder.checked(self.artifacts, files.training,
                                                                        files.checkpoint))
        #: The bytes of each device file served so far, by role (a page that kept its files asks for none).
        self.served: dict[str, int] = {}
        self.hub = Hub(partitions=devices, weight_order=self.exchange.sent, device_timeout=device_timeout,
                       on_event=on_event)
        #: The largest frame a page may send: its weights, or SecAgg+'s masked vectors (int64 .npy, one per tensor
        #: and the weight's), and a header of at most HEADER_LIMIT bytes.
        tensors = len(self.hub.weight_order.tensors) + 1
        self.frame_limit = 8 * self.hub.parameters + (128 + 8) * tensors + HEADER_LIMIT + 16
        self._app = web_app(self.hub, token=self.token, files=files.by_role(), ort=find_ort_web(ort_web),
                            frame_limit=self.frame_limit, page_data=self.page_data, fleet=name,
                            exchange=self.exchange.describe(), served=self.served)
        self._socket = socket.create_server((host, port), reuse_port=False)
        self.port: int = self._socket.getsockname()[1]
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The URL a browser opens to join (with the join token)."""
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/?token={self.token}"

    @property
    def connected(self) -> list[BrowserDevice]:
        """The browsers that are devices now, in joining order."""
        return [device for node in self.hub.node_ids() if (device := self.hub.device(node)) is not None]

    @property
    def refusals(self) -> list[Refusal]:
        """Every device that failed a round or was refused, and why."""
        return list(self.hub.refusals)

    def start(self) -> BrowserFleet:
        """Serve the page (in a background thread) until `close`."""
        if self._thread is not None:
            return self
        # NOTE: no access log: every request's query carries the join token, which no log line may show.
        # No per-message deflate: Node 20's WebSocket (undici 6.24) drops a deflated message that inflates past
        # 4 MiB (1006), every train frame of a model over a million values; float weights barely compress anyway.
        config = uvicorn.Config(self._app, log_level="warning", access_log=False, ws="websockets-sansio",
                                ws_max_size=self.frame_limit, ws_per_message_deflate=False, lifespan="on",
                                ssl_certfile=self.tls[0] if self.tls else None,
                                ssl_keyfile=self.tls[1] if self.tls else None)
        if self.tls is None and not is_loopback(self.host):
            _LOG.warning("the fleet serves %s:%d without TLS: the join token and every update travel in clear; "
                         "pass certfile and keyfile (or serve it behind an HTTPS reverse proxy)", self.host, self.port)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="ort-lightning-browser-fleet", daemon=True)
        self._thread.start()
        while not self._server.started and self._thread.is_alive():
            time.sleep(0.02)
        if not self._server.started:
            raise ConfigurationError(f"The fleet's web server did not start on {self.host}:{self.port}; see the log "
                                     "above, or pass another host or port.")
        return self

    def wait_for_devices(self, timeout: float | None = None) -> bool:
        """Block until `min_devices` browsers have joined (or `timeout` seconds pass); whether they have."""
        return self.hub.wait_for(self.min_devices, timeout)

    def run(self, server: Server, *, join_timeout: float | None = None, beside: LocalGrid | None = None) -> Server:
        """Serve, wait for the browsers, and run `server`'s rounds over them (`BrowserGrid`).

        Once the rounds are over, every page is told that the run finished (close code 4000, `hub.RUN_FINISHED`):
        it shows so and does not try to join again, as it does after a server restart.

        Args:
            server: the fleet's server (its strategy, rounds, checkpoints, evaluation); a `SecureFleetServer`
                runs Flower's SecAgg+ over the pages, which then send masked vectors, never their weights.
            join_timeout: seconds to wait for `devices` browsers (None: no limit).
            beside: simulated devices that join every round with the pages (`JoinedGrid`), their node ids apart
                from the pages' (``LocalGrid(..., first_node=2**60)``); the strategy's minimum counts them,
                `min_devices` does not.

        Raises:
            ConfigurationError: when the browsers did not join in time, or `server` holds another model.
        """
        self._check(server)
        self.start()
        if not self.wait_for_devices(join_timeout):
            raise ConfigurationError(f"{len(self.hub.node_ids())} of {self.min_devices} browsers joined within "
                                     f"{join_timeout} s; open the fleet's URL in {self.min_devices} browsers (tabs), "
                                     "or pass fewer min_devices.")
        local = None if self.page_data is None else PageData(self.epochs, int(self.max_examples or 0))
        simulated = len(list(beside.get_node_ids())) if beside is not None else 0
        pages = BrowserGrid(self.hub, local or self._epochs, floor=max(0, strategy_floor(server.strategy) - simulated),
                            wait_timeout=self.wait_timeout)
        grid = pages if beside is None else JoinedGrid(pages, beside)
        server.main(grid, Context(_RUN_ID, 0, {}, RecordDict(), {}))
        self.hub.finish()
        return server

    def close(self) -> None:
        """Stop serving (the pages see their connection close)."""
        self.hub.close()
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
        self._socket.close()

    def __enter__(self) -> BrowserFleet:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def _check(self, server: FleetServer | SecureFleetServer) -> None:
        theirs = {name: tuple(array.shape) for name, array in server.model.arrays().items()}
        ours = dict(self.hub.weight_order.tensors)
        if theirs != ours:
            raise ConfigurationError(f"The FleetServer's model has the state {theirs}, but the browsers' folder "
                                     f"{self.artifacts.directory} trains {ours}; build both from the same export.")

    def _epochs(self, partition: int) -> Epochs:
        names = [spec.name for spec in self.artifacts.manifest.graph_inputs]
        assert self.data is not None, "a fleet without data has page_data, whose grid never asks for batches"
        loader = self.data(partition, self.devices).train
        # NOTE: a fresh loader each round, iterated once per epoch, as DeviceClient's ORT loop iterates it:
        # the same seeds give the same batches in the same order.
        return [[ordered(batch, names) for batch in loader] for _ in range(self.epochs)]

    def __repr__(self) -> str:
        return f"BrowserFleet({self.url!r}, devices={self.devices}, epochs={self.epochs})"
