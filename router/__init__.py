"""Request entry and placement (HTTP ingress, gRPC, coordinator, KV-aware router)."""
