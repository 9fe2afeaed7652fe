"""Tessera core: settings, models, errors, frame/tile maths, job state, queue, storage, CLI."""
