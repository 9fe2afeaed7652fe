"""Tessera stream service (WebRTC sessions, PyAV encoder); built by the streaming issue."""
