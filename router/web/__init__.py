"""aiohttp pieces shared by the router and the worker: errors, auth, body parsing."""
