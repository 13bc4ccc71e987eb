"""Adapters that let other JAX serving engines drive jaxkv (tpu-inference, sglang-jax, EasyDeL).

One module per engine; none imports its engine when jaxkv is imported: each takes the engine's
objects, or imports the engine inside the call that needs it.
"""
