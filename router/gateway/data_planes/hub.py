"""The control process's side of the data planes: publish routing snapshots, collect acknowledgements.

Each data-plane process holds one WebSocket to the control process (``/_omni/data-plane`` on its
Unix socket, never on the public port). On connecting it is sent the current snapshot; from then
on it is *registered* and counted by every barrier until the supervisor has seen its process
exit (:meth:`DataPlaneHub.forget`) — not merely until its socket closes: a process that went
silent (stopped, stuck) may still hold its listening socket, so it holds the barrier until it is
killed. A process that never connected cannot be serving (it listens only once it holds a
snapshot), so it is not waited for.

* :meth:`DataPlaneHub.keep_publishing` compares the registry's routing state with the last
  snapshot every :data:`CHECK_S` and publishes a new version when it changed, with a keepalive
  every :data:`KEEPALIVE_S` (a data plane that hears nothing for :data:`SILENT_S` stops serving).
* :meth:`DataPlaneHub.confirm` is the fence barrier: it publishes at once and waits, at most
  ``ack_timeout_s``, until every live data plane has acknowledged that version. A data plane
  that has not is restarted and the caller gets 503: the fenced operation sends nothing.
* Sessions (``--session-affinity``): the control process's table is the router's only one; data
  planes ask it where a new session goes and keep copies of its pins (:mod:`.session_pins`).
* Load: each data plane reports its requests in flight per worker; the hub sums them into the
  registry (``GET /workers``, the metrics) and tells each data plane what the others carry, so
  ``least_inflight`` sees the whole router's load, as of the last report (every
  :data:`LOAD_EVERY_S`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from aiohttp import WSMsgType, web
from pydantic import ValidationError

from router.contract.errors import BadRequest, Unavailable
from router.contract.web.middleware import Handler
from router.gateway.data_planes.messages import (
    TO_CONTROL,
    Ack,
    DropStale,
    GateView,
    LoadElsewhere,
    LoadReport,
    PinsUsed,
    Place,
    Placed,
    ScrapeAnswer,
    ScrapeRequest,
    StaleDropped,
    Unpinned,
    WorkerRestarted,
)
from router.gateway.data_planes.mirror import ViewCache, routing_key, same_routing, view_of
from router.gateway.fleet.registry import WorkerRegistry
from router.gateway.routing.affinity import SessionAffinity

log = logging.getLogger(__name__)

#: The control process's internal route for its data planes (on its Unix socket only).
HUB_PATH = "/_omni/data-plane"
#: How often the routing state is compared with the last snapshot.
CHECK_S = 0.05
#: A snapshot is re-sent at least this often, so a data plane can tell a quiet control process from a dead one.
KEEPALIVE_S = 2.0
#: A data plane that hears nothing for this long stops serving (its control process is gone or stuck).
SILENT_S = 3 * KEEPALIVE_S
#: How often a data plane reports its load, and the hub passes the others' on.
LOAD_EVERY_S = 0.25


@dataclass(eq=False)
class _Plane:
    index: int
    socket: web.WebSocketResponse
    connected: bool = True
    acked: int = 0
    inflight: dict[str, int] = field(default_factory=dict)
    adapters: dict[str, int] = field(default_factory=dict)
    """LoRA adapter name → requests naming it in flight through this plane, as it last reported."""
    acked_event: asyncio.Event = field(default_factory=asyncio.Event)


class DataPlaneHub:
    """Snapshots out, acknowledgements and load in, for every connected data plane."""

    def __init__(
        self,
        registry: WorkerRegistry,
        *,
        ack_timeout_s: float,
        restart: Callable[[int, str], None],
        gate: Callable[[], GateView] | None = None,
        sessions: SessionAffinity | None = None,
    ):
        self._registry = registry
        self._sessions = sessions
        """The router's one session table (``--session-affinity``; :mod:`.session_pins`)."""
        self._unpinned: list[int] = []
        self._sending: set[asyncio.Future[None]] = set()
        if sessions is not None:
            sessions.on_forget = self._unpinned.append
        self._gate = gate
        """The leader gate's state for each snapshot (``--leader-election``; :mod:`.leader_mirror`)."""
        self.ack_timeout_s = ack_timeout_s
        self._restart = restart
        self._planes: dict[int, _Plane] = {}
        self._views = ViewCache()
        self._snapshot = view_of(registry, 1, self._gate_view(), self._views)
        self._key: tuple[object, ...] = routing_key(registry, self._gate_view())
        self._scrape_ids = itertools.count(1)
        self._scrapes: dict[int, dict[int, asyncio.Future[str]]] = {}
        self._drops: dict[int, dict[int, asyncio.Future[int]]] = {}

    @property
    def live(self) -> list[int]:
        """The registered data planes (connected now or not)."""
        return sorted(self._planes)

    def forget(self, index: int) -> None:
        """Data plane ``index``'s process has exited: it no longer holds any barrier."""
        plane = self._planes.pop(index, None)
        if plane is not None:
            self._drop_load(plane)
            self._count_adapters()
            plane.acked_event.set()

    @property
    def version(self) -> int:
        return self._snapshot.version

    def _refresh(self) -> bool:
        """Take the registry's routing state as the next version if it changed; True if it did. Asked before
        every admin answer and every :data:`CHECK_S`: a cheap key is compared first, the snapshot built only
        when it differs."""
        gate = self._gate_view()
        key = routing_key(self._registry, gate)
        if key == self._key:
            return False
        self._key = key
        fresh = view_of(self._registry, self._snapshot.version + 1, gate, self._views)
        if same_routing(fresh, self._snapshot):
            return False
        self._snapshot = fresh
        return True

    def _gate_view(self) -> GateView | None:
        return self._gate() if self._gate is not None else None

    async def publish(self, *, always: bool = False) -> int:
        """Send the current routing state to every live data plane (if it changed, or ``always``)."""
        if self._refresh() or always:
            text = self._snapshot.model_dump_json()
            await asyncio.gather(*(self._send(p, text) for p in list(self._planes.values())))
        return self._snapshot.version

    def announce(self) -> None:
        """The routing state changed: send it to every data plane now; a later :meth:`settled` waits for the
        acknowledgements (a fence lowered while its journal entry is being written reaches them meanwhile)."""
        if not self._refresh():
            return
        text = self._snapshot.model_dump_json()
        for plane in list(self._planes.values()):
            task = asyncio.ensure_future(self._send(plane, text))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def confirm(self, why: str) -> None:
        """The fence barrier: every live data plane has applied the current routing state, or 503.

        Called after a fence is raised in the registry and before anything is sent to a worker."""
        laggards = await self._everyone_applied()
        if laggards:
            raise Unavailable(
                f"{why}: data-plane process(es) {laggards} did not acknowledge the fence within "
                f"{self.ack_timeout_s:g}s; nothing was sent to any worker (they are being restarted)"
            )

    async def settled(self) -> None:
        """Before an admin call answers: every data plane has applied what it changed (a fence lifted,
        a worker back), so a caller's next request already sees it; a late one is restarted."""
        await self._everyone_applied()

    async def _everyone_applied(self) -> list[int]:
        """Publish, wait (bounded) for every registered data plane's acknowledgement, restart the late ones."""
        version = await self.publish()
        deadline = time.monotonic() + self.ack_timeout_s
        for plane in list(self._planes.values()):
            while plane.acked < version and self._planes.get(plane.index) is plane:
                plane.acked_event.clear()
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(plane.acked_event.wait(), left)
                except TimeoutError:
                    break
        laggards = [p.index for p in self._planes.values() if p.acked < version]
        for index in laggards:
            self._restart(index, f"did not acknowledge routing snapshot {version} within {self.ack_timeout_s:g}s")
        return laggards

    @web.middleware
    async def settle_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every call that may change routing answers only once the data planes applied the change."""
        try:
            return await handler(request)
        finally:  # a refusal too: a fence raised and lowered again must be lowered everywhere
            if request.method not in ("GET", "HEAD"):
                await self.settled()

    async def keep_publishing(self) -> None:
        """Publish changes as they happen, a keepalive every :data:`KEEPALIVE_S`, and the load."""
        last_sent = last_load = time.monotonic()
        while True:
            await asyncio.sleep(CHECK_S)
            now = time.monotonic()
            try:
                if self._refresh() or now - last_sent >= KEEPALIVE_S:
                    await self.publish(always=True)
                    last_sent = now
                if now - last_load >= LOAD_EVERY_S:
                    await self._share_load()
                    last_load = now
            except Exception:  # the publisher must outlive any one bad round: the data planes depend on it
                log.exception("publishing the routing state failed; retrying")

    async def scrape(self, timeout_s: float) -> list[str]:
        """Every live data plane's metrics (Prometheus text); one that does not answer in time is left out."""
        scrape_id = next(self._scrape_ids)
        loop = asyncio.get_running_loop()
        connected = [p.index for p in self._planes.values() if p.connected]
        waiting: dict[int, asyncio.Future[str]] = {i: loop.create_future() for i in connected}
        self._scrapes[scrape_id] = waiting
        try:
            text = ScrapeRequest(id=scrape_id).model_dump_json()
            await asyncio.gather(*(self._send(self._planes[i], text) for i in list(waiting) if i in self._planes))
            done, _ = await asyncio.wait(waiting.values(), timeout=timeout_s) if waiting else (set(), set())
            return [f.result() for f in done if not f.cancelled() and f.exception() is None]
        finally:
            self._scrapes.pop(scrape_id, None)

    async def drop_stale(self, next_sequence: int, workers: list[str], wait_s: float) -> int:
        """Before a pause: every connected data plane drops its requests on ``workers`` that ``next_sequence``
        makes stale (:class:`DropStale`); the sum of what those that answered within ``wait_s`` dropped. A data
        plane that did not is logged and left out: the pause goes on (it is not restarted: nothing is wrong
        with its routing)."""
        drop_id = next(self._scrape_ids)
        loop = asyncio.get_running_loop()
        waiting: dict[int, asyncio.Future[int]] = {
            p.index: loop.create_future() for p in self._planes.values() if p.connected
        }
        if not waiting:
            return 0
        self._drops[drop_id] = waiting
        try:
            # Each plane's own aborts get most of the bound, so its answer comes back within it.
            text = DropStale(id=drop_id, next_sequence=next_sequence, workers=workers, wait_s=0.8 * wait_s)
            sent = text.model_dump_json()
            await asyncio.gather(*(self._send(self._planes[i], sent) for i in list(waiting) if i in self._planes))
            done, _ = await asyncio.wait(waiting.values(), timeout=wait_s)
            late = [i for i, f in waiting.items() if f not in done]
            if late:
                log.warning(
                    "data-plane process(es) %s did not answer the drop of stale requests within %gs; the pause "
                    "goes on without them (their requests are left to the pause)",
                    late,
                    wait_s,
                )
            return sum(f.result() for f in done if not f.cancelled() and f.exception() is None)
        finally:
            self._drops.pop(drop_id, None)

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        """``/_omni/data-plane?index=N``: one data plane's connection, for as long as it lives."""
        try:
            index = int(request.query["index"])
        except (KeyError, ValueError):
            raise BadRequest("a data plane connects with ?index=<its number>") from None
        # No per-message compression on a local socket, whatever the peer offers (it costs the fence's barrier).
        socket = web.WebSocketResponse(heartbeat=KEEPALIVE_S, max_msg_size=16 * 1024 * 1024, compress=False)
        await socket.prepare(request)
        plane = _Plane(index, socket)
        previous = self._planes.get(index)
        if previous is not None:
            await previous.socket.close()
        self._planes[index] = plane
        log.info("data-plane process %d connected", index)
        try:
            self._refresh()
            await self._send(plane, self._snapshot.model_dump_json())
            async for message in socket:
                if message.type != WSMsgType.TEXT:
                    break
                reply = self._receive(plane, message.data)
                if reply is not None:
                    await self._send(plane, reply)
                if self._unpinned:  # a placement moved or evicted pins: every copy goes, before the next turn
                    rows, self._unpinned = self._unpinned, []
                    text = Unpinned(rows=rows).model_dump_json()
                    await asyncio.gather(*(self._send(p, text) for p in list(self._planes.values())))
        finally:
            # Still registered: only the supervisor, having seen the process exit, forgets it.
            plane.connected = False
            self._drop_load(plane)
            log.info("data-plane process %d disconnected", index)
        return socket

    def _receive(self, plane: _Plane, data: str) -> str | None:
        """Apply one message from ``plane``; what to answer it, if anything."""
        try:
            message = TO_CONTROL.validate_json(data)
        except ValidationError as exc:
            log.error("data-plane process %d sent an unreadable message: %s", plane.index, exc)
            return None
        if isinstance(message, Place):
            return Placed(id=message.id, worker=self._place(message)).model_dump_json()
        if isinstance(message, PinsUsed):
            if self._sessions is not None:
                self._sessions.touch(message.rows)
            return None
        if isinstance(message, Ack):
            plane.acked = max(plane.acked, message.version)
            plane.acked_event.set()
        elif isinstance(message, LoadReport):
            self._drop_load(plane)
            plane.inflight = dict(message.inflight)
            plane.adapters = dict(message.adapters)
            self._count_adapters()
            for wid, count in plane.inflight.items():
                worker = self._registry.find(wid)
                if worker is not None:
                    worker.inflight += count
        elif isinstance(message, WorkerRestarted):
            worker = self._registry.find(message.worker)
            if worker is not None and worker.instance_id != message.instance_id:
                log.info("data-plane process %d saw worker %s restarted", plane.index, worker.id)
                worker.instance_id = message.instance_id
        elif isinstance(message, ScrapeAnswer):
            future = self._scrapes.get(message.id, {}).get(plane.index)
            if future is not None and not future.done():
                future.set_result(message.text)
        elif isinstance(message, StaleDropped):
            dropped = self._drops.get(message.id, {}).get(plane.index)
            if dropped is not None and not dropped.done():
                dropped.set_result(message.dropped)
        return None

    def _place(self, message: Place) -> str | None:
        """Where the one table puts the session, among the candidates the data plane named that exist here."""
        if self._sessions is None:
            return None
        candidates = [w for wid in message.candidates if (w := self._registry.find(wid)) is not None]
        if not candidates:
            return None
        return self._sessions.choose(message.session, candidates, retry=message.retry).id

    def _count_adapters(self) -> None:
        """Requests in flight per adapter through every data plane, for an unload's wait."""
        totals: dict[str, int] = {}
        for plane in self._planes.values():
            for name, count in plane.adapters.items():
                totals[name] = totals.get(name, 0) + count
        self._registry.adapters.inflight_elsewhere = totals

    def _drop_load(self, plane: _Plane) -> None:
        for wid, count in plane.inflight.items():
            worker = self._registry.find(wid)
            if worker is not None:
                worker.inflight = max(0, worker.inflight - count)
        plane.inflight = {}

    async def _share_load(self) -> None:
        planes = [p for p in self._planes.values() if p.connected]
        if len(planes) < 2:
            return
        totals: dict[str, int] = {}
        for plane in planes:
            for wid, count in plane.inflight.items():
                totals[wid] = totals.get(wid, 0) + count
        sends = []
        for plane in planes:
            elsewhere = {wid: n - plane.inflight.get(wid, 0) for wid, n in totals.items()}
            sends.append(
                self._send(plane, LoadElsewhere(inflight={k: v for k, v in elsewhere.items() if v}).model_dump_json())
            )
        await asyncio.gather(*sends)

    async def _send(self, plane: _Plane, text: str) -> None:
        if not plane.connected:
            return
        try:
            await plane.socket.send_str(text)
        except (ConnectionError, RuntimeError) as exc:  # closing: its handler unregisters it
            log.debug("data-plane process %d: send failed: %s", plane.index, exc)

    async def run_ctx(self, _app: web.Application) -> AsyncIterator[None]:
        """An aiohttp cleanup context: publish for as long as the app runs, then close every socket."""
        task = asyncio.create_task(self.keep_publishing(), name="data-plane-publisher")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for plane in list(self._planes.values()):
            await plane.socket.close()
