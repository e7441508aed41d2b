"""Where workers come from besides --worker-urls and POST /workers."""
