"""Where a request runs: KV-aware routing (a Serve RequestRouter), the coordinator that
holds every replica's report, and groups of replicas of several shapes."""
