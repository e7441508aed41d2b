"""Admin operations on the whole fleet: one table of operations, the update lock,
fencing and the durable journal, rank planning, the two-phase barrier, fleet reads."""
