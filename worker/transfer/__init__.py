"""The worker's side of weight sync, one subpackage per way the weights arrive:

* :mod:`worker.transfer.group`: a receive over a weight-update group (``torch.distributed``, or
  vLLM's NCCL group): the groups, the receive loop, one receive on every rank, the controller
  behind the weight-sync routes, and SGLang's two-phase and single-phase protocols over it;
* :mod:`worker.transfer.handles`: tensors another process on this host shares (shared memory, CUDA
  IPC): the project's JSON handle message, and the restricted unpickler for SGLang's and vLLM's
  pickled handles;
* :mod:`worker.transfer.vllm`: vLLM's weight-transfer engine (init, start, update, finish) and the
  receiving end of its NCCL rendezvous.

:mod:`worker.transfer.validation` holds the checks all three share: an update's metadata against
the served model, and each received bucket against the checksum the trainer announced. Imports go
one way: ``vllm`` uses ``group`` and ``handles``, and both of those use ``validation``. Every
update runs through the worker's update pipeline (:mod:`worker.update_pipeline`).
"""
