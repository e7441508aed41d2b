"""Weight transfer: process groups, flattened buckets, the receiver and the trainer-side sender."""
