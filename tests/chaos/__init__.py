"""The chaos suite: a farm of real workers in network namespaces under seeded random faults,
its promises checked from outside (`make chaos`; a short run is part of `make test`)."""
