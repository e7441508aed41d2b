"""A standby router on Kubernetes (``--leader-election``): one replica leads, the others wait warm.

:mod:`.elector` takes and renews a ``coordination.k8s.io/v1`` Lease with client-go's rules;
:mod:`.gate` answers for a replica that does not lead (503, ``Retry-After``,
``X-Omni-Router-Role: standby``). What a replica does when it takes the lease (read every durable
record again, then open the gate) and when it loses it (close the gate, exit) is
:mod:`router.gateway.leadership`: it reads the app's objects, so it sits above them, while the app's keys
name the elector and the gate, which sit below.
The durable records themselves live in ConfigMaps (:mod:`router.gateway.state.k8s_store`), so
every replica reads what the leader wrote.
"""
