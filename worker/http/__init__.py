"""The worker's aiohttp application: one route table over the Coordinator."""
