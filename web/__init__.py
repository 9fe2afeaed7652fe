"""Tessera web app (aiohttp API and pages); built by the web issue."""
