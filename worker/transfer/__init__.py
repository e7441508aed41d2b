"""The worker's side of weight sync: metadata validation, the receive loop, the applier
and the controller behind the weight-sync routes."""
