"""The receiving end of vLLM's own NCCL weight-transfer engine (``--weight-transfer-config
'{"backend": "nccl"}'`` on a CUDA worker).

vLLM's trainer side (``NCCLTrainerWeightTransferEngine``, ``nccl_common.trainer_init``: TRL's and
SkyRL's NCCL paths) does not build a ``torch.distributed`` group: rank 0 hosts a
``StatelessProcessGroup`` store and broadcasts a pickled ``ncclUniqueId`` through it (or the id is
shared out of band as ``nccl_unique_id_b64``), and every rank joins a bare NCCL communicator
(``PyNcclCommunicator``). This package joins such a group as a worker rank:

* :mod:`.rendezvous`: the store's key protocol, a bounded client, and a restricted unpickler that
  admits only vLLM's ``ncclUniqueId`` record (never ``pickle.loads`` of the trainer's bytes);
* :mod:`.libnccl`: a ctypes binding to the ``libnccl`` of torch's CUDA wheels, with non-blocking
  communicators so that every wait has a deadline;
* :mod:`.group`: :func:`join_vllm_nccl_group` and :class:`VllmNcclGroup`, a
  :class:`~router.dataplane.group.WeightUpdateGroup` the receive path uses unchanged.
"""

from router.contract.vllm import NCCL_UNIQUE_ID_BYTES, decode_unique_id_b64
from worker.transfer.vllm.nccl.group import VllmNcclGroup, join_vllm_nccl_group
from worker.transfer.vllm.nccl.libnccl import NcclError
from worker.transfer.vllm.nccl.rendezvous import (
    RefusedUniqueId,
    RendezvousError,
    receive_unique_id,
    unique_id_from_pickle,
)

__all__ = [
    "NCCL_UNIQUE_ID_BYTES",
    "NcclError",
    "RefusedUniqueId",
    "RendezvousError",
    "VllmNcclGroup",
    "decode_unique_id_b64",
    "join_vllm_nccl_group",
    "receive_unique_id",
    "unique_id_from_pickle",
]
