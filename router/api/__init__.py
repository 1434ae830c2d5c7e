"""The API surfaces of the ingress: OpenAI's HTTP routes (chat, completions, Responses,
rerank), Anthropic's Messages, and gRPC, over one front end (frontend.py)."""
