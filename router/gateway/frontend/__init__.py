"""A data plane's own HTTP server for the generation routes (:mod:`.site`), beside aiohttp's for the rest."""
