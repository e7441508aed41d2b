"""The admin operation framework: one table of operations, the update lock, the fan-out, fencing and
the durable journal, each worker's verdict, the fleet answer, targeted calls, and fleet-wide reads.
The weight-sync protocols (:mod:`router.gateway.sync`) and catch-up (:mod:`router.gateway.catch_up`)
are built on it."""
