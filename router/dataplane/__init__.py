"""The torch half of the weight-sync contract, shared by the trainer's sender and the worker's receiver.

- :mod:`~router.dataplane.group`: the weight-update process group (trainer = rank 0);
- :mod:`~router.dataplane.buckets`: packing tensors into a flattened bucket and viewing them out;
- :mod:`~router.dataplane.digest`: the weights-checker digest both ends compute.

This is the torch half of the shared contract (:mod:`router.contract` is the other): the
trainer (:mod:`router.trainer.sender`, with the ``trainer`` extra) and :mod:`worker` import it;
it imports only :mod:`router.contract` and torch. The gateway never imports it, so the router
server runs without torch.
"""
