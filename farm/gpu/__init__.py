"""GPUs as NVML sees them: the types (types), the driver's library (real), a fake for machines
without one (fake), and which of them FARM_NVML names (factory)."""
