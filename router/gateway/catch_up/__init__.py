"""A worker is brought to the fleet's weights and state before it serves: a late joiner or a restarted
worker loads the fleet's weights (from a live peer, or from the checkpoint path its engine can load),
and a worker found paused or with its memory released behind the router's back is brought back to
the fleet's pause and memory state, each under the update lock."""
