"""The aiohttp side of the contract, shared by both servers: the error middleware,
bearer-key auth and body parsing."""
