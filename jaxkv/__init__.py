"""jaxkv: KV cache management for hybrid LLMs in JAX serving loops."""

__version__ = "0.1.0"
