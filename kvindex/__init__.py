"""kvindex: the KV-cache index for LLM inference fleets."""
