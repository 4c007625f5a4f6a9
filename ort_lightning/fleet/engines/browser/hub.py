"""The browsers of a fleet and the replies they owe, shared by the web server's event loop and Flower's thread.

The event loop calls `join`, `ready`, `receive` and `lost`; Flower's side (`BrowserGrid`) calls `send`
and `collect`. A device that fails (closed, refused, silent past its deadline) owes an error reply and
leaves a `Refusal`; one that leaves on purpose owes an error of code `LEFT_ERROR_CODE`, a departure, not a
failure; one that says it could not answer a SecAgg+ stage owes an error reply and stays. Who the devices
are is the `Population`'s business; each change is a `PopulationEvent`.

Example::

    >>> hub = Hub(partitions=2, weight_order=WeightOrder([("weight", (3, 4)), ("bias", (3,))]), device_timeout=60.0)
    >>> hub.parameters, hub.node_ids()
    (15, [])
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Error, Message

from ort_lightning.errors import DeviceReplyError
from ort_lightning.fleet.devices.frames import unpack
from ort_lightning.fleet.devices.protocol import LEFT_ERROR_CODE
from ort_lightning.fleet.devices.weight_order import WeightOrder
from ort_lightning.fleet.engines.browser.ledger import Ledger, Receipt, Refusal
from ort_lightning.fleet.engines.browser.population import Population, PopulationEvent
from ort_lightning.fleet.engines.browser.reply import Asked, answer_content
from ort_lightning.fleet.engines.local import CLIENT_ERROR_CODE
from ort_lightning.web import wire

__all__ = ["RUN_FINISHED", "BrowserDevice", "Hub", "OnEvent", "Refusal"]

_LOG = logging.getLogger("ort_lightning.fleet.engines.browser")
_CLOSES: dict[str, int] = wire()["closes"]
#: WebSocket close codes (wire.json, which the page's scripts read too): a refused device, a frame over the size
#: limit, and the fleet's run being over (an application code: the page stops and does not join again).
POLICY_VIOLATION = _CLOSES["refused"]
TOO_BIG = _CLOSES["too_big"]
RUN_FINISHED = _CLOSES["run_finished"]

#: Sends a coroutine to the web server's event loop (a socket's send or close); its future, to wait for it.
Schedule = Callable[[Coroutine[Any, Any, None]], concurrent.futures.Future[None]]
#: Told of each device that joins, comes back, leaves or is refused (called without the hub's lock).
OnEvent = Callable[[PopulationEvent], None]


@dataclass
class BrowserDevice:
    """One page that joined the fleet.

    Attributes:
        name: the page's ``name=`` query value, else ``browser-<n>``; logs and refusals name it (a
            device that comes back keeps the name it had).
        address: the browser's host and port, as the server saw them.
        partition: the share of the data it trains (see `Population`).
        node_id: its Flower node id (one per identity: a device that comes back has its own again).
        identity: the identity the page keeps in its storage (empty until it is ready).
    """

    name: str
    address: str
    partition: int = -1
    node_id: int = 0
    identity: str = ""
    send: Callable[[bytes | str], Coroutine[Any, Any, None]] | None = field(default=None, repr=False)
    close: Callable[[int, str], Coroutine[Any, Any, None]] | None = field(default=None, repr=False)


@dataclass
class _Owed:
    device: BrowserDevice
    message: Message
    asked: Asked
    deadline: float

    @property
    def server_round(self) -> int:
        return self.asked.server_round


class Hub:
    """Connected devices and owed replies (see the module docstring).

    Args:
        partitions: how many devices the fleet has (each takes one partition).
        weight_order: the order of the flat weights.
        device_timeout: seconds a device may take to answer a train message.
    """

    def __init__(
        self,
        *,
        partitions: int,
        weight_order: WeightOrder,
        device_timeout: float,
        on_event: OnEvent | None = None,
    ) -> None:
        self.partitions = partitions
        self.population = Population(partitions)
        #: Every device that joined, came back, left or was refused, in order.
        self.events: list[PopulationEvent] = []
        self._on_event = on_event
        #: The latest round the server has sent (0 before the first).
        self.server_round = 0
        self.weight_order = weight_order
        self.parameters = weight_order.size
        self.device_timeout = device_timeout
        self.refusals: list[Refusal] = []
        #: What became of every reply that reached the server (used, refused, dropped).
        self.ledger = Ledger()
        self._schedule: Schedule | None = None
        self._changed = threading.Condition()
        self._devices: dict[int, BrowserDevice] = {}
        self._owed: dict[str, _Owed] = {}
        self._replies: dict[str, Message] = {}
        self._joins = 0
        self._closing = False
        #: Whether the run's rounds are over (`finish`): a page that opens the fleet's URL now is told so.
        self.finished = False
        #: Every open connection, ready or not, by `id` (a page that loads its files is not a device yet).
        self._open: dict[int, BrowserDevice] = {}

    def close(self) -> None:
        """The fleet is shutting down: sockets that close from now on are no device's failure."""
        with self._changed:
            self._closing = True

    def finish(self, timeout: float = 5.0) -> None:
        """The rounds are over: tell every open page so (`RUN_FINISHED`), so that none tries to join again.

        Waits up to `timeout` seconds for the closing handshakes; a page that does not answer is left to the server's
        shutdown.
        """
        with self._changed:
            self._closing = self.finished = True
            closers = [device.close for device in self._open.values() if device.close is not None]
        if self._schedule is None or not closers:
            return
        schedule = self._schedule
        concurrent.futures.wait([schedule(close(RUN_FINISHED, "the fleet's run finished")) for close in closers],
                                timeout=timeout)
        _LOG.info("the run finished: %d page(s) told so", len(closers))

    def bind(self, schedule: Schedule) -> None:
        """Where socket sends and closes run (the web server's event loop)."""
        self._schedule = schedule

    # ----------------------------------------------------------------------------- event loop side
    def join(self, device: BrowserDevice) -> None:
        """A page's socket opened (it is not a node until `ready`)."""
        with self._changed:
            self._joins += 1
            device.name = device.name or f"browser-{self._joins}"
            self._open[id(device)] = device

    def ready(self, device: BrowserDevice, parameters: object, identity: object) -> str | None:
        """The page loaded the device files; returns why it is refused, or None once it is a node."""
        with self._changed:
            reason, kind = self._admit(device, parameters, identity)
            if reason is not None:
                self.refusals.append(Refusal(device.name, 0, reason))
            event = self._event(device.name, kind, reason or f"partition {device.partition} of {self.partitions}",
                                address="" if reason else device.address)
            self._changed.notify_all()
        if reason is not None:
            _LOG.warning("%s refused: %s", device.name, reason)
        else:
            _LOG.info("%s %s as partition %d of %d (%s)", device.name, kind, device.partition, self.partitions,
                      device.address)
        self._tell(event)
        return reason

    def _admit(self, device: BrowserDevice, parameters: object, identity: object) -> tuple[str | None, str]:
        # NOTE: called with the condition held.
        if parameters != self.parameters:
            return (f"{device.name} opened a model of {parameters} parameters, but the fleet's has "
                    f"{self.parameters}; the page loaded other artifacts than the server's", "was refused")
        connected = {d.identity: d.name for d in self._devices.values()}
        admission = self.population.admit(identity, device.name, connected=connected)
        if admission.member is None:
            return admission.reason, "was refused"
        member = admission.member
        device.name, device.partition, device.node_id = member.name, member.partition, member.node_id
        device.identity = str(identity)
        self._devices[device.node_id] = device
        return None, "came back" if admission.came_back else "joined"

    def _event(self, name: str, kind: str, detail: str, *, address: str = "") -> PopulationEvent:
        # NOTE: called with the condition held.
        event = PopulationEvent(self.server_round, name, kind, detail, address)
        self.events.append(event)
        return event

    def _tell(self, event: PopulationEvent | None) -> None:
        if event is not None and self._on_event is not None:
            self._on_event(event)

    def receive(self, device: BrowserDevice, frame: bytes | dict[str, Any]) -> None:
        """A binary result frame, or a text frame's JSON (``error``), from `device`."""
        found = self._owed_by(device)
        header: dict[str, Any] = frame if isinstance(frame, dict) else {}
        payload = memoryview(b"")
        if isinstance(frame, bytes):
            try:
                header, payload = unpack(frame, device=device.name)
            except DeviceReplyError as error:
                self._refused(device, found[1].server_round if found else 0, str(error))
                return
        said = header.get("id")
        if found is None or (said is not None and said != found[0]):
            self._stray(device, header)
            return
        message_id, owed = found
        _LOG.debug("round %d: %d bytes from %s", owed.server_round, len(frame) if isinstance(frame, bytes) else 0,
                   device.name)
        try:
            if isinstance(frame, dict) and owed.asked.stage is not None:
                self._declined(device, message_id, owed, str(frame.get("message", "no reason given")))
                return
            if isinstance(frame, dict):
                raise DeviceReplyError(f"{device.name} could not train round {owed.server_round}: "
                                       f"{frame.get('message', 'no reason given')}")
            content = answer_content(owed.asked, header, payload, self.weight_order, device=device.name)
            reply = Message(content, reply_to=owed.message)
        except DeviceReplyError as error:
            self._refused(device, owed.server_round, str(error))
            return
        with self._changed:
            if self._owed.pop(message_id, None) is not None:
                self._replies[message_id] = reply
                self.ledger.accepted(message_id, Receipt(owed.server_round, device.name, device.partition, "used"))
                self.ledger.closed(message_id, owed.server_round)
                self._changed.notify_all()

    def _declined(self, device: BrowserDevice, message_id: str, owed: _Owed, why: str) -> None:
        """A device's error at a SecAgg+ stage (e.g. a page reloaded since setup): an error reply, and it stays.

        As a Python device's exception in Flower's runtimes, it fails the round only.
        """
        reason = f"{device.name} could not answer SecAgg+'s {owed.asked.stage} stage of round {owed.server_round}: " \
                 f"{why}"
        with self._changed:
            if self._owed.pop(message_id, None) is None:
                return
            self.ledger.record(Receipt(owed.server_round, device.name, device.partition, "refused", reason))
            self.ledger.closed(message_id, owed.server_round)
            self._fail(owed.message, reason)
        _LOG.warning("%s", reason)

    def _refused(self, device: BrowserDevice, server_round: int, reason: str) -> None:
        """A reply that failed its checks: on the ledger, and its device dropped."""
        with self._changed:
            self.ledger.record(Receipt(server_round, device.name, device.partition, "refused", reason))
        self.refuse(device, reason)

    def _stray(self, device: BrowserDevice, header: dict[str, Any]) -> None:
        """A reply to a message `device` owes no more (or never got): dropped, and the device told why."""
        said = header.get("id")
        with self._changed:
            closed = self.ledger.round_of(said)
            if closed is not None:
                reason = (f"{device.name} sent its reply to round {closed} after that round had closed for it (it had "
                          "answered already, failed, or the round ended without it); the reply is dropped")
            else:
                reason = (f"{device.name} sent a {header.get('type', 'reply')!r} frame for message {str(said)[:40]!r}, "
                          "which the fleet never sent it; the frame is dropped")
            self.ledger.record(Receipt(closed or 0, device.name, device.partition, "dropped", reason))
        _LOG.warning("%s", reason)
        if device.send is not None and self._schedule is not None:
            self._schedule(device.send(json.dumps({"type": "notice", "message": reason})))

    def lost(self, device: BrowserDevice, reason: str, *, left: bool = False) -> None:
        """`device`'s socket closed (`left`: on purpose): each reply it owed becomes an error reply."""
        with self._changed:
            self._open.pop(id(device), None)
        self._drop(device, reason, close=False, left=left)

    def refuse(self, device: BrowserDevice, reason: str) -> None:
        """Drop `device` from the fleet, close its socket, and fail what it owed."""
        self._drop(device, reason, close=True)

    # ----------------------------------------------------------------------------- Flower side
    def node_ids(self) -> list[int]:
        """Node ids of the devices that are ready, in joining order."""
        with self._changed:
            return sorted(self._devices)

    def device(self, node_id: int) -> BrowserDevice | None:
        """The device of `node_id`, None once it has left."""
        with self._changed:
            return self._devices.get(node_id)

    def wait_for(self, count: int, timeout: float | None = None) -> bool:
        """Block until `count` devices are ready (or `timeout` seconds pass); whether they are."""
        with self._changed:
            return self._changed.wait_for(lambda: len(self._devices) >= count, timeout)

    def send(self, message: Message, frame: bytes, asked: Asked) -> None:
        """Send `frame` to the message's device; its reply (or failure), checked against `asked`, comes to `collect`."""
        node_id = message.metadata.dst_node_id
        with self._changed:
            device = self._devices.get(node_id)
            if device is None or device.send is None or self._schedule is None:
                self._fail(message, f"node {node_id} is not a connected browser (it left the fleet)")
                return
            self._owed[message.metadata.message_id] = _Owed(device, message, asked,
                                                            time.monotonic() + self.device_timeout)
            self.server_round = max(self.server_round, asked.server_round)
        _LOG.debug("round %d: sent %d bytes to %s", asked.server_round, len(frame), device.name)
        self._schedule(device.send(frame))

    def answer(self, message: Message, reason: str) -> None:
        """Answer `message` at once with an error reply."""
        with self._changed:
            self._fail(message, reason)

    def collect(self, message_ids: Sequence[str], *, wait: float | None, close: bool = False) -> list[Message]:
        """Replies to `message_ids` that are in, after waiting up to `wait` seconds for all (None: no limit).

        With `close`, the round ends here: a message still unanswered is owed no more (a late reply is dropped).
        """
        wanted = list(message_ids)
        end = None if wait is None else time.monotonic() + wait
        while True:
            self._expire()
            with self._changed:
                if all(i in self._replies or i not in self._owed for i in wanted):
                    break
                now = time.monotonic()
                deadlines = [self._owed[i].deadline for i in wanted if i in self._owed]
                limit = min([*deadlines, *([end] if end is not None else [])])
                if end is not None and now >= end:
                    break
                self._changed.wait(max(0.0, min(limit - now, 1.0)))
        with self._changed:
            for message_id in wanted:
                # NOTE: a round that ended before a device answered closes its message: a late reply is dropped.
                abandoned = self._owed.pop(message_id, None) if close else None
                if abandoned is not None:
                    self.ledger.closed(message_id, abandoned.server_round)
                self.ledger.collected(message_id)
            return [self._replies.pop(i) for i in wanted if i in self._replies]

    # ----------------------------------------------------------------------------- helpers
    def _owed_by(self, device: BrowserDevice) -> tuple[str, _Owed] | None:
        with self._changed:
            return next(((i, o) for i, o in self._owed.items() if o.device is device), None)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._changed:
            late = {o.device.node_id: o for o in self._owed.values() if o.deadline <= now}
        for owed in late.values():
            self.refuse(owed.device, f"{owed.device.name} did not answer round {owed.server_round} within the "
                                     f"device timeout of {self.device_timeout:g} s; raise device_timeout for slow "
                                     "devices or larger partitions")

    def _drop(self, device: BrowserDevice, reason: str, *, close: bool, left: bool = False) -> None:
        with self._changed:
            member = self._devices.get(device.node_id) is device
            if member:
                del self._devices[device.node_id]
            owed = [(i, o) for i, o in self._owed.items() if o.device is device]
            for message_id, entry in owed:
                del self._owed[message_id]
                self.ledger.closed(message_id, entry.server_round)
                self._fail(entry.message, reason, LEFT_ERROR_CODE if left else CLIENT_ERROR_CODE)
            server_round = owed[0][1].server_round if owed else 0
            departed = member and not self._closing
            # NOTE: a page that leaves on purpose, or closes between rounds, has left; one that owed a round, or was
            # refused, failed.
            failed = departed and not left and (close or bool(owed))
            if failed:
                self.refusals.append(Refusal(device.name, server_round, reason))
            event = self._event(device.name, "was dropped" if failed else "left", reason) if departed else None
            self._changed.notify_all()
        if failed:
            _LOG.warning("%s was dropped%s: %s", device.name, f" in round {server_round}" if owed else "", reason)
        elif departed:
            _LOG.info("%s left the fleet%s: %s", device.name, f" in round {server_round}" if owed else "", reason)
        elif close and not member:
            _LOG.warning("%s refused: %s", device.name, reason)
        self._tell(event)
        if close and device.close is not None and self._schedule is not None:
            self._schedule(device.close(POLICY_VIOLATION, reason[:120]))

    def _fail(self, message: Message, reason: str, code: int = CLIENT_ERROR_CODE) -> None:
        # NOTE: called with the condition held; an error reply is what Flower's runtimes send for a failed node.
        self._replies[message.metadata.message_id] = Message(Error(code, reason), reply_to=message)
        self._changed.notify_all()
