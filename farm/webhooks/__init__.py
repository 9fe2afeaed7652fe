"""Webhooks: a project's hooks, the outbox job events go to, signing, and the dispatcher."""
