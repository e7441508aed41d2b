"""A weight update received over a weight-update group, and the protocols that drive it.

* :mod:`.table`: the groups this worker has joined (every TP rank joins at once);
* :mod:`.receiver`: the receive loop, one background thread per update, as a state machine;
* :mod:`.receive_session`: one receive on every TP rank of this worker, inside a pipeline transaction;
* :mod:`.controller`: what the protocols share: the groups, the call lock, the start of a receive;
* :mod:`.two_phase` and :mod:`.single_phase`: SGLang's prepare/complete/abort and
  ``/update_weights_from_distributed``, adapters over the controller;
* :mod:`.bracket`: SGLang's ``/begin_weight_update`` … ``/end_weight_update`` bracket;
* :mod:`.held`: one update held across calls, and its expiry.
"""
