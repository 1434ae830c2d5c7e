"""The Ray Serve adapter around one engine: the LLMServer deployment, the engine's own
thread, its reports to the coordinator, and the streams it sends back to the ingress."""
