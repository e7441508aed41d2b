"""Generation traffic: load-balancing policies and the ``/generate`` proxy."""
