"""The one slot allocator: devices and their capacity (devices, agent), leases granted by Lua in
Redis (allocator, scripts), NVML checked against the leases (reconcile), and usage accounting."""
