"""LoRA adapters served beside their base model (vLLM's interface, Punica's batching).

request.py and adapter_files.py import no torch: the ingress reads them to name and
check adapters. The rest is the replica's."""
