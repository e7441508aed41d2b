"""The worker's side of weight sync: metadata validation, the receive loop, and the
controller behind the weight-sync routes (its updates run through :mod:`worker.updates`)."""
