"""Loading weights from a live peer: the source's snapshot stream, the sink's reader, the source's read leases."""
