"""Loading weights from a live peer: ``GET /weights_snapshot`` (source) and ``POST /update_weights_from_peer`` (sink).

The source streams its current weights in safetensors layout under a read lease
(:mod:`worker.peer.lease`, :mod:`worker.peer.snapshot`) while it keeps generating:
each chunk is copied to bytes off the event loop. It refuses with 503 while its
weights are not whole (``writing``, ``partial``, ``released``) or an update holds
them, and with 501 at tensor-parallel size > 1. An update that arrives while a
snapshot is being sent waits for it (``--snapshot-lease-wait-s``), then cuts it:
the connection closes before the announced length, so the sink fails.

The sink reads that stream with its own admin key as bearer (a fleet shares one
worker key) and loads it through the worker's update pipeline
(:meth:`worker.staged_updates.OneStepUpdates.from_peer`): checked against the
model before any tensor byte is read, checksum verified before anything is written,
written in one step; any failure leaves the old weights intact.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from aiohttp import web

from router.contract import endpoints as ep
from router.contract.errors import ApiError
from router.contract.peer import SNAPSHOT_MEDIA_TYPE, SNAPSHOT_PATH, UpdateWeightsFromPeerRequest
from router.contract.web.openapi import Route
from router.contract.web.parsing import parse_body
from router.dataplane.buckets import NamedTensors
from worker.http.admin_routes import admin_handler, endpoint_routes, stage_answer
from worker.http.keys import CONFIG, COORDINATOR
from worker.peer.fetch import Receipt, fetch_snapshot
from worker.peer.lease import LeaseRefused, ReadLease
from worker.peer.snapshot import SnapshotCut, chunk_bounds, copy_chunk, plan_snapshot, raw_bytes

log = logging.getLogger(__name__)

_TP_LIMIT = "loading from a peer needs tensor-parallel size 1 on both ends (this worker runs {tp})"


async def weights_snapshot(request: web.Request) -> web.StreamResponse:
    """The worker's current weights as one safetensors stream (see the module docstring)."""
    coord = request.app[COORDINATOR]
    if coord.stage.tp_size > 1:
        raise ApiError(501, _TP_LIMIT.format(tp=coord.stage.tp_size))
    state = coord.weight_state
    if state != "serving":
        raise ApiError(503, f"the weights are {state}, not whole: there is nothing consistent to send")
    try:
        lease = coord.updates.leases.acquire()
    except LeaseRefused as exc:
        raise ApiError(503, str(exc)) from None
    try:
        return await _send(request, lease)
    finally:
        lease.release()


async def _send(request: web.Request, lease: ReadLease) -> web.StreamResponse:
    coord = request.app[COORDINATOR]
    worker = coord.worker
    leases = coord.updates.leases
    epoch = leases.epoch
    views = list(worker.model.iter_checkpoint_tensors())
    try:
        snap = await asyncio.to_thread(
            functools.partial(
                plan_snapshot,
                views,
                weight_version=worker.weight_version,
                instance_id=coord.instance_id,
                cut=lease.cut,
                digests=leases.cached_digests(epoch),
            )
        )
    except SnapshotCut as exc:
        raise ApiError(503, str(exc)) from None
    if not lease.cut.is_set():
        leases.keep_digests(epoch, snap.digests)
    delay_s = request.app[CONFIG].snapshot_send_delay_s
    resp = web.StreamResponse(headers={"Content-Type": SNAPSHOT_MEDIA_TYPE})
    resp.content_length = snap.content_length
    await resp.prepare(request)
    log.info(
        "weights_snapshot: sending %d tensors, %d bytes, weight_version %r",
        len(snap.tensors),
        snap.content_length,
        worker.weight_version,
    )
    await resp.write(snap.header)
    for name, tensor in snap.tensors:
        flat = await asyncio.to_thread(raw_bytes, tensor)
        for start, stop in chunk_bounds(flat.numel()):
            data = await asyncio.to_thread(copy_chunk, flat, start, stop)
            # Checked after the copy: a chunk that may have raced an update's write is never sent.
            if lease.cut.is_set():
                log.info("weights_snapshot cut at %s: a weight update took the weights", name)
                if request.transport is not None:
                    request.transport.close()
                return resp
            await resp.write(data)
        if delay_s > 0:
            await asyncio.sleep(delay_s)
    await resp.write_eof()
    return resp


@admin_handler
async def update_weights_from_peer(request: web.Request) -> web.Response:
    req = await parse_body(request, UpdateWeightsFromPeerRequest, allow_empty=False)
    coord = request.app[COORDINATOR]
    if coord.stage.tp_size > 1:
        raise ApiError(501, _TP_LIMIT.format(tp=coord.stage.tp_size))
    model = coord.worker.model
    receipt = Receipt()

    def validate(named: NamedTensors) -> None:
        model.validate_weights(named, require_complete=True)

    bearer = request.app[CONFIG].admin_api_key
    fetch = functools.partial(fetch_snapshot, req, bearer=bearer, validate=validate, receipt=receipt)
    result = await coord.one_step.from_peer(req, fetch, ep.UPDATE_WEIGHTS_FROM_PEER.worker_bound(req))
    return stage_answer(
        request,
        ep.UPDATE_WEIGHTS_FROM_PEER,
        result,
        checksum=receipt.checksum if result.success else None,
        source_instance_id=receipt.source_instance_id,
        bytes_received=receipt.bytes_received,
    )


ROUTES: list[Route] = [
    Route(
        "GET",
        SNAPSHOT_PATH,
        weights_snapshot,
        "Stream this worker's current weights in safetensors layout (for a peer's /update_weights_from_peer)",
        media_type=SNAPSHOT_MEDIA_TYPE,
    ),
    *endpoint_routes(ep.UPDATE_WEIGHTS_FROM_PEER, update_weights_from_peer),
]
