"""vLLM's weight-transfer engine on this worker.

* :mod:`.engine`: init, start, update (×N), finish: one transaction of the update pipeline, received
  over a group (:mod:`worker.transfer.group`) or from shared memory (:mod:`worker.transfer.handles`);
* :mod:`.nccl`: the receiving end of vLLM's own NCCL engine (``--weight-transfer-config
  '{"backend": "nccl"}'``), loaded only when a worker joins such a group.
"""
