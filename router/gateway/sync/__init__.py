"""The weight-sync protocols through the router, each built on the admin operation framework
(:mod:`router.gateway.admin`): SGLang's two-phase barrier (prepare on all, then complete on all),
vLLM's weight-transfer API (start, update, finish), the rank plan of a weight-update group, and the
update held between the calls of one protocol."""
