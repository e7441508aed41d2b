"""Who the workers are and whether they may take traffic: the registry and health checks."""
