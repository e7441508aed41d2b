"""The torch half of the weight-sync contract, shared by the trainer's sender and the worker's receiver.

- :mod:`~router.dataplane.group`: the weight-update process group (trainer = rank 0);
- :mod:`~router.dataplane.buckets`: packing tensors into a flattened bucket and viewing them out;
- :mod:`~router.dataplane.digest`: the weights-checker digest both ends compute.

Unlike the rest of :mod:`router`, these modules import torch; the gateway never imports them.
"""
