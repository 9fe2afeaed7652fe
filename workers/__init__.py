"""Tessera render worker: an rq worker per device driving a long-lived Blender child."""
